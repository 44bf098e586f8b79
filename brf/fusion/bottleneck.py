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

**Reduced basis.** With ``A~ = [A; s 1^T]`` (s the root-mean-square norm of the
support's rows of W, so that the sum row weighs like a token's row) and its
thin SVD ``A~ = U S V^T``, the affine constraints are ``E p = h`` with
``E = V_r^T`` (r orthonormal rows, r the numerical rank: singular values above
``rank_rtol * sigma_max``) and ``h = S_r^{-1} U_r^T b~`` — provided ``b~`` lies
in the range of ``A~``.

**Regimes** (per position; :func:`regime`):
  * *infeasible*: ``b~`` is not in the range of ``A~`` (relative residual of its
    projection above ``consistency_rtol``), e.g. one model under two prompts
    (``W_1 = W_2``, ``p_hat_1 != p_hat_2``). Solve least squares on the simplex.
  * *unique*: consistent and ``r = K``: at most one p (which may still violate
    ``p >= 0``; the solvers say so).
  * *underdetermined*: consistent and ``r < K`` (generic when ``m + 1 < K``).
    Choose by an objective: the LP ``min -sum_i w_i p . log p_hat_i``, the QP
    ``min sum_i w_i (p . log p_hat_i)^2``, or the min-KL projection.

**Precision.** The problem data are computed in float64 (under
``jax.enable_x64`` inside these functions; the rest of brf stays float32): the
right-hand side ``b`` (a sum over all V tokens, whose float32 rounding depends
on how the product is blocked, so one position and a batch of positions would
otherwise solve different problems), the SVD and ``h`` (``S^{-1}`` amplifies
rounding along the small singular directions), and every stopping certificate.
Every solver also iterates in float64, so that
the certificate (a relative gap of ``tol``, default 1e-5, on objectives that
can be small differences of large terms) is not limited by the iterates'
rounding; float32 iterates would halve the memory traffic of the matvecs but
are not offered.

**Stopping rules that certify.** ``converged`` means the returned objective is
within ``tol`` (relative) of the optimum of the problem solved, with the
constraints met to ``tol`` (relative residual of ``E p = h``):
  * least squares: f is convex, so at any point x, ``f(x) - (g.x - min_j g_j)``
    (g = grad f(x)) is a lower bound on the optimum: at the iterate it is the
    Frank–Wolfe gap; it is also taken at a point of the affine hull
    ``sum x = 1`` that conjugate gradients drive to f's minimum there, which
    is the optimum itself where the members' common image is met on the
    simplex (:func:`solve_lsq`);
  * LP/QP: the Lagrangian bound over the simplex,
    ``D(y, u) = -h.y + min_j (c + E^T y + Lh^T u)_j - sum_i u_i^2 / (2 qd_i)``,
    is a lower bound on the optimum for any multipliers (the feasible set lies
    in the simplex); the primal residual r costs at most ``|y.r|`` to first
    order (the constraints' sensitivity is y);
  * min-KL: the dual value ``l.h - logsumexp(log q0 + E^T l)`` is a lower bound
    and the gap to the returned p's KL is exactly ``l.r``.
``Solution.lower_bound`` and ``gap = (objective - lower_bound) / lower_bound``
are the certificate. A lower bound above the largest objective any
distribution on the support can have proves the constraints empty (status
``empty``); on a support no larger than the rank (``r = K``) the one candidate
``p = E^T h`` is checked at once instead of iterated.

In the infeasible regime the LP, QP and min-KL solvers work with ``E p = h``,
i.e. with ``b~`` replaced by its projection onto the range of ``A~`` (the nearest
consistent right-hand side, rescaled to unit total mass; for ``W_1 = W_2`` that
is about the image of the average ``mean_i p_hat_i W``). They then converge,
and ``regime`` / ``inconsistency`` (and the unreduced ``constraint_res``) say
that the members' constraints were not met exactly. Positivity can still make
``E p = h`` empty (e.g. a top-k support too small to reproduce the tail's
image): the solvers then do not converge and the registered methods fall back.

Solvers (all pure, jit-compiled, vmapped over positions):
  * :func:`solve_lsq` — FISTA with adaptive restart on the simplex for
    ``min_p sum_i w_i ||W_i^T p - b_i||^2`` (Gram form, float64), its step from
    the curvature on the simplex's tangent space, certified at the iterate and
    at a conjugate-gradient point of the affine hull.
  * :func:`solve_pdhg` — restarted PDHG (PDLP-style: restart to the average,
    adaptive primal weight) for the LP and the QP (the QP's n linear forms are
    lifted to free variables ``t_i`` whose prox is exact).
  * :func:`solve_maxent` — ``min KL(p || q0)`` s.t. ``E p = h`` through the
    unconstrained concave dual ``max_l l.h - logsumexp(log q0 + E^T l)`` fitted
    with optax's L-BFGS.

**Vocabularies.** All members must share one vocabulary (same V, same token
ids): the constraints compare images of distributions over the same events.
Members with different vocabularies are refused (``FusionInputError``); brf
does not define the constraints on a union event space.

**Cost.** Once per support: an SVD of the K x (m+1) matrix ``A~^T``
(O(K m^2), float64; minutes for K = 49152, m = 576 on a 2-core CPU, so it is
cached by the caller for full-vocabulary use). Per position and iteration: two
matvecs with ``E`` (r x K, float64), kept in both layouts — near memory-bound
unbatched, a matmul when batched over positions (E is shared); least squares:
one K x K matvec (float64). See BENCHMARKS.md, "Softmax-bottleneck fusion".

Each returns a :class:`Solution`: the certificate (objective, lower bound,
gap, residuals), the iteration count and a status (``converged``, ``budget``:
out of iterations, ``empty``: the constraints have no solution on the
support). The fusion methods registered below return the linear pool and set
``fallback`` wherever the status is not ``converged``.
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
STATUSES = ("converged", "budget", "empty")
CONVERGED, BUDGET, EMPTY = 0, 1, 2
LOGP_FLOOR = -50.0  # log p_hat below this counts as this (cost of a ~zero token)
DEFAULT_TOL = 1e-5
# Relative certificates need a nonzero optimum: a gap below this fraction of the
# objective's natural scale (least squares: sum_i w_i ||b_i||^2, i.e. a misfit of
# 1e-6 relative; LP/QP/min-KL: the largest objective on the simplex) counts as
# converged whatever the optimum (it is at the float64 resolution of the gap).
OBJECTIVE_FLOOR = 1e-12
F32, F64 = jnp.float32, jnp.float64


def _x64():
    """float64 enabled within (dtypes are then explicit: float32 stays float32)."""
    return jax.enable_x64(True)


class Basis(NamedTuple):
    """The reduced constraint basis on one support (see the module docstring).

    Attributes:
      E_qxK: rows of V^T (orthonormal), float64; rows past the rank are zero.
      ET_Kxq: the same matrix stored transposed (V): XLA's CPU product with a
        transposed operand is ~40x slower than with a contiguous one (measured
        at 577 x 49152), so both layouts are kept.
      sigma_q: singular values of A~ (0 past the rank), float64.
      U_Mxq: left singular vectors, M = m + 1 (member blocks, then the sum
        row), float64.
      scale: s, the weight of the sum row (float64).
      rank: the numerical rank r (int32).
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
    """A solver's answer and its certificate (per position under vmap).

    Attributes:
      p_K: the distribution on the support (sums to 1).
      objective: the objective at ``p_K`` (evaluated in float64).
      lower_bound: a lower bound on the optimum (Frank–Wolfe, Lagrangian or
        dual bound; see the module docstring).
      primal_res: relative residual ``||E p - h|| / ||h||``; for least squares
        the relative misfit ``sqrt(f / sum_i w_i ||b_i||^2)``, not a residual
        that must vanish.
      dual_res: the primal residual's first-order cost ``|y.r|`` relative to the
        lower bound (0 for least squares, whose iterates are feasible).
      gap: ``(objective - lower_bound) / lower_bound``.
      iters: iterations used.
      converged: ``status == CONVERGED``: gap and dual_res within ``tol`` (the
        objective is within ``tol`` of the optimum, relative) and primal_res
        within ``tol`` (least squares: no residual condition).
      status: CONVERGED, BUDGET (out of iterations) or EMPTY (the constraints
        have no solution on the support, certified; see ``STATUSES``).
    """
    p_K: jax.Array
    objective: jax.Array
    lower_bound: jax.Array
    primal_res: jax.Array
    dual_res: jax.Array
    gap: jax.Array
    iters: jax.Array
    converged: jax.Array
    status: jax.Array


def _solution(p_K, objective, lower_bound, primal_res, dual_res, scale, iters, status):
    """A Solution in float32 / int32 from float64 certificate terms."""
    gap = (objective - lower_bound) / scale
    return Solution(p_K.astype(F32), objective.astype(F32), lower_bound.astype(F32),
                    primal_res.astype(F32), dual_res.astype(F32), gap.astype(F32),
                    iters.astype(jnp.int32), status == CONVERGED, status.astype(jnp.int32))


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


def rank_bound(dims: Sequence[int], shared: bool = False) -> int:
    """An upper bound on the constraints' rank: ``sum_i d_i + 1``, or ``d + 1``
    when every member has the same unembedding (one model under several prompts).

    On a support of at most this many tokens the constraints generically pin a
    single point (the unique regime, or an infeasible one whose projection has
    a single solution), which real next-token distributions (no zero tail) put
    outside the simplex: the LP, QP and min-KL cannot converge there.
    """
    return (int(dims[0]) if shared else int(sum(dims))) + 1


def constraint_basis(W_KxM: jax.Array, support_K: jax.Array,
                     rank_rtol: float = 1e-4) -> Basis:
    """The SVD basis of ``A~ = [W_S^T; s 1^T]`` on one support (jit/vmap-able).

    Args:
      W_KxM: the members' unembedding rows on the support, concatenated along
        the hidden axis (K x m).
      support_K: token ids of the support.
      rank_rtol: singular values below ``rank_rtol * sigma_max`` count as zero.
    """
    with _x64():
        W = jnp.asarray(W_KxM).astype(F64)
        K = W.shape[0]
        scale = jnp.sqrt(jnp.sum(W * W) / K)
        At_KxM = jnp.concatenate([W, jnp.full((K, 1), scale, F64)], 1)
        Vf_Kxq, s_q, Ut_qxM = jnp.linalg.svd(At_KxM, full_matrices=False)
        keep = s_q > rank_rtol * s_q[0]
        return Basis(jnp.where(keep[:, None], Vf_Kxq.T, 0.0),
                     jnp.where(keep[None, :], Vf_Kxq, 0.0),
                     jnp.where(keep, s_q, 0.0), jnp.where(keep[None, :], Ut_qxM.T, 0.0),
                     scale, jnp.sum(keep).astype(jnp.int32),
                     jnp.asarray(support_K).astype(jnp.int32))


def truncate(basis: Basis) -> Basis:
    """Drops the zero rows past the rank (concrete bases only: shapes change)."""
    r = int(basis.rank)
    with _x64():
        return basis._replace(E_qxK=basis.E_qxK[:r], ET_Kxq=basis.ET_Kxq[:, :r],
                              sigma_q=basis.sigma_q[:r], U_Mxq=basis.U_Mxq[:, :r])


def rhs(basis: Basis, Wfull_VxM: jax.Array, phat_nxV: jax.Array, dims: tuple):
    """b~ = [W_i^T p_hat_i; s] for one position, shape [m+1], float64.

    Each product sums V terms; it is accumulated in float64 so that it does not
    depend on how XLA blocks it (a matrix-vector product for one position, a
    matrix product for a batch; in float32 the two differ by up to 1e-4
    relative on real unembeddings).
    """
    with _x64():
        parts, o = [], 0
        for i, d in enumerate(dims):
            parts.append(phat_nxV[i].astype(F64) @ Wfull_VxM[:, o:o + d].astype(F64))
            o += d
        return jnp.concatenate(parts + [basis.scale[None].astype(F64)])


class Reduced(NamedTuple):
    """The reduced right-hand side of one position."""
    h_q: jax.Array            # S_r^{-1} U_r^T b~, rescaled to unit mass (float64)
    inconsistency: jax.Array  # ||b~ - U_r U_r^T b~|| / ||b~||


def reduce_rhs(basis: Basis, b_M: jax.Array) -> Reduced:
    """h = S^{-1} U^T b~ (the projection of b~ onto the range of A~), float64.

    Every p with ``E p = h`` has total mass ``a.h`` with ``a = E 1`` (the sum row
    is in the row space); h is divided by it so that those p are
    distributions. For a consistent b~ the mass is 1 already.
    """
    with _x64():
        b = b_M.astype(F64)
        c_q = basis.U_Mxq.T @ b
        pos = basis.sigma_q > 0
        h_q = jnp.where(pos, c_q / jnp.where(pos, basis.sigma_q, 1.0), 0.0)
        inc = jnp.linalg.norm(b - basis.U_Mxq @ c_q) / jnp.linalg.norm(b)
        mass = jnp.sum(basis.ET_Kxq.astype(F64), 0) @ h_q
        h_q = h_q / jnp.where(mass > 0, mass, 1.0)
        return Reduced(h_q, inc.astype(F32))


def regime(basis: Basis, red: Reduced, consistency_rtol: float = 1e-4):
    """Regime code (0 unique, 1 infeasible, 2 underdetermined) of one position."""
    K = basis.E_qxK.shape[1]
    return jnp.where(red.inconsistency > consistency_rtol, INFEASIBLE,
                     jnp.where(basis.rank >= K, UNIQUE, UNDERDETERMINED)).astype(jnp.int32)


def _single_point(E_qxK, ET_Kxq, h_q, tol):
    """On a support no larger than the rank, the one p with E p = h: p = E^T h.

    Returns (p normalised after clipping negatives, relative residual, ok):
    ok when the clipped p still meets the constraints to ``tol``.
    """
    x = jnp.maximum(ET_Kxq @ h_q, 0.0)
    s = jnp.sum(x)
    x = jnp.where(s > 0, x / jnp.where(s > 0, s, 1.0), jnp.full_like(x, 1.0 / x.shape[0]))
    res = jnp.linalg.norm(E_qxK @ x - h_q) / jnp.linalg.norm(h_q)
    return x, res, res <= tol


def _full_rank(E_qxK):
    """True when the basis has K nonzero rows (a square, orthogonal E)."""
    return jnp.sum(jnp.any(E_qxK != 0, axis=1)) >= E_qxK.shape[1]


# --------------------------------------------------------------------------
# Least squares on the simplex.

def project_simplex(y_K: jax.Array) -> jax.Array:
    """Euclidean projection onto {p >= 0, sum p = 1} (sort-based, exact)."""
    u = jnp.sort(y_K)[::-1]
    css = jnp.cumsum(u) - 1.0
    k = jnp.arange(1, y_K.shape[0] + 1).astype(y_K.dtype)
    cond = u - css / k > 0
    rho = jnp.max(jnp.where(cond, jnp.arange(y_K.shape[0]), 0))
    theta = css[rho] / (rho + 1).astype(y_K.dtype)
    return jnp.maximum(y_K - theta, 0.0)


def _tangent_top_eigenvalue(H_KxK: jax.Array, steps: int = 50) -> jax.Array:
    """The largest eigenvalue of H on the simplex's tangent space {d : sum d = 0}
    (a power iteration on P H P, P the projection onto it; a Rayleigh quotient,
    so it estimates the eigenvalue from below)."""
    K = H_KxK.shape[0]
    tangent = lambda v: v - jnp.mean(v)  # noqa: E731
    # A fixed start with a component along every eigenvector in general position.
    v = tangent(jnp.cos(1.0 + 2.399963 * jnp.arange(K, dtype=F64)))
    v = v / jnp.linalg.norm(v)

    def power(_, v):
        u = tangent(H_KxK @ v)
        return u / jnp.maximum(jnp.linalg.norm(u), 1e-300)

    v = jax.lax.fori_loop(0, steps, power, v)
    return v @ (H_KxK @ v)


@functools.partial(jax.jit, static_argnames=("dims", "max_iters", "check_every"))
def solve_lsq(W_KxM: jax.Array, b_M: jax.Array, weights_n: jax.Array, *, dims: tuple,
              lipschitz: jax.Array | None = None, p0_K: jax.Array | None = None,
              tol: float = DEFAULT_TOL, max_iters: int = 20000,
              check_every: int = 20) -> Solution:
    r"""min_{p in simplex} f(p) = sum_i w_i ||W_i^T p - b_i||^2 (FISTA, adaptive restart).

    Works in float64 on the Gram form ``f = p.H p - 2 q.p + const`` with
    ``H = sum_i w_i W_i W_i^T`` (K x K) and ``q = sum_i w_i W_i b_i``.

    **Certificate.** f is convex on all of R^K, so for *any* point x,
    ``f* >= f(x) - (g.x - min_j g_j)`` (g = grad f(x); the linearisation at x,
    minimised over the simplex's vertices e_j). At x = p it is the Frank–Wolfe
    bound. It is also evaluated at a second point x on the affine hull
    ``sum x = 1`` (negative entries allowed), which conjugate gradients on the
    tangent space drive to the minimum of f over that hull. Where the members'
    common image can be met on the simplex (one model under two prompts, on a
    support above the rank: all but a few of the real positions measured) that
    minimum *is* f*,
    and the bound at x is exact up to CG's residual, while the Frank–Wolfe gap
    at p shrinks only like sqrt(f(p) - f*): the first order certificate, not the
    iterate, was what needed tens of thousands of steps (issue 37). Every
    ``check_every`` FISTA steps (and ``check_every / 2`` CG steps, until CG has
    converged or its hull minimum falls below the bound at p, when the hull
    cannot certify) both bounds are evaluated from fresh products with H; it
    stops when ``f(p) - LB <= max(tol * LB, OBJECTIVE_FLOOR * const)``, LB the
    larger bound seen.

    **Step.** Every FISTA step moves between points of the simplex, i.e. along
    its tangent space ``sum d = 0``, so the step is ``1 / (2 L)`` with L the
    largest eigenvalue of H *on that space*: unembedding rows share a large
    common component, so H's top eigenvector is close to the all-ones
    direction; on the SmolLM2 supports measured (BENCHMARKS.md, issue 37) L on
    the tangent space is 1.5-2x below H's and 9x below the bound
    ``max_i w_i sigma_max(A~)^2`` used before. L is estimated by 50 steps of
    power iteration (from below), with a 2% margin, and raised (that step
    undone, momentum reset) whenever a step's own curvature ``d.H d / d.d``
    exceeds it, so every accepted step satisfies the descent lemma FISTA needs. Neither the step nor x enters the
    certificate's validity, only how soon it is met.

    Args:
      W_KxM: the members' unembedding rows on the support (K x m).
      b_M: the right-hand side ``[b_1; ...; b_n]`` (m entries; an (m+1)-th, the
        sum row of :func:`rhs`, is ignored).
      weights_n: member weights.
      dims: hidden sizes of the members (their blocks of W and b).
      lipschitz: an estimate of the largest eigenvalue of H on the tangent space
        (default: the power iteration); raised as above if too small.
      p0_K: start (projected onto the simplex; default uniform); CG starts there too.
      max_iters: budget of products with H, FISTA and CG steps together (the
        power iteration's 50 and one per check for the certificates aside);
        ``iters`` reports the steps used.
    """
    with _x64():
        m = sum(dims)
        W = W_KxM.astype(F64)
        b = b_M.astype(F64)[:m]
        wrow = jnp.concatenate([jnp.full((d,), weights_n[i], F64) for i, d in enumerate(dims)])
        Wd = W * wrow[None, :]
        H = Wd @ W.T
        q = Wd @ b
        const = jnp.sum(wrow * b * b)
        K = W.shape[0]
        if lipschitz is None:
            lipschitz = _tangent_top_eigenvalue(H)
        lip0 = jnp.maximum(1.02 * jnp.asarray(lipschitz, F64), 1e-300)
        floor = OBJECTIVE_FLOOR * const
        tangent = lambda v: v - jnp.mean(v)  # noqa: E731
        cg_every = max(1, check_every // 2)

        def bound(x, Hx):
            """(f(x), the convexity lower bound on f* at x): valid for any x."""
            f = x @ Hx - 2.0 * q @ x + const
            g = 2.0 * (Hx - q)
            return f, f - (g @ x - jnp.min(g))

        def fista(_, s):
            # One product with H per step: H y follows from H p and H pn by linearity.
            p, Hp, y, Hy, t, lip = s
            pn = project_simplex(y - (Hy - q) / lip)
            Hpn = H @ pn
            d = pn - y
            dd = d @ d
            curv = d @ (Hpn - Hy)
            # The descent lemma failed (L too small): raise L, undo the step, restart
            # the momentum. Below |d| ~ 1e-11 the curvature is rounding noise.
            bad = (curv > lip * dd) & (dd > 1e-22)
            lip = jnp.where(bad, jnp.maximum(2.0 * lip, 1.25 * curv / jnp.where(bad, dd, 1.0)),
                            lip)
            tn = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
            # O'Donoghue-Candes gradient restart: momentum off when it points uphill.
            restart = jnp.dot(y - pn, pn - p) > 0
            tn = jnp.where(restart, 1.0, tn)
            beta = jnp.where(restart, 0.0, (t - 1.0) / tn)
            yn, Hyn = pn + beta * (pn - p), Hpn + beta * (Hpn - Hp)
            keep = lambda old, new: jnp.where(bad, old, new)  # noqa: E731
            return (keep(p, pn), keep(Hp, Hpn), keep(p, yn), keep(Hp, Hyn),
                    keep(jnp.ones((), F64), tn), lip)

        def cg(_, s):
            # Conjugate gradients for min f on {sum x = 1}: H x = q on the tangent space
            # (consistent: f is bounded below there). r is the tangent residual.
            x, r, z, rr, on = s
            Hz = H @ z
            zHz = z @ Hz
            go = on & (zHz > 0) & (rr > 0)
            a = jnp.where(go, rr / jnp.where(go, zHz, 1.0), 0.0)
            x = x + a * z
            r = r - a * tangent(Hz)
            rn = r @ r
            z = jnp.where(go, r + (rn / jnp.where(go, rr, 1.0)) * z, z)
            return x, r, z, jnp.where(go, rn, rr), go

        def body(state):
            p, Hp, y, Hy, t, lip, x, r, z, rr, cg_on, lb_x, it, _ = state
            p, Hp, y, Hy, t, lip = jax.lax.fori_loop(0, check_every, fista,
                                                     (p, Hp, y, Hy, t, lip))
            x, r, z, rr, on = jax.lax.fori_loop(0, cg_every, cg, (x, r, z, rr, cg_on))
            ran = cg_on
            # The bounds from fresh products (no drift from the recurrences).
            Hp = H @ p
            f, lb_p = bound(p, Hp)
            fx, lb_xn = bound(x, H @ x)
            lb_x = jnp.where(ran, jnp.maximum(lb_x, lb_xn), lb_x)
            # CG stops once converged (its bound within tol / 100 of its hull
            # minimum) or once that minimum lies below the bound at p.
            cg_on = on & ~((fx < lb_p) | (fx - lb_xn <= 0.01 * tol * fx))
            lb = jnp.maximum(lb_p, lb_x)
            it = it + check_every + jnp.where(ran, cg_every, 0)
            return (p, Hp, y, Hy, t, lip, x, r, z, rr, cg_on, lb_x, it,
                    f - lb <= jnp.maximum(tol * lb, floor))

        def cond(state):
            return (state[12] < max_iters) & ~state[13]

        p0 = (jnp.full((K,), 1.0 / K, F64) if p0_K is None
              else project_simplex(p0_K.astype(F64)))
        Hp0 = H @ p0
        f0, lb0 = bound(p0, Hp0)
        r0 = -tangent(Hp0 - q)
        init = (p0, Hp0, p0, Hp0, jnp.ones((), F64), lip0, p0, r0, r0, r0 @ r0,
                jnp.ones((), bool), lb0, jnp.zeros((), jnp.int32),
                f0 - lb0 <= jnp.maximum(tol * lb0, floor))
        out = jax.lax.while_loop(cond, body, init)
        p, lb_x, it, ok = out[0], out[11], out[12], out[13]
        f, lb_p = bound(p, H @ p)
        lb = jnp.maximum(lb_p, lb_x)
        f = jnp.maximum(f, 0.0)  # (a rounding below 0 where f* = 0)
        misfit = jnp.sqrt(f / jnp.maximum(const, 1e-300))
        return _solution(p, f, lb, misfit, jnp.zeros((), F64), jnp.maximum(lb, 1e-300), it,
                         jnp.where(ok, CONVERGED, BUDGET))


# --------------------------------------------------------------------------
# LP and QP by restarted PDHG.

class _PD(NamedTuple):
    x: jax.Array  # p on the support [K]
    t: jax.Array  # lifted QP variables [n] (empty for the LP)
    y: jax.Array  # multipliers of E p = h [q]
    u: jax.Array  # multipliers of Lh p - t = 0 [n]


def _pd_kkt(z: _PD, E, ET, h, c, Lh, qd):
    """Relative KKT error of a PDHG iterate: drives the restarts (not the stopping).

    Problem: min c.x + 1/2 sum_j qd_j t_j^2 s.t. E x = h, Lh x - t = 0, x >= 0.
    Lagrangian c.x + 1/2 qd.t^2 + y.(E x - h) + u.(Lh x - t) - lam.x, lam >= 0.
    KKT: E x = h, Lh x = t (primal); lam = c + E^T y + Lh^T u >= 0 and
    qd t = u (dual); lam.x = 0 (complementarity).
    """
    rp = jnp.concatenate([E @ z.x - h, Lh @ z.x - z.t])
    lam = c + ET @ z.y + Lh.T @ z.u
    rd = jnp.concatenate([jnp.minimum(lam, 0.0), qd * z.t - z.u])
    P = c @ z.x + 0.5 * jnp.sum(qd * z.t * z.t)
    safe_q = jnp.where(qd > 0, qd, 1.0)
    D = -h @ z.y - 0.5 * jnp.sum(jnp.where(qd > 0, z.u * z.u / safe_q, 0.0))
    comp = jnp.abs(jnp.maximum(lam, 0.0) @ z.x)
    pres = jnp.linalg.norm(rp) / (1.0 + jnp.linalg.norm(h))
    dres = jnp.linalg.norm(rd) / (1.0 + jnp.linalg.norm(c) + jnp.linalg.norm(qd * z.t))
    gap = jnp.maximum(jnp.abs(P - D), comp) / (1.0 + jnp.abs(P) + jnp.abs(D))
    return jnp.maximum(jnp.maximum(pres, dres), gap)


def _pd_certificate(z: _PD, E, ET, h, c, Lh, qd, offset):
    """Objective, Lagrangian lower bound, |y.r| and relative residual (float64).

    The iterate's x is normalised to unit mass first (what is returned); the
    bound ``D = -h.y + min_j lam_j - sum u^2 / (2 qd)`` is the minimum of the
    Lagrangian over the simplex and over t, valid for any (y, u).
    """
    s = jnp.sum(z.x.astype(F64))
    x = z.x.astype(F64) / jnp.where(s > 0, s, 1.0)
    y, u = z.y.astype(F64), z.u.astype(F64)
    r = E @ x - h
    t = Lh @ x
    P = offset + c @ x + 0.5 * jnp.sum(qd * t * t)
    lam = c + ET @ y + Lh.T @ u
    safe_q = jnp.where(qd > 0, qd, 1.0)
    D = offset - h @ y + jnp.min(lam) - 0.5 * jnp.sum(jnp.where(qd > 0, u * u / safe_q, 0.0))
    return x, P, D, jnp.abs(y @ r), jnp.linalg.norm(r) / jnp.linalg.norm(h)


@functools.partial(jax.jit, static_argnames=("max_iters", "check_every"))
def solve_pdhg(E_qxK: jax.Array, ET_Kxq: jax.Array, h_q: jax.Array, c_K: jax.Array,
               Lh_nxK: jax.Array, qd_n: jax.Array, *, offset: jax.Array | float = 0.0,
               x0_K: jax.Array | None = None, tol: float = DEFAULT_TOL,
               max_iters: int = 50000, check_every: int = 64) -> Solution:
    r"""Restarted PDHG for min offset + c.x + 1/2 sum qd_j t_j^2, E x = h, Lh x = t, x >= 0.

    The LP is ``Lh`` with zero rows (n = 0 allowed). ``E`` has orthonormal rows
    (||E|| <= 1) and the rows of ``Lh`` unit norm, so the operator norm is at
    most ``sqrt(2 + lambda_max(Lh Lh^T))`` (1 for the LP) and the steps are
    ``tau = eta / omega``, ``sigma = eta * omega`` with eta 0.95 over that bound.

    Iteration (Chambolle-Pock with an extrapolated primal, float64):
      x+ = max(0, x - tau (c + E^T y + Lh^T u));  t+ = (t + tau u) / (1 + tau qd)
      y+ = y + sigma (E (2x+ - x) - h);           u+ = u + sigma (Lh (2x+ - x) - (2t+ - t))
    Every ``check_every`` steps the KKT error (:func:`_pd_kkt`) of the current
    and the averaged iterate are computed; the better one becomes the restart
    point when it has halved since the last restart (PDLP's sufficient decay),
    and the primal weight omega is re-balanced then from the distance moved:
    omega <- sqrt(omega * ||dy|| / ||dx||). The better one is also certified
    in float64 (:func:`_pd_certificate`): the solver stops when
    ``max(P - D, |y.r|) <= tol * D`` and ``||r|| / ||h|| <= tol``, or when
    ``D`` exceeds the largest objective on the simplex (the constraints are
    empty). With K nonzero rows in E (a support no larger than the rank) the
    only candidate ``E^T h`` is checked instead (0 iterations).
    """
    with _x64():
        K = E_qxK.shape[1]
        n = Lh_nxK.shape[0]
        E, ET = E_qxK.astype(F64), ET_Kxq.astype(F64)
        h, c = h_q.astype(F64), c_K.astype(F64)
        Lh, qd = Lh_nxK.astype(F64), qd_n.astype(F64)
        offset = jnp.asarray(offset).astype(F64)
        # The largest objective on the simplex (at a vertex: the objective is convex).
        ub = offset + jnp.max(c + 0.5 * jnp.sum(qd[:, None] * Lh * Lh, 0))
        floor = OBJECTIVE_FLOOR * jnp.maximum(jnp.abs(ub), 1e-300)
        lam_max = jnp.linalg.eigvalsh(Lh @ Lh.T)[-1] if n else 0.0
        eta = 0.95 / jnp.sqrt(1.0 + (1.0 + lam_max if n else 0.0))
        hn, cn = jnp.linalg.norm(h), jnp.linalg.norm(c)
        omega0 = jnp.where((hn > 1e-12) & (cn > 1e-12), cn / jnp.maximum(hn, 1e-12), 1.0)
        x0 = jnp.full((K,), 1.0 / K, F64) if x0_K is None else x0_K.astype(F64)
        z0 = _PD(x0, Lh @ x0, jnp.zeros_like(h), jnp.zeros((n,), F64))

        def err(z):
            return _pd_kkt(z, E, ET, h, c, Lh, qd)

        def certify(z):
            _, P, D, yr, pres = _pd_certificate(z, E, ET, h, c, Lh, qd, offset)
            ok = (jnp.maximum(P - D, yr) <= jnp.maximum(tol * D, floor)) & (pres <= tol)
            return jnp.where(ok, CONVERGED, jnp.where(D > ub, EMPTY, -1)).astype(jnp.int32)

        def step(_, s):
            z, zsum, omega = s
            tau, sig = eta / omega, eta * omega
            xn = jnp.maximum(z.x - tau * (c + ET @ z.y + Lh.T @ z.u), 0.0)
            tn = (z.t + tau * z.u) / (1.0 + tau * qd)
            xb, tb = 2.0 * xn - z.x, 2.0 * tn - z.t
            yn = z.y + sig * (E @ xb - h)
            un = z.u + sig * (Lh @ xb - tb)
            zn = _PD(xn, tn, yn, un)
            return zn, jax.tree.map(jnp.add, zsum, zn), omega

        def body(state):
            z, zsum, cnt, omega, z_last, e_last, it, _, _ = state
            z, zsum, _ = jax.lax.fori_loop(0, check_every, step, (z, zsum, omega))
            cnt = cnt + check_every
            it = it + check_every
            zavg = jax.tree.map(lambda a: a / cnt.astype(F64), zsum)
            e_cur, e_avg = err(z), err(zavg)
            cand = jax.tree.map(lambda a, b: jnp.where(e_avg < e_cur, a, b), zavg, z)
            e_c = jnp.minimum(e_avg, e_cur)
            # PDLP's sufficient decay, or an artificial restart after a long run.
            restart = (e_c <= 0.5 * e_last) | (cnt >= (0.36 * it).astype(cnt.dtype))
            dx = jnp.linalg.norm(jnp.concatenate([cand.x - z_last.x, cand.t - z_last.t]))
            dy = jnp.linalg.norm(jnp.concatenate([cand.y - z_last.y, cand.u - z_last.u]))
            ok = restart & (dx > 1e-10) & (dy > 1e-10)
            omega = jnp.where(ok, jnp.sqrt(omega * dy / jnp.maximum(dx, 1e-30)), omega)
            omega = jnp.clip(omega, 1e-4 * omega0, 1e4 * omega0)
            z = jax.tree.map(lambda a, b: jnp.where(restart, a, b), cand, z)
            zero = jax.tree.map(jnp.zeros_like, z)
            zsum = jax.tree.map(lambda a, b: jnp.where(restart, a, b), zero, zsum)
            cnt = jnp.where(restart, 0, cnt)
            z_last = jax.tree.map(lambda a, b: jnp.where(restart, a, b), cand, z_last)
            e_last = jnp.where(restart, e_c, e_last)
            status = certify(cand)
            status = jnp.where((status < 0) & (it >= max_iters), BUDGET, status).astype(jnp.int32)
            return z, zsum, cnt, omega, z_last, e_last, it, status, cand

        single = _full_rank(E)
        zero = jax.tree.map(jnp.zeros_like, z0)
        init = (z0, zero, jnp.zeros((), jnp.int32), omega0, z0,
                err(z0), jnp.zeros((), jnp.int32),
                jnp.where(single, CONVERGED, -1).astype(jnp.int32), z0)
        *_, it, status, z = jax.lax.while_loop(lambda s: s[7] < 0, body, init)
        x, P, D, yr, pres = _pd_certificate(z, E, ET, h, c, Lh, qd, offset)
        scale = jnp.maximum(jnp.abs(D), 1e-300)
        # The single candidate on a support no larger than the rank.
        xs, res_s, ok_s = _single_point(E, ET, h, tol)
        ts = Lh @ xs
        Ps = offset + c @ xs + 0.5 * jnp.sum(qd * ts * ts)
        pick = lambda a, b: jnp.where(single, a, b)  # noqa: E731
        return _solution(pick(xs, x), pick(Ps, P), pick(Ps, D), pick(res_s, pres),
                         pick(0.0, yr / scale), pick(jnp.maximum(jnp.abs(Ps), 1e-300), scale),
                         pick(0, it), pick(jnp.where(ok_s, CONVERGED, EMPTY), status))


def lp_data(logphat_nxK: jax.Array, weights_n: jax.Array):
    """Cost of the LP: c = -sum_i w_i log p_hat_i (floored at LOGP_FLOOR)."""
    lp = jnp.maximum(logphat_nxK, LOGP_FLOOR)
    return -(weights_n[:, None] * lp).sum(0)


def qp_data(logphat_nxK: jax.Array, weights_n: jax.Array):
    """Lifted QP data: rows Lh_i = l_i / ||l_i|| and qd_i = 2 w_i ||l_i||^2.

    sum_i w_i (p . l_i)^2 = 1/2 sum_i qd_i t_i^2 with t_i = Lh_i . p.
    """
    lp = jnp.maximum(logphat_nxK, LOGP_FLOOR)
    return _lift(lp, weights_n)


def _lift(l_nxK, weights_n):
    nrm = jnp.maximum(jnp.linalg.norm(l_nxK, axis=1), 1e-30)
    return l_nxK / nrm[:, None], 2.0 * weights_n * nrm * nrm


def centred_data(kind: str, logphat_nxK: jax.Array, weights_n: jax.Array, x0_K: jax.Array):
    """(c, Lh, qd, offset) of the LP or QP with the costs centred at a reference p.

    On distributions the objective is unchanged by shifting a cost vector by a
    constant: the LP's ``c.p = (c - k).p + k`` with ``k = c.x0``, and the QP's
    ``sum_i w_i (l_i.p)^2 = sum_i w_i (l~_i.p)^2 + 2 sum_i w_i k_i l~_i.p +
    sum_i w_i k_i^2`` with ``l~_i = l_i - k_i``, ``k_i = l_i.x0``. Centred at a p
    near the answer, the costs of the tokens it uses are near 0, so the
    multiplier of the mass constraint is small: without it the products ``E^T y``
    carry the rounding of |y| ~ 500 (measured on SmolLM2) and the Lagrangian
    bound ``min_j lam_j`` is lost in it.
    """
    l_nxK = jnp.maximum(logphat_nxK, LOGP_FLOOR)
    if kind == "lp":
        c = -(weights_n[:, None] * l_nxK).sum(0)
        k = c @ x0_K
        n0 = jnp.zeros((0, c.shape[0]), c.dtype)
        return c - k, n0, jnp.zeros((0,), c.dtype), k
    k_n = l_nxK @ x0_K
    lt = l_nxK - k_n[:, None]
    Lh, qd = _lift(lt, weights_n)
    return 2.0 * (weights_n * k_n) @ lt, Lh, qd, jnp.sum(weights_n * k_n * k_n)


# --------------------------------------------------------------------------
# Min-KL (max-entropy) projection through its dual.

@functools.partial(jax.jit, static_argnames=("max_iters", "check_every"))
def solve_maxent(E_qxK: jax.Array, ET_Kxq: jax.Array, h_q: jax.Array, logq0_K: jax.Array, *,
                 tol: float = DEFAULT_TOL, max_iters: int = 1000, check_every: int = 10,
                 lam0_q: jax.Array | None = None) -> Solution:
    r"""min_p KL(p || q0) s.t. E p = h, p on the simplex, via the dual (optax L-BFGS).

    The Lagrangian's minimiser is ``p(l) = softmax(log q0 + E^T l)`` and the dual
    ``g(l) = l.h - logsumexp(log q0 + E^T l)`` is concave and unconstrained with
    gradient ``h - E p(l)``: the primal residual r. L-BFGS runs in float64;
    every ``check_every`` steps the certificate is evaluated in float64:
    ``g(l)`` is a lower bound on the optimum and ``KL(p(l) || q0) - g(l) = l.r``
    exactly. Stops when ``|l.r| <= tol * g`` and ``||r|| / ||h|| <= tol``, or
    when ``g`` exceeds ``max_j log(1 / q0_j)`` (the largest KL on the simplex:
    the constraints are empty; the dual is then unbounded). Constraints met only
    by distributions with zeros leave the dual's supremum unattained: L-BFGS
    then runs out of iterations and says so. With K nonzero rows in E the only
    candidate ``E^T h`` is checked instead (0 iterations).
    """
    import optax

    with _x64():
        E, ET = E_qxK.astype(F64), ET_Kxq.astype(F64)
        h, lq = h_q.astype(F64), logq0_K.astype(F64)
        ub = jnp.max(-lq)
        floor = OBJECTIVE_FLOOR * jnp.maximum(ub, 1e-300)

        def negdual(lam):
            return jax.nn.logsumexp(lq + ET @ lam) - lam @ h

        def certificate(lam):
            a = lq + ET @ lam
            lse = jax.nn.logsumexp(a)
            p = jnp.exp(a - lse)
            r = E @ p - h
            g = lam @ h - lse
            kl = g + lam @ r  # = lam.E p - lse = sum p log(p / q0)
            return p, kl, g, jnp.abs(lam @ r), jnp.linalg.norm(r) / jnp.linalg.norm(h)

        def status_of(lam, it):
            _, kl, g, lr, pres = certificate(lam)
            ok = (lr <= jnp.maximum(tol * g, floor)) & (pres <= tol)
            return jnp.where(ok, CONVERGED, jnp.where(
                g > ub, EMPTY, jnp.where(it >= max_iters, BUDGET, -1))).astype(jnp.int32)

        opt = optax.lbfgs()
        vg = optax.value_and_grad_from_state(negdual)
        lam = jnp.zeros_like(h) if lam0_q is None else lam0_q.astype(F64)

        def lbfgs(_, s):
            lam, state = s
            v, g = vg(lam, state=state)
            upd, state = opt.update(g, state, lam, value=v, grad=g, value_fn=negdual)
            return optax.apply_updates(lam, upd), state

        def body(s):
            lam, state, it, _ = s
            lam, state = jax.lax.fori_loop(0, check_every, lbfgs, (lam, state))
            return lam, state, it + check_every, status_of(lam, it + check_every)

        single = _full_rank(E)
        init = (lam, opt.init(lam), jnp.zeros((), jnp.int32),
                jnp.where(single, CONVERGED, status_of(lam, 0)).astype(jnp.int32))
        lam, _, it, status = jax.lax.while_loop(lambda s: s[3] < 0, body, init)
        p, kl, g, lr, pres = certificate(lam)
        xs, res_s, ok_s = _single_point(E, ET, h, tol)
        kls = jnp.sum(jnp.where(xs > 0, xs * (jnp.log(jnp.where(xs > 0, xs, 1.0)) - lq), 0.0))
        pick = lambda a, b: jnp.where(single, a, b)  # noqa: E731
        scale = jnp.maximum(jnp.abs(g), 1e-300)
        return _solution(pick(xs, p), pick(kls, kl), pick(kls, g), pick(res_s, pres),
                         pick(0.0, lr / scale), pick(jnp.maximum(kls, 1e-300), scale),
                         pick(0, it), pick(jnp.where(ok_s, CONVERGED, EMPTY), status))


# --------------------------------------------------------------------------
# One entry point for a batch of positions on a fixed support.

def stack_unembeddings(unembeddings: Sequence) -> tuple[jax.Array, tuple]:
    ws = check_unembeddings(unembeddings)
    dims = tuple(int(np.shape(w)[1]) for w in ws)
    return jnp.concatenate([jnp.asarray(w, jnp.float32) for w in ws], 1), dims


def solve(kind: str, basis: Basis, Wfull_VxM, dims: tuple, phat_BxnxV,
          weights_Bxn, *, tol: float = DEFAULT_TOL, max_iters: int | None = None,
          consistency_rtol: float = 1e-4, x0_BxK=None):
    """Solves a batch of positions on one shared support (the basis).

    Args:
      kind: 'lsq' | 'lp' | 'qp' | 'maxent'.
      basis: :func:`constraint_basis` of the support (possibly :func:`truncate`-d).
      Wfull_VxM: the stacked unembeddings over the full vocabulary (for b).
      dims: hidden sizes of the members.
      phat_BxnxV: member distributions.
      weights_Bxn: member weights.
      tol: relative objective tolerance of the certificate (see :class:`Solution`).
      max_iters: iteration budget (None: the solver's default).
      x0_BxK: optional warm start (primal) per position (default: the weighted
        mean of the members' distributions on the support).

    Returns:
      (Solution batched over B, regime codes [B], inconsistency [B], constraint
      residual [B]: ``||W_S^T p - b|| / ||b||`` in the original, unreduced terms).
    """
    if kind not in SOLVERS:
        raise FusionInputError(f"unknown bottleneck solver {kind!r}; use lsq, lp, qp or maxent")
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


SOLVERS = ("lsq", "lp", "qp", "maxent")


@functools.partial(jax.jit, static_argnames=("kind", "dims", "max_iters"))
def _solve_batch(kind, basis, Wfull_VxM, phat_BxnxV, weights_Bxn, x0_BxK, *,
                 dims, tol, max_iters, consistency_rtol):
    def one(phat_nxV, w_n, x0):
        return _solve_one(kind, basis, Wfull_VxM, phat_nxV, w_n, x0, dims, tol,
                          max_iters, consistency_rtol)
    with _x64():
        if x0_BxK is None:
            return jax.vmap(lambda a, b: one(a, b, None))(phat_BxnxV, weights_Bxn)
        return jax.vmap(one)(phat_BxnxV, weights_Bxn, x0_BxK)


def _solve_one(kind, basis, Wfull_VxM, phat_nxV, w_n, x0, dims, tol, max_iters,
               consistency_rtol):
    """One position: the float64 data, the chosen solver, the unreduced residual."""
    with _x64():
        phat_nxV = phat_nxV.astype(F64)
        w_n = w_n.astype(F64)
        b = rhs(basis, Wfull_VxM, phat_nxV, dims)
        red = reduce_rhs(basis, b)
        code = regime(basis, red, consistency_rtol)
        S = basis.support_K
        ph_nxK = phat_nxV[:, S]
        # Start (and centre the costs) at the members' weighted mean on the support.
        x0 = w_n @ ph_nxK if x0 is None else jnp.maximum(x0.astype(F64), 0.0)
        x0 = x0 / jnp.maximum(jnp.sum(x0), 1e-300)
        logphat_nxK = jnp.log(jnp.maximum(ph_nxK, 1e-300))
        if kind == "lsq":
            sol = solve_lsq(Wfull_VxM[S], b, w_n, dims=dims, p0_K=x0, tol=tol,
                            max_iters=max_iters or 20000)
        elif kind in ("lp", "qp"):
            c, Lh, qd, offset = centred_data(kind, logphat_nxK, w_n, x0)
            sol = solve_pdhg(basis.E_qxK, basis.ET_Kxq, red.h_q, c, Lh, qd, offset=offset,
                             x0_K=x0, tol=tol, max_iters=max_iters or 50000)
        elif kind == "maxent":
            K = basis.E_qxK.shape[1]
            logq0 = jnp.full((K,), -np.log(K), F64)  # uniform on the support
            sol = solve_maxent(basis.E_qxK, basis.ET_Kxq, red.h_q, logq0, tol=tol,
                               max_iters=max_iters or 1000)
        else:
            raise FusionInputError(
                f"unknown bottleneck solver {kind!r}; use lsq, lp, qp or maxent")
        return sol, code, red.inconsistency, constraint_residual(basis, Wfull_VxM, b, sol.p_K)


def constraint_residual(basis: Basis, Wfull_VxM, b_M, p_K):
    """||W_S^T p - b|| / ||b|| over the members' blocks (the sum row excluded), float32."""
    with _x64():
        r = p_K.astype(F64) @ Wfull_VxM[basis.support_K].astype(F64) - b_M[:-1].astype(F64)
        return (jnp.linalg.norm(r) / jnp.linalg.norm(b_M[:-1].astype(F64))).astype(F32)


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
    Wf = jnp.concatenate([jnp.asarray(w).astype(F32) for w in ws], 1)
    lead = logits.shape[:-2]
    n = logits.shape[-2]
    logits_BxnxV = logits.reshape((-1, n, V))
    logp = jax.nn.log_softmax(logits_BxnxV.astype(F32), axis=-1)
    w = jnp.broadcast_to(weights, lead + (n,)).reshape((-1, n))
    B = logp.shape[0]

    def one(phat_nxV, w_n, basis):
        return _solve_one(kind, basis, Wf, phat_nxV, w_n, None, dims, tol,
                          max_iters or None, 1e-4)

    with _x64():
        # p_hat in float64 from the float32 logits: it feeds the right-hand side.
        phat = jnp.exp(jax.nn.log_softmax(logits_BxnxV.astype(F64), axis=-1))
        if top_k > 0:
            K = min(V, top_k * n)
            support = jax.lax.top_k(jnp.max(logp, axis=1), K)[1]
            sol, code, inc, cres = jax.vmap(
                lambda a, b, s: one(a, b, constraint_basis(Wf[s], s)))(phat, w, support)
        else:
            support = jnp.arange(V, dtype=jnp.int32)
            basis = constraint_basis(Wf, support)
            sol, code, inc, cres = jax.vmap(lambda a, b: one(a, b, basis))(phat, w)
            support = jnp.broadcast_to(support, (B, V))
    q = jnp.zeros((B, V), F32).at[jnp.arange(B)[:, None], support].add(sol.p_K)
    q = q / jnp.sum(q, axis=-1, keepdims=True)
    ok = sol.converged & jnp.all(jnp.isfinite(q), axis=-1)
    logq = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf)
    logq = jnp.where(ok[:, None], logq, linear_pool(logp, w))
    info = {"fallback": ~ok, "converged": sol.converged, "status": sol.status,
            "regime": code, "inconsistency": inc, "constraint_res": cres,
            "objective": sol.objective, "lower_bound": sol.lower_bound, "gap": sol.gap,
            "primal_res": sol.primal_res, "dual_res": sol.dual_res, "iters": sol.iters}
    info = {k: v.reshape(lead) for k, v in info.items()}
    return logq.reshape(lead + (V,)).astype(logits.dtype), info


# The most iterations a call may ask for: 50 times the largest default budget (PDHG's),
# minutes per row on a CPU; more is a typo, not a budget.
MAX_ITERS = 2_500_000

_PARAMS = dict(
    unembeddings=M.Param(None, "array", _unembeddings_check,
                         doc="members' unembeddings, a list of [V, d_i] arrays (shared V)"),
    top_k=M.Param(256, "int", M.nonnegative_int,
                  doc="support: the top_k * n tokens by max_i p_hat_i; 0 = all V"),
    tol=M.Param(DEFAULT_TOL, "float", M.positive,
                doc="certified relative tolerance on the objective (and the residual)"),
    max_iters=M.Param(0, "int", M.at_most(MAX_ITERS),
                      doc=f"iteration budget (0 = the solver's default; at most {MAX_ITERS})"))


@M.register("bottleneck_lsq", **_PARAMS)
def bottleneck_lsq(logits, weights, *, unembeddings, top_k=256, tol=DEFAULT_TOL, max_iters=0):
    """Softmax bottleneck, least squares: argmin_{p in simplex} sum_i w_i ||(p - p_hat_i) W_i||^2.

    The infeasible regime's answer (e.g. one model under two prompts). Where
    the solver does not meet ``tol`` within its budget it returns the linear
    pool and sets ``fallback``; ``info`` carries the regime, residuals and
    iterations per position.
    """
    return _fuse("lsq", logits, weights, unembeddings=unembeddings, top_k=top_k,
                 tol=tol, max_iters=max_iters)


@M.register("bottleneck_lp", **_PARAMS)
def bottleneck_lp(logits, weights, *, unembeddings, top_k=256, tol=DEFAULT_TOL, max_iters=0):
    """Softmax bottleneck, LP: min -sum_i w_i p . log p_hat_i s.t. p W_i = p_hat_i W_i.

    For the underdetermined regime. Support, fallback and ``info`` as for
    ``bottleneck_lsq``; infeasible positions do not converge and fall back.
    """
    return _fuse("lp", logits, weights, unembeddings=unembeddings, top_k=top_k,
                 tol=tol, max_iters=max_iters)


@M.register("bottleneck_qp", **_PARAMS)
def bottleneck_qp(logits, weights, *, unembeddings, top_k=256, tol=DEFAULT_TOL, max_iters=0):
    """Softmax bottleneck, QP: min sum_i w_i (p . log p_hat_i)^2 s.t. p W_i = p_hat_i W_i."""
    return _fuse("qp", logits, weights, unembeddings=unembeddings, top_k=top_k,
                 tol=tol, max_iters=max_iters)


@M.register("bottleneck_maxent", **_PARAMS)
def bottleneck_maxent(logits, weights, *, unembeddings, top_k=256, tol=DEFAULT_TOL, max_iters=0):
    """Softmax bottleneck, max entropy: the min-KL (to uniform) p with p W_i = p_hat_i W_i."""
    return _fuse("maxent", logits, weights, unembeddings=unembeddings, top_k=top_k,
                 tol=tol, max_iters=max_iters)


__all__ = ["Basis", "DEFAULT_TOL", "REGIMES", "STATUSES", "bottleneck_lp", "bottleneck_lsq",
           "bottleneck_maxent", "bottleneck_qp", "Reduced", "Solution", "check_unembeddings",
           "constraint_basis", "lp_data", "project_simplex", "qp_data", "rank_bound",
           "reduce_rhs", "regime", "rhs", "solve", "solve_lsq", "solve_maxent", "solve_pdhg",
           "stack_unembeddings", "truncate"]
