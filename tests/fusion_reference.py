"""Independent float64 NumPy references for the fusion kernels.

Written from the formulas in docs/design.md §1, sharing no code with brf.fusion.
"""

import math

import numpy as np


def softmax(l):
    l = np.asarray(l, np.float64)
    m = np.max(l, axis=-1, keepdims=True)
    e = np.exp(l - m)
    return e / e.sum(-1, keepdims=True)


def log_softmax(l):
    l = np.asarray(l, np.float64)
    m = np.max(l, axis=-1, keepdims=True)
    return l - m - np.log(np.exp(l - m).sum(-1, keepdims=True))


def gap(l):
    """top1 - top2 per row (ties -> 0; fewer than 2 finite values -> 0)."""
    s = -np.sort(-np.asarray(l, np.float64), axis=-1)
    g = s[..., 0] - s[..., 1] if s.shape[-1] > 1 else np.zeros(s.shape[:-1])
    return np.where(np.isfinite(g), g, 0.0)


CURVES = {
    "constant": lambda x, **k: np.zeros_like(x),
    "linear": lambda x, scale: scale * x,
    "tanh": lambda x, scale, rate: scale * np.tanh(rate * x),
    "sigmoid": lambda x, scale, rate, center: scale / (1 + np.exp(-rate * (x - center))),
    "arctan": lambda x, scale, rate: scale * 2 / math.pi * np.arctan(rate * x),
    "log1p": lambda x, scale, rate: scale * np.log1p(rate * x),
}


def phases(l, name, offset=0.0, **params):
    """Member phases: [..., n] (per-position) or [..., n, V] (token_*)."""
    l = np.asarray(l, np.float64)
    offset = np.asarray(offset, np.float64)
    if name.startswith("token_"):
        top = np.max(l, axis=-1, keepdims=True)
        d = np.where(np.isfinite(l), top - l, 0.0)
        off = offset[..., None] if offset.ndim else offset
        return CURVES[name[6:]](d, **params) + off
    return CURVES[name](gap(l), **params) + offset


def born(l, w, phi, z_min=1e-3):
    """(q, Z): Born fusion with phases phi ([..., n] or [..., n, V])."""
    p = softmax(l)
    w = np.broadcast_to(np.asarray(w, np.float64), p.shape[:-1])
    phi = np.asarray(phi, np.float64)
    if phi.ndim == p.ndim - 1:
        phi = phi[..., None]
    amp = np.sqrt(w[..., None] * p) * np.exp(1j * phi)
    s = np.abs(amp.sum(-2)) ** 2
    z = s.sum(-1)
    q = s / np.where(z > 0, z, 1.0)[..., None]
    lin = (w[..., None] * p).sum(-2)
    q = np.where((z < z_min)[..., None], lin, q)
    return q, z


def linear(l, w):
    p = softmax(l)
    w = np.broadcast_to(np.asarray(w, np.float64), p.shape[:-1])
    return (w[..., None] * p).sum(-2)


def _norm(s):
    return s / s.sum(-1, keepdims=True)


def power(l, w, alpha):
    p = softmax(l)
    w = np.broadcast_to(np.asarray(w, np.float64), p.shape[:-1])[..., None]
    act = w > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        if alpha == 0:
            logp = log_softmax(l)
            s = np.where(act, w * np.where(act, logp, 0), 0).sum(-2)
            s = np.where((act & np.isneginf(logp)).any(-2), -np.inf, s)
            return softmax(s)
        else:
            s = np.where(act, w * np.power(p, alpha), 0).sum(-2) ** (1 / alpha)
            if alpha < 0:
                s = np.where((act & (p == 0)).any(-2), 0.0, s)
    return _norm(s)


def loglinear(l, w, temperature):
    p = softmax(l)
    w = np.broadcast_to(np.asarray(w, np.float64), p.shape[:-1])[..., None]
    act = w > 0
    logp = log_softmax(l)
    score = np.where(act, w * np.where(act, logp, 0), 0).sum(-2) / temperature
    score = np.where((act & np.isneginf(logp)).any(-2), -np.inf, score)
    return softmax(score)


def max_pool(l, w):
    p = softmax(l)
    act = np.broadcast_to(np.asarray(w), p.shape[:-1])[..., None] > 0
    return _norm(np.where(act, p, -1).max(-2))


def min_pool(l, w):
    p = softmax(l)
    act = np.broadcast_to(np.asarray(w), p.shape[:-1])[..., None] > 0
    return _norm(np.where(act, p, 2).min(-2))


def entropy(p):
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log(p), 0).sum(-1)


def routing(l, w, criterion="max_prob"):
    p = softmax(l)
    w = np.broadcast_to(np.asarray(w), p.shape[:-1])
    if criterion == "max_prob":
        conf = p.max(-1)
    elif criterion == "neg_entropy":
        conf = -entropy(p)
    else:
        conf = gap(np.log(np.where(p > 0, p, 0) + 0.0))
    conf = np.where(w > 0, conf, -np.inf)
    k = np.argmax(conf, -1)
    return np.take_along_axis(p, k[..., None, None], -2)[..., 0, :]


def entropy_gated(l, w, threshold, primary=0):
    p = softmax(l)
    own = p[..., primary, :]
    fused = linear(l, w)
    return np.where((entropy(own) > threshold)[..., None], fused, own)


def contrastive(l, beta, plausibility, expert=0, amateur=1):
    p = softmax(l)
    pe, pa = p[..., expert, :], p[..., amateur, :]
    keep = pe >= plausibility * pe.max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        la = np.log(pa)
        floor = np.min(np.where(pa > 0, la, np.inf), -1, keepdims=True)
        score = np.where(keep, np.log(pe) - beta * np.maximum(la, floor), -np.inf)
    return softmax(score)


def _logsumexp(a, axis):
    a = np.asarray(a, np.float64)
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.squeeze(m, axis) + np.log(np.exp(a - m).sum(axis))


def reshape(l, w, curve, scale, rate=1.0, center=0.0, pool="linear"):
    """Each member tilted by exp(scale_i c(d_i(t))) (unit-scale curve), then pooled."""
    l = np.asarray(l, np.float64)
    finite = np.isfinite(l)
    d = np.where(finite, np.max(l, -1, keepdims=True) - l, 0.0)
    shape = {"linear": {}, "tanh": {"rate": abs(rate)},
             "sigmoid": {"rate": abs(rate), "center": center},
             "arctan": {"rate": abs(rate)}, "log1p": {"rate": abs(rate)}}[curve]
    c = CURVES[curve](d, scale=1.0, **shape)
    s = np.broadcast_to(np.asarray(scale, np.float64), (l.shape[-2],))[:, None]
    tilted = np.where(finite, l + s * c, -np.inf)
    if pool == "linear":
        return linear(tilted, w)
    with np.errstate(invalid="ignore"):  # rows with no mass left: NaN, the caller's case
        return loglinear(tilted, w, 1.0)


def power_members(l, w, alpha, order):
    """(sum_i w_i p_i^alpha_i)^(1/order), normalised; computed in log space."""
    lp = log_softmax(l)
    n = lp.shape[-2]
    w = np.broadcast_to(np.asarray(w, np.float64), lp.shape[:-1])[..., None]
    a = np.broadcast_to(np.asarray(alpha, np.float64), (n,))[:, None]
    act = w > 0
    alive = act & np.isfinite(lp)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(alive, np.log(np.where(act, w, 1.0)) + a * np.where(alive, lp, 0.0),
                     -np.inf)
    s = _logsumexp(t, -2)
    score = np.where(np.isfinite(s), s / order, -np.inf)
    veto = (act & np.isneginf(lp) & (a < 0)).any(-2)
    score = np.where(veto, -np.inf, score)
    with np.errstate(invalid="ignore"):  # rows with no mass left: NaN, the caller's case
        return softmax(score)
