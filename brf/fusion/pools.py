"""The baselines BRF is judged against, all in the fusion-method registry.

Conventions shared by every pool: members with weight 0 take no part (they
cannot veto a token in min/log-linear pools, nor win a routing decision);
where a pool would leave no token with positive mass (e.g. the log-linear pool
of members with disjoint supports) it returns the linear pool there and sets
``info["fallback"]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from brf.fusion import methods as M
from brf.fusion.members import mlogsumexp, mmax, mmin, msum, unstack


def _log_weights(weights):
    return jnp.where(weights > 0, jnp.log(jnp.where(weights > 0, weights, 1.0)),
                     -jnp.inf)


def linear_pool(logp, weights):
    """log sum_i w_i p_i from member log-probabilities [..., n, V]."""
    w = unstack(jnp.broadcast_to(weights, logp.shape[:-1]), axis=-1)
    return mlogsumexp([lp + _log_weights(wi)[..., None]
                       for lp, wi in zip(unstack(logp), w)])


def _normalise_or_fallback(score, logp, weights):
    """log_softmax(score) over V, or the linear pool where score is all -inf."""
    empty = ~jnp.any(score > -jnp.inf, axis=-1)
    safe = jnp.where(empty[..., None], 0.0, score)
    out = jnp.where(empty[..., None], linear_pool(logp, weights),
                    jax.nn.log_softmax(safe, axis=-1))
    return out, {"fallback": empty}


@M.register("linear")
def linear(logits, weights):
    """Linear pool (probability averaging): q = sum_i w_i p_i."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    out = linear_pool(logp, weights)
    return out, {"fallback": jnp.zeros(out.shape[:-1], bool)}


@M.register("loglinear", temperature=M.Param(
    1.0, "float", M.positive, doc="q ∝ exp(sum_i w_i log p_i / temperature)"))
def loglinear(logits, weights, *, temperature=1.0):
    """Log-linear pool / product of experts: q ∝ prod_i p_i^(w_i / T)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return _normalise_or_fallback(_finite_scale(_geometric(logp, weights), 1.0 / temperature),
                                  logp, weights)


def _finite_scale(x, c):
    """c * x, keeping -inf entries -inf with a finite gradient in c."""
    finite = jnp.isfinite(x)
    return jnp.where(finite, c * jnp.where(finite, x, 0.0), x)


def _geometric(logp, weights):
    """sum_i w_i log p_i over members with w_i > 0 (a zero p_i vetoes)."""
    w = unstack(jnp.broadcast_to(weights, logp.shape[:-1]), axis=-1)
    terms = []
    for lp, wi in zip(unstack(logp), w):
        wi = wi[..., None]
        t = jnp.where(wi > 0, wi * jnp.where(jnp.isfinite(lp), lp, 0.0), 0.0)
        terms.append(jnp.where((wi > 0) & jnp.isneginf(lp), -jnp.inf, t))
    return msum(terms)


@M.register("power", alpha=M.Param(
    0.5, "float", M.finite,
    doc="order of the power mean; 1 = linear, 1/2 = Hellinger, 0 = geometric"))
def power(logits, weights, *, alpha=0.5):
    """Power mean of order alpha: q ∝ (sum_i w_i p_i^alpha)^(1/alpha).

    alpha = 0 is the limit, the weighted geometric mean (log-linear pool).
    """
    logp = jax.nn.log_softmax(logits, axis=-1)
    w = unstack(jnp.broadcast_to(weights, logp.shape[:-1]), axis=-1)
    zero = alpha == 0
    safe_alpha = jnp.where(zero, 1.0, alpha)
    # p_i = 0 contributes nothing for alpha > 0 and vetoes the token for
    # alpha < 0; both written so that gradients stay finite.
    active = [wi[..., None] > 0 for wi in w]
    lps = unstack(logp)
    dead = [a & jnp.isneginf(lp) for a, lp in zip(active, lps)]
    terms = [jnp.where(a & ~d, _log_weights(wi)[..., None]
                       + safe_alpha * jnp.where(d, 0.0, lp), -jnp.inf)
             for a, d, lp, wi in zip(active, dead, lps, w)]
    powered = _finite_scale(mlogsumexp(terms), 1.0 / safe_alpha)
    veto = (safe_alpha < 0) & functools.reduce(jnp.logical_or, dead)
    powered = jnp.where(veto, -jnp.inf, powered)
    score = jnp.where(zero, _geometric(logp, weights), powered)
    return _normalise_or_fallback(score, logp, weights)


@M.register("max")
def max_pool(logits, weights):
    """Max pool: q ∝ max_i p_i over members with w_i > 0."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return _normalise_or_fallback(mmax(_active(logp, weights, -jnp.inf)),
                                  logp, weights)


def _active(logp, weights, fill):
    """Per-member log-probs, ``fill`` for members with weight 0."""
    w = unstack(jnp.broadcast_to(weights, logp.shape[:-1]), axis=-1)
    return [jnp.where(wi[..., None] > 0, lp, fill)
            for lp, wi in zip(unstack(logp), w)]


@M.register("min")
def min_pool(logits, weights):
    """Min pool: q ∝ min_i p_i over members with w_i > 0."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return _normalise_or_fallback(mmin(_active(logp, weights, jnp.inf)),
                                  logp, weights)


def confidence(logp, criterion: str):
    """Per-member confidence [..., n]: 'max_prob', 'neg_entropy' or 'gap'."""
    if criterion == "max_prob":
        return jnp.max(logp, axis=-1)
    if criterion == "neg_entropy":
        return -entropy(logp)
    top1 = jnp.max(logp, axis=-1)
    is_top = logp == top1[..., None]
    top2 = jnp.max(jnp.where(is_top, -jnp.inf, logp), axis=-1)
    gap = jnp.where(jnp.sum(is_top, -1) > 1, 0.0, top1 - top2)
    return jnp.where(jnp.isfinite(gap), gap, jnp.inf)


def entropy(logp):
    """Shannon entropy in nats along the last axis (0 log 0 = 0)."""
    p = jnp.exp(logp)
    return -jnp.sum(jnp.where(p > 0, p * jnp.where(p > 0, logp, 0.0), 0.0),
                    axis=-1)


@M.register("routing", criterion=M.Param(
    "max_prob", "str", M.one_of("max_prob", "neg_entropy", "gap"),
    doc="how confidence is measured"))
def routing(logits, weights, *, criterion="max_prob"):
    """Routing: the most confident member (w_i > 0) alone, per position.

    Ties go to the lowest member index. info["member"] says who was chosen.
    """
    logp = jax.nn.log_softmax(logits, axis=-1)
    w = jnp.broadcast_to(weights, logp.shape[:-1])
    conf = jnp.where(w > 0, confidence(logp, criterion), -jnp.inf)
    k = jnp.argmax(conf, axis=-1)
    rows = unstack(logp)
    out = rows[0]
    for i in range(1, len(rows)):
        out = jnp.where((k == i)[..., None], rows[i], out)
    return out, {"fallback": jnp.zeros(k.shape, bool), "member": k}


@M.register(
    "entropy_gated",
    threshold=M.Param(1.0, "float", M.nonnegative,
                      doc="fuse where the primary member's entropy (nats) > this"),
    primary=M.Param(0, "int", M.nonnegative_int, doc="index of the primary member"),
    inner=M.Param("linear", "method", doc="fusion method used where gated on"),
    inner_params=M.Param(None, "params", doc="parameters of the inner method"),
)
def entropy_gated(logits, weights, *, threshold=1.0, primary=0, inner="linear",
                  inner_params=None):
    """Entropy-gated fusion: fuse only at the primary member's "forking tokens".

    Where the primary member's entropy exceeds ``threshold`` the inner method's
    fused distribution is used, elsewhere the primary member's own.
    info["gate"] is True where fusion was applied.
    """
    n = logits.shape[-2]
    if not 0 <= primary < n:
        raise M.FusionInputError(
            f"entropy_gated: primary={primary} but there are {n} members")
    logp = jax.nn.log_softmax(logits, axis=-1)
    own = logp[..., primary, :]
    fused, info = M.get_method(inner).fn(logits, weights, **(inner_params or {}))
    gate = entropy(own) > threshold
    out = jnp.where(gate[..., None], fused, own)
    return out, {"fallback": info["fallback"] & gate, "gate": gate}


@M.register(
    "contrastive",
    beta=M.Param(1.0, "float", M.nonnegative, doc="strength of the amateur penalty"),
    plausibility=M.Param(0.1, "float", M.unit_interval,
                         doc="keep tokens with p_expert >= this * max p_expert"),
    expert=M.Param(0, "int", M.nonnegative_int),
    amateur=M.Param(1, "int", M.nonnegative_int),
)
def contrastive(logits, weights, *, beta=1.0, plausibility=0.1, expert=0,
                amateur=1):
    """Contrastive: log p_expert - beta log p_amateur on plausible tokens.

    Plausible tokens are those with p_expert(t) >= plausibility * max p_expert
    (Li et al., 2023); the others get probability 0. Weights are not used.
    With a single member there is no amateur and the member's own distribution
    is returned.
    """
    n = logits.shape[-2]
    logp = jax.nn.log_softmax(logits, axis=-1)
    if n == 1:
        return logp[..., 0, :], {"fallback": jnp.zeros(logp.shape[:-2], bool)}
    for role, k in (("expert", expert), ("amateur", amateur)):
        if not 0 <= k < n:
            raise M.FusionInputError(
                f"contrastive: {role}={k} but there are {n} members")
    if expert == amateur:
        raise M.FusionInputError("contrastive: expert and amateur must differ")
    le, la = logp[..., expert, :], logp[..., amateur, :]
    keep = le >= jnp.max(le, axis=-1, keepdims=True) + jnp.log(plausibility)
    # A plausible token the amateur rules out (p_a = 0) would score +inf; it
    # is scored as if the amateur gave it its smallest nonzero probability.
    floor = jnp.min(jnp.where(jnp.isfinite(la), la, jnp.inf), axis=-1,
                    keepdims=True)
    score = jnp.where(keep, le - beta * jnp.maximum(la, floor), -jnp.inf)
    return _normalise_or_fallback(score, logp, weights)
