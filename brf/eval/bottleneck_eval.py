"""Softmax-bottleneck fusion in the study: one model under two prompts.

The bottleneck methods (``brf.fusion.bottleneck``) need each member's full
next-token distribution and its unembedding, which the stored summaries (top-k
per position) do not keep. For the prompt ensemble of one model (a shared
vocabulary and ``W_1 = W_2``: the *infeasible* regime unless the two prompts
agree), this module recomputes both members' full logits at a sample of test
positions and scores every bottleneck method next to the linear and log-linear
pools on exactly those positions, reporting each method's regime counts and
how often it fell back to the linear pool.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from tqdm.auto import tqdm

from brf.align.vocab import encode_text
from brf.eval import hypotheses
from brf.eval.fitting import NLL_CAP
from brf.fusion import bottleneck, fuse
from brf.models import iter_logits_chunks

METHODS = ("bottleneck_lsq", "bottleneck_lp", "bottleneck_qp", "bottleneck_maxent")
CONSTRAINED = ("bottleneck_lp", "bottleneck_qp", "bottleneck_maxent")  # need a support above the rank
REGIME_NAMES = ("unique", "infeasible", "underdetermined")


def _rows_logits(model, ids: np.ndarray, rows: np.ndarray, chunk: int) -> np.ndarray:
    """Full next-token logits [len(rows), V] of one sequence at the given rows."""
    n = len(ids)
    pad = -(-n // chunk) * chunk
    tokens = np.zeros((1, pad), np.int32)
    tokens[0, :n] = ids
    valid = np.arange(pad)[None] < n
    out = np.zeros((len(rows), model.cfg.vocab_size), np.float32)
    for start, logits in iter_logits_chunks(model.params, model.cfg, tokens, valid, chunk=chunk):
        sel = (rows >= start) & (rows < start + logits.shape[1])
        if sel.any():
            out[sel] = np.asarray(logits[0, rows[sel] - start])
    return out


def full_logits(model, label: str, prefixes: tuple[str, str], segments: list[str],
                test_segments: list[int], n_positions: int):
    """Both members' full next-token logits at positions sampled evenly over the test split.

    Returns:
        (logits [P, 2, V] float32, gold token ids [P]).
    """
    tok, cfg = model.tokenizer, model.cfg
    bos = [cfg.bos_id] if cfg.bos_id is not None else []
    seg_ids = [encode_text(tok, segments[s]) for s in test_segments]
    total = sum(max(len(x) - 1, 0) for x in seg_ids)
    picks = set(np.linspace(0, total - 1, min(n_positions, total)).astype(int).tolist())
    logits, gold, k = [[], []], [], 0
    for x in tqdm(seg_ids, desc=f"bottleneck rows: full logits ({label})", unit="segment",
                  dynamic_ncols=True):
        local = [r for r in range(len(x) - 1) if k + r in picks]
        k += max(len(x) - 1, 0)
        if not local:
            continue
        gold += [x[r + 1] for r in local]
        for i, pre in enumerate(prefixes):
            p = encode_text(tok, pre) if pre else []
            ids = np.asarray(bos + p + x, np.int32)
            rows = np.asarray(local) + len(bos) + len(p)
            logits[i].append(_rows_logits(model, ids, rows, 256))
    return np.stack([np.concatenate(l) for l in logits], axis=1), np.asarray(gold)


def unembedding(model) -> jnp.ndarray:
    """The model's output head as [V, d] float32."""
    cfg = model.cfg
    W = model.params["embed"] if cfg.tie_embeddings else model.params["lm_head"]
    W = jnp.asarray(W, jnp.float32)
    return W if W.shape[0] == cfg.vocab_size else W.T


def skipped(top_k: int, d: int, vocab_size: int) -> dict[str, str]:
    """The constrained methods that cannot converge on a 2 x top_k support, with the reason.

    One model under two prompts has constraints of rank at most d + 1
    (``bottleneck.rank_bound``). On a support no larger than that they pin at
    most one distribution, ``E^T h``, which real next-token distributions (no zero
    tail to leave out) put outside the simplex: the LP, QP and min-KL would only
    report the linear pool. Least squares needs no such support.
    """
    K = min(vocab_size, 2 * top_k) if top_k > 0 else vocab_size
    bound = bottleneck.rank_bound([d, d], shared=True)
    if K > bound:
        return {}
    why = (f"not solved: the support (2 x top {top_k} = {K} tokens) is not above the "
           f"constraints' rank (at most d + 1 = {bound}), where they admit at most one "
           "distribution and real ones put it outside the simplex; raise bottleneck_top_k "
           f"above {bound // 2} to solve it")
    return {m: why for m in CONSTRAINED}


def bottleneck_rows(model, label: str, prefixes: tuple[str, str], segments: list[str],
                    test_segments: list[int], *, n_positions: int = 64, top_k: int = 512,
                    batch: int = 16, n_boot: int = 1000, seed: int = 0) -> dict:
    """Every bottleneck method vs the linear and log-linear pools on sampled positions.

    The LP, QP and min-KL rows are left out, with the reason, when the support
    is not above the constraints' rank (:func:`skipped`): there they cannot
    converge, and iterating to the budget would only spend minutes on the
    linear pool.

    Args:
        model: the one model (``registry.load``: cfg, params, tokenizer).
        label: the model's name, for the report.
        prefixes: the two members' prefixes (conditioning texts).
        segments: the corpus segments.
        test_segments: indices of the test split's segments.
        n_positions: positions sampled, evenly over the test segments' tokens.
        top_k: the bottleneck methods' support (top_k * 2 tokens).
        batch: positions per fused call.
        n_boot, seed: bootstrap of the mean NLL.

    Returns:
        {"members", "positions", "top_k", "support", "rank_bound", "rows":
         [{"method", "nll", "nll_ci", "fallback_fraction", "regimes": {name: count},
           "statuses": {name: count}, "difference_to_linear": {"mean_difference",
           "ci", ...}} or {"method", "skipped": reason}]}
    """
    logits, gold = full_logits(model, label, prefixes, segments, test_segments, n_positions)
    logits_PxnxV = jnp.asarray(logits)
    W = unembedding(model)
    V, d = W.shape
    skip = skipped(top_k, d, V)
    w = jnp.asarray([0.5, 0.5], jnp.float32)
    P = len(gold)
    nll, info, floored = {}, {}, {}
    for method in ("linear", "loglinear") + METHODS:
        if method in skip:
            continue
        parts, infos = [], []
        for a in tqdm(range(0, P, batch), desc=f"bottleneck rows: {method}", unit="batch",
                      dynamic_ncols=True, leave=False):
            params = ({} if not method.startswith("bottleneck") else
                      {"unembeddings": [W, W], "top_k": top_k})
            lq, inf = fuse(method, logits_PxnxV[a:a + batch], w, return_info=True, **params)
            parts.append(-np.asarray(lq)[np.arange(lq.shape[0]), gold[a:a + batch]])
            infos.append({k2: np.asarray(v) for k2, v in inf.items()})
        x = np.concatenate(parts).astype(np.float64)
        floored[method] = int(np.sum(~(x <= NLL_CAP)))  # gold outside the support: q = 0
        nll[method] = np.where(x <= NLL_CAP, x, NLL_CAP)
        info[method] = {k2: np.concatenate([i[k2] for i in infos]) for k2 in infos[0]}
    out = {"members": [f"{label} + prefix {i + 1}" for i in range(2)], "prefixes": list(prefixes),
           "positions": int(P), "top_k": top_k, "support": min(V, 2 * top_k) if top_k else V,
           "rank_bound": bottleneck.rank_bound([d, d], shared=True), "rows": []}
    for method in ("linear", "loglinear") + METHODS:
        if method in skip:
            out["rows"].append({"method": method, "skipped": skip[method]})
            continue
        x = nll[method]
        mean, ci = hypotheses.mean_ci(x, n_boot=n_boot, block=8, seed=seed)
        row = {"method": method, "nll": mean, "nll_ci": ci, "floored_positions": floored[method],
               "fallback_fraction": float(np.mean(info[method]["fallback"]))}
        if "regime" in info[method]:
            r, st = info[method]["regime"], info[method]["status"]
            row["regimes"] = {name: int(np.sum(r == c)) for c, name in enumerate(REGIME_NAMES)}
            row["statuses"] = {name: int(np.sum(st == c))
                               for c, name in enumerate(bottleneck.STATUSES)}
            row["converged_fraction"] = float(np.mean(info[method]["converged"]))
        if method != "linear":
            row["difference_to_linear"] = hypotheses.nll_difference(
                x, nll["linear"], n_boot=n_boot, block=8, seed=seed)
        out["rows"].append(row)
    return out
