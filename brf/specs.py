"""Specs written as text: ``name`` or ``name(key=value, ...)``, and lists of them.

Configs and command-line flags name members, fusion methods and phase maps as
strings, so that flags can set them (ml_collections cannot override a list of
dicts from the command line):

    --config.members='smollm2-135m-instruct, gemma3-270m(prefix="You are terse.")'
    --config.methods='linear, loglinear(temperature=0.8)'

Grammar: a spec is a *name* optionally followed by keyword arguments in
parentheses. The name is any text without top-level parentheses or commas (model
names such as ``smollm2-135m-instruct`` and file paths are names). Values are
Python literals (numbers, quoted strings, True/False/None, lists), arithmetic on
numbers and ``pi``, or a nested spec such as ``phase=tanh(rate=0.5)``, which is
kept as its source text. A list of specs is separated by top-level commas. Every
number is finite (``nan`` and ``inf`` are refused, as are results beyond float range);
each grammar bounds its own fields (tests/test_specs.py walks them all).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Iterable, Mapping

from brf.errors import UserError


class SpecError(UserError):
    """A spec string that does not parse (the message quotes it)."""


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.Pow: operator.pow}
# Arithmetic in a spec is bounded: an integer result of more bits than this (or a
# float that overflows) is refused instead of computed (``9**9**9`` would take
# hours and gigabytes; no setting needs a number beyond float range).
MAX_INT_BITS = 1024
_OPEN, _CLOSE = "([{", ")]}"
# Bare names that mean a non-finite number (refused, not kept as a nested spec's text).
_NOT_FINITE = ("nan", "inf", "infinity")


def split_list(text: str) -> list[str]:
    """Splits ``text`` at commas outside brackets and quotes; drops empty items.

    Raises:
        SpecError: unbalanced brackets or an unterminated quote.
    """
    items, depth, quote, start = [], [], None, 0
    for i, ch in enumerate(text):
        if quote:
            if ch == "\\":
                continue
            if ch == quote and text[i - 1] != "\\":
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth.append(_CLOSE[_OPEN.index(ch)])
        elif ch in _CLOSE:
            if not depth or depth.pop() != ch:
                raise SpecError(f"unbalanced {ch!r} at character {i} of {text!r}")
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if quote:
        raise SpecError(f"unterminated quote in {text!r}")
    if depth:
        raise SpecError(f"missing {''.join(reversed(depth))!r} in {text!r}")
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def arithmetic(op: type, a: float, b: float, text: str) -> float:
    """``a <op> b`` for one of +, -, *, /, ** (an ``ast`` operator class), bounded:
    the result must be a finite number of at most MAX_INT_BITS bits.

    Args:
        op: ``ast.Add``, ``ast.Sub``, ``ast.Mult``, ``ast.Div`` or ``ast.Pow``.
        a, b: the operands (ints or floats).
        text: the expression as written, for the message.

    Raises:
        SpecError: a result too large (checked before an integer power is
            computed), not finite, complex, or a division by zero.
    """
    if op is ast.Pow and isinstance(a, int) and isinstance(b, int) and abs(a) > 1 \
            and b > 0 and b * math.log2(abs(a)) > MAX_INT_BITS:
        raise SpecError(f"{text!r} is too large a number (more than {MAX_INT_BITS} bits)")
    try:
        out = _BINOPS[op](a, b)
    except ZeroDivisionError:
        raise SpecError(f"{text!r} divides by zero") from None
    except (OverflowError, ValueError):
        raise SpecError(f"{text!r} is too large a number (beyond float range)") from None
    if isinstance(out, complex):
        raise SpecError(f"{text!r} is not a real number")
    if isinstance(out, int) and out.bit_length() > MAX_INT_BITS:
        raise SpecError(f"{text!r} is too large a number (more than {MAX_INT_BITS} bits)")
    if isinstance(out, float) and not math.isfinite(out):
        raise SpecError(f"{text!r} is not a finite number")
    return out


def _value(node: ast.AST, source: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, float) \
            and not math.isfinite(node.value):
        raise SpecError(f"{ast.get_source_segment(source, node)!r} is not a finite number "
                        f"(beyond float range)")
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool)):
        return node.value
    if isinstance(node, ast.Constant) and node.value is None:
        return None
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    if isinstance(node, ast.Name) and node.id in ("true", "false"):
        return node.id == "true"
    if isinstance(node, ast.Name) and node.id.lower() in _NOT_FINITE:
        # not a nested spec: a number the user meant, which no setting takes
        raise SpecError(f"{node.id!r} is not a finite number (no setting takes one)")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand, source)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _value(node.left, source), _value(node.right, source)
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            return arithmetic(type(node.op), a, b, ast.get_source_segment(source, node))
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e, source) for e in node.elts]
    if isinstance(node, (ast.Call, ast.Name)):  # a nested spec: keep its text
        return ast.get_source_segment(source, node)
    raise SpecError(f"cannot read the value {ast.get_source_segment(source, node)!r}: use "
                    f"numbers, quoted strings, True/False/None, lists, arithmetic with pi, "
                    f"or a nested spec like tanh(rate=0.5)")


def parse_spec(text: str, what: str = "spec") -> tuple[str, dict[str, Any]]:
    """``"name(k=v, ...)"`` -> ``("name", {"k": v, ...})``.

    Args:
        text: the spec.
        what: what the spec names, for error messages ("member", "method").

    Raises:
        SpecError: an empty name, positional arguments, duplicate keys, a value
            that is not a literal, or unbalanced brackets (the message quotes the spec).
    """
    if not isinstance(text, str):
        raise SpecError(f"a {what} spec must be a string; got {text!r}")
    text = text.strip()
    split_list(text)  # bracket and quote balance, with a clear message
    i = text.find("(")
    if i < 0:
        if not text:
            raise SpecError(f"empty {what} spec")
        return text, {}
    name, args = text[:i].strip(), text[i + 1:]
    if not name:
        raise SpecError(f"{what} spec {text!r} has no name before '('")
    if not args.endswith(")"):
        raise SpecError(f"{what} spec {text!r} must end with ')'")
    source = f"f({args}"
    try:
        call = ast.parse(source, mode="eval").body
    except SyntaxError:
        call = None
    if call is None and "\n" in source:  # a real line break inside a quoted value
        source = source.replace("\r", "\\r").replace("\n", "\\n")
        try:
            call = ast.parse(source, mode="eval").body
        except SyntaxError:
            pass
    if call is None:
        raise SpecError(f"cannot parse {what} spec {text!r}; write e.g. "
                        f"name(key=1.5, other=\"text\")") from None
    if not isinstance(call, ast.Call) or call.args:
        raise SpecError(f"{what} spec {text!r}: give keyword arguments only (key=value)")
    params = {}
    for kw in call.keywords:
        if kw.arg is None:
            raise SpecError(f"{what} spec {text!r}: '**' is not allowed")
        if kw.arg in params:
            raise SpecError(f"{what} spec {text!r}: {kw.arg!r} is given twice")
        try:
            params[kw.arg] = _value(kw.value, source)
        except SpecError as e:  # the field, as typed
            raise SpecError(f"{what} spec {text!r}: {kw.arg}: {e}") from None
    return name, params


def parse_list(value: str | Iterable[Any], what: str = "spec",
               key: str = "name") -> list[tuple[str, dict]]:
    """A list of specs from a comma-separated string or a sequence.

    Sequence items may be spec strings or mappings whose ``key`` entry is the
    name (the rest are parameters).

    Raises:
        SpecError: an item that does not parse.
    """
    items = split_list(value) if isinstance(value, str) else list(value)
    out = []
    for item in items:
        if isinstance(item, Mapping):
            item = dict(item)
            if key not in item:
                raise SpecError(f"a {what} given as a mapping needs a {key!r} key; got {item}")
            out.append((str(item.pop(key)), item))
        else:
            out.append(parse_spec(item, what))
    return out


def format_spec(name: str, params: Mapping[str, Any] | None = None) -> str:
    """The inverse of :func:`parse_spec` for literal values."""
    if not params:
        return name
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in params.items()) + ")"


def parse_call(text: str, what: str = "value") -> tuple[str, list[Any], dict[str, Any]]:
    """``"f(1, 'a', k=2)"`` -> ``("f", [1, "a"], {"k": 2})``, values read as in :func:`parse_spec`.

    Configs use calls as markers inside a spec's values, e.g. ``temperature=fit(1.0)``
    or ``criterion=grid("max_prob", "gap")`` in a validation method spec.

    Raises:
        SpecError: not a call of a plain name, a value that is not a literal, or a
            key given twice.
    """
    source = str(text).strip()
    try:
        call = ast.parse(source, mode="eval").body
    except SyntaxError:
        call = None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise SpecError(f"cannot read {what} {source!r}; write e.g. name(1.0, key=2)")
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
            kw.arg is None for kw in call.keywords):
        raise SpecError(f"{what} {source!r}: '*' and '**' are not allowed")
    kwargs = {}
    for kw in call.keywords:
        if kw.arg in kwargs:
            raise SpecError(f"{what} {source!r}: {kw.arg!r} is given twice")
        kwargs[kw.arg] = _value(kw.value, source)
    return call.func.id, [_value(a, source) for a in call.args], kwargs
