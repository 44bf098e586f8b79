r"""Softmax-bottleneck fusion benchmark: brf's JAX solvers vs scipy HiGHS, one run.

Problems come from the real SmolLM2-135M unembedding (V = 49152, d = 576): one
member, p_hat = softmax(W h) for hidden states near token rows (mixed 90/10 with
uniform so that log p_hat stays bounded), the LP
``min -p . log p_hat  s.t.  p W = p_hat W, p in simplex`` (underdetermined).

Parts (all in one process, same problems, ratios side by side):
  * ``speed``: per-position LP solve time on the top-K support (K of the
    49152 tokens by p_hat; b from the full p_hat), brf batched (1, 8, 64
    positions) vs HiGHS one position at a time; objective gap and constraint
    residual of both against each other, and brf's certified gap; the QP on the
    same problems (HiGHS's column is the LP's, for scale).
  * ``bound``: full-V cost of one PDHG iteration (two matvecs with E, r x V)
    per position at batch 1, 8, 64 against the memory-bandwidth floor.
  * ``tractability``: on a sub-vocabulary of V' tokens (the "full problem",
    solved by HiGHS), the effect on the answer of (a) restricting p to the top-K
    support, (b) truncating the basis to singular values above rank_rtol,
    (c) warm-starting each position from the previous one's solution.
  * ``lsq``: least squares on the simplex (``bottleneck_lsq``'s solver) on
    SmolLM2's own next-token distributions at every position of a short text
    under two prefixes (the study's two Hamlet prefixes), support 2 x top_k,
    as ``brf.fuse`` builds it: brf's solver against the one before issue 37
    (:func:`lsq_before_issue_37`, in the same process), iterations, convergence
    and time per position, and scipy's NNLS (a heavy sum row keeps it on the
    simplex) with the float64 minimum over the affine hull (a lower bound) as
    the reference. Not part of the default run.

  python experiments/bench_bottleneck.py                    # everything
  python experiments/bench_bottleneck.py --parts=speed --K=4096 --kinds=lp,qp
  python experiments/bench_bottleneck.py --quick            # small smoke run
  python experiments/bench_bottleneck.py --parts=lsq        # least squares, real positions
"""

import functools
import os
import platform
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from scipy.optimize import linprog, nnls

from brf import cli
from brf.align.vocab import encode_text
from brf.benchmark import markdown_table, memory_bandwidth, time_call
from brf.fusion import bottleneck as bn

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "small sizes (smoke)")
flags.DEFINE_list("parts", ["speed", "bound", "tractability"], "which parts to run")
flags.DEFINE_integer("K", 4096, "support size for the speed part")
flags.DEFINE_list("batches", ["1", "8", "64"], "batch sizes")
flags.DEFINE_integer("highs_positions", 3, "positions HiGHS solves (per-position time = median)")
flags.DEFINE_integer("sub_vocab", 8192, "V' of the tractability part's full problem")
flags.DEFINE_list("kinds", ["lp", "qp"], "solvers timed in the speed part (HiGHS solves the LP)")
flags.DEFINE_float("tol", bn.DEFAULT_TOL, "brf's certified relative objective tolerance")
flags.DEFINE_string("lsq_text", "Who's there?\nNay, answer me: stand, and unfold yourself.",
                    "lsq part: the text whose positions are solved")
# lsq part: the two members' prefixes (configs/validate.py's HAMLET_PREFIX, SECOND_PREFIX).
flags.DEFINE_string("lsq_prefix_1", "The following is the text of Hamlet, a tragedy by "
                    "William Shakespeare.\n\n", "lsq part: the first member's prefix")
flags.DEFINE_string("lsq_prefix_2", "Here is a passage of text.\n\n",
                    "lsq part: the second member's prefix")
flags.DEFINE_integer("lsq_top_k", 512, "lsq part: support of 2 x top_k tokens (brf.fuse's rule)")


def smollm2_unembedding():
    from brf.checkpoints import registry
    m = registry.load("smollm2-135m-instruct", progress=False)
    return np.asarray(m.params["embed" if m.cfg.tie_embeddings else "lm_head"], np.float32)


def member_dists(W, B, rng, drift=None):
    """p_hat for B positions; with ``drift``, consecutive positions' hidden states drift slowly."""
    V, d = W.shape
    if drift is None:
        h = W[rng.integers(0, V, B)] * 1.5 + 0.2 * rng.standard_normal((B, d))
    else:
        h0 = W[rng.integers(0, V)] * 1.5
        steps = np.cumsum(drift * rng.standard_normal((B, d)), 0)
        h = h0 + steps
    x = h @ W.T
    ph = np.exp(x - x.max(1, keepdims=True))
    ph /= ph.sum(1, keepdims=True)
    return 0.9 * ph + 0.1 / V


def highs(WS, b, c):
    t = time.perf_counter()
    A = np.vstack([WS.T.astype(np.float64), np.ones(WS.shape[0])])
    r = linprog(c, A_eq=A, b_eq=np.append(b, 1.0), bounds=(0, None), method="highs")
    dt = time.perf_counter() - t
    if r.status != 0:
        return None, dt
    return r.x, dt


def rel_res(p, WS, b):
    return float(np.linalg.norm(p @ WS.astype(np.float64) - b) / np.linalg.norm(b))


def support_problem(W, ph, K):
    """Top-K support by p_hat (shared by the batch: union over positions' top tokens)."""
    score = ph.max(0)
    S = np.sort(np.argsort(-score)[:K])
    return S


def part_speed(W, rng, rows):
    K = FLAGS.K
    Bmax = max(int(b) for b in FLAGS.batches)
    ph = member_dists(W, Bmax, rng)
    S = support_problem(W, ph, K)
    Wf = jnp.asarray(W)
    WS = W[S]
    basis = bn.truncate(bn.constraint_basis(jnp.asarray(WS), jnp.asarray(S)))
    # The support basis indexes the rows of the full W (b uses the full p_hat).
    b_full = ph @ W.astype(np.float64)
    c_all = -np.log(ph[:, S])
    print(f"# speed: V={W.shape[0]}, K={K}, rank {int(basis.rank)}", flush=True)
    ref_x, ref_t = [], []
    for i in range(FLAGS.highs_positions):
        x, dt = highs(WS, b_full[i], c_all[i])
        ref_x.append(x)
        ref_t.append(dt)
        print(f"  HiGHS position {i}: {dt:.2f} s, status {'ok' if x is not None else 'failed'}",
              flush=True)
    t_highs = float(np.median(ref_t))
    for kind in FLAGS.kinds:
        for B in (int(b) for b in FLAGS.batches):
            args = (basis, Wf, (W.shape[1],), ph[:B, None], np.ones((B, 1)))

            def call():
                return bn.solve(kind, *args, tol=FLAGS.tol)[0]
            t = time_call(call, repeats=1 if B > 8 else 3, warmup=1)
            sol = call()
            gaps, ress = [], []
            for i in range(min(B, FLAGS.highs_positions)):
                if ref_x[i] is None:
                    continue
                p = np.asarray(sol.p_K[i], np.float64)
                fo, fr = p @ c_all[i], ref_x[i] @ c_all[i]
                gaps.append(abs(fo - fr) / abs(fr))
                ress.append(rel_res(p, WS, b_full[i]))
            # The QP's objective differs from the LP's: no HiGHS column for it.
            gap = f"{max(gaps):.1e}" if gaps and kind == "lp" else ""
            rows.append(["speed", f"{kind.upper()} K={K}", B, t / B, t_highs,
                         t_highs / (t / B), int(np.max(sol.iters)), bool(np.all(sol.converged)),
                         f"{float(np.max(sol.gap)):.1e}", gap,
                         f"{max(ress):.1e}" if ress else ""])
            print(rows[-1], flush=True)


def part_bound(W, rows):
    V, d = W.shape
    bw = memory_bandwidth(1 << 27, 5)
    E = jnp.asarray(np.linalg.qr(W[:, :])[0].T)  # r x V with orthonormal rows (r = d)
    print(f"# bound: V={V}, r={E.shape[0]}, jnp.sum bandwidth {bw / 1e9:.1f} GB/s", flush=True)
    ET = jnp.asarray(np.asarray(E).T.copy())
    naive = jax.jit(lambda E, X, Y: (E @ X, E.T @ Y))   # one layout, transposed product
    kept = jax.jit(lambda E, ET, X, Y: (E @ X, ET @ Y))  # both layouts (what brf does)
    for B in (int(b) for b in FLAGS.batches):
        X = jnp.ones((V, B), jnp.float32) / V
        Y = jnp.ones((E.shape[0], B), jnp.float32)
        floor = 2 * E.size * 4 / bw
        for name, call in (("E x, E^T y (one layout)", lambda: naive(E, X, Y)),
                           ("E x, ET y (both layouts)", lambda: kept(E, ET, X, Y))):
            t = time_call(call, repeats=5, warmup=1)
            rows.append(["bound", name, B, t / B, floor / B, floor / t, "", "", "", "", ""])
            print(rows[-1], flush=True)


def part_tractability(W, rng, out):
    Vp = FLAGS.sub_vocab
    idx = np.sort(rng.choice(W.shape[0], Vp, replace=False))
    Wv = W[idx]
    B = 8
    ph = member_dists(Wv, B, rng, drift=0.05)
    b = ph @ Wv.astype(np.float64)
    c = -np.log(ph)
    Wf = jnp.asarray(Wv)
    full = bn.truncate(bn.constraint_basis(Wf, jnp.arange(Vp)))
    ref = [highs(Wv, b[i], c[i])[0] for i in range(B)]
    fref = np.array([ref[i] @ c[i] for i in range(B)])
    print(f"# tractability: V'={Vp}, full rank {int(full.rank)}", flush=True)
    rows = []

    def report(name, P, iters, converged, t):
        P = np.asarray(P, np.float64)
        obj = np.array([P[i] @ c[i] for i in range(B)])
        tv = 0.5 * np.abs(P - np.stack(ref)).sum(1)
        res = [rel_res(P[i], Wv, b[i]) for i in range(B)]
        rows.append([name, t / B, f"{np.max(np.abs(obj - fref) / np.abs(fref)):.1e}",
                     f"{np.max(tv):.1e}", f"{np.max(res):.1e}", int(np.mean(iters)),
                     bool(np.all(converged))])
        print(rows[-1], flush=True)

    args = (Wf, (Wv.shape[1],), ph[:, None], np.ones((B, 1)))
    t0 = time.perf_counter()
    sol = jax.block_until_ready(bn.solve("lp", full, *args, tol=FLAGS.tol)[0])
    report("full problem (cold)", sol.p_K, sol.iters, sol.converged, time.perf_counter() - t0)
    # (a) top-K support, shared by the batch.
    for K in (1024, 2048, 4096):
        if K >= Vp:
            continue
        S = support_problem(Wv, ph, K)
        basis = bn.truncate(bn.constraint_basis(Wf[S], jnp.asarray(S)))
        t0 = time.perf_counter()
        sol = jax.block_until_ready(bn.solve("lp", basis, *args, tol=FLAGS.tol)[0])
        dt = time.perf_counter() - t0
        P = np.zeros((B, Vp))
        P[:, S] = np.asarray(sol.p_K)
        report(f"top-K support K={K}", P, sol.iters, sol.converged, dt)
    # (b) reduced basis: drop singular directions below rank_rtol * sigma_max.
    for rt in (1e-2, 3e-2, 1e-1):
        basis = bn.truncate(bn.constraint_basis(Wf, jnp.arange(Vp), rank_rtol=rt))
        t0 = time.perf_counter()
        sol = jax.block_until_ready(bn.solve("lp", basis, *args, tol=FLAGS.tol)[0])
        report(f"reduced basis rtol={rt:g} (r={int(basis.rank)})", sol.p_K, sol.iters,
               sol.converged, time.perf_counter() - t0)
    # (c) warm starts: position t starts from position t-1's answer (sequential).
    t0 = time.perf_counter()
    P, its, conv = [], [], []
    prev = None
    for i in range(B):
        x0 = None if prev is None else prev[None]
        s = bn.solve("lp", full, Wf, (Wv.shape[1],), ph[i:i + 1, None], np.ones((1, 1)),
                     tol=FLAGS.tol, x0_BxK=x0)[0]
        prev = s.p_K[0]
        P.append(np.asarray(prev))
        its.append(int(s.iters[0]))
        conv.append(bool(s.converged[0]))
    dt = time.perf_counter() - t0
    report("warm start from previous position (B=1 x 8)", np.stack(P), its, conv, dt)
    t0 = time.perf_counter()
    P, its, conv = [], [], []
    for i in range(B):
        s = bn.solve("lp", full, Wf, (Wv.shape[1],), ph[i:i + 1, None], np.ones((1, 1)),
                     tol=FLAGS.tol)[0]
        P.append(np.asarray(s.p_K[0]))
        its.append(int(s.iters[0]))
        conv.append(bool(s.converged[0]))
    dt = time.perf_counter() - t0
    report("cold start, same positions (B=1 x 8)", np.stack(P), its, conv, dt)
    out.append(markdown_table(
        ["variant", "s / position", "max rel objective diff vs HiGHS full",
         "max TV vs HiGHS full", "max rel constraint residual (full V')", "mean iters",
         "converged"], rows))


@functools.partial(jax.jit, static_argnames=("dims", "max_iters", "check_every"))
def lsq_before_issue_37(W_KxM, b_M, weights_n, *, dims, lipschitz, p0_K, tol,
                        max_iters=20000, check_every=20):
    """brf's least-squares solver before issue 37 (commit 536356a), the baseline:
    FISTA with gradient restart, step 1 / (2 lipschitz) with ``_solve_one``'s bound
    ``max_i w_i sigma_max(A~)^2``, stopping on the Frank–Wolfe gap at p alone.
    Returns (p, objective, Frank–Wolfe gap, iterations, converged)."""
    with jax.enable_x64(True):
        m = sum(dims)
        W = W_KxM.astype(jnp.float64)
        b = b_M.astype(jnp.float64)[:m]
        wrow = jnp.concatenate([jnp.full((d,), weights_n[i], jnp.float64)
                                for i, d in enumerate(dims)])
        Wd = W * wrow[None, :]
        H, q, const = Wd @ W.T, Wd @ b, jnp.sum(wrow * b * b)
        step = 1.0 / (2.0 * lipschitz)
        floor = bn.OBJECTIVE_FLOOR * const

        def certificate(p):
            Hp = H @ p
            f = jnp.maximum(p @ Hp - 2.0 * q @ p + const, 0.0)
            g = 2.0 * (Hp - q)
            return f, g @ p - jnp.min(g)

        def fista(_, s):
            p, y, t = s
            pn = bn.project_simplex(y - step * 2.0 * (H @ y - q))
            tn = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
            restart = jnp.dot(y - pn, pn - p) > 0
            tn = jnp.where(restart, 1.0, tn)
            yn = jnp.where(restart, pn, pn + ((t - 1.0) / tn) * (pn - p))
            return pn, yn, tn

        def body(state):
            p, y, t, it, _ = state
            p, y, t = jax.lax.fori_loop(0, check_every, fista, (p, y, t))
            f, G = certificate(p)
            return p, y, t, it + check_every, G <= jnp.maximum(tol * (f - G), floor)

        p0 = bn.project_simplex(p0_K.astype(jnp.float64))
        f0, G0 = certificate(p0)
        init = (p0, p0, jnp.ones((), jnp.float64), jnp.zeros((), jnp.int32),
                G0 <= jnp.maximum(tol * (f0 - G0), floor))
        p, _, _, it, ok = jax.lax.while_loop(
            lambda s: (s[3] < max_iters) & ~s[4], body, init)
        f, G = certificate(p)
        return p, f, G, it, ok


def two_prefix_logits(text, prefixes):
    """SmolLM2's logits at every position of ``text`` after BOS + each prefix:
    [positions, 2, V] (the distribution of the token after each text token)."""
    from brf.checkpoints import registry
    from brf.models.transformer import forward
    m = registry.load("smollm2-135m-instruct", progress=False)
    bos = [m.cfg.bos_id] if m.cfg.bos_id is not None else []
    x = encode_text(m.tokenizer, text)
    out = []
    for pre in prefixes:
        p = encode_text(m.tokenizer, pre) if pre else []
        ids = bos + p + x
        logits, _ = forward(m.params, m.cfg, np.asarray(ids, np.int32)[None])
        out.append(np.asarray(logits[0, len(bos) + len(p):len(ids)], np.float32))
    return np.stack(out, 1)


def lsq_reference(WS, b, w):
    """scipy NNLS on the simplex (a heavy sum row) and the float64 minimum of f over
    the affine hull sum p = 1 (a lower bound on the simplex's optimum; equal to it
    where the members' common image is met on the simplex)."""
    A = np.vstack([np.sqrt(w[i]) * WS.T for i in range(len(w))])
    y = np.concatenate([np.sqrt(w[i]) * b[i] for i in range(len(w))])
    big = 1e3 * np.linalg.norm(A, 2)
    x = nnls(np.vstack([A, big * np.ones(A.shape[1])]), np.append(y, big),
             maxiter=50 * A.shape[1])[0]
    x /= x.sum()
    f_nnls = float(np.sum((A @ x - y) ** 2))
    K = A.shape[1]
    N = np.linalg.svd(np.ones((1, K)))[2][1:].T  # an orthonormal basis of sum d = 0
    c = np.linalg.lstsq(A @ N, y - A.sum(1) / K, rcond=None)[0]
    f_hull = float(np.sum((A @ (np.full(K, 1.0 / K) + N @ c) - y) ** 2))
    return f_nnls, f_hull


def part_lsq(W, out):
    lg = two_prefix_logits(FLAGS.lsq_text, (FLAGS.lsq_prefix_1, FLAGS.lsq_prefix_2))
    P, K = lg.shape[0], 2 * FLAGS.lsq_top_k
    w = np.array([0.5, 0.5])
    Wf, dims = bn.stack_unembeddings([W, W])
    print(f"# lsq: {P} positions, support K={K}, tol {FLAGS.tol:g}", flush=True)
    rows, before_t, after_t = [], [], []
    for i in range(-1, P):  # -1: position 0 once more first, to compile both solvers
        j = max(i, 0)
        with jax.enable_x64(True):
            logp = jax.nn.log_softmax(jnp.asarray(lg[j]), -1)  # float32, as brf.fuse
            S = jax.lax.top_k(jnp.max(logp, 0), K)[1]
            basis = jax.block_until_ready(bn.constraint_basis(Wf[S], S))
            ph = np.exp(np.asarray(jax.nn.log_softmax(jnp.asarray(lg[j], jnp.float64), -1)))
            b = bn.rhs(basis, Wf, jnp.asarray(ph), dims)
            x0 = w @ ph[:, np.asarray(S)]
            lip = np.max(w) * float(basis.sigma_q[0]) ** 2
            t0 = time.perf_counter()
            old = jax.block_until_ready(lsq_before_issue_37(
                Wf[S], b, jnp.asarray(w), dims=dims, lipschitz=lip,
                p0_K=jnp.asarray(x0 / x0.sum()), tol=FLAGS.tol))
            t_old = time.perf_counter() - t0
            t0 = time.perf_counter()
            new = jax.block_until_ready(bn.solve("lsq", basis, Wf, dims, ph[None], w[None],
                                                 tol=FLAGS.tol)[0])
            t_new = time.perf_counter() - t0
        if i < 0:
            continue
        WS = W[np.asarray(S)].astype(np.float64)
        f_nnls, f_hull = lsq_reference(WS, ph @ W.astype(np.float64), w)
        f_new = float(new.objective[0])
        p_new = np.asarray(new.p_K[0], np.float64)
        f_new64 = sum(w[k] * np.sum((WS.T @ p_new - ph[k] @ W.astype(np.float64)) ** 2)
                      for k in range(2))
        before_t.append(t_old)
        after_t.append(t_new)
        rows.append([j, int(old[3]), bool(old[4]), f"{t_old:.2f}",
                     int(new.iters[0]), bool(new.converged[0]), f"{float(new.gap[0]):.1e}",
                     f"{t_new:.2f}", f"{f_new:.6e}", f"{(f_new64 - f_nnls) / f_nnls:+.1e}",
                     f"{(f_nnls - f_hull) / f_nnls:.1e}"])
        print(rows[-1], flush=True)
    out.append(markdown_table(
        ["position", "before: iters", "before: converged", "before: s", "after: iters",
         "after: converged", "after: certified gap", "after: s", "objective",
         "(f - f_NNLS) / f_NNLS", "(f_NNLS - f_hull) / f_NNLS"], rows))
    out.append(f"before: {sum(r[2] for r in rows)} of {P} converged, "
               f"{sum(before_t):.1f} s in all; after: {sum(r[5] for r in rows)} of {P}, "
               f"{sum(after_t):.1f} s in all (solver only; the basis SVD aside)")


def main(argv):
    del argv
    if FLAGS.quick:
        FLAGS.K, FLAGS.batches, FLAGS.highs_positions, FLAGS.sub_vocab = 700, ["1", "8"], 1, 1024
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}; "
          f"load average {os.getloadavg()[0]:.1f} at start", flush=True)
    W = smollm2_unembedding()
    rng = np.random.default_rng(0)
    rows, tables = [], []
    if "speed" in FLAGS.parts:
        part_speed(W, rng, rows)
    if "bound" in FLAGS.parts:
        part_bound(W, rows)
    if rows:
        tables.append(markdown_table(
            ["part", "problem", "batch", "brf s / position", "HiGHS s / position (or floor)",
             "speedup (or x floor)", "max iters", "converged", "max certified gap",
             "rel objective gap vs HiGHS",
             "rel constraint residual"], rows))
    if "tractability" in FLAGS.parts:
        part_tractability(W, rng, tables)
    if "lsq" in FLAGS.parts:
        part_lsq(W, tables)
    print(f"# load average {os.getloadavg()[0]:.1f} at end")
    for t in tables:
        print(t)
        print()


if __name__ == "__main__":
    cli.run(main)
