"""The study: the validation on several corpora, with prompts, a swarm and a sensitivity check.

What one run answers (``experiments/validate.py``; configs/validate.py):

1. **Per corpus** (``config.corpora``: texts of different kinds): the default
   pair scored teacher-forced, every method fitted on the calibration split in
   two variants (as proposed; calibrated), the Phase Coherence and Cross-Term
   Discrimination tests, the paired NLL comparison of the best BRF setting with
   the best baseline *within each variant*, and the forking-token analysis. Each
   corpus gets its own report in ``<out_dir>/<corpus>/``.
2. **Pooled** over corpora: the per-corpus differences averaged with equal
   weight per corpus, CI by a bootstrap stratified by corpus with blocks inside
   each (positions within a corpus are dependent).
3. **Prompts** (on the corpora that name a ``prefix``): the pair with that
   steadying prefix on each member, against the same pair without, on the same
   test positions: the change in phase concentration (R̄ of the phase
   differences and its excess over the permutation null), in cross-term AUROC and
   in BRF's NLL gap to the calibrated baseline, with CIs. Then one model under two
   prefixes (a same-vocabulary pair) and a **swarm** of four (each model with and
   without the prefix), every method including BRF with n = 4.
4. **Event-space sensitivity** (the first corpus): the event space built from
   each member's top-``topk_sensitivity`` strings instead of top-``top_k``: does
   any verdict move?

Every scoring is stored per member and corpus under the run directory and
reused, so an interrupted run resumes; fits are cached the same way.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Any, Callable

import numpy as np

from brf.eval import config_specs, hypotheses, pipeline, report as report_lib, runfiles, stats
from brf.eval import corpus as corpus_lib
from brf.eval.events import build_event_table
from brf.eval.scoring import truncate_top_k
from brf.specs import format_spec, parse_list

STUDY_SCHEMA = "brf.study/1"
CORPUS_KEYS = ("max_chars", "skip_chars", "prefix", "label")


def corpus_entries(cfg) -> list[dict]:
    """``config.corpora`` -> [{name, label, max_chars, skip_chars, prefix}], checked."""
    out = []
    given = (format_spec(cfg.corpus, {"max_chars": cfg.get("max_chars", 0)})
             if cfg.get("corpus") else cfg.corpora)
    for name, params in parse_list(given, "corpus"):
        bad = sorted(set(params) - set(CORPUS_KEYS))
        if bad:
            raise pipeline.ValidationError(
                f"corpus {name!r}: unknown parameter(s) {bad}; it takes {list(CORPUS_KEYS)}")
        label = params.get("label", os.path.basename(name).split(".")[0] or name)
        out.append({"name": name, "label": label,
                    "max_chars": int(params.get("max_chars", 0)),
                    "skip_chars": int(params.get("skip_chars", 0)),
                    "prefix": params.get("prefix", "")})
    if not out:
        raise pipeline.ValidationError("config.corpora names no corpus")
    labels = [c["label"] for c in out]
    if len(set(labels)) != len(labels):
        raise pipeline.ValidationError(f"config.corpora: duplicate labels {labels}; "
                                       f"give each a label=")
    return out


def _with_prefix(members: list[tuple[str, dict]], prefix: str) -> str:
    return ", ".join(format_spec(n, {**p, "prefix": prefix}) for n, p in members)


def _plain(members: list[tuple[str, dict]]) -> str:
    return ", ".join(format_spec(n, p) for n, p in members)


def check(cfg) -> list[dict]:
    """Everything that can be checked before a model runs."""
    pipeline.check_config(cfg)
    corpora = corpus_entries(cfg)
    for c in corpora:  # a corpus too short for the split fails here, not after scoring
        text, _, _ = corpus_lib.load_named(c["name"], max_chars=c["max_chars"],
                                           skip_chars=c["skip_chars"], min_chars=cfg.min_chars)
        segs = pipeline.split_segments(text, cfg.segment_chars)
        if len(segs) < 2:
            raise pipeline.ValidationError(
                f"corpus {c['label']!r}: {len(text)} characters make {len(segs)} segment(s) "
                f"of <= {cfg.segment_chars}; the calibration/test split needs at least 2")
    k2 = int(cfg.get("topk_sensitivity", 0))
    if k2 and k2 <= cfg.top_k:
        raise pipeline.ValidationError(f"topk_sensitivity ({k2}) must exceed top_k "
                                       f"({cfg.top_k}), or be 0 (off)")
    return corpora


def run_table(cfg, label: str, members: str, segments: list[str], run_dir: str,
              load_member: Callable, *, top_k: int | None = None, store_k: int | None = None,
              sweep_curves: bool = False, write: bool = True,
              variants: str | None = None) -> tuple[dict, dict]:
    """Scores ``members`` on the segments, builds the event table, analyses it
    (in ``variants``, default the config's).

    Returns:
        (report dict of this analysis, extras: coherence rows, cross-term scores,
        per-position test NLL by method, the test table).
    """
    if variants is not None and variants != cfg.get("variants"):
        import copy
        cfg = copy.deepcopy(cfg)
        cfg.variants = variants
    os.makedirs(run_dir, exist_ok=True)
    scored = pipeline.score_all(cfg, segments, run_dir, load_member, members=members,
                                top_k=store_k or cfg.top_k,
                                mesh=pipeline.member_meshes(cfg, members))
    if scored is None:  # multi-process: another process analyses
        return None, None
    infos, scores, tbs = scored
    k = top_k or cfg.top_k
    scores = [truncate_top_k(s, k) if s.topk_ids.shape[1] > k else s for s in scores]
    table, cov = build_event_table(scores, tbs, segments)
    slug = "".join(ch if ch.isalnum() else "_" for ch in label.lower()).strip("_")
    name = f"{slug}-{hashlib.sha256(members.encode()).hexdigest()[:8]}-k{k}"
    section, extras = pipeline.analyse(cfg, table, len(segments), run_dir,
                                       sweep_curves=sweep_curves,
                                       cache_name=f"fits-{name}.json")
    rep = {"analysis": label, "members": infos, "top_k": k, "coverage": cov.as_dict(),
           **section}
    rep["verdict"] = report_lib.verdicts(rep)
    if write:
        report_lib.write_json(os.path.join(run_dir, f"report-{name}.json"), rep)
        with open(os.path.join(run_dir, f"report-{name}.md"), "w") as f:
            f.write(report_lib.markdown({**rep, "corpus": {"source": label, "chars": len(
                "".join(segments)), "segments": len(segments), "sha256": hashlib.sha256(
                "".join(segments).encode()).hexdigest()}}))
        if sweep_curves:
            report_lib.plots(run_dir, rep, extras["coherence"], extras["cross_scores"])
    return rep, extras


# ----------------------------------------------------------------- comparisons

def _rbar(d: np.ndarray) -> float:
    return float(np.hypot(np.cos(d).mean(), np.sin(d).mean()))


def rbar_change(diff_a: np.ndarray, diff_b: np.ndarray, *, n_boot: int, block: int = 32,
                seed: int = 0) -> dict:
    """R̄(b) - R̄(a) for phase differences at the same positions, with a paired circular
    block-bootstrap 95% CI (positions resampled in blocks, jointly for a and b)."""
    n = len(diff_a)
    if len(diff_b) != n or n < 2:
        raise ValueError(f"rbar_change: need two equal-length arrays; got {n}, {len(diff_b)}")
    L = max(1, min(block, n // 4))
    rng = np.random.default_rng(seed)
    n_blocks = -(-n // L)
    boots = np.empty(n_boot)
    ca, sa, cb, sb = np.cos(diff_a), np.sin(diff_a), np.cos(diff_b), np.sin(diff_b)
    for b in range(n_boot):
        starts = rng.integers(0, n, n_blocks)
        idx = ((starts[:, None] + np.arange(L)[None]) % n).reshape(-1)[:n]
        boots[b] = np.hypot(cb[idx].mean(), sb[idx].mean()) - np.hypot(ca[idx].mean(),
                                                                       sa[idx].mean())
    est = _rbar(diff_b) - _rbar(diff_a)
    lo, hi = np.quantile(boots, [0.025, 0.975])
    return {"estimate": est, "ci": [float(lo), float(hi)]}


def prefix_effect(cfg, plain: tuple[dict, dict], prefixed: tuple[dict, dict]) -> dict:
    """How a steadying prefix on each member changes the paper's quantities.

    Both analyses cover the same corpus, split and co-aligned positions (a prefix
    does not move token boundaries), so the changes are paired per position.
    """
    (rep0, ex0), (rep1, ex1) = plain, prefixed
    out: dict[str, Any] = {"phase_concentration": [], "cross_term": {}, "nll_gap": {}}
    t0, t1 = ex0["test"], ex1["test"]
    same = (t0.n_positions == t1.n_positions and np.array_equal(t0.gold_bytes, t1.gold_bytes)
            and np.array_equal(t0.segment, t1.segment))
    out["paired"] = bool(same)
    by1 = {(r["phase_map"], tuple(r["pair"])): r for r in ex1["coherence"]}
    for r0 in ex0["coherence"]:
        r1 = by1.get((r0["phase_map"], tuple(r0["pair"])))
        if r1 is None or not same:
            continue
        ch = rbar_change(r0["diffs"], r1["diffs"], n_boot=min(cfg.n_boot, 1000), seed=cfg.seed)
        ex_0 = r0["mean_resultant_length"] - r0["null_mean_resultant_length"]
        ex_1 = r1["mean_resultant_length"] - r1["null_mean_resultant_length"]
        dnull = r1["null_mean_resultant_length"] - r0["null_mean_resultant_length"]
        out["phase_concentration"].append({
            "phase_map": r0["phase_map"], "pair": r0["pair"],
            "rbar_plain": r0["mean_resultant_length"], "rbar_prefix": r1["mean_resultant_length"],
            "rbar_change": ch["estimate"], "rbar_change_ci": ch["ci"],
            "excess_plain": ex_0, "excess_prefix": ex_1, "excess_change": ex_1 - ex_0,
            # the permutation nulls are treated as fixed: the excess change's CI is the
            # R̄ change's CI shifted by the change of the null's mean.
            "excess_change_ci": [ch["ci"][0] - dnull, ch["ci"][1] - dnull]})
    c0, c1 = rep0["cross_term"]["rel"], rep1["cross_term"]["rel"]
    se = math.hypot((c0["ci"][1] - c0["ci"][0]) / 3.92, (c1["ci"][1] - c1["ci"][0]) / 3.92)
    d = c1["auroc"] - c0["auroc"]
    out["cross_term"] = {"setting_plain": rep0["cross_term"]["setting"],
                         "setting_prefix": rep1["cross_term"]["setting"],
                         "auroc_plain": c0["auroc"], "auroc_prefix": c1["auroc"],
                         "auroc_change": d, "auroc_change_ci": [d - 1.96 * se, d + 1.96 * se],
                         "ci_method": "normal approximation from the two bootstrap CIs, "
                                      "treated as independent (conservative for paired "
                                      "positions)"}
    for v in pipeline.variants(cfg):
        a, b = rep0["nll_comparison"].get(v), rep1["nll_comparison"].get(v)
        if not a or not b or not same:
            continue
        gap0 = ex0["test_nll"][a["brf"]] - ex0["test_nll"][a["baseline"]]
        gap1 = ex1["test_nll"][b["brf"]] - ex1["test_nll"][b["baseline"]]
        ci = stats.paired_bootstrap_ci(gap1, gap0, n_boot=cfg.n_boot,
                                       rng=np.random.default_rng(cfg.seed),
                                       block_size=min(32, max(1, len(gap0) // 4)))
        out["nll_gap"][v] = {"gap_plain": float(gap0.mean()), "gap_prefix": float(gap1.mean()),
                             "change": ci.estimate, "ci": [ci.ci_low, ci.ci_high],
                             "brf_plain": a["brf"], "brf_prefix": b["brf"],
                             "baseline_plain": a["baseline"], "baseline_prefix": b["baseline"]}
    return out


def pooled(cfg, per_corpus: list[tuple[str, dict, dict]]) -> dict:
    """Per variant: the BRF-minus-baseline NLL difference pooled over corpora."""
    out = {}
    for v in pipeline.variants(cfg):
        pairs, used = [], []
        for label, rep, ex in per_corpus:
            c = rep["nll_comparison"].get(v)
            if c:
                pairs.append((ex["test_nll"][c["brf"]], ex["test_nll"][c["baseline"]]))
                used.append({"corpus": label, "brf": c["brf"], "baseline": c["baseline"],
                             "mean_difference": c["mean_difference"], "ci": c["ci"]})
        if not pairs:
            continue
        ci = stats.pooled_paired_bootstrap_ci(pairs, n_boot=cfg.n_boot,
                                              rng=np.random.default_rng(cfg.seed),
                                              block_size=32)
        out[v] = {"mean_difference": ci.estimate, "ci": [ci.ci_low, ci.ci_high],
                  "p_value": ci.p_value, "corpora": used,
                  "weighting": "equal weight per corpus; stratified circular block bootstrap "
                               "(blocks of 32 positions within each corpus)"}
    return out


def topk_moves(rep_a: dict, rep_b: dict) -> dict:
    """Whether the verdicts of two analyses of the same corpus differ (event-space check)."""
    def side(ci):
        return "lower" if ci[1] < 0 else "higher" if ci[0] > 0 else "undecided"
    rows = {}
    for v, a in rep_a["nll_comparison"].items():
        b = rep_b["nll_comparison"].get(v)
        if b:
            rows[f"nll[{v}]"] = {"a": side(a["ci"]), "b": side(b["ci"]),
                                 "a_difference": a["mean_difference"],
                                 "b_difference": b["mean_difference"],
                                 "a_pair": [a["brf"], a["baseline"]],
                                 "b_pair": [b["brf"], b["baseline"]]}
    ra, rb = rep_a["cross_term"]["rel"], rep_b["cross_term"]["rel"]
    rows["cross_term"] = {"a": side([x - 0.5 for x in ra["ci"]]),
                          "b": side([x - 0.5 for x in rb["ci"]]),
                          "a_auroc": ra["auroc"], "b_auroc": rb["auroc"]}
    pa = sum(r["permutation_p"] < 0.05 for r in rep_a["phase_coherence"])
    pb = sum(r["permutation_p"] < 0.05 for r in rep_b["phase_coherence"])
    rows["phase_coherence"] = {"a": pa, "b": pb}
    moved = [k for k, r in rows.items() if r["a"] != r["b"]]
    return {"rows": rows, "moved": moved}


# ----------------------------------------------------------------- the run

def run(cfg, load_member: Callable | None = None) -> dict | None:
    """Runs the whole study; writes ``report.json`` / ``report.md`` / plots in out_dir.

    Multi-host (``cfg.distributed``): every process scores its share of each
    scoring; process 0 merges the stores, analyses and reports; the others
    return None.
    """
    from brf import sharding
    sharding.initialize_distributed(cfg.get("distributed"))  # before any other JAX use
    corpora = check(cfg)
    lead = sharding.process_index() == 0
    t0 = time.time()
    os.makedirs(cfg.out_dir, exist_ok=True)
    members = config_specs.member_entries(cfg.members, supported=pipeline.MEMBER_KEYS)
    if load_member is None:
        load_member = pipeline.registry_loader(cfg)
    cache: dict[str, Any] = {}

    def loader(name):  # each model loaded once, shared by every analysis
        if name not in cache:
            cache[name] = load_member(name)
        return cache[name]

    k2 = int(cfg.get("topk_sensitivity", 0))
    pair = _plain(members)
    per_corpus, corpus_rows = [], []
    prompts: dict[str, Any] = {}
    sensitivity = None
    for ci, c in enumerate(corpora):
        text, source, licence = corpus_lib.load_named(
            c["name"], max_chars=c["max_chars"], skip_chars=c["skip_chars"],
            min_chars=cfg.min_chars)
        segments = pipeline.split_segments(text, cfg.segment_chars)
        run_dir = os.path.join(cfg.out_dir, c["label"])
        # Corpus 1 is scored once with the larger top-k (every analysis of it reads the
        # same stores, truncated to top_k), so the sensitivity check costs no scoring.
        store_k = k2 if (ci == 0 and k2) else None
        rep, ex = run_table(cfg, c["label"], pair, segments, run_dir, loader,
                            store_k=store_k, sweep_curves=True)
        # Every process makes the same run_table calls in the same order (their
        # scorings meet at barriers); on the others run_table returns (None, None)
        # and only process 0 analyses.
        per_corpus.append((c["label"], rep, ex))
        corpus_rows.append({"label": c["label"], "source": source, "licence": licence,
                            "chars": len(text), "segments": len(segments),
                            "sha256": hashlib.sha256(text.encode()).hexdigest(),
                            "prefix": c["prefix"]})
        if ci == 0 and k2:
            rep2, _ = run_table(cfg, f"{c['label']} (top-{k2})", pair, segments, run_dir,
                                loader, top_k=k2, store_k=k2)
            if lead:
                sensitivity = {"corpus": c["label"], "top_k": [cfg.top_k, k2],
                               "coverage": [rep["coverage"]["positions"],
                                            rep2["coverage"]["positions"]],
                               **topk_moves(rep, rep2), "report": _brief(rep2)}
        if c["prefix"] and cfg.get("prompt_study", True):
            aux = cfg.get("prompt_variants") or None
            pre = run_table(cfg, f"{c['label']} + prefix", _with_prefix(members, c["prefix"]),
                            segments, run_dir, loader, store_k=store_k, variants=aux)
            entry = {"prefix": c["prefix"], "with_prefix": _brief(pre[0]),
                     "effect": prefix_effect(cfg, (rep, ex), pre) if lead else None}
            m0 = members[0]
            second = cfg.get("second_prefix", "")
            if second:
                same = ", ".join([format_spec(m0[0], {**m0[1], "prefix": c["prefix"]}),
                                  format_spec(m0[0], {**m0[1], "prefix": second})])
                entry["same_model"] = _brief(run_table(cfg, f"{c['label']} same model",
                                                       same, segments, run_dir, loader,
                                                       store_k=store_k, variants=aux)[0])
                # No score_all (so no barrier) in here: process 0 alone computes it.
                if int(cfg.get("bottleneck_positions", 0)) > 0 and lead:
                    entry["bottleneck"] = _bottleneck(cfg, m0[0], (c["prefix"], second),
                                                      segments, run_dir, loader)
            if cfg.get("swarm", True):
                swarm = ", ".join(format_spec(n, q) for n, p in members
                                  for q in (p, {**p, "prefix": c["prefix"]}))
                entry["swarm"] = _brief(run_table(cfg, f"{c['label']} swarm", swarm,
                                                  segments, run_dir, loader,
                                                  store_k=store_k, variants=aux)[0])
            prompts[c["label"]] = entry
    if not lead:
        return None
    rep = {
        "schema": STUDY_SCHEMA, "config": cfg.to_dict(), "corpora": corpus_rows,
        "per_corpus": {label: _brief(r) for label, r, _ in per_corpus},
        "pooled": pooled(cfg, per_corpus), "prompts": prompts,
        "topk_sensitivity": sensitivity, "seconds": time.time() - t0,
    }
    rep["verdict"] = verdicts(rep)
    report_lib.write_json(os.path.join(cfg.out_dir, "report.json"), rep)
    with open(os.path.join(cfg.out_dir, "report.md"), "w") as f:
        f.write(markdown(rep))
    plots(cfg.out_dir, rep)
    return rep


def _bottleneck(cfg, model_name: str, prefixes, segments, run_dir: str, loader) -> dict:
    """The softmax-bottleneck rows, cached in the run directory like scores and fits."""
    import pathlib
    from brf.eval import bottleneck_eval
    from brf.fusion import bottleneck
    top_k = int(cfg.get("bottleneck_top_k", 256))
    h = hashlib.sha256(repr((model_name, prefixes, segments, int(cfg.bottleneck_positions),
                             top_k, cfg.calibration_fraction, cfg.n_boot, cfg.seed)).encode())
    for mod in (bottleneck, bottleneck_eval):
        h.update(pathlib.Path(mod.__file__).read_bytes())
    path = os.path.join(run_dir, f"bottleneck-{h.hexdigest()[:12]}.json")
    cached = runfiles.read_json(path, "bottleneck cache")
    if cached is not None:
        return cached
    n_cal = max(1, int(round(len(segments) * cfg.calibration_fraction)))
    out = report_lib._jsonable(bottleneck_eval.bottleneck_rows(
        loader(model_name), model_name, prefixes, segments, list(range(n_cal, len(segments))),
        n_positions=int(cfg.bottleneck_positions), top_k=top_k, n_boot=cfg.n_boot,
        seed=cfg.seed))
    runfiles.write_json(path, out)
    return out


def _brief(rep: dict | None) -> dict | None:
    """An analysis without its per-method parameters (the per-corpus files keep them);
    None for None (a multi-process run's other processes analyse nothing)."""
    if rep is None:
        return None
    keep = ("analysis", "members", "top_k", "coverage", "split", "nll_comparison",
            "phase_coherence", "cross_term", "verdict")
    out = {k: rep[k] for k in keep if k in rep}
    out["methods"] = [{"label": m["label"], "variant": m["variant"],
                       "test_nll": m["test"]["nll"], "test_nll_ci": m["test"]["nll_ci"],
                       "calib_nll": m["calib_nll"]} for m in rep["methods"]]
    if "forking" in rep:
        # Keep the gated methods' rows whole (gains, CIs, top share): the study's
        # plot and markdown read them as the per-corpus report has them.
        out["forking"] = {v: {k: f[k] for k in ("reference", "top_fraction", "gated")}
                          | {"by_method": {g["method"]: f["by_method"][g["method"]]
                                           for g in f["gated"].values()}}
                          for v, f in rep["forking"].items()}
    return out


# ----------------------------------------------------------------- words

def _side(ci, what_low, what_high, what_none):
    return what_low if ci[1] < 0 else what_high if ci[0] > 0 else what_none


def verdicts(rep: dict) -> dict[str, str]:
    """The study's answers, one paragraph each, from the numbers alone."""
    out = {}
    for label, r in rep["per_corpus"].items():
        out[f"nll: {label}"] = r["verdict"]["nll"]
    for v, p in rep["pooled"].items():
        lo, hi = p["ci"]
        out[f"nll: pooled ({v})"] = (
            f"Pooled over {len(p['corpora'])} corpora (equal weight each), the best BRF "
            f"setting minus the best baseline, {report_lib.VARIANT_WORDS.get(v, v)}: "
            f"{p['mean_difference']:+.4f} nats/position, 95% CI [{lo:+.4f}, {hi:+.4f}]: BRF is "
            + _side(p["ci"], "better", "worse", "not distinguishable from the baseline")
            + " on this evidence.")
    for label, pr in rep["prompts"].items():
        e = pr["effect"]
        parts = []
        for r in e["phase_concentration"]:
            parts.append(f"{r['phase_map']}: R̄ {r['rbar_plain']:.3f} -> {r['rbar_prefix']:.3f} "
                         f"(change {r['rbar_change']:+.3f} [{r['rbar_change_ci'][0]:+.3f}, "
                         f"{r['rbar_change_ci'][1]:+.3f}]; excess over the null "
                         f"{r['excess_change']:+.3f})")
        ct = e["cross_term"]
        gap = "; ".join(
            f"{v}: BRF's NLL gap to the best baseline {g['gap_plain']:+.4f} -> "
            f"{g['gap_prefix']:+.4f} (change {g['change']:+.4f} [{g['ci'][0]:+.4f}, "
            f"{g['ci'][1]:+.4f}])" for v, g in e["nll_gap"].items())
        tightened = [r for r in e["phase_concentration"] if r["rbar_change_ci"][0] > 0]
        loosened = [r for r in e["phase_concentration"] if r["rbar_change_ci"][1] < 0]
        out[f"prompts: {label}"] = (
            f"With the steadying prefix {pr['prefix']!r} on each member, the members' phase "
            f"relationship tightened for {len(tightened)} and loosened for {len(loosened)} "
            f"of {len(e['phase_concentration'])} phase maps (CIs excluding 0) -- "
            + "; ".join(parts) + f". Cross-term AUROC {ct['auroc_plain']:.3f} -> "
            f"{ct['auroc_prefix']:.3f} (change {ct['auroc_change']:+.3f} "
            f"[{ct['auroc_change_ci'][0]:+.3f}, {ct['auroc_change_ci'][1]:+.3f}]). {gap}.")
        b = pr.get("bottleneck")
        if b:
            parts = []
            for r in b["rows"]:
                if r["method"].startswith("bottleneck"):
                    d = r["difference_to_linear"]
                    reg = ", ".join(f"{v} {k}" for k, v in r["regimes"].items() if v)
                    parts.append(f"{r['method']} {r['nll']:.3f} (vs the linear pool "
                                 f"{d['mean_difference']:+.3f} [{d['ci'][0]:+.3f}, "
                                 f"{d['ci'][1]:+.3f}]; regimes: {reg}; fell back to the linear "
                                 f"pool at {100 * r['fallback_fraction']:.0f}% of positions)")
            lin = next(r for r in b["rows"] if r["method"] == "linear")
            out[f"softmax bottleneck: {label}"] = (
                f"One model under two prefixes, {b['positions']} sampled test positions, full "
                f"distributions (bottleneck support: each member's top {b['top_k']} tokens): "
                f"linear pool NLL {lin['nll']:.3f}; " + "; ".join(parts) + ".")
        for key, what in (("same_model", "One model under two prefixes"),
                          ("swarm", "The four-member swarm")):
            if key in pr:
                out[f"{key}: {label}"] = f"{what}: " + pr[key]["verdict"]["nll"]
    s = rep.get("topk_sensitivity")
    if s:
        out["event space"] = (
            f"On {s['corpus']}, building the event space from each member's top-"
            f"{s['top_k'][1]} strings instead of top-{s['top_k'][0]}: "
            + ("no verdict moves." if not s["moved"] else
               f"these verdicts move: {', '.join(s['moved'])}."))
    return out


def markdown(rep: dict) -> str:
    lines = ["# Born Rule Fusion: the study", "",
             "Each corpus has its full report (every method, the tests, the sweep, "
             "forking tokens, plots) in its own directory; this page gathers the verdicts.",
             "", "## Corpora", "",
             "| corpus | source | licence | characters | co-aligned positions | prefix |",
             "|---|---|---|---|---|---|"]
    for c in rep["corpora"]:
        pc = rep["per_corpus"][c["label"]]
        lines.append(f"| {c['label']} | {c['source']} | {c['licence']} | {c['chars']} | "
                     f"{pc['coverage']['positions']} | {c['prefix']!r} |")
    lines += ["", "## Verdicts", ""]
    for k, v in rep["verdict"].items():
        lines.append(f"- **{k}**: {v}")
    lines += ["", "## Best BRF vs best baseline, per corpus and pooled", "",
              "| corpus | variant | BRF | baseline | difference [95% CI] |",
              "|---|---|---|---|---|"]
    for label, r in rep["per_corpus"].items():
        for v, c in r["nll_comparison"].items():
            lines.append(f"| {label} | {v} | {c['brf']} | {c['baseline']} | "
                         f"{c['mean_difference']:+.4f} [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}] |")
    for v, p in rep["pooled"].items():
        lines.append(f"| **pooled** | {v} | | | {p['mean_difference']:+.4f} "
                     f"[{p['ci'][0]:+.4f}, {p['ci'][1]:+.4f}] |")
    lines += ["", "## Forking tokens", ""]
    for label, r in rep["per_corpus"].items():
        for v, f in r.get("forking", {}).items():
            for kind, g in f["gated"].items():
                share = f["by_method"][g["method"]]["top_share"]
                lines.append(
                    f"- {label} [{v}] {g['method']}: top {100 * f['top_fraction']:.0f}% entropy "
                    f"positions carry {100 * share:.0f}% of the gain over "
                    f"{f['reference']}; gated fusion keeps {100 * g['kept']:.0f}% of it and "
                    f"saves {100 * g['calls_saved']:.0f}% of member calls.")
    lines += ["", "Plots: `gain_by_entropy.png` (this directory and each corpus's), "
              "`pooled.png`.", ""]
    return "\n".join(lines)


def plots(out_dir: str, rep: dict) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    rows = [(label, v, c) for label, r in rep["per_corpus"].items()
            for v, c in r["nll_comparison"].items()]
    rows += [("pooled", v, p) for v, p in rep["pooled"].items()]
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1.2))
    y = np.arange(len(rows))
    m = np.array([r[2]["mean_difference"] for r in rows])
    ci = np.array([r[2]["ci"] for r in rows])
    ax.errorbar(m, y, xerr=[m - ci[:, 0], ci[:, 1] - m], fmt="o", capsize=3)
    ax.axvline(0, color="grey", lw=0.7)
    ax.set_yticks(y, [f"{a} [{b}]" for a, b, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("best BRF minus best baseline, test NLL (nats/position); < 0: BRF better")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "pooled.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    first = next(iter(rep["per_corpus"].values()))
    if first.get("forking"):
        paths.append(report_lib.plot_gain_by_entropy(
            os.path.join(out_dir, "gain_by_entropy.png"), first["forking"]))
    return paths


__all__ = ["run", "check", "corpus_entries", "prefix_effect", "pooled", "rbar_change",
           "topk_moves", "verdicts", "markdown", "STUDY_SCHEMA"]
