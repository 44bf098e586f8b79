r"""Softmax-bottleneck fusion: one distribution that every member could have produced.

A member with unembedding ``W_i`` (V x d_i, the output head; the final norm's
gain scales the columns of ``W_i`` and leaves its column space, hence the
constraint below, unchanged) emits ``p_hat_i = softmax(W_i h)``. Its output pins
only the image ``p_hat_i W_i``: every distribution ``p`` with
``p W_i = p_hat_i W_i`` is equally consistent with it. Fusion looks for one
``p`` on the simplex meeting every member's constraint::

    A p = b,   A = [W_1^T; ...; W_n^T]  (m x K, m = sum_i d_i),
               b = [W_1^T p_hat_1; ...],  1^T p = 1,  p >= 0,

with p restricted to a support of K tokens (all V, or the union of the members'
top-k tokens; b is always computed from the full p_hat_i).

**Reduced basis.** With ``A~ = [A; s 1^T]`` (s = sigma_max(A)/sqrt(K) so the sum
row weighs like the others) and its thin SVD ``A~ = U S V^T``, the affine
constraints are ``E p = h`` with ``E = V_r^T`` (r orthonormal rows, r the
numerical rank: singular values above ``rank_rtol * sigma_max``) and
``h = S_r^{-1} U_r^T b~`` — provided ``b~`` lies in the range of ``A~``.

**Regimes** (per position; :func:`regime`):
  * *infeasible*: ``b~`` is not in the range of ``A~`` (relative residual of its
    projection above ``consistency_rtol``), e.g. one model under two prompts
    (``W_1 = W_2``, ``p_hat_1 != p_hat_2``). Solve least squares on the simplex.
  * *unique*: consistent and ``r = K``: at most one p (which may still violate
    ``p >= 0``; the solvers' residuals say so).
  * *underdetermined*: consistent and ``r < K`` (generic when ``m + 1 < K``).
    Choose by an objective: the LP ``min -sum_i w_i p . log p_hat_i``, the QP
    ``min sum_i w_i (p . log p_hat_i)^2``, or the min-KL projection.

Solvers (all pure, jit-compiled, vmapped over positions; float32 by default):
  * :func:`solve_lsq` — FISTA with adaptive restart on the simplex for
    ``min_p sum_i w_i ||W_i^T p - b_i||^2``.
  * :func:`solve_pdhg` — restarted PDHG (PDLP-style: restart to the average,
    adaptive primal weight) for the LP and the QP (the QP's n linear forms are
    lifted to free variables ``t_i`` whose prox is exact).
  * :func:`solve_maxent` — ``min KL(p || q0)`` s.t. ``E p = h`` through the
    unconstrained concave dual ``max_l l.h - logsumexp(log q0 + E^T l)`` fitted
    with optax's L-BFGS.

In the infeasible regime the LP, QP and min-KL solvers work with ``E p = h``,
i.e. with ``b~`` replaced by its projection onto the range of ``A~`` (the nearest
consistent right-hand side; for ``W_1 = W_2`` that is the image of the average
``mean_i p_hat_i W``). They then converge, and ``regime`` / ``inconsistency``
(and the unreduced ``constraint_res``) say that the members' constraints were
not met exactly. Positivity can still make ``E p = h`` empty (e.g. a top-k
support too small to reproduce the tail's image): the solvers then do not
converge and the registered methods fall back.

**Vocabularies.** All members must share one vocabulary (same V, same token
ids): the constraints compare images of distributions over the same events.
Members with different vocabularies are refused (``FusionInputError``); brf
does not define the constraints on a union event space.

**Cost.** Once per support: an SVD of the K x (m+1) matrix ``A~^T``
(O(K m^2); ~70 s for K = 49152, m = 576 on this 2-core CPU, so it is cached by
the caller for full-vocabulary use). Per position and iteration: two matvecs
with ``E`` (r x K), kept in both layouts — near memory-bound unbatched, a
matmul when batched over positions (E is shared). See BENCHMARKS.md, "Softmax-bottleneck fusion".

Each returns a :class:`Solution` with primal and dual residuals, the duality gap
where defined, the iteration count and a ``converged`` flag (all tolerances met
before ``max_iters``). A solver that runs out of iterations says so; the fusion
methods registered below then return the linear pool and set ``fallback``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.fusion import methods as M
from brf.fusion.checks import FusionInputError

REGIMES = ("unique", "infeasible", "underdetermined")
UNIQUE, INFEASIBLE, UNDERDETERMINED = 0, 1, 2
LOGP_FLOOR = -50.0  # log p_hat below this counts as this (cost of a ~zero token)


class Basis(NamedTuple):
    """The reduced constraint basis on one support (see the module docstring).

    Attributes:
      E_qxK: rows of V^T (orthonormal); rows past the numerical rank are zero.
      ET_Kxq: the same matrix stored transposed (V): XLA's CPU product with a
        transposed operand is ~40x slower than with a contiguous one (measured
        at 577 x 49152), so both layouts are kept.
      sigma_q: singular values of A~ (0 past the rank).
      U_Mxq: left singular vectors, M = m + 1 (member blocks, then the sum row).
      scale: s, the weight of the sum row.
      rank: the numerical rank r (int array).
      support_K: token ids of the support (int32).
    """
    E_qxK: jax.Array
    ET_Kxq: jax.Array
    sigma_q: jax.Array
    U_Mxq: jax.Array
    scale: jax.Array
    rank: jax.Array
    support_K: jax.Array


class Solution(NamedTuple):
    """A solver's answer and diagnostics (per position under vmap).

    Attributes:
      p_K: the distribution on the support.
      objective: the solver's objective at ``p_K``.
      primal_res: relative primal residual (``||E p - h|| / (1 + ||h||)``; for
        least squares, the relative misfit ``sqrt(f) / ||b||``, not a residual
        that must vanish).
      dual_res: relative dual / stationarity residual (KKT), see each solver.
      gap: relative duality gap (0 where not defined).
      iters: iterations used.
      converged: every tolerance met within ``max_iters``.
    """
    p_K: jax.Array
    objective: jax.Array
    primal_res: jax.Array
    dual_res: jax.Array
    gap: jax.Array
    iters: jax.Array
    converged: jax.Array


# --------------------------------------------------------------------------
# Input checks and the constraint basis.

def check_unembeddings(unembeddings, vocab_size: int | None = None) -> list:
    """Checks member unembeddings: a sequence of [V, d_i] float arrays, finite.

    Raises:
      FusionInputError: not a sequence of 2-D floating arrays, different V
        (different vocabularies need an alignment first), V not matching the
        logits, or NaN/inf entries.
    """
    if hasattr(unembeddings, "shape"):
        unembeddings = [unembeddings]
    if not isinstance(unembeddings, (list, tuple)) or not unembeddings:
        raise FusionInputError(
            "unembeddings must be a list of [V, d_i] arrays, one per member; got "
            f"{type(unembeddings).__name__}")
    out = []
    for i, w in enumerate(unembeddings):
        shape = np.shape(w)
        if len(shape) != 2 or min(shape) < 1:
            raise FusionInputError(
                f"unembeddings[{i}] must have shape [V, d]; got shape {shape}")
        if not jnp.issubdtype(jnp.result_type(w), jnp.floating):
            raise FusionInputError(
                f"unembeddings[{i}] must be floating point; got dtype "
                f"{jnp.result_type(w)}")
        if isinstance(w, jax.core.Tracer):
            out.append(w)
            continue
        if not np.isfinite(np.asarray(w)).all():
            raise FusionInputError(f"unembeddings[{i}] contains NaN or inf")
        out.append(w)
    vs = {np.shape(w)[0] for w in out}
    if len(vs) > 1:
        raise FusionInputError(
            f"unembeddings have different vocabulary sizes {sorted(vs)}: "
            "softmax-bottleneck fusion needs a shared vocabulary (align members "
            "first; brf does not define the constraints across vocabularies)")
    if vocab_size is not None and vs != {vocab_size}:
        raise FusionInputError(
            f"unembeddings have V={vs.pop()} rows but the logits have V={vocab_size}")
    return out


def constraint_basis(W_KxM: jax.Array, support_K: jax.Array,
                     rank_rtol: float = 1e-4) -> Basis:
    """The SVD basis of ``A~ = [W_S^T; s 1^T]`` on one support (jit/vmap-able).

    Args:
      W_KxM: the members' unembedding rows on the support, concatenated along
        the hidden axis (K x m).
      support_K: token ids of the support.
      rank_rtol: singular values below ``rank_rtol * sigma_max`` count as zero.
    """
    K = W_KxM.shape[0]
    smax = jnp.linalg.norm(W_KxM, ord=2) if K * W_KxM.shape[1] <= 4_000_000 \
        else jnp.sqrt(jnp.max(jnp.sum(W_KxM * W_KxM, 0)) * K)
    scale = smax / jnp.sqrt(K)
    At_KxM = jnp.concatenate([W_KxM, jnp.full((K, 1), scale, W_KxM.dtype)], 1)
    Vf_Kxq, s_q, Ut_qxM = jnp.linalg.svd(At_KxM, full_matrices=False)
    keep = s_q > rank_rtol * s_q[0]
    ET_Kxq = jnp.where(keep[None, :], Vf_Kxq, 0.0)
    E_qxK = jnp.where(keep[:, None], Vf_Kxq.T, 0.0)
    U_Mxq = jnp.where(keep[None, :], Ut_qxM.T, 0.0)
    return Basis(E_qxK, ET_Kxq, jnp.where(keep, s_q, 0.0), U_Mxq, scale,
                 jnp.sum(keep), support_K)


def truncate(basis: Basis) -> Basis:
    """Drops the zero rows past the rank (concrete bases only: shapes change)."""
    r = int(basis.rank)
    return basis._replace(E_qxK=basis.E_qxK[:r], ET_Kxq=basis.ET_Kxq[:, :r],
                          sigma_q=basis.sigma_q[:r],
                          U_Mxq=basis.U_Mxq[:, :r])


def rhs(basis: Basis, Wfull_VxM: jax.Array, phat_nxV: jax.Array, dims: tuple):
    """b~ = [W_i^T p_hat_i; s] for one position (full-V products), shape [m+1]."""
    parts, o = [], 0
    for i, d in enumerate(dims):
        parts.append(phat_nxV[i] @ Wfull_VxM[:, o:o + d])
        o += d
    return jnp.concatenate(parts + [basis.scale[None].astype(phat_nxV.dtype)])


class Reduced(NamedTuple):
    """The reduced right-hand side of one position."""
    h_q: jax.Array         # S_r^{-1} U_r^T b~
    inconsistency: jax.Array  # ||b~ - U_r U_r^T b~|| / ||b~||


def reduce_rhs(basis: Basis, b_M: jax.Array) -> Reduced:
    c_q = basis.U_Mxq.T @ b_M
    safe = jnp.where(basis.sigma_q > 0, basis.sigma_q, 1.0)
    h_q = jnp.where(basis.sigma_q > 0, c_q / safe, 0.0)
    out = b_M - basis.U_Mxq @ c_q
    return Reduced(h_q, jnp.linalg.norm(out) / jnp.linalg.norm(b_M))


def regime(basis: Basis, red: Reduced, consistency_rtol: float = 1e-4):
    """Regime code (0 unique, 1 infeasible, 2 underdetermined) of one position."""
    K = basis.E_qxK.shape[1]
    return jnp.where(red.inconsistency > consistency_rtol, INFEASIBLE,
                     jnp.where(basis.rank >= K, UNIQUE, UNDERDETERMINED))


# --------------------------------------------------------------------------
# Least squares on the simplex.

def project_simplex(y_K: jax.Array) -> jax.Array:
    """Euclidean projection onto {p >= 0, sum p = 1} (sort-based, exact)."""
    u = jnp.sort(y_K)[::-1]
    css = jnp.cumsum(u) - 1.0
    k = jnp.arange(1, y_K.shape[0] + 1, dtype=y_K.dtype)
    cond = u - css / k > 0
    rho = jnp.max(jnp.where(cond, jnp.arange(y_K.shape[0]), 0))
    theta = css[rho] / (rho + 1).astype(y_K.dtype)
    return jnp.maximum(y_K - theta, 0.0)


def lsq_operator(basis: Basis, b_M: jax.Array, weights_n: jax.Array, dims: tuple):
    """(G, c, const) with ``f(p) = z^T G z - 2 c^T z + const``, ``z = S V^T p``.

    ``f(p) = sum_i w_i ||W_i^T p - b_i||^2`` and ``W_i^T p = U_i S V^T p`` (U_i:
    the rows of U of member i's block), so ``G = sum_i w_i U_i^T U_i`` and
    ``c = sum_i w_i U_i^T b_i`` — a q x q problem behind one matvec with V^T.
    """
    wrow = jnp.concatenate([jnp.full((d,), weights_n[i], b_M.dtype)
                            for i, d in enumerate(dims)] + [jnp.zeros((1,), b_M.dtype)])
    Uw = basis.U_Mxq * wrow[:, None]
    G = basis.U_Mxq.T @ Uw
    c = Uw.T @ b_M
    const = jnp.sum(wrow * b_M * b_M)
    return G, c, const


@functools.partial(jax.jit, static_argnames=("dims", "max_iters", "check_every"))
def solve_lsq(basis: Basis, b_M: jax.Array, weights_n: jax.Array, *, dims: tuple,
              p0_K: jax.Array | None = None, tol: float = 1e-6,
              max_iters: int = 20000, check_every: int = 20) -> Solution:
    r"""min_{p in simplex} sum_i w_i ||W_i^T p - b_i||^2 (FISTA, adaptive restart).

    KKT (checked): with g = grad f(p), there is nu with g_j >= nu for all j and
    g_j = nu where p_j > 0. The dual residual is the projected-gradient step
    ``||p - P(p - g / L)||`` (in probability units; zero iff KKT holds).
    Stops when it is below ``tol``. ``primal_res`` is the misfit ``sqrt(f)/||b||``.
    """
    dt = basis.E_qxK.dtype
    G, c, const = lsq_operator(basis, b_M, weights_n, dims)
    S = basis.sigma_q
    K = basis.E_qxK.shape[1]
    # Lipschitz constant of grad f: 2 * lambda_max(S G S).
    lam = jnp.linalg.eigvalsh(S[:, None] * G * S[None, :])[-1]
    L = 2.0 * jnp.maximum(lam, 1e-30)

    def grad(p):
        z = S * (basis.E_qxK @ p)
        gz = 2.0 * (G @ z - c)
        return basis.ET_Kxq @ (S * gz), z

    def fval(z):
        return jnp.maximum(z @ (G @ z) - 2.0 * c @ z + const, 0.0)

    def kkt(p):
        g, z = grad(p)
        return jnp.linalg.norm(p - project_simplex(p - g / L)), z

    p0 = jnp.full((K,), 1.0 / K, dt) if p0_K is None else project_simplex(p0_K.astype(dt))

    def body(state):
        p, y, t, it, _ = state

        def step(_, s):
            p, y, t = s
            g, _ = grad(y)
            pn = project_simplex(y - g / L)
            tn = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
            # O'Donoghue-Candes gradient restart: momentum off when it points uphill.
            restart = jnp.dot(y - pn, pn - p) > 0
            tn = jnp.where(restart, 1.0, tn)
            yn = jnp.where(restart, pn, pn + ((t - 1.0) / tn) * (pn - p))
            return pn, yn, tn

        p, y, t = jax.lax.fori_loop(0, check_every, step, (p, y, t))
        res, _ = kkt(p)
        return p, y, t, it + check_every, res

    def cond(state):
        return (state[3] < max_iters) & (state[4] > tol)

    init = (p0, p0, jnp.ones((), dt), jnp.zeros((), jnp.int32), jnp.full((), jnp.inf, dt))
    p, _, _, it, res = jax.lax.while_loop(cond, body, init)
    _, z = grad(p)
    f = fval(z)
    return Solution(p, f, jnp.sqrt(f / jnp.maximum(const, 1e-30)), res,
                    jnp.zeros((), dt), it, res <= tol)


# --------------------------------------------------------------------------
# LP and QP by restarted PDHG.

class _PD(NamedTuple):
    x: jax.Array  # p on the support [K]
    t: jax.Array  # lifted QP variables [n] (empty for the LP)
    y: jax.Array  # multipliers of E p = h [q]
    u: jax.Array  # multipliers of Lh p - t = 0 [n]


def _pd_kkt(z: _PD, E, ET, h, c, Lh, qd):
    """Relative residuals (primal, dual, gap) and objectives of a PDHG iterate.

    Problem: min c.x + 1/2 sum_j qd_j t_j^2 s.t. E x = h, Lh x - t = 0, x >= 0.
    Lagrangian c.x + 1/2 qd.t^2 + y.(E x - h) + u.(Lh x - t) - lam.x, lam >= 0.
    KKT: E x = h, Lh x = t (primal); lam = c + E^T y + Lh^T u >= 0 and
    qd t = u (dual); lam.x = 0, which for a primal-dual feasible pair is the
    gap P - D with P = c.x + 1/2 qd.t^2 and D = -h.y - 1/2 sum u^2/qd.
    """
    rp = jnp.concatenate([E @ z.x - h, Lh @ z.x - z.t])
    lam = c + ET @ z.y + Lh.T @ z.u
    rd = jnp.concatenate([jnp.minimum(lam, 0.0), qd * z.t - z.u])
    P = c @ z.x + 0.5 * jnp.sum(qd * z.t * z.t)
    safe_q = jnp.where(qd > 0, qd, 1.0)
    D = -h @ z.y - 0.5 * jnp.sum(jnp.where(qd > 0, z.u * z.u / safe_q, 0.0))
    # lam.x is the complementarity the gap measures; use it directly (it stays
    # meaningful while the dual is slightly infeasible).
    comp = jnp.abs(jnp.maximum(lam, 0.0) @ z.x)
    pres = jnp.linalg.norm(rp) / (1.0 + jnp.linalg.norm(h))
    dres = jnp.linalg.norm(rd) / (1.0 + jnp.linalg.norm(c) + jnp.linalg.norm(qd * z.t))
    gap = jnp.maximum(jnp.abs(P - D), comp) / (1.0 + jnp.abs(P) + jnp.abs(D))
    return pres, dres, gap, P


@functools.partial(jax.jit, static_argnames=("max_iters", "check_every"))
def solve_pdhg(E_qxK: jax.Array, ET_Kxq: jax.Array, h_q: jax.Array, c_K: jax.Array,
               Lh_nxK: jax.Array, qd_n: jax.Array, *,
               x0_K: jax.Array | None = None, tol: float = 1e-6,
               max_iters: int = 50000, check_every: int = 64) -> Solution:
    r"""Restarted PDHG for min c.x + 1/2 sum qd_j t_j^2, E x = h, Lh x = t, x >= 0.

    The LP is ``Lh`` with zero rows (n = 0 allowed). ``E`` has orthonormal rows
    (||E|| <= 1) and the rows of ``Lh`` unit norm, so the operator norm is at
    most sqrt(n + 2) and the steps are ``tau = eta / omega``,
    ``sigma = eta * omega`` with ``eta = 0.95 / sqrt(n + 2)``.

    Iteration (Chambolle-Pock with an extrapolated primal):
      x+ = max(0, x - tau (c + E^T y + Lh^T u));  t+ = (t + tau u) / (1 + tau qd)
      y+ = y + sigma (E (2x+ - x) - h);           u+ = u + sigma (Lh (2x+ - x) - (2t+ - t))
    Every ``check_every`` steps the KKT residuals (:func:`_pd_kkt`) of the
    current and the averaged iterate are computed; the better one becomes the
    restart point when it has halved since the last restart (PDLP's sufficient
    decay), and the primal weight omega is re-balanced then from the distance
    moved: omega <- sqrt(omega * ||dy|| / ||dx||). Stops when the relative
    primal, dual residuals and gap are all below ``tol``.
    """
    dt = E_qxK.dtype
    K = E_qxK.shape[1]
    n = Lh_nxK.shape[0]
    eta = 0.95 / jnp.sqrt(n + 2.0)
    hn, cn = jnp.linalg.norm(h_q), jnp.linalg.norm(c_K)
    omega0 = jnp.where((hn > 1e-12) & (cn > 1e-12), cn / jnp.maximum(hn, 1e-12), 1.0)
    x0 = jnp.full((K,), 1.0 / K, dt) if x0_K is None else x0_K.astype(dt)
    z0 = _PD(x0, Lh_nxK @ x0, jnp.zeros_like(h_q), jnp.zeros((n,), dt))

    def kkt(z):
        return _pd_kkt(z, E_qxK, ET_Kxq, h_q, c_K, Lh_nxK, qd_n)

    def err(z):
        pr, dr, g, _ = kkt(z)
        return jnp.maximum(jnp.maximum(pr, dr), g)

    def step(_, s):
        z, zsum, omega = s
        tau, sig = eta / omega, eta * omega
        xn = jnp.maximum(z.x - tau * (c_K + ET_Kxq @ z.y + Lh_nxK.T @ z.u), 0.0)
        tn = (z.t + tau * z.u) / (1.0 + tau * qd_n)
        xb, tb = 2.0 * xn - z.x, 2.0 * tn - z.t
        yn = z.y + sig * (E_qxK @ xb - h_q)
        un = z.u + sig * (Lh_nxK @ xb - tb)
        zn = _PD(xn, tn, yn, un)
        return zn, jax.tree.map(jnp.add, zsum, zn), omega

    def body(state):
        z, zsum, cnt, omega, z_last, e_last, it, _, _ = state
        z, zsum, _ = jax.lax.fori_loop(0, check_every, step, (z, zsum, omega))
        cnt = cnt + check_every
        zavg = jax.tree.map(lambda a: a / cnt, zsum)
        e_cur, e_avg = err(z), err(zavg)
        cand = jax.tree.map(lambda a, b: jnp.where(e_avg < e_cur, a, b), zavg, z)
        e_c = jnp.minimum(e_avg, e_cur)
        # PDLP's sufficient decay, or an artificial restart after a long run.
        restart = (e_c <= 0.5 * e_last) | (cnt >= (0.36 * (it + check_every)).astype(cnt.dtype))
        dx = jnp.linalg.norm(jnp.concatenate([cand.x - z_last.x, cand.t - z_last.t]))
        dy = jnp.linalg.norm(jnp.concatenate([cand.y - z_last.y, cand.u - z_last.u]))
        ok = restart & (dx > 1e-10) & (dy > 1e-10)
        omega = jnp.where(ok, jnp.sqrt(omega * dy / jnp.maximum(dx, 1e-30)), omega)
        z = jax.tree.map(lambda a, b: jnp.where(restart, a, b), cand, z)
        zero = jax.tree.map(jnp.zeros_like, z)
        zsum = jax.tree.map(lambda a, b: jnp.where(restart, a, b), zero, zsum)
        cnt = jnp.where(restart, 0, cnt)
        z_last = jax.tree.map(lambda a, b: jnp.where(restart, a, b), cand, z_last)
        e_last = jnp.where(restart, e_c, e_last)
        return z, zsum, cnt, omega, z_last, e_last, it + check_every, e_c, cand

    def cond(state):
        return (state[6] < max_iters) & (state[7] > tol)

    zero = jax.tree.map(jnp.zeros_like, z0)
    init = (z0, zero, jnp.zeros((), jnp.int32), omega0.astype(dt), z0,
            err(z0), jnp.zeros((), jnp.int32), jnp.full((), jnp.inf, dt), z0)
    *_, it, e_out, z = jax.lax.while_loop(cond, body, init)
    pr, dr, g, P = kkt(z)
    conv = e_out <= tol  # the loop's own test of this iterate (the better of avg/current)
    return Solution(z.x, P, pr, dr, g, it, conv)


def lp_data(logphat_nxK: jax.Array, weights_n: jax.Array):
    """Cost of the LP: c = -sum_i w_i log p_hat_i (floored at LOGP_FLOOR)."""
    lp = jnp.maximum(logphat_nxK, LOGP_FLOOR)
    return -(weights_n[:, None] * lp).sum(0)


def qp_data(logphat_nxK: jax.Array, weights_n: jax.Array):
    """Lifted QP data: rows Lh_i = l_i / ||l_i|| and qd_i = 2 w_i ||l_i||^2.

    sum_i w_i (p . l_i)^2 = 1/2 sum_i qd_i t_i^2 with t_i = Lh_i . p.
    """
    lp = jnp.maximum(logphat_nxK, LOGP_FLOOR)
    nrm = jnp.maximum(jnp.linalg.norm(lp, axis=1), 1e-30)
    return lp / nrm[:, None], 2.0 * weights_n * nrm * nrm


# --------------------------------------------------------------------------
# Min-KL (max-entropy) projection through its dual.

@functools.partial(jax.jit, static_argnames=("max_iters",))
def solve_maxent(E_qxK: jax.Array, ET_Kxq: jax.Array, h_q: jax.Array, logq0_K: jax.Array, *,
                 tol: float = 1e-6, max_iters: int = 500,
                 lam0_q: jax.Array | None = None) -> Solution:
    r"""min_p KL(p || q0) s.t. E p = h, p on the simplex, via the dual (optax L-BFGS).

    The Lagrangian's minimiser is ``p(l) = softmax(log q0 + E^T l)`` and the dual
    ``g(l) = l.h - logsumexp(log q0 + E^T l)`` is concave and unconstrained with
    gradient ``h - E p(l)``: the primal residual. KKT: p = p(l) (exact by
    construction, p > 0) and E p = h. Stops when ``||E p - h|| / (1 + ||h||)``
    is below ``tol``. Infeasible constraints (no strictly positive p) make the
    dual unbounded: it runs out of iterations and says so. ``dual_res`` is the
    duality gap ``KL(p||q0) - g(l)`` relative (it vanishes with the residual).
    """
    import optax

    dt = E_qxK.dtype

    def negdual(lam):
        return jax.nn.logsumexp(logq0_K + ET_Kxq @ lam) - lam @ h_q

    opt = optax.lbfgs()
    vg = optax.value_and_grad_from_state(negdual)
    lam = jnp.zeros_like(h_q) if lam0_q is None else lam0_q.astype(dt)
    state = opt.init(lam)

    def res(lam):
        p = jax.nn.softmax(logq0_K + ET_Kxq @ lam)
        return jnp.linalg.norm(E_qxK @ p - h_q) / (1.0 + jnp.linalg.norm(h_q)), p

    def body(s):
        lam, state, it, _ = s
        v, g = vg(lam, state=state)
        upd, state = opt.update(g, state, lam, value=v, grad=g, value_fn=negdual)
        lam = optax.apply_updates(lam, upd)
        return lam, state, it + 1, res(lam)[0]

    def cond(s):
        return (s[2] < max_iters) & (s[3] > tol)

    lam, state, it, r = jax.lax.while_loop(
        cond, body, (lam, state, jnp.zeros((), jnp.int32), res(lam)[0]))
    r, p = res(lam)
    kl = jnp.sum(jnp.where(p > 0, p * (jnp.log(jnp.maximum(p, 1e-38)) - logq0_K), 0.0))
    gap = jnp.abs(kl + negdual(lam)) / (1.0 + jnp.abs(kl))
    return Solution(p, kl, r, gap, jnp.zeros((), dt), it, r <= tol)


# --------------------------------------------------------------------------
# One entry point for a batch of positions on a fixed support.

def stack_unembeddings(unembeddings: Sequence) -> tuple[jax.Array, tuple]:
    ws = check_unembeddings(unembeddings)
    dims = tuple(int(np.shape(w)[1]) for w in ws)
    return jnp.concatenate([jnp.asarray(w, jnp.float32) for w in ws], 1), dims


def solve(kind: str, basis: Basis, Wfull_VxM, dims: tuple, phat_BxnxV,
          weights_Bxn, *, tol: float = 1e-6, max_iters: int | None = None,
          consistency_rtol: float = 1e-4, x0_BxK=None):
    """Solves a batch of positions on one shared support (the basis).

    Args:
      kind: 'lsq' | 'lp' | 'qp' | 'maxent'.
      basis: :func:`constraint_basis` of the support (possibly :func:`truncate`-d).
      Wfull_VxM: the stacked unembeddings over the full vocabulary (for b).
      dims: hidden sizes of the members.
      phat_BxnxV: member distributions.
      weights_Bxn: member weights.
      x0_BxK: optional warm start (primal) per position.

    Returns:
      (Solution batched over B, regime codes [B], inconsistency [B], constraint
      residual [B]: ``||W_S^T p - b|| / ||b||`` in the original, unreduced terms).
    """
    shape = np.shape(phat_BxnxV)
    if len(shape) != 3 or shape[1] != len(dims) or shape[2] != Wfull_VxM.shape[0]:
        raise FusionInputError(
            f"p_hat must have shape [B, n={len(dims)}, V={Wfull_VxM.shape[0]}]; got {shape}")
    if not isinstance(phat_BxnxV, jax.core.Tracer):
        ph = np.asarray(phat_BxnxV)
        if not np.isfinite(ph).all() or (ph < 0).any():
            raise FusionInputError("p_hat must be finite and >= 0 (it contains NaN, inf "
                                   "or negative entries)")
    phat_BxnxV = jnp.asarray(phat_BxnxV, jnp.float32)
    weights_Bxn = jnp.broadcast_to(jnp.asarray(weights_Bxn, jnp.float32),
                                   phat_BxnxV.shape[:2])
    return _solve_batch(kind, basis, Wfull_VxM, phat_BxnxV, weights_Bxn, x0_BxK,
                        dims=dims, tol=tol, max_iters=max_iters,
                        consistency_rtol=consistency_rtol)


@functools.partial(jax.jit, static_argnames=("kind", "dims", "max_iters"))
def _solve_batch(kind, basis, Wfull_VxM, phat_BxnxV, weights_Bxn, x0_BxK, *,
                 dims, tol, max_iters, consistency_rtol):
    def one(phat_nxV, w_n, x0):
        return _solve_one(kind, basis, Wfull_VxM, phat_nxV, w_n, x0, dims, tol,
                          max_iters, consistency_rtol)
    if x0_BxK is None:
        return jax.vmap(lambda a, b: one(a, b, None))(phat_BxnxV, weights_Bxn)
    return jax.vmap(one)(phat_BxnxV, weights_Bxn, x0_BxK)


def _solve_one(kind, basis, Wfull_VxM, phat_nxV, w_n, x0, dims, tol, max_iters,
               consistency_rtol):
    b = rhs(basis, Wfull_VxM, phat_nxV, dims)
    red = reduce_rhs(basis, b)
    code = regime(basis, red, consistency_rtol)
    logphat_nxK = jnp.log(jnp.maximum(phat_nxV[:, basis.support_K], 1e-38))
    if kind == "lsq":
        sol = solve_lsq(basis, b, w_n, dims=dims, p0_K=x0, tol=tol,
                        max_iters=max_iters or 20000)
    elif kind in ("lp", "qp"):
        if kind == "lp":
            c = lp_data(logphat_nxK, w_n)
            Lh, qd = jnp.zeros((0, c.shape[0]), c.dtype), jnp.zeros((0,), c.dtype)
        else:
            c = jnp.zeros((logphat_nxK.shape[1],), logphat_nxK.dtype)
            Lh, qd = qp_data(logphat_nxK, w_n)
        sol = solve_pdhg(basis.E_qxK, basis.ET_Kxq, red.h_q, c, Lh, qd, x0_K=x0, tol=tol,
                         max_iters=max_iters or 50000)
    elif kind == "maxent":
        K = basis.E_qxK.shape[1]
        logq0 = jnp.full((K,), -jnp.log(float(K)), basis.E_qxK.dtype)  # uniform on the support
        sol = solve_maxent(basis.E_qxK, basis.ET_Kxq, red.h_q, logq0, tol=tol,
                           max_iters=max_iters or 500)
    else:
        raise FusionInputError(f"unknown bottleneck solver {kind!r}; use lsq, lp, qp or maxent")
    return sol, code, red.inconsistency, constraint_residual(basis, Wfull_VxM, b, sol.p_K)


def constraint_residual(basis: Basis, Wfull_VxM, b_M, p_K):
    """||W_S^T p - b|| / ||b|| over the members' blocks (the sum row excluded)."""
    Ws = Wfull_VxM[basis.support_K]
    r = p_K @ Ws - b_M[:-1]
    return jnp.linalg.norm(r) / jnp.linalg.norm(b_M[:-1])


# --------------------------------------------------------------------------
# Fusion methods in the registry.

def _unembeddings_check(value) -> str | None:
    try:
        check_unembeddings(value)
    except FusionInputError as e:
        return str(e)
    return None


def _fuse(kind, logits, weights, *, unembeddings, top_k, tol, max_iters):
    """Shared body of the ``bottleneck_*`` methods (see :func:`bottleneck_lp`)."""
    from brf.fusion.pools import linear_pool

    V = logits.shape[-1]
    ws = list(unembeddings)
    vs = {w.shape[0] for w in ws}
    if vs != {V}:
        raise FusionInputError(
            f"bottleneck_{kind}: unembeddings have V={sorted(vs)} rows but the logits "
            f"have V={V}; members with different vocabularies need an alignment "
            "(brf does not define the constraints across vocabularies)")
    if len(ws) != logits.shape[-2]:
        raise FusionInputError(
            f"bottleneck_{kind}: {len(ws)} unembeddings for {logits.shape[-2]} members")
    dims = tuple(int(w.shape[1]) for w in ws)
    Wf = jnp.concatenate(ws, 1)
    lead = logits.shape[:-2]
    n = logits.shape[-2]
    logp = jax.nn.log_softmax(logits.reshape((-1, n, V)), axis=-1)
    w = jnp.broadcast_to(weights, lead + (n,)).reshape((-1, n))
    phat = jnp.exp(logp)

    def one(phat_nxV, w_n, support_K):
        basis = constraint_basis(Wf[support_K], support_K)
        return _solve_one(kind, basis, Wf, phat_nxV, w_n, None, dims, tol,
                          max_iters or None, 1e-4)

    if top_k > 0:
        K = min(V, top_k * n)
        support = jax.lax.top_k(jnp.max(logp, axis=1), K)[1]
        sol, code, inc, cres = jax.vmap(one)(phat, w, support)
    else:
        support = jnp.arange(V)
        basis = constraint_basis(Wf, support)
        sol, code, inc, cres = jax.vmap(
            lambda a, b: _solve_one(kind, basis, Wf, a, b, None, dims, tol,
                                    max_iters or None, 1e-4))(phat, w)
        support = jnp.broadcast_to(support, (phat.shape[0], V))
    B = phat.shape[0]
    q = jnp.zeros((B, V), jnp.float32).at[jnp.arange(B)[:, None], support].add(sol.p_K)
    q = q / jnp.sum(q, axis=-1, keepdims=True)
    ok = sol.converged & jnp.all(jnp.isfinite(q), axis=-1)
    logq = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf)
    logq = jnp.where(ok[:, None], logq, linear_pool(logp, w))
    info = {"fallback": ~ok, "converged": sol.converged, "regime": code,
            "inconsistency": inc, "constraint_res": cres, "primal_res": sol.primal_res,
            "dual_res": sol.dual_res, "gap": sol.gap, "iters": sol.iters,
            "objective": sol.objective}
    info = {k: v.reshape(lead) for k, v in info.items()}
    return logq.reshape(lead + (V,)).astype(logits.dtype), info


_PARAMS = dict(
    unembeddings=M.Param(None, "array", _unembeddings_check,
                         doc="members' unembeddings, a list of [V, d_i] arrays (shared V)"),
    top_k=M.Param(256, "int", M.nonnegative_int,
                  doc="support: the top_k * n tokens by max_i p_hat_i; 0 = all V"),
    tol=M.Param(1e-6, "float", M.positive, doc="relative KKT tolerance"),
    max_iters=M.Param(0, "int", M.nonnegative_int,
                      doc="iteration budget (0 = the solver's default)"))


@M.register("bottleneck_lsq", **_PARAMS)
def bottleneck_lsq(logits, weights, *, unembeddings, top_k=256, tol=1e-6, max_iters=0):
    """Softmax bottleneck, least squares: argmin_{p in simplex} sum_i w_i ||(p - p_hat_i) W_i||^2.

    The infeasible regime's answer (e.g. one model under two prompts). Where
    the solver does not meet ``tol`` within its budget it returns the linear
    pool and sets ``fallback``; ``info`` carries the regime, residuals and
    iterations per position.
    """
    return _fuse("lsq", logits, weights, unembeddings=unembeddings, top_k=top_k,
                 tol=tol, max_iters=max_iters)


@M.register("bottleneck_lp", **_PARAMS)
def bottleneck_lp(logits, weights, *, unembeddings, top_k=256, tol=1e-6, max_iters=0):
    """Softmax bottleneck, LP: min -sum_i w_i p . log p_hat_i s.t. p W_i = p_hat_i W_i.

    For the underdetermined regime. Support, fallback and ``info`` as for
    ``bottleneck_lsq``; infeasible positions do not converge and fall back.
    """
    return _fuse("lp", logits, weights, unembeddings=unembeddings, top_k=top_k,
                 tol=tol, max_iters=max_iters)


@M.register("bottleneck_qp", **_PARAMS)
def bottleneck_qp(logits, weights, *, unembeddings, top_k=256, tol=1e-6, max_iters=0):
    """Softmax bottleneck, QP: min sum_i w_i (p . log p_hat_i)^2 s.t. p W_i = p_hat_i W_i."""
    return _fuse("qp", logits, weights, unembeddings=unembeddings, top_k=top_k,
                 tol=tol, max_iters=max_iters)


@M.register("bottleneck_maxent", **_PARAMS)
def bottleneck_maxent(logits, weights, *, unembeddings, top_k=256, tol=1e-6, max_iters=0):
    """Softmax bottleneck, max entropy: the min-KL (to uniform) p with p W_i = p_hat_i W_i."""
    return _fuse("maxent", logits, weights, unembeddings=unembeddings, top_k=top_k,
                 tol=tol, max_iters=max_iters)


__all__ = ["Basis", "REGIMES", "bottleneck_lp", "bottleneck_lsq",
           "bottleneck_maxent", "bottleneck_qp", "Reduced", "Solution", "check_unembeddings",
           "constraint_basis", "lp_data", "project_simplex", "qp_data", "reduce_rhs",
           "regime", "rhs", "solve", "solve_lsq", "solve_maxent", "solve_pdhg",
           "stack_unembeddings", "truncate"]
