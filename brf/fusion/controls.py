"""Control methods that separate Born fusion's interference from its capacity.

Calibrated BRF with a per-token phase map (``token_*``: a token's phase follows
its distance to its member's top logit) can beat the tuned pools. Two things
could produce that edge: the interference structure (cross-terms whose sign
follows the members' per-token phases) or the extra freedom the map gives. The
three methods here keep one and remove the other; fitted like every other
method, they tell the two apart.

**Phase-shuffled BRF** (``born_shuffled``). The same per-token phase map, but
the per-token phases are permuted at random across the events, one permutation
per position shared by the members. Each member's multiset of phases at a
position is kept (and with it everything the map's parameters control about
their spread), and so is the multiset of the members' phase tuples (each event
takes all members' phases from one other event: where the members agree, as
identical members do everywhere, their phases still agree); their link to
*which* token carries which phases is broken. Events a member rules out (-inf)
carry no amplitude, so they neither give nor receive a phase: events are
permuted within the class of events that the same members give mass. (Until
issue 37 each member drew its own permutation; identical members then
interfered destructively, down to zero mass on tokens both gave mass.)
Interference that matters should lose its edge here; capacity alone would not
care.

The permutation is a deterministic function of ``seed`` and the members'
*rankings* of their finite events (each member's logits sorted, ties broken
by event index). A position therefore gets the same permutation wherever it
sits in a batch (a fit's subsample included), whichever other rows are fused
with it, with any number of -inf padding events appended, and under any
increasing map of a member's logits (tempering with ``log_softmax(l / T)``, the
calibrated variant's member temperatures), so an optimiser sees one fixed
function and a fitted control evaluates to the function it was fitted as. (Two logits that differ by a rounding error
and become equal after tempering can reorder a ranking; the position then
draws another permutation.) Only per-token maps are accepted: per-position
phases are the same for every event and there is nothing to shuffle. The
shuffle sorts over the whole event axis, so unlike the other kernels it is not
a vocabulary-sharded computation.

**Per-token reshaping without cross-terms** (``reshape``). Each member's
distribution is tilted token by token by a curve of its own distance to its
top logit, ``d_i(t) = l_i(top) - l_i(t)``,

    p~_i(t) ∝ p_i(t) exp(s_i c(d_i(t))),

renormalised over the member's events, then pooled linearly or log-linearly
with the member weights. ``c`` is one of the phase-map curves with unit scale
(``tanh``: ``tanh(rate d)``, ``sigmoid``: ``sigmoid(rate (d - center))``,
``arctan``, ``log1p``, ``linear``: ``d``), ``s_i`` a per-member strength
(signed; 0 leaves the member as it is). Free parameters: n strengths plus the
curve's shape parameters, which is the count of a per-token phase map with
the same curve (its scale and shape parameters plus n - 1 phase-offset
differences). With ``linear`` the tilt is ``p_i^(1 - s_i)``, i.e. a member
temperature, which the calibrated variant already fits: use a curve with a
shape parameter for a control there.

**Power mean with per-member exponents** (``power_members``). A pool with one
free exponent per member:

    q(t) ∝ (sum_i w_i p_i(t)^alpha_i)^(1 / order).

It reduces to known pools: all ``alpha_i = order = a`` is the power mean of
order a (``power``), ``a = 1`` the linear pool, ``a = 1/2`` Hellinger, and
``a -> 0`` the log-linear pool (weights ``w_i alpha_i / sum w alpha``, when the
alphas shrink together). ``order`` only tempers the result, so under the
calibrated variant (which fits a post-fusion temperature) it is redundant and
should be held at 1; there the pool has n free exponents. Where a member with
``alpha_i < 0`` gives a token probability 0 the token is vetoed (q = 0); a
member with ``alpha_i >= 0`` and p_i(t) = 0 contributes nothing to it.

All three keep -inf events at -inf with finite gradients and never return NaN
or negative probabilities; where no token keeps mass they fall back to the
linear pool (``reshape``: of the tilted members) and set ``info["fallback"]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from brf.fusion import methods as M
from brf.fusion import pools
from brf.fusion.born import DEFAULT_Z_MIN, born_from_phases, member_phases
from brf.fusion.checks import FusionInputError
from brf.fusion.members import mlogsumexp, unstack
from brf.fusion.phase import PHASE_MAPS, phase_map, token_gap

RESHAPE_CURVES = ("linear", "tanh", "sigmoid", "arctan", "log1p")
POOLS = ("linear", "loglinear")


def _token_map(pm) -> str | None:
    pm = phase_map(pm)
    if pm.kind != "token":
        return (f"phase map {pm.name!r} gives one phase per position; shuffling needs "
                f"a per-token map (token_*)")
    return None


def _mix32(x: jax.Array) -> jax.Array:
    """A bijective avalanche mix of uint32 values (xor-shift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


@functools.partial(jax.jit, static_argnames=("seed",))
def shuffle_sources(logits: jax.Array, seed: int = 0) -> jax.Array:
    """For every event, the event whose phase it takes under the phase shuffle.

    Args:
      logits: [..., n, V] member logits (-inf: the member gives no mass).
      seed: selects the family of permutations (static).

    Returns:
      int32 [..., n, V]: ``src`` with ``phi_shuffled[..., i, t] = phi[..., i,
      src[..., i, t]]``. Per position it is one random permutation shared by
      the members: it permutes the events within each class of events that the
      same members give mass (so each member's finite events among themselves)
      and maps every event a member rules out to itself for that member. It
      depends only on ``seed`` and the members' rankings of the events (see the
      module docstring).
    """
    x = jax.lax.stop_gradient(logits)
    n, v = x.shape[-2], x.shape[-1]
    finite = jnp.isfinite(x)
    salt = _mix32(jnp.uint32(seed) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x632BE5AB))
    events = jnp.arange(v, dtype=jnp.uint32)
    # A 32-bit fingerprint of each member's ranking of its finite events:
    # sum_k order[k] c_k (mod 2^32) over the ranks k of finite events, odd c_k;
    # events appended at -inf (padding) change neither it nor anything below.
    order = jnp.argsort(-x, axis=-1, stable=True).astype(jnp.uint32)
    c = _mix32(events ^ salt) | jnp.uint32(1)
    ranked = events < jnp.sum(finite, axis=-1, keepdims=True).astype(jnp.uint32)
    fingerprint = jnp.sum(jnp.where(ranked, order * c, jnp.uint32(0)), axis=-1,
                          dtype=jnp.uint32)
    # One permutation per position, shared by the members (issue 37): with one
    # permutation per member, two members that agree on an event took the phases
    # of two different events there, so their phases at it no longer matched. With
    # identical members (where Born fusion returns the member) that is destructive
    # interference that Born never has, down to exactly zero mass where the phases
    # drawn differ by pi (two identical uniform members over V = 4 tokens plus a
    # negligible OTHER event at phase ~pi: half the positions floored). Shared, each
    # event keeps the members' phases as a tuple, taken from one other event.
    row = salt
    for i in range(n):
        row = _mix32(row ^ _mix32(fingerprint[..., i] + _mix32(jnp.uint32(i) + salt)))
    # One key per event: distinct within a row (mixing is a bijection), so sorting
    # them draws a permutation.
    keys = _mix32(row[..., None] ^ _mix32(events + jnp.uint32(0x85EBCA6B)))
    # Events are permuted within their class (the set of members finite there):
    # sorted by class, then by key (the sources) or by index (the destinations).
    ruled_out = [~finite[..., i, :] for i in range(n)]
    index = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), keys.shape)
    by_key = jax.lax.sort((*ruled_out, keys, index), num_keys=n + 1)[-1]
    by_index = jax.lax.sort((*ruled_out, index), num_keys=n + 1)[-1]
    place = jnp.argsort(by_index, axis=-1)  # each event's slot in the class order
    src = jnp.take_along_axis(by_key, place, axis=-1)
    return jnp.where(finite, src[..., None, :], jnp.arange(v)).astype(jnp.int32)


@M.register(
    "born_shuffled",
    phase=M.Param("token_tanh", "phase", _token_map,
                  doc="a per-token phase map (token_*) whose phases are shuffled"),
    seed=M.Param(0, "int", M.seed, doc="selects the permutations"),
    z_min=M.Param(DEFAULT_Z_MIN, "float", M.nonnegative,
                  doc="fall back to the linear pool where Z < z_min"),
)
def born_shuffled(logits, weights, *, phase=None, seed=0, z_min=DEFAULT_Z_MIN):
    """BRF with each member's per-token phases permuted across its events.

    Args:
      logits: [..., n, V] member logits (-inf marks invalid tokens).
      weights: [..., n] on the simplex.
      phase: a per-token PhaseMap or spec (``token_*``).
      seed: selects the permutations (:func:`shuffle_sources`).
      z_min: threshold of the Z -> 0 guard (as :func:`brf.fusion.born.born`).

    Returns:
      (log q [..., V], info) as :func:`brf.fusion.born.born`.
    """
    return born_from_sources(logits, weights, shuffle_sources(logits, seed),
                             phase=phase, z_min=z_min)


def born_from_sources(logits, weights, sources, *, phase=None, z_min=DEFAULT_Z_MIN):
    """:func:`born_shuffled` with the permutation given: ``sources`` [..., n, V] as
    :func:`shuffle_sources` returns it. A fit computes it once from a table's rows
    (it depends only on their rankings, which a member's temperature keeps) instead
    of sorting every event at every evaluation."""
    phase = phase_map(phase if phase is not None else "token_tanh")
    msg = _token_map(phase)
    if msg:
        raise FusionInputError(f"born_shuffled: {msg}")
    top1, phi = member_phases(logits, phase)
    phi = jnp.take_along_axis(phi, sources, axis=-1)
    return born_from_phases(logits, weights, top1, phi, z_min=z_min)


def _per_member(value, n: int, dtype, what: str) -> jax.Array:
    """A scalar or [n] parameter as an [n] array."""
    a = jnp.asarray(value, dtype)
    if a.ndim == 1 and a.shape[0] not in (1, n):
        raise FusionInputError(
            f"{what} must be a number or one number per member ({n}); got shape {a.shape}")
    return jnp.broadcast_to(a.reshape(-1), (n,)) if a.ndim else jnp.full((n,), a)


def reshaped_logprobs(logits: jax.Array, scale, *, curve: str = "tanh", rate=1.0,
                      center=0.0) -> jax.Array:
    """Each member tilted by its own token distances: log p~_i [..., n, V].

    ``p~_i(t) ∝ p_i(t) exp(scale_i c(d_i(t)))`` with ``d_i(t) = l_i(top) - l_i(t)``
    and ``c`` the named phase-map curve at unit scale (``|rate|`` is used, so an
    unconstrained fit stays inside every curve's domain). -inf stays -inf.
    """
    if curve not in RESHAPE_CURVES:
        raise FusionInputError(f"reshape: curve={curve!r} must be one of {list(RESHAPE_CURVES)}")
    n = logits.shape[-2]
    s = _per_member(scale, n, logits.dtype, "reshape: scale")
    d = token_gap(logits, jnp.max(logits, axis=-1))
    shape_params = {"scale": 1.0, "rate": jnp.abs(rate), "center": center}
    defaults = PHASE_MAPS.get(curve).defaults
    c = PHASE_MAPS.get(curve).curve(d, **{k: shape_params[k] for k in defaults})
    finite = jnp.isfinite(logits)
    tilted = jnp.where(finite, jnp.where(finite, logits, 0.0) + s[:, None] * c, -jnp.inf)
    return jax.nn.log_softmax(tilted, axis=-1)


@M.register(
    "reshape",
    curve=M.Param("tanh", "str", M.one_of(*RESHAPE_CURVES),
                  doc="the tilt's curve of d = l(top) - l(t) (phase-map curves, unit scale)"),
    scale=M.Param(0.0, "floats", M.finite,
                  doc="tilt strength, one number or one per member (0: no tilt)"),
    rate=M.Param(1.0, "float", M.finite, doc="the curve's rate (|rate| is used)"),
    center=M.Param(0.0, "float", M.finite, doc="the sigmoid curve's center"),
    pool=M.Param("linear", "str", M.one_of(*POOLS), doc="how the tilted members are pooled"),
)
def reshape(logits, weights, *, curve="tanh", scale=0.0, rate=1.0, center=0.0,
            pool="linear"):
    """Per-token reshaping of each member by its own token distances, then a pool.

    Args:
      logits: [..., n, V] member logits (-inf marks invalid tokens).
      weights: [..., n] on the simplex.
      curve: one of ``RESHAPE_CURVES``.
      scale: tilt strength s_i (scalar or [n]).
      rate, center: the curve's shape parameters (those it takes).
      pool: 'linear' (sum_i w_i p~_i) or 'loglinear' (prod_i p~_i^w_i, normalised).

    Returns:
      (log q [..., V], info with ``fallback``).
    """
    tilted = reshaped_logprobs(logits, scale, curve=curve, rate=rate, center=center)
    if pool == "linear":
        return pools.linear(tilted, weights)
    return pools.loglinear(tilted, weights)


@M.register(
    "power_members",
    alpha=M.Param(0.5, "floats", M.finite,
                  doc="exponent of each member (one number or one per member)"),
    order=M.Param(0.5, "float", M.nonzero,
                  doc="outer root: q ∝ (sum_i w_i p_i^alpha_i)^(1/order)"),
)
def power_members(logits, weights, *, alpha=0.5, order=0.5):
    """Power mean with per-member exponents: q ∝ (sum_i w_i p_i^alpha_i)^(1/order).

    Args:
      logits: [..., n, V] member logits (-inf marks invalid tokens).
      weights: [..., n] on the simplex; members with weight 0 take no part.
      alpha: per-member exponents (scalar or [n]).
      order: the outer root (nonzero).

    Returns:
      (log q [..., V], info with ``fallback``).
    """
    logp = jax.nn.log_softmax(logits, axis=-1)
    n = logits.shape[-2]
    a = _per_member(alpha, n, logits.dtype, "power_members: alpha")
    w = unstack(jnp.broadcast_to(weights, logp.shape[:-1]), axis=-1)
    terms, vetoes = [], []
    for i, lp in enumerate(unstack(logp)):
        active = w[i][..., None] > 0
        dead = active & jnp.isneginf(lp)
        log_w = jnp.log(jnp.where(active, w[i][..., None], 1.0))
        terms.append(jnp.where(active & ~dead,
                               log_w + a[i] * jnp.where(dead, 0.0, lp), -jnp.inf))
        vetoes.append(dead & (a[i] < 0))
    total = mlogsumexp(terms)
    finite = jnp.isfinite(total)
    score = jnp.where(finite, jnp.where(finite, total, 0.0) / order, -jnp.inf)
    veto = vetoes[0]
    for v in vetoes[1:]:
        veto = veto | v
    score = jnp.where(veto, -jnp.inf, score)
    return pools._normalise_or_fallback(score, logp, weights)
