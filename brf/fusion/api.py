"""The entry points of the fusion library: :func:`fuse` and :func:`compile`.

:func:`compile` parses a method and its parameters once (names looked up,
values coerced and checked, phase maps parsed, traced parameters placed on
the device) and returns a :class:`Fuser`: a callable whose every call is one
jitted program. Its input checks split in two: shapes and dtypes on the host
(no values read), and the value checks (NaN, +inf, empty rows, weights off the
simplex) on the device inside the same program, which hands back one int32;
only when that is not 0 do the host checks run again to name the first bad
index. So a validated call moves 4 bytes to the host, not the logits.

:func:`fuse` is the one-line form: it keeps the fusers it compiled in a small
cache keyed by the method and its parameters (when they are plain values:
strings, numbers, lists of numbers), so calling it in a loop parses nothing
twice. Inside ``jax.jit`` both trace into the caller's program.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from brf.fusion import born as _born  # noqa: F401  (registers "born")
from brf.fusion import bottleneck as _bottleneck  # noqa: F401  (registers "bottleneck_*")
from brf.fusion import controls as _controls  # noqa: F401  (registers the controls)
from brf.fusion import pools as _pools  # noqa: F401  (registers the baselines)
from brf.fusion import methods as M
from brf.fusion.checks import (FusionInputError, bad_rows, check_inputs, check_shapes,
                               is_concrete, uniform_weights, value_status)
from brf.fusion.born import xla_sincos as born_xla_sincos, xla_sincos_on
from brf.fusion.phase import check_offset

# How often each method's jitted body has been traced (tests use it to prove
# that changing parameter values does not recompile).
TRACE_COUNTS: collections.Counter = collections.Counter()


def _apply(logits, weights, where, dynamic, *, name, static):
    """The method on checked inputs; weights None means uniform."""
    method = M.get_method(name)
    if where is not None:
        logits = jnp.where(where, logits, -jnp.inf)
    if weights is None:
        weights = uniform_weights(logits.shape[-2], logits.dtype)
    return method.fn(logits, weights, **M.join_params(static, dynamic))


@functools.lru_cache(maxsize=64)
def _uniform(n: int, dtype) -> jax.Array:
    """Uniform weights for n members, made once: calls with and without weights
    then share one compiled program."""
    return uniform_weights(n, dtype)


@functools.partial(jax.jit, static_argnames=("name", "static", "check", "xla_sincos",
                                             "poison"))
def _fuse_jit(logits, weights, where, dynamic, *, name, static, check=False, xla_sincos=False,
              poison=False):
    """The method as one program; with ``check`` also the inputs' value status; with
    ``poison`` NaN in every entry of a row whose inputs break the value checks (a call
    traced inside the caller's jit, where no check can raise).
    ``xla_sincos``: the caller's :func:`brf.fusion.born.xla_sincos` mode (part of the
    program's identity: a nested jit's trace is cached by its static arguments, not by
    the context it was called in)."""
    TRACE_COUNTS[name] += 1
    with born_xla_sincos(xla_sincos):
        out, info = _apply(logits, weights, where, dynamic, name=name, static=static)
    if poison:
        out = jnp.where(bad_rows(logits, weights, where)[..., None], jnp.nan, out)
    if check:
        return out, info, value_status(logits, weights, where)
    return out, info


class Fuser:
    """A fusion method with its parameters resolved once (see :func:`compile`).

    Attributes:
      name: the method's registered name.
      params: the resolved parameters (defaults filled in, phase maps parsed).
    """

    def __init__(self, method: str, params: Mapping[str, Any]):
        m = M.get_method(method)
        self.name = m.name
        self.params = M.resolve_params(m, dict(params))
        self._static, self._dynamic = M.split_params(m, self.params)
        phase = self.params.get("phase")
        self._offset_shape = None if phase is None else jnp.shape(phase.params["offset"])

    def __repr__(self) -> str:
        return f"Fuser({self.name!r}, {self.params})"

    @property
    def static(self) -> tuple:
        """The compile-time parameters (hashable): part of a program's identity."""
        return self._static

    @property
    def dynamic(self) -> dict:
        """The traced parameters (a pytree of device arrays): arguments of a program."""
        return self._dynamic

    def fn(self, logits_XnV, weights=None, where=None):
        """The pure function ``(logits, weights, where) -> (logq, info)``, no checks:
        for use inside the caller's own jitted program."""
        return _apply(logits_XnV, weights, where, self._dynamic, name=self.name,
                      static=self._static)

    def __call__(self, logits_XnV: jax.Array, weights: jax.Array | None = None, *,
                 where: jax.Array | None = None, return_info: bool = False,
                 validate: bool = True):
        """Fuses member logits; the arguments are those of :func:`fuse`.

        With ``validate`` the value checks run on the device and their status
        is read back (a 4-byte transfer that waits for the result): pass
        ``validate=False`` to dispatch without waiting, e.g. in a loop whose
        inputs are known to be good.
        """
        logits_XnV = jnp.asarray(logits_XnV)
        check_shapes(logits_XnV, weights, where)
        if self._offset_shape is not None:
            check_offset(self.params["phase"], logits_XnV.shape[-2])
        if weights is not None:
            weights = jnp.asarray(weights, logits_XnV.dtype)
        elif is_concrete(logits_XnV):
            weights = _uniform(logits_XnV.shape[-2], logits_XnV.dtype)
        concrete = all(x is None or is_concrete(x) for x in (logits_XnV, weights, where))
        if validate and concrete:
            out, info, status = _fuse_jit(logits_XnV, weights, where, self._dynamic,
                                          name=self.name, static=self._static, check=True,
                                          xla_sincos=xla_sincos_on())
            status = int(jax.device_get(status))  # 4 bytes, the only read-back
            if status:
                check_inputs(logits_XnV, weights, where)  # raises, naming the first bad index
                raise FusionInputError(f"bad input to {self.name!r} (status {status})")
        else:
            out, info = _fuse_jit(logits_XnV, weights, where, self._dynamic, name=self.name,
                                  static=self._static, xla_sincos=xla_sincos_on(),
                                  poison=validate)
        return (out, info) if return_info else out


def compile(method: str, **params: Any) -> Fuser:  # noqa: A001 (brf.fusion.compile)
    """A fusion method with its parameters parsed and checked once.

    Args:
      method: a name in ``brf.fusion.METHODS``.
      **params: the method's parameters, as for :func:`fuse`.

    Returns:
      A :class:`Fuser`: ``fuser(logits, weights, where=..., return_info=...,
      validate=...)`` computes what ``fuse(method, logits, weights, ...,
      **params)`` does, without re-reading the parameters; ``fuser.fn`` is the
      unchecked pure function for use inside jit.

    Raises:
      FusionInputError: unknown method or parameter, bad parameter value.
    """
    return Fuser(method, params)


_CACHE_SIZE = 256
_FUSERS: collections.OrderedDict = collections.OrderedDict()


def _freeze(value: Any):
    """A hashable stand-in for a plain parameter value, or raises TypeError.

    Strings, numbers, bools, None, and lists, tuples and dicts of them freeze;
    arrays and PhaseMap objects do not (their values could change under the
    same identity, or be tracers), so calls with them compile a fuser each time.
    """
    if value is None or isinstance(value, (str, bool, int, float)):
        return (type(value).__name__, value)
    if isinstance(value, (list, tuple)):
        return ("seq",) + tuple(_freeze(v) for v in value)
    if isinstance(value, Mapping):
        return ("map",) + tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    raise TypeError(type(value).__name__)


def cached_fuser(method: str, params: Mapping[str, Any]) -> Fuser:
    """The :class:`Fuser` for ``(method, params)``, from the cache when the
    parameters are plain values (see :func:`_freeze`)."""
    try:
        key = (method, _freeze(dict(params)))
    except TypeError:
        return Fuser(method, params)
    fuser = _FUSERS.get(key)
    if fuser is None:
        fuser = _FUSERS[key] = Fuser(method, params)
        if len(_FUSERS) > _CACHE_SIZE:
            _FUSERS.popitem(last=False)
    else:
        _FUSERS.move_to_end(key)
    return fuser


def fuse(method: str, logits_XnV: jax.Array, weights: jax.Array | None = None,
         *, where: jax.Array | None = None, return_info: bool = False,
         validate: bool = True, **params: Any):
    """Fuses members' next-token distributions with a registered method.

    Args:
      method: a name in ``brf.fusion.METHODS`` (``brf.fusion.METHODS.names()``).
      logits_XnV: member logits [..., n_members, V]; -inf marks invalid tokens.
      weights: member weights [n] or [..., n] on the simplex (default uniform).
        They are checked, never renormalised silently.
      where: optional bool mask broadcastable to the logits; False = token not
        allowed (as if its logit were -inf).
      return_info: also return the method's diagnostics (``fallback`` etc.).
      validate: check inputs before computing (value checks run on the device
        and the call waits for their 4-byte answer). Inside the caller's
        ``jax.jit`` values cannot be read: shapes, dtypes and parameters still
        raise, and a row whose values are bad (NaN / +inf logits, a member with
        no valid token, weights off the simplex) comes out NaN in every entry.
      **params: the method's parameters (see ``METHODS.get(method).params``).

    Returns:
      log-probabilities [..., V] (normalised over V), and the info dict if
      ``return_info``.

    Raises:
      FusionInputError: unknown method or parameter, bad parameter value, bad
        shapes, NaN/+inf logits, weights off the simplex (the last two outside
        ``jax.jit``; see ``validate``).
    """
    fuser = cached_fuser(method, params)
    return fuser(logits_XnV, weights, where=where, return_info=return_info,
                 validate=validate)
