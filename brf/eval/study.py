"""The study: the plan's analyses on every corpus, then the comparisons across them.

What one run answers (``experiments/validate.py``; configs/validate.py):

1. **Per corpus**: the default pair scored teacher-forced, every method fitted on
   the calibration split in each variant (as proposed; calibrated), the Phase
   Coherence and Cross-Term Discrimination tests, the paired NLL comparison of
   the best BRF setting with the best baseline *within each variant*, the
   forking-token analysis and the sweep. Each analysis writes its full report
   into the corpus's run directory.
2. **Pooled** over corpora: the per-corpus differences averaged with equal
   weight per corpus, CI by a bootstrap stratified by corpus with blocks inside
   each (positions within a corpus are dependent).
3. **Prompts** (on corpora that name a ``prefix``): the pair with that steadying
   prefix on each member against the same pair without, on the same test
   positions; one model under two prefixes (a same-vocabulary pair, with the
   softmax-bottleneck rows); and a **swarm** of four.
4. **Event-space sensitivity** (first corpus): the event space built from each
   member's top-``topk_sensitivity`` strings instead of top-``top_k``: does any
   verdict move?
5. **Every byte** (``plan.bytes.enabled``): 1-3 again on every byte of every
   corpus (each member's next-byte distributions, :mod:`brf.eval.byte_scorer`;
   the default pair, the prefix pair, the same-model pair and the swarm, no
   event-space check and no softmax-bottleneck rows), reported beside the
   co-aligned verdicts with which of them moved (``report.json``'s ``bytes``).
   Each corpus's byte-level reports, fits and plots go to ``<corpus>/bytes/``.

Every scoring is stored per member and corpus under the run directory and
reused, so an interrupted run resumes; fits and bottleneck rows are cached too.
Multi-host (``plan.distributed``): every process scores its share of each
token-level scoring; process 0 merges the stores, analyses and reports, and
scores the byte level alone after the token level is done (its scoring is not
shared); the others return None.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Any, Callable

import numpy as np

from brf import sharding
from brf.eval import byte_scorer, caches, compare, report as report_lib, scorer, study_report
from brf.eval.analysis import AnalysisResult, analyse
from brf.eval.events import Coverage, build_event_table
from brf.eval.plan import Analysis, Corpus, Plan, calibration_segments, load_segments
from brf.eval.scoring import truncate_top_k


@dataclasses.dataclass
class Outcome:
    """One analysis done: its scored members, coverage, result and report."""
    analysis: Analysis
    infos: list[scorer.MemberInfo]
    coverage: Coverage
    result: AnalysisResult
    report: dict


def event_table(plan: Plan, analysis: Analysis, segments: list[str], run_dir: str,
                load_model: Callable[[str], Any]):
    """Scores the analysis's members (reusing their stores) and builds its event table:
    (table, coverage, member infos), or None on the processes that do not analyse.
    At the byte level (``analysis.level == 'bytes'``) every byte is a row
    (:func:`brf.eval.byte_scorer.event_table`; this process alone scores)."""
    os.makedirs(run_dir, exist_ok=True)
    if analysis.level == "bytes":
        return byte_scorer.event_table(analysis.members, segments, run_dir, load_model,
                                       getattr(load_model, "byte_lm", None),
                                       settings=plan.bytes, chunk=plan.scoring.chunk)
    scored = scorer.score_members(
        analysis.members, segments, run_dir, load_model, top_k=analysis.store_k,
        chunk=plan.scoring.chunk,
        meshes=scorer.member_meshes(plan.mesh, len(analysis.members)))
    if scored is None:  # multi-process: another process analyses
        return None
    k = analysis.top_k
    scores = [truncate_top_k(s, k) if s.topk_ids.shape[1] > k else s for s in scored.scores]
    table, cov = build_event_table(scores, scored.token_bytes, segments)
    return table, cov, scored.infos


def study_tables(plan: Plan, load_model: Callable[[str], Any] | None = None, *,
                 which: Callable[[str, Analysis], bool] = lambda corpus, analysis: True,
                 levels: tuple[str, ...] = ("tokens",)):
    """The event tables of the plan's analyses at ``levels`` that ``which(corpus label,
    analysis)`` selects, in the study's order (for benchmarks): yields (corpus label,
    analysis, table, number of segments)."""
    loader = _loaded_once(load_model or scorer.registry_loader(plan.members, plan.mesh))
    for index, corpus in enumerate(plan.corpora):
        segments, _, _ = load_segments(plan, corpus)
        for a in (a for level in levels for a in plan.analyses(index, level)):
            if not which(corpus.label, a):
                continue
            table, _, _ = event_table(plan, a, segments, os.path.join(plan.out_dir, corpus.label),
                                      loader)
            yield corpus.label, a, table, len(segments)


def run_analysis(plan: Plan, analysis: Analysis, segments: list[str], run_dir: str,
                 load_model: Callable[[str], Any]) -> Outcome | None:
    """Scores the analysis's members, builds its event table, analyses it and writes
    its report into ``run_dir`` (byte-level analyses: into ``run_dir/bytes``, beside
    nothing of the token level's). None on the processes that do not analyse."""
    built = event_table(plan, analysis, segments, run_dir, load_model)
    if built is None:
        return None
    table, cov, infos = built
    k = analysis.top_k
    tokens = analysis.level == "tokens"
    key = ", ".join(m.label for m in analysis.members)
    slug = "".join(ch if ch.isalnum() else "_" for ch in analysis.label.lower()).strip("_")
    name = f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:8]}" + (f"-k{k}" if tokens else "")
    out_dir = run_dir if tokens else os.path.join(run_dir, "bytes")
    os.makedirs(out_dir, exist_ok=True)
    result = analyse(plan, table, len(segments), variants=analysis.variants,
                     cache_path=os.path.join(out_dir, f"fits-{name}.json"),
                     with_sweep=analysis.sweep)
    level = ({"top_k": k} if tokens else
             {"beam": plan.bytes.beam, "threshold": plan.bytes.threshold,
              "max_lag": plan.bytes.max_lag})
    rep = {"analysis": analysis.label, "level": analysis.level,
           "members": [i.as_dict() for i in infos], **level, "coverage": cov.as_dict(),
           **result.section()}
    rep["verdict"] = report_lib.verdicts(rep)
    text = "".join(segments)
    report_lib.write_analysis(out_dir, name, rep, corpus={
        "source": analysis.label, "chars": len(text), "segments": len(segments),
        "sha256": hashlib.sha256(text.encode()).hexdigest()},
        figures=(result.coherence, result.cross["scores"]) if analysis.sweep else None)
    return Outcome(analysis, infos, cov, result, rep)


def run(plan: Plan, *, load_model: Callable[[str], Any] | None = None) -> dict | None:
    """Runs the whole study; writes ``report.json`` / ``report.md`` / plots in
    ``plan.out_dir`` and returns the report (None on processes other than 0)."""
    sharding.initialize_distributed(plan.distributed)  # before any other JAX use
    lead = sharding.process_index() == 0
    t0 = time.time()
    os.makedirs(plan.out_dir, exist_ok=True)
    loader = _loaded_once(load_model or scorer.registry_loader(plan.members, plan.mesh))
    corpora, per_corpus, prompts, sensitivity = [], [], {}, None
    for index, corpus in enumerate(plan.corpora):
        segments, source, licence = load_segments(plan, corpus)
        run_dir = os.path.join(plan.out_dir, corpus.label)
        # Every process makes the same run_analysis calls in the same order (their
        # scorings meet at barriers); only process 0 gets outcomes and analyses.
        done = {a.kind: run_analysis(plan, a, segments, run_dir, loader)
                for a in plan.analyses(index)}
        text = "".join(segments)
        corpora.append({"label": corpus.label, "source": source, "licence": licence,
                        "chars": len(text), "segments": len(segments),
                        "sha256": hashlib.sha256(text.encode()).hexdigest(),
                        "prefix": corpus.prefix})
        if not lead:
            continue
        main = done["corpus"]
        per_corpus.append((corpus.label, main))
        if "topk" in done:
            other = done["topk"]
            sensitivity = {"corpus": corpus.label, "top_k": [main.analysis.top_k,
                                                             other.analysis.top_k],
                           "coverage": [main.coverage.positions, other.coverage.positions],
                           **compare.topk_moves(main.result, other.result),
                           "report": study_report.brief(other.report)}
        if "prefix" in done:
            prompts[corpus.label] = _prompt_entry(plan, corpus, done, segments, run_dir,
                                                  loader)
    if not lead:
        return None
    st = plan.stats
    rep = {"schema": study_report.STUDY_SCHEMA, "config": plan.config, "corpora": corpora,
           "per_corpus": {label: study_report.brief(o.report) for label, o in per_corpus},
           "pooled": compare.pooled([(label, o.result) for label, o in per_corpus],
                                    plan.variants, n_boot=st.n_boot, seed=st.seed),
           "pooled_fair": compare.pooled([(label, o.result) for label, o in per_corpus],
                                         plan.variants, n_boot=st.n_boot, seed=st.seed,
                                         fair=True),
           "prompts": prompts, "topk_sensitivity": sensitivity}
    rep["verdict"] = study_report.verdicts(rep)
    if plan.bytes.enabled:
        # The co-aligned report first: the byte level takes far longer.
        study_report.write(plan.out_dir, {**rep, "seconds": time.time() - t0})
        t1 = time.time()
        rep["bytes"] = byte_level(plan, loader)
        rep["bytes"]["moved"] = compare.level_moves(rep, rep["bytes"])
        rep["bytes"]["seconds"] = time.time() - t1
        rep["verdict"]["every byte"] = study_report.moved_sentence(rep["bytes"]["moved"])
    rep["seconds"] = time.time() - t0
    study_report.write(plan.out_dir, rep)
    return rep


def byte_level(plan: Plan, loader: Callable[[str], Any]) -> dict:
    """The study on every byte (this process alone): each corpus's byte-level analyses,
    pooled over corpora, the prompt study; report.json's ``bytes`` section but for
    ``moved`` and ``seconds`` (:func:`run` adds them)."""
    per_corpus, prompts, consistency, precision = [], {}, {}, {}
    for index, corpus in enumerate(plan.corpora):
        segments, _, _ = load_segments(plan, corpus)
        run_dir = os.path.join(plan.out_dir, corpus.label)
        done = {a.kind: run_analysis(plan, a, segments, run_dir, loader)
                for a in plan.analyses(index, "bytes")}
        per_corpus.append((corpus.label, done["corpus"]))
        consistency[corpus.label] = {i.name: i.consistency for o in done.values()
                                     for i in o.infos}
        if plan.bytes.check_bytes:
            precision[corpus.label] = byte_precision_check(plan, done["corpus"], segments,
                                                           run_dir, loader)
        if "prefix" in done:
            prompts[corpus.label] = _prompt_entry(plan, corpus, done, segments, run_dir,
                                                  loader, bottleneck=False)
    st = plan.stats
    results = [(label, o.result) for label, o in per_corpus]
    out = {"beam": plan.bytes.beam, "threshold": plan.bytes.threshold,
           "max_lag": plan.bytes.max_lag, "swarm": plan.bytes.swarm,
           "per_corpus": {label: study_report.brief(o.report) for label, o in per_corpus},
           "consistency": consistency,
           "pooled": compare.pooled(results, plan.variants, n_boot=st.n_boot, seed=st.seed),
           "pooled_fair": compare.pooled(results, plan.variants, n_boot=st.n_boot,
                                         seed=st.seed, fair=True),
           "prompts": prompts}
    if precision:
        from brf.eval import byte_precision
        out["precision"] = {
            "settings": plan.bytes.settings.as_dict(),
            "reference": plan.bytes.reference.as_dict(), "slice_bytes": plan.bytes.check_bytes,
            "per_corpus": precision,
            "pooled": {**byte_precision.pooled_shifts(
                {k: p["verdicts"] for k, p in precision.items()}, out["pooled"], "nll"),
                **byte_precision.pooled_shifts(
                {k: p["verdicts"] for k, p in precision.items()}, out["pooled_fair"], "fair")}}
    out["verdict"] = study_report.verdicts(out, unit="byte")
    if precision:
        out["verdict"]["precision"] = study_report.precision_sentence(out["precision"])
    return out


def byte_precision_check(plan: Plan, outcome: Outcome, segments: list[str], run_dir: str,
                         loader) -> dict:
    """The precision check of one corpus's byte level (:mod:`brf.eval.byte_precision`):
    each member of the default pair rescored on the slice with the reference settings
    (and, when the study merges, without merging), against the study's rows, and the
    shift each byte-level comparison takes between the two."""
    from brf.bytes import Settings
    from brf.eval import byte_precision as bp
    b = plan.bytes
    sl = bp.slice_of(segments, calibration_segments(plan.scoring, len(segments)),
                     b.check_bytes)
    text = segments[sl.segment].encode("utf-8")
    gold = np.frombuffer(text[:sl.n_bytes], np.uint8).astype(np.int64)
    test = outcome.result.test
    study_rows, reference, unmerged = [], [], []
    for i, m in enumerate(outcome.analysis.members):
        pre = scorer.prefix_ids(loader(m.name).tokenizer, m.prefix)
        study_rows.append(test.logp[sl.test_start:sl.test_start + sl.n_bytes, i])
        base = os.path.basename(byte_scorer.store_path(run_dir, m))[len("bytes-"):]
        for settings, tag, out in ((b.reference, "reference", reference),
                                   (Settings(b.beam, b.threshold, 0), "unmerged", unmerged)):
            if tag == "unmerged" and not b.max_lag:
                continue
            out.append(bp.reference_rows(
                lambda: loader.byte_lm(m.name), m.name, text, sl.n_bytes, pre, settings,
                os.path.join(run_dir, f"bytes-{tag}-{base}")))
    return {"segment": sl.segment, "bytes": sl.n_bytes,
            "members": bp.measure_members([m.label for m in outcome.analysis.members],
                                          study_rows, reference, gold, unmerged or None),
            "verdicts": bp.verdict_shifts(outcome.result,
                                          bp.slice_table(study_rows, gold, sl.segment),
                                          bp.slice_table(reference, gold, sl.segment))}


def _prompt_entry(plan: Plan, corpus: Corpus, done: dict[str, Outcome], segments, run_dir,
                  loader, *, bottleneck: bool = True) -> dict:
    """The prompt study of one corpus: the prefix effect, the same-model pair (with its
    softmax-bottleneck rows, when ``bottleneck``) and the swarm."""
    st = plan.stats
    entry = {"prefix": corpus.prefix, "with_prefix": study_report.brief(done["prefix"].report),
             "effect": compare.prefix_effect(done["corpus"].result, done["prefix"].result,
                                             n_boot=st.n_boot, seed=st.seed)}
    if "same_model" in done:
        entry["same_model"] = study_report.brief(done["same_model"].report)
        if bottleneck and plan.bottleneck.positions > 0:
            prefixes = tuple(m.prefix for m in done["same_model"].analysis.members)
            entry["bottleneck"] = bottleneck_rows(plan, plan.members[0].name, prefixes,
                                                  segments, run_dir, loader)
    if "swarm" in done:
        entry["swarm"] = study_report.brief(done["swarm"].report)
    return entry


def bottleneck_rows(plan: Plan, model_name: str, prefixes, segments, run_dir: str,
                    loader) -> dict:
    """The softmax-bottleneck rows (:mod:`brf.eval.bottleneck_eval`), cached in the run
    directory like scores and fits."""
    from brf.eval import bottleneck_eval
    from brf.fusion import bottleneck
    b, sc, st = plan.bottleneck, plan.scoring, plan.stats
    key = caches.source_hash([bottleneck, bottleneck_eval], model_name, prefixes, segments,
                             b.positions, b.top_k, sc.calibration_fraction, st.n_boot, st.seed)
    n_cal = calibration_segments(sc, len(segments))
    return caches.cached_json(
        os.path.join(run_dir, f"bottleneck-{key[:12]}.json"),
        lambda: bottleneck_eval.bottleneck_rows(
            loader(model_name), model_name, prefixes, segments,
            list(range(n_cal, len(segments))), n_positions=b.positions, top_k=b.top_k,
            n_boot=st.n_boot, seed=st.seed),
        what="bottleneck rows")


class _loaded_once:
    """``load_model`` with each model loaded once, shared by every analysis; its
    byte-level view (:meth:`byte_lm`) built once per model too."""

    def __init__(self, load_model: Callable[[str], Any]):
        self._load = load_model
        self._models: dict[str, Any] = {}
        self._lms: dict[str, Any] = {}

    def __call__(self, name: str):
        if name not in self._models:
            self._models[name] = self._load(name)
        return self._models[name]

    def byte_lm(self, name: str):
        if name not in self._lms:
            self._lms[name] = byte_scorer.byte_lm(self(name), name)
        return self._lms[name]


__all__ = ["Outcome", "bottleneck_rows", "byte_level", "event_table", "run", "run_analysis",
           "study_tables"]
