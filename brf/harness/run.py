"""What experiments/harness.py runs: one brf ensemble, several variants (each member
alone, pools, BRF), each through ``lm_eval.simple_evaluate`` on the same tasks; the
harness's own results JSON per variant, a table of them all with intervals, and
BRF paired per document against the better pool.

Imports lm_eval (the ``harness`` extra) when :func:`run` is called, not before.
"""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

from brf.harness.ensemble import HarnessInputError

MEMBERS = "members"  # the variant 'every member alone'
STUDY = "study"      # the variant 'the study's calibrated row of a corpus'
POOLS = ("linear", "loglinear")  # what BRF is compared with, paired per document
CONFIDENCE = 0.95
N_BOOT = 2000


def variants(spec: str, n_members: int, study_dir: str = "results/study"
             ) -> list[tuple[str, list[int], str, dict]]:
    """(label, member indices, method spec, extra model args) of each variant in
    ``config.variants``: a comma-separated list of method specs (brf.specs),
    ``members`` for each member alone, ``study(corpus=<name>)`` for the calibrated BRF
    row the study in ``study_dir`` fitted on that corpus's bytes (`brf.harness.calibrated`)."""
    from brf.harness.calibrated import study_row
    from brf.specs import format_spec, parse_list
    out = []
    for name, params in parse_list(spec, "variant"):
        if name == MEMBERS:
            if params:
                raise HarnessInputError("variant 'members' takes no parameters")
            out += [(f"member {j}", [j], "linear", {}) for j in range(n_members)]
        elif name == STUDY:
            if set(params) != {"corpus"}:
                raise HarnessInputError("variant 'study' takes corpus=<a corpus of the study> "
                                        f"only; got {sorted(params) or 'nothing'}")
            where = f"{study_dir}:{params['corpus']}"
            row = study_row(where)
            out.append((f"{row.label} ({row.corpus})", list(range(n_members)), row.method,
                        {"study": where}))
        else:
            method = format_spec(name, params)
            out.append((method, list(range(n_members)), method, {}))
    if not out:
        raise HarnessInputError("config.variants names no variant")
    return out


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of a proportion k / n."""
    from statistics import NormalDist
    if n == 0:
        return (0.0, 1.0)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, mid - half), min(1.0, mid + half))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b and c are the discordant pairs (only the first
    right, only the second right); under no difference each is Binomial(b + c, 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def paired(a: Sequence[float], b: Sequence[float], *, seed: int = 0, n_boot: int = N_BOOT,
           confidence: float = CONFIDENCE) -> dict:
    """Two variants' per-document scores (0/1, the same documents in the same order):
    the mean difference a - b, its paired bootstrap interval (documents resampled), and
    the exact McNemar p-value."""
    import numpy as np
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if x.shape != y.shape or x.ndim != 1 or not len(x):
        raise ValueError(f"paired scores of the same documents; got {x.shape} and {y.shape}")
    d = x - y
    idx = np.random.default_rng(seed).integers(0, len(d), (n_boot, len(d)))
    boot = d[idx].mean(axis=1)
    lo, hi = np.quantile(boot, [(1 - confidence) / 2, (1 + confidence) / 2])
    return dict(n=len(d), difference=float(d.mean()), ci=[float(lo), float(hi)],
                only_a=int(((x > y)).sum()), only_b=int((y > x).sum()),
                p_value=mcnemar_exact(int((x > y).sum()), int((y > x).sum())))


def per_document(res: dict) -> dict:
    """{task: {metric: [per-document value, by doc_id]}} from a results dict with
    samples (0/1 metrics: acc, acc_norm, exact_match)."""
    out: dict = {}
    for task, samples in (res.get("samples") or {}).items():
        rows = sorted(samples, key=lambda s: s["doc_id"])
        for metric in ("acc", "acc_norm", "exact_match"):
            if rows and all(isinstance(s.get(metric), (int, float)) for s in rows):
                out.setdefault(task, {})[metric] = [float(s[metric]) for s in rows]
    return out


def compare(rows: Sequence[dict], seed: int = 0) -> list[dict]:
    """Each BRF variant (``born``, ``study``) against the better pool (linear or
    log-linear, the higher mean on the same documents: the choice favours the pool),
    per task and metric, paired per document (:func:`paired`), with a verdict."""
    pools = [r for r in rows if r["method"].split("(")[0] in POOLS and len(r["members"]) > 1
             and not r.get("study")]
    brfs = [r for r in rows if r["method"].split("(")[0] == "born" or r.get("study")]
    out = []
    for brf in brfs:
        for task, metrics in brf["docs"].items():
            for metric, values in metrics.items():
                cands = [p for p in pools if metric in p["docs"].get(task, {})]
                if not cands:
                    continue
                pool = max(cands, key=lambda p: sum(p["docs"][task][metric]))
                st = paired(values, pool["docs"][task][metric], seed=seed)
                lo, hi = st["ci"]
                called = st["p_value"] < 1 - CONFIDENCE and (lo > 0 or hi < 0)
                verdict = ("not distinguishable" if not called else
                           "BRF higher" if st["difference"] > 0 else "the pool higher")
                out.append(dict(task=task, metric=metric, brf=brf["variant"],
                                pool=pool["variant"], verdict=verdict, **st))
    return out


def _metrics(task_result: dict) -> list[tuple[str, float, float | None]]:
    """(metric, value, standard error) of one task's results, as the harness keys them."""
    out = []
    for key, value in task_result.items():
        if ("_stderr" in key or key == "sample_len" or not isinstance(value, (int, float))
                or isinstance(value, bool)):
            continue
        metric, _, filt = key.partition(",")
        err = task_result.get(f"{metric}_stderr,{filt}")
        out.append((key if filt not in ("none", "") else metric, float(value),
                    float(err) if isinstance(err, (int, float)) else None))
    return out


def table(rows: Sequence[dict], comparisons: Sequence[dict] = ()) -> str:
    """A Markdown table: one line per variant and task metric, value ± standard error
    (and its Wilson interval where per-document scores were kept); then the paired
    comparisons (:func:`compare`)."""
    lines = ["| variant | task | metric | value | stderr | 95% interval |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        for task, metrics in r["tasks"].items():
            for metric, value, err in metrics:
                shown = "-" if err is None or math.isnan(err) else f"{err:.4f}"
                docs = r.get("docs", {}).get(task, {}).get(metric)
                ci = ("-" if not docs else "[{:.3f}, {:.3f}]".format(
                    *wilson(int(round(sum(docs))), len(docs))))
                lines.append(f"| {r['variant']} | {task} | {metric} | {value:.4f} | {shown} "
                             f"| {ci} |")
    lost = [r for r in rows if r.get("bytes")]
    if lost:
        lines += ["", "Byte level: the pruned log-mass per member (nats; a log-likelihood lies "
                      "at most this far below the exact one):", ""]
        for r in lost:
            b = r["bytes"]
            lines.append(f"- {r['variant']}: {b['requests']} requests, largest "
                         + ", ".join(f"{x:.3g}" for x in b["lost_max"]) + "; mean "
                         + ", ".join(f"{x:.3g}" for x in b["lost_mean"]))
    if comparisons:
        lines += ["", "BRF against the better pool on the same documents (paired: the "
                      "difference's 95% bootstrap interval over documents, the exact McNemar "
                      "p-value; a difference is called where p < 0.05 and the interval "
                      "excludes 0; the better pool is chosen on these documents, which "
                      "favours it):", "",
                  "| task | metric | BRF | pool | n | difference | 95% interval | only BRF "
                  "right | only pool right | p | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in comparisons:
            lines.append(f"| {c['task']} | {c['metric']} | {c['brf']} | {c['pool']} | {c['n']} "
                         f"| {c['difference']:+.3f} | [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] "
                         f"| {c['only_a']} | {c['only_b']} | {c['p_value']:.3g} "
                         f"| {c['verdict']} |")
    return "\n".join(lines) + "\n"


def check_tasks(tasks: Sequence[str], include_path: str):
    """The task manager, with every task known and loadable (offline too).

    Raises:
        HarnessInputError: an unknown task, or one whose data cannot be loaded.
    """
    from lm_eval.tasks import TaskManager, get_task_dict
    if include_path and not os.path.isdir(include_path):
        raise HarnessInputError(f"config.include_path {include_path!r} is not a directory")
    tm = TaskManager(include_path=include_path or None)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise HarnessInputError(f"unknown task(s) {unknown}; see `lm-eval ls tasks` (shipped "
                                "offline: brf_hamlet_next_line, brf_python_next_line with "
                                "include_path=tasks)")
    try:
        get_task_dict(list(tasks), tm)
    except Exception as e:  # noqa: BLE001 -- datasets raises many kinds; all mean the same
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise HarnessInputError(f"task(s) {list(tasks)} cannot be loaded (offline, the "
                                f"dataset must be on this machine): {type(e).__name__}: "
                                f"{first}") from None
    return tm


def run(c) -> list[dict]:
    """Runs every variant of config ``c`` (configs/harness.py) on its tasks; writes
    ``<output>/<variant>.json`` (the harness's results), ``<output>/table.md`` and
    ``<output>/comparisons.json`` (:func:`compare`) and ``<output>/documents.json`` (each
    variant's per-document scores, what the comparisons read).

    Returns:
        Per variant: {'variant', 'method', 'members', 'study', 'tasks': {task: [(metric,
        value, stderr)]}, 'docs': {task: {metric: per-document scores}}, 'bytes'}.
    """
    import lm_eval
    from lm_eval.utils import handle_non_serializable

    from brf.ensemble.run import check_fusable, load_members
    from brf.harness.lm import BRFLM, ModelArgs, byte_summary
    tasks = [t for t in c.tasks]
    base = dict(level=c.level, precision=c.precision, batch_size=c.batch_size,
                max_gen_toks=c.max_gen_toks, seed=c.seed, dtype=c.dtype,
                speculative=c.get("speculative", ""))
    if c.max_length:
        base["max_length"] = c.max_length
    ModelArgs.parse(dict(base, members=c.members, phase=c.phase))  # before any model loads
    from brf.specs import parse_list
    plan = variants(c.variants, len(parse_list(c.members, "member")),
                    c.get("study", "results/study"))
    for _, _, method, extra in plan:
        ModelArgs.parse(dict(base, members=c.members, **(
            extra or dict(method=method, phase=c.phase))))
    tm = check_tasks(tasks, c.include_path)
    os.makedirs(c.output, exist_ok=True)
    check_fusable(c.members, level="bytes" if c.level == "bytes" else "tokens")
    members = load_members(c.members)  # after the check: nothing converts to be refused
    from brf.ensemble.member import same_vocabulary
    level = c.level
    if level == "auto":  # each member alone on the ensemble's level: comparable, and on
        # bytes its scores are the ones the fused variants read back (the cache)
        level = "tokens" if all(same_vocabulary(members[0], m) for m in members) else "bytes"
    base["level"] = level
    rows, cache = [], {}  # one member's byte scores serve every variant
    for label, idx, method, extra in plan:
        chosen = [members[j] for j in idx]
        if len(chosen) == 1:  # a member alone: weight 1
            import dataclasses
            chosen = [dataclasses.replace(chosen[0], weight=None)]
        given = extra or dict(method=method, phase=c.phase if len(chosen) > 1 else "")
        lm = BRFLM(members=chosen, byte_cache=cache, **given, **base)
        print(f"{label}: {', '.join(m.name for m in chosen)} ({lm.level} level)")
        res = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=c.num_fewshot if c.num_fewshot >= 0 else None,
            limit=c.limit or None, task_manager=tm, log_samples=True,
            random_seed=c.seed, numpy_random_seed=c.seed, torch_random_seed=c.seed,
            fewshot_random_seed=c.seed)
        docs = per_document(res)
        if not c.log_samples:
            res.pop("samples", None)
        name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
        with open(os.path.join(c.output, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
        rows.append(dict(variant=label, method=method, members=[m.name for m in chosen],
                         study=extra.get("study", ""),
                         tasks={t: _metrics(r) for t, r in res["results"].items()},
                         docs=docs, bytes=byte_summary(lm.byte_reports)))
    comparisons = compare(rows, seed=c.seed)
    with open(os.path.join(c.output, "comparisons.json"), "w", encoding="utf-8") as f:
        json.dump(comparisons, f, indent=2)
    with open(os.path.join(c.output, "documents.json"), "w", encoding="utf-8") as f:
        json.dump({r["variant"]: r["docs"] for r in rows}, f)  # compare() can be rerun
    with open(os.path.join(c.output, "table.md"), "w", encoding="utf-8") as f:
        f.write(table(rows, comparisons))
    return rows


__all__ = ["check_tasks", "compare", "mcnemar_exact", "paired", "per_document", "run", "table",
           "variants", "wilson"]
