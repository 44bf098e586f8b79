"""What the byte-level verdicts rest on: each member's measured precision, and how far
that approximation could move each verdict.

The study scores every byte with the plan's settings (``plan.bytes``: a beam, a prune
threshold and a merge lag). Those views approximate each member's own next-byte
distributions, and the approximation has no bound per byte (`brf.bytes.precision`).
So every run measures it, on a *slice* of each corpus: the first ``slice_bytes``
bytes of the first test segment, read as in the study (after BOS and the member's
prefix, the rest of the segment's text after them).

1. **Members** (:func:`measure_members`): each member of the corpus's default pair
   rescores the slice with the reference settings (``brf.bytes.REFERENCE`` unless the
   plan says otherwise; cached in the corpus's run directory). Reported: the study's
   settings against the reference (difference in bits per byte, per-byte total
   variation: mean, 99th percentile, maximum), and, when the study merges, what
   merging alone changes (the study's settings against the same without merging).
2. **Verdicts** (:func:`verdict_shifts`): the default pair's fitted methods (fitted on
   the study's own calibration split, unchanged) are evaluated on the slice twice:
   on the members' views at the study's settings and at the reference. For each
   byte-level comparison (the best BRF row against the best baseline; against the
   best of every other row) the *shift* is the change in their paired mean
   difference, reference minus study. A verdict *holds* when its 95% CI, moved by
   |shift| either way, still lies where it lay (below 0, above 0, or across it): the
   approximation, as measured on the slice, is too small to change it.

The shift is measured on one slice per corpus and applied to the whole test split as
an estimate; it is a measured sensitivity, not a bound.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from brf.bytes import Settings
from brf.bytes.precision import compare
from brf.event_table import EventTable
from brf.eval.fitting import evaluate


class Slice(NamedTuple):
    """Where the precision check reads: ``n_bytes`` bytes from the start of segment
    ``segment`` (the first test segment), rows ``start:start + n_bytes`` of the
    corpus's byte table, and row ``test_start`` of its test split."""
    segment: int
    n_bytes: int
    start: int
    test_start: int


def slice_of(segments: Sequence[str], n_calibration: int, slice_bytes: int) -> Slice:
    """The precision slice of a corpus cut into ``segments`` (the first
    ``n_calibration`` of them calibrate)."""
    data = [s.encode("utf-8") for s in segments]
    s = min(n_calibration, len(data) - 1)
    start = sum(len(d) for d in data[:s])
    return Slice(s, min(int(slice_bytes), len(data[s])), start,
                 start - sum(len(d) for d in data[:n_calibration]))


def reference_rows(load_lm: Callable[[], Any], name: str, text: bytes, n_bytes: int,
                   prefix_ids: Sequence[int], settings: Settings, path: str) -> np.ndarray:
    """[n_bytes, 257] float32 log-probs of ``text``'s first ``n_bytes`` bytes at
    ``settings`` (`brf.bytes.lm.score_text` with ``n_bytes``) by the member ``name``,
    cached at ``path`` (a cache made from another member, text, prefix or settings is
    recomputed). ``load_lm()`` gives the member's ByteLM; it is called only to score."""
    from brf.bytes.lm import score_text
    from brf.runtime import release_compiled
    key = repr((name, hashlib.sha256(text).hexdigest()[:16], int(n_bytes),
                tuple(int(i) for i in prefix_ids), tuple(settings)))
    if os.path.isfile(path):
        try:
            with np.load(path) as z:
                if str(z["key"]) == key and z["logp"].shape == (n_bytes, 257):
                    return np.asarray(z["logp"])
        except Exception:  # noqa: BLE001 -- an unreadable cache is recomputed
            pass
    sc = score_text(load_lm(), text, prefix_ids=prefix_ids, beam=settings.beam,
                    threshold=settings.threshold, max_lag=settings.max_lag, n_bytes=n_bytes)
    logp = sc.logp.astype(np.float32)
    del sc
    release_compiled()  # the reference walk's programs (brf.runtime)
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, logp=logp, key=np.asarray(key))
    os.replace(tmp, path)
    return logp


def measure_members(names: Sequence[str], study_rows: Sequence[np.ndarray],
                    reference: Sequence[np.ndarray], gold: np.ndarray,
                    unmerged: Sequence[np.ndarray] | None = None) -> dict[str, dict]:
    """Per member: the study's rows against the reference's on the slice
    (`brf.bytes.precision.compare`), and against the same settings without merging
    (``merging``) when ``unmerged`` is given."""
    out = {}
    for i, name in enumerate(names):
        out[name] = compare(study_rows[i], reference[i], gold)
        if unmerged is not None:
            out[name]["merging"] = compare(study_rows[i], unmerged[i], gold)
    return out


def slice_table(rows: Sequence[np.ndarray], gold: np.ndarray, segment: int) -> EventTable:
    """The members' event table on the slice from their [n, 257] rows (as
    `brf.bytes.scoring.byte_event_table` builds it: one row per byte)."""
    from brf.bytes.lm import top2_gap
    logp = np.stack([np.asarray(r, np.float32) for r in rows], axis=1)
    gap = np.stack([top2_gap(np.asarray(r, np.float64)) for r in rows], axis=1)
    n = len(gold)
    return EventTable(logp, np.asarray(gold, np.int64), gap.astype(np.float32),
                      np.ones(n, np.int64), np.full(n, segment, np.int64))


def _where(lo: float, hi: float) -> str:
    return "below 0" if hi < 0 else "above 0" if lo > 0 else "across 0"


def holds(ci: Sequence[float], shift: float) -> bool:
    """Whether a CI moved by |shift| either way still lies where it lay (below 0, above
    0, or across 0): a verdict the measured approximation cannot change."""
    s = abs(float(shift))
    here = _where(ci[0], ci[1])
    return _where(ci[0] - s, ci[1] - s) == here == _where(ci[0] + s, ci[1] + s)


def verdict_shifts(result, study: EventTable, reference: EventTable) -> dict[str, dict]:
    """How far the members' approximation moves each comparison of ``result`` (an
    :class:`brf.eval.analysis.AnalysisResult` of the default pair) on the slice.

    Returns:
        {"<kind> [<variant>]": {"brf", "other", "difference", "ci", "shift",
        "study_slice", "reference_slice", "holds"}} for kind 'nll' (best BRF vs best
        baseline) and 'fair' (best BRF vs best of every other row).
    """
    out: dict[str, dict] = {}
    cache: dict[tuple[str, int], np.ndarray] = {}

    def nll(label: str, which: int) -> np.ndarray:
        if (label, which) not in cache:
            f = result.by_label(label).fitted
            cache[label, which] = evaluate(f, study if which == 0 else reference)["nll"]
        return cache[label, which]

    pairs = [(f"nll [{v}]", c) for v, c in result.comparisons.items()]
    pairs += [(f"fair [{v}]", c.pair()) for v, c in result.fair.items()]
    for key, c in pairs:
        d_study = float(np.mean(nll(c.brf, 0) - nll(c.baseline, 0)))
        d_ref = float(np.mean(nll(c.brf, 1) - nll(c.baseline, 1)))
        shift = d_ref - d_study
        out[key] = {"brf": c.brf, "other": c.baseline, "difference": c.mean_difference,
                    "ci": list(c.ci), "shift": shift, "study_slice": d_study,
                    "reference_slice": d_ref, "holds": holds(c.ci, shift)}
    return out


def pooled_shifts(per_corpus: Mapping[str, Mapping[str, dict]],
                  pooled: Mapping[str, Mapping[str, Any]], kind: str) -> dict[str, dict]:
    """The pooled verdicts' shifts: the corpora's shifts averaged with equal weight (as
    the pooled difference averages their differences)."""
    out = {}
    for v, p in pooled.items():
        shifts = [s[f"{kind} [{v}]"]["shift"] for s in per_corpus.values()
                  if f"{kind} [{v}]" in s]
        if not shifts:
            continue
        shift = float(np.mean(shifts))
        out[f"{kind} [{v}]"] = {"difference": p["mean_difference"], "ci": list(p["ci"]),
                                "shift": shift, "holds": holds(p["ci"], shift)}
    return out


def check_corpus(plan, analysis, result, segments: Sequence[str], run_dir: str,
                 views) -> dict:
    """The precision check of one corpus's byte level: each member of the default pair
    (``analysis``, fitted into ``result``) rescored on the slice with the reference
    settings (and, when the study merges, without merging), against the study's rows,
    and the shift each byte-level comparison takes between the two. ``views``: the
    members' views (:class:`brf.eval.levels.Views`)."""
    from brf.eval import byte_scorer, scorer
    from brf.eval.plan import calibration_segments
    b = plan.bytes
    sl = slice_of(segments, calibration_segments(plan.scoring, len(segments)), b.check_bytes)
    text = segments[sl.segment].encode("utf-8")
    gold = np.frombuffer(text[:sl.n_bytes], np.uint8).astype(np.int64)
    test = result.test
    study_rows, reference, unmerged = [], [], []
    for i, m in enumerate(analysis.members):
        pre = scorer.prefix_ids(views.model(m.name).tokenizer, m.prefix)
        study_rows.append(test.logp[sl.test_start:sl.test_start + sl.n_bytes, i])
        base = os.path.basename(byte_scorer.store_path(run_dir, m))[len("bytes-"):]
        for settings, tag, out in ((b.reference, "reference", reference),
                                   (Settings(b.beam, b.threshold, 0), "unmerged", unmerged)):
            if tag == "unmerged" and not b.max_lag:
                continue
            out.append(reference_rows(
                lambda: views.byte_lm(m.name), m.name, text, sl.n_bytes, pre, settings,
                os.path.join(run_dir, f"bytes-{tag}-{base}")))
    return {"segment": sl.segment, "bytes": sl.n_bytes,
            "members": measure_members([m.label for m in analysis.members], study_rows,
                                       reference, gold, unmerged or None),
            "verdicts": verdict_shifts(result, slice_table(study_rows, gold, sl.segment),
                                       slice_table(reference, gold, sl.segment))}


__all__ = ["Slice", "check_corpus", "holds", "measure_members", "pooled_shifts",
           "reference_rows", "slice_of", "slice_table", "verdict_shifts"]
