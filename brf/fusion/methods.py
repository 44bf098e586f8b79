"""The registry of fusion methods and the parameter schema they declare.

A method is a pure function ``fn(logits_XnV, weights_Xn, **params) ->
(logq_XV, info)``: member logits with any leading batch shape ``X``, masked
tokens already set to -inf, weights on the simplex broadcast to ``X + (n,)``.
It returns normalised log-probabilities and a dict of diagnostics (at least
``fallback``, a bool [X] that is True where the method fell back to the linear
pool). Methods assume checked inputs; :func:`brf.fusion.fuse` does the checks.

Each method declares its parameters. Float, phase-map and array parameters are
traced under jit (changing their values never recompiles); int, str and bool
parameters are compile-time constants. A ``floats`` parameter is a number or
one number per member (shape [] or [n]), traced like a float. Array parameters (e.g. the members'
unembeddings for softmax-bottleneck fusion) are a tuple of float32 arrays,
checked by the parameter's own ``check``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from brf.fusion.checks import FusionInputError
from brf.fusion.phase import phase_map
from brf.registry import Registry

DYNAMIC_KINDS = ("float", "floats", "phase", "array")


@dataclasses.dataclass(frozen=True)
class Param:
    """One declared parameter of a fusion method.

    Attributes:
      default: the value used when the caller gives none.
      kind: 'float' | 'floats' | 'int' | 'str' | 'phase' | 'method' | 'params' |
        'array'.
      check: ``check(value) -> None or str``; a string is the error message.
      doc: one line for listings.
    """
    default: Any
    kind: str
    check: Callable[[Any], str | None] | None = None
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    fn: Callable[..., tuple[Any, dict]]
    params: Mapping[str, Param]
    doc: str


METHODS: Registry[Method] = Registry("fusion method")


def register(name: str, **params: Param):
    """Decorator: registers ``fn`` as fusion method ``name`` with ``params``."""

    def deco(fn):
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        METHODS.add(name, Method(name, fn, dict(params), doc))
        return fn

    return deco


def get_method(name: str) -> Method:
    try:
        return METHODS.get(name)
    except KeyError as e:
        raise FusionInputError(str(e)) from None


def _coerce(method: str, key: str, p: Param, value: Any) -> Any:
    where = f"{method}: parameter {key}={value!r}"
    if p.kind in ("float", "floats"):
        one = p.kind == "float"
        what = "a number" if one else "a number or a list of numbers"
        if isinstance(value, bool) or value is None:
            raise FusionInputError(f"{where} must be {what}")
        if not _finite_literal(value):  # 1e999 parses as inf: refused, as the sampler does
            raise FusionInputError(f"{where} must be finite")
        try:
            arr = jnp.asarray(value, dtype=jnp.result_type(float))
        except (TypeError, ValueError):
            raise FusionInputError(f"{where} must be {what}") from None
        if not _host_finite(value, arr.dtype):  # 1e300 is inf in float32
            raise FusionInputError(f"{where} must be finite in {arr.dtype} (at most "
                                   f"{float(jnp.finfo(arr.dtype).max):.4g} in size)")
        if arr.ndim > (0 if one else 1):
            raise FusionInputError(f"{where} must be " + (
                "a scalar" if one else "a number or one number per member"))
        value = arr
    elif p.kind == "int":
        if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                              np.floating))
                or not math.isfinite(value) or int(value) != value):
            raise FusionInputError(f"{where} must be an integer")
        value = int(value)
        if not -2**63 <= value < 2**63:  # a compile-time constant: a C long
            raise FusionInputError(f"{where} must lie in [-2^63, 2^63)")
    elif p.kind == "str":
        if not isinstance(value, str):
            raise FusionInputError(f"{where} must be a string")
    elif p.kind == "phase":
        value = phase_map(value)
    elif p.kind == "method":
        get_method(value)
    elif p.kind == "array":
        if value is None:
            raise FusionInputError(f"{method}: parameter {key} is required (an array "
                                   "or a list of arrays)")
        if p.check is not None and not _is_traced(value):
            msg = p.check(value)
            if msg:
                raise FusionInputError(f"{method}: parameter {key}: {msg}")
        seq = [value] if hasattr(value, "shape") else list(value)
        return tuple(jnp.asarray(a, jnp.float32) for a in seq)
    if p.check is not None and not _is_traced(value):
        msg = p.check(value)
        if msg:
            raise FusionInputError(f"{where}: {msg}")
    return value


def _finite_literal(value) -> bool:
    """False for a number on the host (Python's or NumPy's, or a list or NumPy array
    of them) that is inf or nan; JAX arrays pass (checking one would wait for the
    device: the fused program's own value checks see what they produce)."""
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return math.isfinite(value)
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.number):
        return bool(np.all(np.isfinite(value)))
    if isinstance(value, (list, tuple)):
        return all(_finite_literal(v) for v in value)
    return True


def _host_finite(value, dtype) -> bool:
    """False for a value on the host (a number, a list, a NumPy array) that is not
    finite in ``dtype``; JAX arrays pass (see :func:`_finite_literal`)."""
    if any(isinstance(v, jax.Array) for v in jax.tree_util.tree_leaves(value)):
        return True
    with np.errstate(over="ignore"):
        return bool(np.all(np.isfinite(np.asarray(value, dtype=dtype))))


def _is_traced(value) -> bool:
    import jax
    leaves = jax.tree_util.tree_leaves(value)
    return any(isinstance(v, jax.core.Tracer) for v in leaves)


def resolve_params(method: Method, given: Mapping[str, Any]) -> dict[str, Any]:
    """Fills defaults, rejects unknown names, coerces and checks values."""
    unknown = set(given) - set(method.params)
    if unknown:
        raise FusionInputError(
            f"fusion method {method.name!r} has no parameter(s) {sorted(unknown)}; "
            f"it takes {sorted(method.params) or 'none'}")
    out = {}
    for key, p in method.params.items():
        value = given.get(key, p.default)
        out[key] = _coerce(method.name, key, p, value)
    if "inner" in method.params:  # nested method (entropy-gated fusion)
        inner = get_method(out["inner"])
        if inner.name == method.name:
            raise FusionInputError(f"{method.name}: inner method cannot be itself")
        out["inner_params"] = resolve_params(inner, out.get("inner_params") or {})
    return out


def split_params(method: Method, params: Mapping[str, Any]):
    """Splits resolved params into a hashable static tuple and a dynamic dict."""
    static, dynamic = [], {}
    for key, value in params.items():
        kind = method.params[key].kind
        if kind in DYNAMIC_KINDS:
            dynamic[key] = value
        elif kind == "params":
            inner = get_method(params["inner"])
            s, d = split_params(inner, value)
            static.append((key, s))
            dynamic[key] = d
        else:
            static.append((key, value))
    return tuple(sorted(static)), dynamic


def join_params(static: tuple, dynamic: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(dynamic)
    for key, value in static:
        if key == "inner_params":
            out[key] = join_params(value, dynamic[key])
        else:
            out[key] = value
    return out


# Shared parameter checks.
def positive(v) -> str | None:
    return None if float(v) > 0 else "must be > 0"


def finite(v) -> str | None:
    return None if bool(jnp.all(jnp.isfinite(v))) else "must be finite"


def nonzero(v) -> str | None:
    if not bool(jnp.isfinite(v)):
        return "must be finite"
    return None if float(v) != 0 else "must be nonzero"


def nonnegative(v) -> str | None:
    return None if float(v) >= 0 else "must be >= 0"


def unit_interval(v) -> str | None:
    return None if 0.0 <= float(v) <= 1.0 else "must lie in [0, 1]"


def nonnegative_int(v) -> str | None:
    return None if v >= 0 else "must be >= 0"


def seed(v) -> str | None:
    """A seed as the command line takes one (brf.schema): in [0, 2^32 - 1]."""
    return None if 0 <= v < 2**32 else "must lie in [0, 2^32 - 1]"


def at_most(top: int) -> Callable[[Any], str | None]:
    """A count in [0, top] (an iteration budget: more would run for hours)."""
    return lambda v: None if 0 <= v <= top else f"must lie in [0, {top}]"


def one_of(*options: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in options else f"must be one of {list(options)}"
