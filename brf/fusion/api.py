"""The one entry point of the fusion library: :func:`fuse`."""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp

from brf.fusion import born as _born  # noqa: F401  (registers "born")
from brf.fusion import bottleneck as _bottleneck  # noqa: F401  (registers "bottleneck_*")
from brf.fusion import controls as _controls  # noqa: F401  (registers the controls)
from brf.fusion import pools as _pools  # noqa: F401  (registers the baselines)
from brf.fusion import methods as M
from brf.fusion.checks import check_inputs, uniform_weights
from brf.fusion.phase import check_offset

# How often each method's jitted body has been traced (tests use it to prove
# that changing parameter values does not recompile).
TRACE_COUNTS: collections.Counter = collections.Counter()


@functools.partial(jax.jit, static_argnames=("name", "static"))
def _fuse_jit(logits, weights, where, dynamic, *, name, static):
    TRACE_COUNTS[name] += 1
    method = M.get_method(name)
    if where is not None:
        logits = jnp.where(where, logits, -jnp.inf)
    return method.fn(logits, weights, **M.join_params(static, dynamic))


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
      validate: check inputs before computing (value checks only apply to
        concrete arrays, i.e. outside a jit trace).
      **params: the method's parameters (see ``METHODS.get(method).params``).

    Returns:
      log-probabilities [..., V] (normalised over V), and the info dict if
      ``return_info``.

    Raises:
      FusionInputError: unknown method or parameter, bad parameter value, bad
        shapes, NaN/+inf logits, weights off the simplex.
    """
    m = M.get_method(method)
    resolved = M.resolve_params(m, params)
    logits_XnV = jnp.asarray(logits_XnV)
    if validate:
        check_inputs(logits_XnV, weights, where)
    if "phase" in resolved:
        check_offset(resolved["phase"], logits_XnV.shape[-2])
    if weights is None:
        weights = uniform_weights(logits_XnV.shape, logits_XnV.dtype)
    weights = jnp.asarray(weights, logits_XnV.dtype)
    static, dynamic = M.split_params(m, resolved)
    out, info = _fuse_jit(logits_XnV, weights, where, dynamic, name=m.name,
                          static=static)
    return (out, info) if return_info else out
