"""Born Rule Fusion (BRF) and its decomposition.

Member i contributes the amplitude ``a_i(t) = sqrt(w_i p_i(t)) e^{i phi_i}``;
the fused distribution is ``q(t) = |sum_i a_i(t)|^2 / Z``. Expanded,

    |sum_i a_i|^2 = sum_i w_i p_i + 2 sum_{i<j} sqrt(w_i w_j p_i p_j) cos(phi_i - phi_j)

(the linear pool plus the bilinear "interference" cross-terms).

With one phase per member per position (per-position phase maps) this is a
one-parameter family through known poolings: equal phases give the power mean
of order 1/2 (Hellinger pooling; since amplitudes carry sqrt(w_i), its weights
are proportional to sqrt(w_i) — the same weights when they are uniform), a
phase difference of pi/2 between two
members gives the linear pool, and beyond pi/2 tokens both members favour are
pushed down — q(t) can fall below every member's p_i(t).

**Z -> 0 guard.** Opposed phases on near-identical members cancel almost all
mass; float32 cancellation then leaves relative errors of about eps / Z in q.
Where ``Z < z_min`` (default 1e-3, i.e. less than 0.1% of the phase-free mass
survives) the kernel returns the linear pool for that position instead and sets
``info["fallback"]`` there. It never returns NaN.

**Kernel layout (per-position maps).** One pass finds each member's top-1
logit and gap (chunked, see :func:`brf.fusion.members.chunked_top2_gap`). The
normaliser is then analytic, from the members' Gram matrix
``G_ij = sum_t e_i(t) e_j(t)`` with ``e_i = exp((l_i - max l_i) / 2)``:
``G_ii`` is member i's softmax normaliser and
``Z = sum_ij c_i c_j cos(phi_i - phi_j) G_ij`` with ``c_i = sqrt(w_i / G_ii)``.
The output pass writes ``log q`` directly in the log domain (amplitudes
rescaled by their per-token maximum over members), so tiny probabilities keep
their precision and no further pass over V is needed to normalise. Per-token
maps cannot use the Gram trick and normalise with a log-sum-exp over V.
Sums over members are unrolled (see :mod:`brf.fusion.members`).
"""

from __future__ import annotations

import itertools
import contextlib
import contextvars
from typing import NamedTuple

import jax
import jax.numpy as jnp

from brf.fusion import methods as M
from brf.fusion.checks import check_inputs
from brf.fusion.members import mmax, msum, unstack
from brf.fusion.phase import (PhaseMap, check_offset, phase_map, position_gap,
                              token_gap)

DEFAULT_Z_MIN = 1e-3

# sin and cos for float32 phases, vectorised: XLA:CPU evaluates jnp.sin and jnp.cos
# one element at a time (many times the cost of jnp.exp, which it vectorises), and
# per-token phases need both at every (member, event), forward and again in the
# gradient. Reduction by pi/2 in three parts (Cody-Waite), then minimax polynomials
# on [-pi/4, pi/4] (the Cephes sinf/cosf coefficients). float64 goes to
# jnp.sin/jnp.cos; narrower floats are computed in float32.
_PIO2 = (1.5703125, 4.837512969970703125e-4, 7.54978995489188216e-8)
_SIN = (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1)
_COS = (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2)


_XLA_SINCOS = contextvars.ContextVar("brf_xla_sincos", default=False)


@contextlib.contextmanager
def xla_sincos(on: bool = True):
    """Within this context, :func:`sincos` traced in this thread takes sin and cos
    from jnp (XLA's own, about two float32 ulps from the polynomial): the fits'
    stability check uses it to show that no answer hangs on those last bits."""
    token = _XLA_SINCOS.set(bool(on))
    try:
        yield
    finally:
        _XLA_SINCOS.reset(token)


def xla_sincos_on() -> bool:
    """Whether :func:`sincos` now takes XLA's sin and cos (inside :func:`xla_sincos`)."""
    return _XLA_SINCOS.get()


def sincos(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sin x, cos x): for float32, within 1.2e-7 of the exact values (about 2 ulp;
    tested for |x| <= 3000); float64 and non-float input, and any input traced inside
    :func:`xla_sincos`, as jnp.sin and jnp.cos.

    Its derivative reuses the values (d sin = cos dx, d cos = -sin dx) instead of
    evaluating them again. (A plain function choosing between two: JAX caches the trace
    of a custom_jvp function by its inputs' shapes, so one function could not follow
    the context.)"""
    x = jnp.asarray(x)
    if (x.dtype == jnp.float64 or not jnp.issubdtype(x.dtype, jnp.floating)
            or _XLA_SINCOS.get()):
        return jnp.sin(x), jnp.cos(x)
    return _sincos32(x)


@jax.custom_jvp
def _sincos32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`sincos` by the polynomials (a floating ``x``, computed in float32)."""
    dtype, x = x.dtype, x.astype(jnp.float32)
    j = jnp.round(x * (2.0 / 3.141592653589793))
    r = ((x - j * _PIO2[0]) - j * _PIO2[1]) - j * _PIO2[2]
    r2 = r * r
    s = r + r * r2 * (_SIN[2] + r2 * (_SIN[1] + r2 * _SIN[0]))
    c = 1.0 - 0.5 * r2 + r2 * r2 * (_COS[2] + r2 * (_COS[1] + r2 * _COS[0]))
    q = jnp.mod(j, 4.0)  # the quadrant: sin, cos = (s, c), (c, -s), (-s, -c), (-c, s)
    swap = (q == 1.0) | (q == 3.0)
    sin = jnp.where(swap, c, s) * jnp.where(q >= 2.0, -1.0, 1.0)
    cos = jnp.where(swap, s, c) * jnp.where((q == 1.0) | (q == 2.0), -1.0, 1.0)
    return sin.astype(dtype), cos.astype(dtype)


@_sincos32.defjvp
def _sincos_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    s, c = _sincos32(x)
    return (s, c), (c * dx, -s * dx)


def member_phases(logits: jax.Array, phase: PhaseMap) -> tuple[jax.Array, jax.Array]:
    """Top-1 logits [..., n] and phases ([..., n] or [..., n, V] for token maps)."""
    if phase.kind == "token":
        top1 = jnp.max(logits, axis=-1)
        return top1, phase(token_gap(logits, top1), member_axis=-2)
    top1, gap = position_gap(logits)
    return top1, phase(gap, member_axis=-1)


def _log(x):
    """log x, -inf at 0, with gradients that stay finite where x = 0."""
    pos = x > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, x, 1.0)), -jnp.inf)


@M.register(
    "born",
    phase=M.Param("constant", "phase", doc="phase map (see brf.fusion.phase)"),
    z_min=M.Param(DEFAULT_Z_MIN, "float", M.nonnegative,
                  doc="fall back to the linear pool where Z < z_min"),
)
def born(logits: jax.Array, weights: jax.Array, *, phase=None,
         z_min=DEFAULT_Z_MIN):
    """Born Rule Fusion: |sum_i sqrt(w_i p_i) e^{i phi_i}|^2, normalised.

    Args:
      logits: [..., n, V] member logits (-inf marks invalid tokens).
      weights: [..., n] on the simplex.
      phase: a PhaseMap, or a spec :func:`brf.fusion.phase.phase_map` accepts.
      z_min: threshold of the Z -> 0 guard.

    Returns:
      (log q [..., V], info) with info = {"fallback": bool [...], "z": [...]},
      z being the normaliser relative to the linear pool's (which is 1).
    """
    phase = phase_map(phase if phase is not None else "constant")
    top1, phi = member_phases(logits, phase)
    return born_from_phases(logits, weights, top1, phi, z_min=z_min)


def born_from_phases(logits: jax.Array, weights: jax.Array, top1: jax.Array,
                     phi: jax.Array, *, z_min=DEFAULT_Z_MIN):
    """Born fusion with given member phases (the kernel behind :func:`born`).

    Args:
      logits: [..., n, V] member logits (-inf marks invalid tokens).
      weights: [..., n] on the simplex.
      top1: [..., n] each member's top logit.
      phi: [..., n] (one phase per member) or [..., n, V] (one per token).
      z_min: threshold of the Z -> 0 guard.

    Returns:
      (log q [..., V], info) as :func:`born`.
    """
    n = logits.shape[-2]
    token = phi.ndim == logits.ndim
    weights = jnp.broadcast_to(weights, logits.shape[:-1]).astype(logits.dtype)
    xs, ws = unstack(logits), unstack(weights, axis=-1)
    # h_i = log sqrt of member i's unnormalised probabilities (max token: 0).
    h = [0.5 * (xs[i] - top1[..., i, None]) for i in range(n)]
    log_w = [_log(w) for w in ws]
    if token:
        log_norm = [jax.nn.logsumexp(2.0 * hi, axis=-1) for hi in h]
        sin_phi, cos_phi = sincos(phi)
        cos_phi, sin_phi = unstack(cos_phi), unstack(sin_phi)
    else:
        # Gram matrix of half-amplitudes; its diagonal holds the normalisers.
        gram = {}
        for i in range(n):
            for j in range(i, n):
                gram[i, j] = gram[j, i] = jnp.sum(jnp.exp(h[i] + h[j]), axis=-1)
        log_norm = [jnp.log(gram[i, i]) for i in range(n)]
        c = [jnp.exp(0.5 * (log_w[i] - log_norm[i])) for i in range(n)]
        z = msum([c[i] * c[j] * sincos(phi[..., i] - phi[..., j])[1] * gram[i, j]
                  for i in range(n) for j in range(n)])
        sin_all, cos_all = sincos(phi)
        cos_phi = [cos_all[..., i, None] for i in range(n)]
        sin_phi = [sin_all[..., i, None] for i in range(n)]
    # u_i = 0.5 log(w_i p_i(t)); rescaled per token by its max over members.
    u = [h[i] + (0.5 * (log_w[i] - log_norm[i]))[..., None] for i in range(n)]
    top = mmax(u)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    a = [jnp.exp(ui - top) for ui in u]
    re = msum([ai * ci for ai, ci in zip(a, cos_phi)])
    im = msum([ai * si for ai, si in zip(a, sin_phi)])
    if token:
        log_born = 2.0 * top + _log(re * re + im * im)
        log_z = jax.nn.logsumexp(log_born, axis=-1)
        z = jnp.exp(log_z)
        fallback = ~(z >= z_min)
        log_lin = 2.0 * top + _log(msum([ai * ai for ai in a]))
        log_q = jnp.where(fallback[..., None], log_lin, log_born - log_z[..., None])
        return log_q, {"fallback": fallback, "z": z}
    # Per-position maps: Z is known before the output pass, so the fallback
    # picks the squared amplitude to take the log of (one log per token).
    fallback = ~(z >= z_min)
    sq = jnp.where(fallback[..., None], msum([ai * ai for ai in a]), re * re + im * im)
    log_q = 2.0 * top + _log(sq) - jnp.where(fallback, 0.0, _log(z))[..., None]
    return log_q, {"fallback": fallback, "z": z}


class BornTerms(NamedTuple):
    """BRF's decomposition (unnormalised: q = (linear + cross.sum(-2)) / z).

    Attributes:
      linear: [..., V] the linear pool sum_i w_i p_i (sums to 1).
      cross: [..., P, V] per-pair cross-terms
        2 sqrt(w_i w_j p_i p_j) cos(phi_i - phi_j), pairs in ``pairs`` order.
      pairs: [P, 2] member indices (i < j) of each pair.
      z: [...] normaliser, 1 + sum of all cross-terms.
      bhattacharyya: [..., P] sum_t sqrt(p_i(t) p_j(t)) per pair.
      phase: member phases, [..., n] (per-position) or [..., n, V] (per-token).
    """
    linear: jax.Array
    cross: jax.Array
    pairs: jax.Array
    z: jax.Array
    bhattacharyya: jax.Array
    phase: jax.Array


def born_terms(logits: jax.Array, weights: jax.Array | None = None,
               phase=None) -> BornTerms:
    """Decomposes Born fusion into linear part, cross-terms, Z and overlaps.

    Args:
      logits: [..., n, V] member logits.
      weights: [..., n] on the simplex (default uniform).
      phase: a phase map or spec (default ``constant``).

    Returns:
      A :class:`BornTerms`; P = n (n - 1) / 2 pairs.
    """
    logits = jnp.asarray(logits)
    check_inputs(logits, weights)
    n = logits.shape[-2]
    weights = (jnp.full((n,), 1.0 / n, logits.dtype) if weights is None
               else jnp.asarray(weights, logits.dtype))
    phase = phase_map(phase if phase is not None else "constant")
    check_offset(phase, n)
    weights = jnp.broadcast_to(weights, logits.shape[:-1]).astype(logits.dtype)
    _, phi = member_phases(logits, phase)
    p = jax.nn.softmax(logits, axis=-1)
    amp = jnp.sqrt(weights[..., None] * p)
    root_p = jnp.sqrt(p)
    pairs = jnp.array(list(itertools.combinations(range(n), 2)) or
                      jnp.zeros((0, 2)), dtype=jnp.int32).reshape(-1, 2)
    i, j = pairs[:, 0], pairs[:, 1]
    phi_v = phi if phase.kind == "token" else phi[..., None]
    cross = (2.0 * amp[..., i, :] * amp[..., j, :]
             * sincos(phi_v[..., i, :] - phi_v[..., j, :])[1])
    linear = jnp.sum(weights[..., None] * p, axis=-2)
    z = 1.0 + jnp.sum(cross, axis=(-2, -1))
    bc = jnp.sum(root_p[..., i, :] * root_p[..., j, :], axis=-1)
    return BornTerms(linear, cross, pairs, z, bc, phi)
