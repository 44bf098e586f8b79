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

Both levels run through one loop (:func:`run_level`); what differs between them
(where a table's rows come from, what else each reports) is a level value
(:mod:`brf.eval.levels`).

Every scoring is stored per member and corpus under the run directory and
reused, so an interrupted run resumes; fits and bottleneck rows are cached too.
Multi-host (``plan.distributed``): every process scores its share of each
token-level scoring; process 0 merges the stores, analyses and reports, and
scores the byte level alone after the token level is done (its scoring is not
shared); the others return None.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Any, Callable

from brf import sharding
from brf.eval import caches, compare, report as report_lib, scorer, stability, study_report
from brf.eval.analysis import analyse
from brf.eval.levels import Level, LoadedCorpus, Outcome, Views, levels
from brf.eval.plan import Analysis, Plan, calibration_segments
from brf.runtime import release_compiled


def run_analysis(plan: Plan, level: Level, analysis: Analysis, corpus: LoadedCorpus,
                 run_dir: str, views: Views) -> Outcome | None:
    """Scores the analysis's members at ``level``, builds its event table, analyses it
    and writes its report (into the level's directory of ``run_dir``). None on the
    processes that do not analyse."""
    built = level.build(analysis, corpus, run_dir, views)
    if built is None:
        return None
    key = ", ".join(m.label for m in analysis.members)
    slug = "".join(ch if ch.isalnum() else "_" for ch in analysis.label.lower()).strip("_")
    name = level.report_name(analysis, f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:8]}")
    out_dir = level.out_dir(run_dir)
    os.makedirs(out_dir, exist_ok=True)
    cache_path = os.path.join(out_dir, f"fits-{name}.json")
    n = built.table.logp.shape[1]
    result = analyse(plan, built.table, len(corpus.segments), variants=analysis.variants,
                     cache_path=cache_path, with_sweep=analysis.sweep)
    check = stability.check(plan, result, analysis.variants, cache_path=cache_path, n=n)
    if check is not None:
        result = check.result  # its ties widened by how far each row's refit moved
    rep = {"analysis": analysis.label, "level": level.name,
           "members": [i.as_dict() for i in built.infos], **level.fields(analysis),
           "coverage": built.coverage.as_dict(), **result.section()}
    if check is not None:
        rep["stability"] = check.as_dict()
    rep["verdict"] = report_lib.verdicts(rep)
    report_lib.write_analysis(out_dir, name, rep, corpus=corpus.report_corpus(analysis),
                              figures=((result.coherence, result.cross["scores"])
                                       if analysis.sweep else None))
    release_compiled()  # the analysis's scoring and fit programs (brf.runtime)
    return Outcome(analysis, built.infos, built.coverage, result, rep, check)


def run_level(plan: Plan, level: Level, corpora: list[LoadedCorpus], views: Views,
              lead: bool) -> dict | None:
    """Every analysis of every corpus at one level, pooled over corpora, with the
    prompt study and the level's own extras: the level's section of the report (None
    on processes other than 0)."""
    per_corpus, prompts, extras, prompt_outcomes = [], {}, {}, []
    for index, corpus in enumerate(map(level.span, corpora)):
        run_dir = os.path.join(plan.out_dir, corpus.label)  # each level's build makes it
        # Every process makes the same run_analysis calls in the same order (their
        # scorings meet at barriers); only process 0 gets outcomes and analyses.
        done = {a.kind: run_analysis(plan, level, a, corpus, run_dir, views)
                for a in level.analyses(index)}
        if not lead:
            continue
        per_corpus.append((corpus.label, done["corpus"]))
        extras[corpus.label] = level.corpus_extras(corpus, done, run_dir, views)
        if "prefix" in done:
            prompts[corpus.label] = _prompt_entry(plan, corpus, done, run_dir, views,
                                                  bottleneck=level.bottleneck)
            prompt_outcomes.append((corpus.label, done))
    if not lead:
        return None
    st = plan.stats
    results = [(label, o.result) for label, o in per_corpus]
    section = {**level.header(),
               "per_corpus": {label: study_report.brief(o.report) for label, o in per_corpus},
               **{key: {v: p.as_dict() for v, p in compare.pooled(
                   results, plan.variants, n_boot=st.n_boot, seed=st.seed, fair=fair).items()}
                  for key, fair in (("pooled", False), ("pooled_fair", True))},
               "prompts": prompts}
    level.finish(section, extras)
    section["stability"] = _stability_section(plan, per_corpus, prompt_outcomes)
    section["verdict"] = study_report.verdicts(section, unit=level.unit)
    level.finish_verdicts(section)
    return section


def run(plan: Plan, *, load_model: Callable[[str], Any] | None = None) -> dict | None:
    """Runs the whole study; writes ``report.json`` / ``report.md`` / plots in
    ``plan.out_dir`` and returns the report (None on processes other than 0).

    The first level (co-aligned positions) is the report's body; every later one (every
    byte) is a section of its own under its name, with the verdicts that moved from
    the first. The report is written after each level, so the first level's answers
    are there while the next one runs."""
    sharding.initialize_distributed(plan.distributed)  # before any other JAX use
    lead = sharding.process_index() == 0
    t0 = time.time()
    os.makedirs(plan.out_dir, exist_ok=True)
    views = Views(load_model or scorer.registry_loader(plan.members, plan.mesh))
    corpora = [LoadedCorpus.load(plan, c) for c in plan.corpora]
    rep, todo = None, levels(plan)
    for i, level in enumerate(todo):
        if level.lead_only and not lead:
            continue
        t1 = time.time()
        section = run_level(plan, level, corpora, views, lead)
        if not lead:
            continue
        if rep is None:
            rep = {"schema": study_report.STUDY_SCHEMA, "code": study_report.provenance(),
                   "config": plan.config,
                   "corpora": [c.info() for c in corpora], **section}
        else:
            section["moved"] = compare.level_moves(rep, section).as_dict()
            section["seconds"] = time.time() - t1
            rep[level.name] = section
            rep["verdict"]["every byte"] = study_report.moved_sentence(section["moved"])
        if i < len(todo) - 1:  # this level's answers while the next one runs
            study_report.write(plan.out_dir, {**rep, "seconds": time.time() - t0})
    if not lead:
        return None
    rep["seconds"] = time.time() - t0
    study_report.write(plan.out_dir, rep)
    return rep


def _stability_section(plan: Plan, per_corpus: list, prompts: list) -> dict | None:
    """The stability check over the level: each analysis's (its report's ``stability``)
    and the study-level verdicts recomputed from the refitted analyses; None when the
    plan runs no check."""
    outcomes = [o for _, o in per_corpus] + [o for _, done in prompts for k, o in done.items()
                                              if k != "corpus"]
    checks = [(o.analysis.label, o.check) for o in outcomes if o.check is not None]
    if not checks:
        return None
    study = stability.study_moves(
        plan, [(label, o.result, o.check.perturbed) for label, o in per_corpus
               if o.check is not None],
        [(label, done["corpus"].result, done["corpus"].check.perturbed,
          done["prefix"].result, done["prefix"].check.perturbed) for label, done in prompts
         if done["corpus"].check is not None and done["prefix"].check is not None])
    per = {label: c.as_dict() for label, c in checks}
    moved = [f"{label}: {k}" for label, c in checks for k in c.moved]
    moved += [k for k, (a, b) in study.items() if a.differs(b)]
    standing = [f"{label}: {k}" for label, c in checks for k in c.moved_untied]
    standing += [k for k, (a, b) in study.items()
                 if a.differs(b) and not a.fragile]
    rows = [(label, r) for label, c in checks for r in c.rows]
    finite = [(label, r) for label, r in rows if math.isfinite(r.move)]
    top = max(finite, key=lambda x: abs(x[1].move)) if finite else None
    return {"perturbation": plan.stability, "tolerance": stability.FIT_TOLERANCE,
            "analyses": len(checks), "refitted_rows": len(rows),
            "not_refitted": sum(len(c.left_out) for _, c in checks),
            "rows_over_tolerance": sum(not abs(r.move) <= stability.FIT_TOLERANCE
                                       for _, r in rows),
            "largest_row_move": (None if top is None else
                                 {"analysis": top[0], "label": top[1].label,
                                  "move": top[1].move}),
            "verdicts": sum(len(c.verdicts) for _, c in checks) + len(study),
            "moved": moved, "moved_untied": standing,
            "study": {k: {"run": a.answer, "refit": b.answer, "tied_fragile": a.fragile}
                      for k, (a, b) in study.items()},
            "seconds": sum(c.seconds for _, c in checks), "per_analysis": per}


def study_tables(plan: Plan, load_model: Callable[[str], Any] | None = None, *,
                 which: Callable[[str, Analysis], bool] = lambda corpus, analysis: True,
                 level_names: tuple[str, ...] = ("tokens",)):
    """The event tables of the plan's analyses at the named levels that ``which(corpus
    label, analysis)`` selects, in the study's order (for benchmarks): yields (corpus
    label, analysis, table, number of segments)."""
    views = Views(load_model or scorer.registry_loader(plan.members, plan.mesh))
    chosen = [lv for lv in levels(plan) if lv.name in level_names]
    for index, c in enumerate(plan.corpora):
        whole = LoadedCorpus.load(plan, c)
        for level in chosen:
            corpus = level.span(whole)
            for a in level.analyses(index):
                if which(corpus.label, a):
                    built = level.build(a, corpus, os.path.join(plan.out_dir, corpus.label),
                                        views)
                    yield corpus.label, a, built.table, len(corpus.segments)


def _prompt_entry(plan: Plan, corpus: LoadedCorpus, done: dict[str, Outcome], run_dir: str,
                  views: Views, *, bottleneck: bool) -> dict:
    """The prompt study of one corpus: the prefix effect, the same-model pair (with its
    softmax-bottleneck rows, when ``bottleneck``) and the swarm."""
    st = plan.stats
    entry = {"prefix": corpus.corpus.prefix,
             "with_prefix": study_report.brief(done["prefix"].report),
             "effect": compare.prefix_effect(done["corpus"].result, done["prefix"].result,
                                             n_boot=st.n_boot, seed=st.seed).as_dict()}
    if "same_model" in done:
        entry["same_model"] = study_report.brief(done["same_model"].report)
        if bottleneck and plan.bottleneck.positions > 0:
            prefixes = tuple(m.prefix for m in done["same_model"].analysis.members)
            entry["bottleneck"] = bottleneck_rows(plan, plan.members[0].name, prefixes,
                                                  corpus.segments, run_dir, views.model)
    if "swarm" in done:
        entry["swarm"] = study_report.brief(done["swarm"].report)
    return entry


def bottleneck_rows(plan: Plan, model_name: str, prefixes, segments, run_dir: str,
                    loader) -> dict:
    """The softmax-bottleneck rows (:mod:`brf.eval.bottleneck_eval`), cached in the run
    directory like scores and fits; ``loader(name)`` gives the model."""
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


__all__ = ["Outcome", "bottleneck_rows", "run", "run_analysis", "run_level", "study_tables"]
