"""The study's two levels as values, the members' views they read, and each corpus
loaded once.

A *level* turns one analysis (its members) on one corpus into an event table and
says what else the study reports at that level. Both levels give the same things,
so the study (:func:`brf.eval.study.run`) runs one loop over :func:`levels`:

* :class:`TokenLevel`: co-aligned positions, an event space of each member's top
  strings and OTHER (:mod:`brf.eval.events`), from each member's token-level store
  (:mod:`brf.eval.scorer`); a row is a co-aligned position. Its extras: the
  event-space check (first corpus) and the softmax-bottleneck rows of the
  same-model pair. Every process of a multi-host run takes part.
* :class:`ByteLevel`: every byte, the 257 byte events (:mod:`brf.eval.byte_scorer`),
  from each member's byte store; a row is a byte. Its extras: each member's
  consistency and the precision check (:mod:`brf.eval.byte_precision`). Process 0
  alone runs it.

:class:`Views` is where the members' views come from: each model loaded once, and
each model's byte-level view (:class:`brf.bytes.lm.ByteLM`) built once from it.
:class:`LoadedCorpus` is a corpus's segments, read and hashed once for every level.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any, Callable, NamedTuple

from brf.event_table import EventTable
from brf.eval import byte_scorer, compare, scorer, study_report
from brf.eval.analysis import AnalysisResult
from brf.eval.plan import Analysis, Corpus, Plan, load_segments


class Views:
    """The members' views: ``model(name)`` (loaded once; ``.cfg``, ``.params``,
    ``.tokenizer``) and ``byte_lm(name)`` (its byte-level view, built once)."""

    def __init__(self, load_model: Callable[[str], Any]):
        self._load = load_model
        self._models: dict[str, Any] = {}
        self._byte_lms: dict[str, Any] = {}

    def model(self, name: str):
        if name not in self._models:
            self._models[name] = self._load(name)
        return self._models[name]

    def byte_lm(self, name: str):
        if name not in self._byte_lms:
            self._byte_lms[name] = byte_scorer.byte_lm(self.model(name), name)
        return self._byte_lms[name]


@dataclasses.dataclass(frozen=True)
class LoadedCorpus:
    """A corpus read once: its segments, where they came from, and one hash of them."""
    corpus: Corpus
    segments: list[str]   # a list, as load_segments gives it (cache keys hash its repr)
    source: str
    licence: str
    chars: int
    sha256: str

    @classmethod
    def load(cls, plan: Plan, corpus: Corpus) -> "LoadedCorpus":
        return cls.of(corpus, *load_segments(plan, corpus))

    @classmethod
    def of(cls, corpus: Corpus, segments: list[str], source: str,
           licence: str) -> "LoadedCorpus":
        """The corpus read as these segments, counted and hashed."""
        text = "".join(segments)
        return cls(corpus, segments, source, licence, len(text),
                   hashlib.sha256(text.encode()).hexdigest())

    def head(self, max_chars: int) -> "LoadedCorpus":
        """The corpus's first segments up to ``max_chars`` characters: whole segments, at
        least two (a calibration and a test split), every one when ``max_chars`` is 0
        or covers them all. Hashed as what it holds."""
        n = len(self.segments)
        if max_chars:
            total, n = 0, 0
            for seg in self.segments:
                if n >= 2 and total + len(seg) > max_chars:
                    break
                total, n = total + len(seg), n + 1
        if n == len(self.segments):
            return self
        return self.of(self.corpus, self.segments[:n], self.source, self.licence)

    @property
    def label(self) -> str:
        return self.corpus.label

    def info(self) -> dict:
        """The study report's entry for the corpus."""
        return {"label": self.label, "source": self.source, "licence": self.licence,
                "chars": self.chars, "segments": len(self.segments), "sha256": self.sha256,
                "prefix": self.corpus.prefix}

    def report_corpus(self, analysis: Analysis) -> dict:
        """An analysis's report's ``corpus`` entry."""
        return {"source": analysis.label, "chars": self.chars,
                "segments": len(self.segments), "sha256": self.sha256}


class Built(NamedTuple):
    """An analysis's event table, its coverage and what its report says of its members."""
    table: EventTable
    coverage: Any   # brf.eval.events.Coverage or brf.eval.byte_scorer.ByteCoverage
    infos: list     # scorer.MemberInfo / byte_scorer.ByteMemberInfo per member


@dataclasses.dataclass
class Outcome:
    """One analysis done: its scored members, coverage, result and report."""
    analysis: Analysis
    infos: list
    coverage: Any
    result: AnalysisResult
    report: dict
    check: Any = None   # the stability check (brf.eval.stability.Check) or None


@dataclasses.dataclass(frozen=True)
class _Level:
    """What both levels share: the plan, and its analyses at the level's name."""
    plan: Plan
    name = ""

    def analyses(self, index: int) -> list[Analysis]:
        return self.plan.analyses(index, self.name)

    def span(self, corpus: LoadedCorpus) -> LoadedCorpus:
        """The part of a corpus the level reads: all of it."""
        return corpus


@dataclasses.dataclass(frozen=True)
class TokenLevel(_Level):
    """Co-aligned positions (docs/study.md, "Scoring across tokenizers")."""
    name = "tokens"
    unit = "position"
    lead_only = False   # every process scores its share of each member's store
    bottleneck = True   # the same-model pair's softmax-bottleneck rows

    def build(self, analysis: Analysis, corpus: LoadedCorpus, run_dir: str,
              views: Views) -> Built | None:
        """The analysis's table (None on the processes that do not analyse)."""
        from brf.eval.events import build_event_table
        from brf.eval.scoring import truncate_top_k
        plan = self.plan
        os.makedirs(run_dir, exist_ok=True)
        scored = scorer.score_members(
            analysis.members, corpus.segments, run_dir, views.model,
            top_k=analysis.store_k, chunk=plan.scoring.chunk,
            meshes=scorer.member_meshes(plan.mesh, len(analysis.members)))
        if scored is None:  # multi-process: another process analyses
            return None
        k = analysis.top_k
        scores = [truncate_top_k(s, k) if s.topk_ids.shape[1] > k else s for s in scored.scores]
        table, cov = build_event_table(scores, scored.token_bytes, corpus.segments)
        return Built(table, cov, scored.infos)

    def fields(self, analysis: Analysis) -> dict:
        """What an analysis's report says of the level."""
        return {"top_k": analysis.top_k}

    def out_dir(self, run_dir: str) -> str:
        return run_dir

    def report_name(self, analysis: Analysis, name: str) -> str:
        return f"{name}-k{analysis.top_k}"

    def header(self) -> dict:
        """The level's section's first entries."""
        return {}

    def corpus_extras(self, corpus: LoadedCorpus, done: dict[str, Outcome], run_dir: str,
                      views: Views) -> dict:
        """What the level reports of one corpus besides its analyses: the event-space
        check where the corpus has one."""
        if "topk" not in done:
            return {}
        main, other = done["corpus"], done["topk"]
        return {"topk_sensitivity": {
            "corpus": corpus.label, "top_k": [main.analysis.top_k, other.analysis.top_k],
            "coverage": [main.coverage.positions, other.coverage.positions],
            **compare.topk_moves(main.result, other.result).as_dict(),
            "report": study_report.brief(other.report)}}

    def finish(self, section: dict, extras: dict[str, dict]) -> None:
        """Adds the level's own entries to its section (before its verdicts)."""
        section["topk_sensitivity"] = next(
            (e["topk_sensitivity"] for e in extras.values() if "topk_sensitivity" in e), None)

    def finish_verdicts(self, section: dict) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class ByteLevel(_Level):
    """Every byte (docs/study.md, "The study on every byte")."""
    name = "bytes"
    unit = "byte"
    lead_only = True    # process 0 scores the byte level alone, after the token level
    bottleneck = False

    def span(self, corpus: LoadedCorpus) -> LoadedCorpus:
        """The corpus's first segments up to ``bytes.max_chars`` (all of it at 0)."""
        return corpus.head(self.plan.bytes.max_chars)

    def build(self, analysis: Analysis, corpus: LoadedCorpus, run_dir: str,
              views: Views) -> Built:
        table, cov, infos = byte_scorer.event_table(
            analysis.members, corpus.segments, run_dir, views,
            settings=self.plan.bytes, chunk=self.plan.scoring.chunk)
        return Built(table, cov, infos)

    def fields(self, analysis: Analysis | None = None) -> dict:
        s = self.plan.bytes
        return {"beam": s.beam, "threshold": s.threshold, "max_lag": s.max_lag}

    def out_dir(self, run_dir: str) -> str:
        return os.path.join(run_dir, "bytes")

    def report_name(self, analysis: Analysis, name: str) -> str:
        return name

    def header(self) -> dict:
        b = self.plan.bytes
        return {**self.fields(), "swarm": b.swarm, "prompts": b.prompts,
                "max_chars": b.max_chars}

    def corpus_extras(self, corpus: LoadedCorpus, done: dict[str, Outcome], run_dir: str,
                      views: Views) -> dict:
        """Each member's consistency and, when the plan checks it, the precision check."""
        from brf.eval import byte_precision
        out = {"consistency": {i.name: i.consistency for o in done.values() for i in o.infos}}
        if self.plan.bytes.check_bytes:
            out["precision"] = byte_precision.check_corpus(
                self.plan, done["corpus"].analysis, done["corpus"].result,
                corpus.segments, run_dir, views)
        return out

    def finish(self, section: dict, extras: dict[str, dict]) -> None:
        from brf.eval import byte_precision
        section["consistency"] = {label: e["consistency"] for label, e in extras.items()}
        precision = {label: e["precision"] for label, e in extras.items() if "precision" in e}
        if not precision:
            return
        b = self.plan.bytes
        shifts = {k: p["verdicts"] for k, p in precision.items()}
        section["precision"] = {
            "settings": b.settings.as_dict(), "reference": b.reference.as_dict(),
            "slice_bytes": b.check_bytes, "per_corpus": precision,
            "pooled": {**byte_precision.pooled_shifts(shifts, section["pooled"], "nll"),
                       **byte_precision.pooled_shifts(shifts, section["pooled_fair"], "fair")}}

    def finish_verdicts(self, section: dict) -> None:
        if section.get("precision"):
            section["verdict"]["precision"] = study_report.precision_sentence(
                section["precision"])


Level = TokenLevel | ByteLevel


def levels(plan: Plan) -> list[Level]:
    """The plan's levels, in the order the study runs them: co-aligned positions, then
    every byte when ``plan.bytes.enabled``."""
    return [TokenLevel(plan)] + ([ByteLevel(plan)] if plan.bytes.enabled else [])


__all__ = ["Built", "ByteLevel", "Level", "LoadedCorpus", "Outcome", "TokenLevel", "Views",
           "levels"]
