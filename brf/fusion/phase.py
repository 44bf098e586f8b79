"""Phase maps: how a member's logits set the phase of its Born amplitudes.

Two kinds, one registry (:data:`PHASE_MAPS`):

* **per-position** maps read the member's top-1 minus top-2 logit gap ``g >= 0``
  at a position and give one phase per member per position (the paper's
  reading). With one phase per member, Born fusion is a one-parameter family in
  the phase difference: equal phases give the power mean of order 1/2
  (Hellinger pooling), a difference of pi/2 gives the linear pool, and beyond
  pi/2 the tokens both members favour are pushed down.
* **per-token** maps (names ``token_*``) read each token's own distance to the
  member's top logit, ``d(t) = l(top1) - l(t) >= 0``, so the interference is
  token-selective.

Every map is ``phi = offset + curve(x)`` with a named curve and float
parameters. ``offset`` is a scalar or one value per member; that is what puts
members at different phases under the ``constant`` map (the reference points:
``constant`` is Hellinger, ``constant(offset=[0, pi/2])`` is the linear pool
for two members).

A phase map is a :class:`PhaseMap` pytree: its name is static and its
parameters are traced arrays, so a sweep over parameter values never
recompiles. Build one with :func:`phase_map`, from a string such as
``"tanh(scale=pi, rate=0.5)"`` or a dict ``{"name": "tanh", "rate": 0.5}``.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from brf.fusion.checks import FusionInputError
from brf.fusion.members import chunked_top2_gap
from brf.registry import Registry


@dataclasses.dataclass(frozen=True)
class PhaseMapDef:
    """A registered phase-map family.

    Attributes:
      kind: 'position' (reads the top-1/top-2 gap) or 'token' (reads each
        token's distance to the top logit).
      curve: ``curve(x, **params) -> phase`` without the offset, x >= 0.
      defaults: every parameter's default value (floats), offset excluded.
      doc: one line shown in listings and reports.
    """
    kind: str
    curve: Callable[..., jax.Array]
    defaults: Mapping[str, float]
    doc: str


PHASE_MAPS: Registry[PhaseMapDef] = Registry("phase map")

_CURVES: dict[str, tuple[Callable[..., jax.Array], dict[str, float], str]] = {
    "linear": (lambda x, scale: scale * x,
               {"scale": 1.0}, "scale * x"),
    "tanh": (lambda x, scale, rate: scale * jnp.tanh(rate * x),
             {"scale": math.pi, "rate": 1.0}, "scale * tanh(rate * x)"),
    "sigmoid": (lambda x, scale, rate, center:
                scale * jax.nn.sigmoid(rate * (x - center)),
                {"scale": math.pi, "rate": 1.0, "center": 0.0},
                "scale * sigmoid(rate * (x - center))"),
    "arctan": (lambda x, scale, rate:
               scale * (2.0 / math.pi) * jnp.arctan(rate * x),
               {"scale": math.pi, "rate": 1.0},
               "scale * (2/pi) * arctan(rate * x)"),
    "log1p": (lambda x, scale, rate: scale * jnp.log1p(rate * x),
              {"scale": 1.0, "rate": 1.0}, "scale * log1p(rate * x)"),
}

PHASE_MAPS.add("constant", PhaseMapDef(
    "position", lambda x: jnp.zeros_like(x), {},
    "phi = offset (no dependence on the logits)"))
for _name, (_curve, _defaults, _formula) in _CURVES.items():
    PHASE_MAPS.add(_name, PhaseMapDef(
        "position", _curve, _defaults,
        f"phi = offset + {_formula}, x = top-1 minus top-2 logit gap"))
    PHASE_MAPS.add(f"token_{_name}", PhaseMapDef(
        "token", _curve, _defaults,
        f"phi(t) = offset + {_formula}, x = l(top1) - l(t) of each token"))

_NONNEGATIVE = ("rate",)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PhaseMap:
    """A named phase map with its parameter values (a pytree).

    Attributes:
      name: a key of :data:`PHASE_MAPS` (static under jit).
      params: parameter name -> array (traced under jit); always includes
        ``offset`` (scalar or [n_members]).
    """
    name: str
    params: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return PHASE_MAPS.get(self.name).kind

    def __call__(self, x: jax.Array, member_axis: int) -> jax.Array:
        """Phases for ``x`` (gaps). ``member_axis`` is where members sit in x."""
        d = PHASE_MAPS.get(self.name)
        params = {k: v for k, v in self.params.items() if k != "offset"}
        offset = jnp.asarray(self.params["offset"], x.dtype)
        if offset.ndim == 1:
            axis = member_axis % x.ndim
            offset = offset.reshape(offset.shape + (1,) * (x.ndim - 1 - axis))
        return d.curve(x, **params) + offset

    def spec(self) -> str:
        """The string this map parses back from (values rounded to 6 digits)."""
        def fmt(v):
            v = jax.device_get(v)
            if getattr(v, "ndim", 0):
                return "[" + ", ".join(f"{float(e):.6g}" for e in v) + "]"
            return f"{float(v):.6g}"
        args = ", ".join(f"{k}={fmt(v)}" for k, v in sorted(self.params.items()))
        return f"{self.name}({args})"

    def tree_flatten(self):
        keys = tuple(sorted(self.params))
        return tuple(self.params[k] for k in keys), (self.name, keys)

    @classmethod
    def tree_unflatten(cls, aux, children):
        name, keys = aux
        return cls(name, dict(zip(keys, children)))


# --- parsing ---------------------------------------------------------------

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub,
           ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}


def _literal(node: ast.AST):
    """Evaluates numbers, lists, +-*/** and the name ``pi``; nothing else."""
    if (isinstance(node, ast.Constant) and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)):  # True is an int to Python, not here
        return float(node.value)
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _literal(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        from brf.specs import SpecError, arithmetic  # bounded: 9**9**9 is refused
        try:
            return arithmetic(type(node.op), _literal(node.left), _literal(node.right),
                              ast.unparse(node))
        except SpecError as e:  # the library's documented error, as every other one here
            raise FusionInputError(f"phase map parameter {e}") from None
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    raise FusionInputError(
        f"phase map parameters must be numbers, lists of numbers or arithmetic "
        f"on them and `pi`; got {ast.unparse(node)!r}")


def _parse_string(spec: str) -> tuple[str, dict[str, Any]]:
    try:
        tree = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError:
        raise FusionInputError(
            f"cannot parse phase map {spec!r}; write e.g. 'tanh(scale=pi, rate=0.5)'"
        ) from None
    if isinstance(tree, ast.Name):
        return tree.id, {}
    if (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name)
            and not tree.args):
        keys = [kw.arg for kw in tree.keywords]
        twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
        if twice:
            raise FusionInputError(f"phase map {spec!r}: {twice[0]!r} is given twice")
        return tree.func.id, {kw.arg: _literal(kw.value) for kw in tree.keywords}
    raise FusionInputError(
        f"cannot parse phase map {spec!r}; write e.g. 'tanh(scale=pi, rate=0.5)' "
        f"(keyword arguments only)")


def _numeric(v) -> bool:
    """A number (not a bool), a list of numbers, or a numeric array (traced ones too)."""
    if isinstance(v, (list, tuple)):
        return all(_numeric(x) and not isinstance(x, (list, tuple)) for x in v)
    if hasattr(v, "dtype"):
        return v.dtype.kind in "iuf"
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def phase_map(spec: str | Mapping[str, Any] | PhaseMap, **overrides) -> PhaseMap:
    """Builds a :class:`PhaseMap` from a string, a dict or another PhaseMap.

    Args:
      spec: ``"name"``, ``"name(k=v, ...)"``, ``{"name": ..., k: v}`` or a
        PhaseMap. Unknown names and parameters raise FusionInputError.
      **overrides: parameter values that replace those in ``spec``.

    Returns:
      A PhaseMap whose params hold every parameter (defaults filled in).
    """
    if isinstance(spec, PhaseMap):
        name, given = spec.name, dict(spec.params)
    elif isinstance(spec, str):
        name, given = _parse_string(spec)
    elif isinstance(spec, Mapping):
        given = dict(spec)
        if "name" not in given:
            raise FusionInputError(f"phase map dict needs a 'name' key; got {spec}")
        name = given.pop("name")
    else:
        raise FusionInputError(
            f"a phase map is a string, a dict or a PhaseMap; got {type(spec).__name__}")
    given.update(overrides)
    try:
        d = PHASE_MAPS.get(name)
    except KeyError as e:
        raise FusionInputError(str(e)) from None
    allowed = set(d.defaults) | {"offset"}
    unknown = set(given) - allowed
    if unknown:
        raise FusionInputError(
            f"phase map {name!r} has no parameter(s) {sorted(unknown)}; it takes "
            f"{sorted(allowed)}")
    params = {**d.defaults, "offset": 0.0, **given}
    out = {}
    for k, v in params.items():
        if not _numeric(v):
            raise FusionInputError(f"phase map parameter {k}={v!r} must be a number"
                                   + (" or one number per member" if k == "offset" else ""))
        arr = jnp.asarray(v, dtype=jnp.float32) if not isinstance(
            v, jax.Array) or not jnp.issubdtype(v.dtype, jnp.floating) else v
        if arr.ndim > (1 if k == "offset" else 0):
            raise FusionInputError(
                f"phase map parameter {k!r} must be a scalar"
                + (" or one value per member" if k == "offset" else "")
                + f"; got shape {arr.shape}")
        if not isinstance(arr, jax.core.Tracer):
            # Checked with NumPy: a concrete value read on the host, which also
            # holds when this runs while a caller's jit traces (a closed-over map).
            value = np.asarray(arr)
            if not np.all(np.isfinite(value)):
                raise FusionInputError(f"phase map parameter {k}={v} is not finite")
            if k in _NONNEGATIVE and np.any(value < 0):
                raise FusionInputError(f"phase map parameter {k}={v} must be >= 0")
        out[k] = arr
    return PhaseMap(name, out)


# Where an embedded linear map sits on a saturating curve: rate * x stays below about
# 0.1 for gaps up to 10 (tanh's cubic term is then 0.3% of its linear one), and the
# scale that restores the slope (about 100x the linear map's) stays inside a fit's box.
EMBED_RATE = 0.01


def embed(source: str, params: Mapping[str, Any], target: str) -> dict[str, Any] | None:
    """The parameters under which the map ``target`` gives the phases that ``source``
    gives under ``params`` (exactly, or nearly where noted), or None where ``target``
    does not contain ``source``.

    The families nest: ``constant`` is every curve at scale 0 (of either kind); the
    ``linear`` curve is a saturating one (``tanh``, ``arctan``, ``log1p``,
    ``sigmoid``) in its linear part, at rate :data:`EMBED_RATE` (nearly: a relative
    error of rate^2 x^2 / 3 for tanh); ``tanh`` is ``sigmoid`` exactly
    (``s tanh(r x) = 2 s sigmoid(2 r x) - s``, the constant going to the offset).
    Fits use it to start a map from the fit of a map it contains, so a larger family
    never fits worse than one it contains.

    Args:
      source, target: phase-map names.
      params: ``source``'s parameters (``offset`` and its curve's; missing ones take
        their defaults).

    Returns:
      ``target``'s parameters (``offset`` and every curve parameter), or None.
    """
    src, dst = PHASE_MAPS.get(source), PHASE_MAPS.get(target)
    given = {**src.defaults, "offset": 0.0, **params}
    offset = given["offset"]
    if source == target:
        return {k: given[k] for k in (*dst.defaults, "offset")}
    out = {**dst.defaults, "offset": offset}
    if source == "constant":
        return {**out, "scale": 0.0} if "scale" in dst.defaults else None
    if src.kind != dst.kind:
        return None
    s_curve, d_curve = source.removeprefix("token_"), target.removeprefix("token_")
    if s_curve == "linear" and d_curve in ("tanh", "arctan", "log1p", "sigmoid"):
        slope, r = float(given["scale"]), EMBED_RATE
        gain = {"tanh": 1.0, "log1p": 1.0, "arctan": math.pi / 2.0, "sigmoid": 4.0}[d_curve]
        out.update(rate=r, scale=gain * slope / r)
        if d_curve == "sigmoid":
            out.update(center=0.0, offset=np.asarray(offset) - 0.5 * out["scale"])
        return out
    if s_curve == "tanh" and d_curve == "sigmoid":
        scale, rate = float(given["scale"]), float(given["rate"])
        return {**out, "scale": 2.0 * scale, "rate": 2.0 * rate, "center": 0.0,
                "offset": np.asarray(offset) - scale}
    return None


def check_offset(pm: PhaseMap, n_members: int) -> None:
    shape = jnp.shape(pm.params["offset"])
    if shape not in ((), (n_members,)):
        raise FusionInputError(
            f"phase map offset must be a scalar or have one value per member "
            f"({n_members}); got shape {shape}")


def position_gap(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-1 logit and top-1 minus top-2 gap along the last axis.

    Ties for the top give a gap of 0. With fewer than two valid (finite)
    tokens there is no competitor and the gap is defined as 0.

    Args:
      logits: [..., V].

    Returns:
      (top1 [...], gap [...]).
    """
    return chunked_top2_gap(logits)


def token_gap(logits: jax.Array, top1: jax.Array) -> jax.Array:
    """``l(top1) - l(t)`` for every token; 0 for invalid (-inf) tokens."""
    d = top1[..., None] - logits
    return jnp.where(jnp.isfinite(d), d, 0.0)
