"""Byte-level scoring of a corpus by one member, into a resumable store, and the
event table of several members over every byte.

A member's store keeps, for every byte of every segment, its log-probs over
the 257 byte events (float32), the byte-level gap, the pruned mass and the
number of hypotheses, plus per-segment counts (`brf.bytes.lm.score_text`).
One ``.npz`` per member, rewritten atomically after each segment; a run that
finds it resumes after the segments it holds. A store made with other
settings is rescored; a damaged one is rescored with a warning, never used.

**The byte-level gap.** A member's gap at a byte is the top-1 minus top-2
log-probability of its next-byte distribution (257 events) -- the byte-level
counterpart of the token-level top-1 minus top-2 logit gap. Per-position
phase maps read it (fusion recomputes it from the byte log-probs, which gives
the same number); per-token phase maps read each byte event's distance to the
member's top event, ``logp(top) - logp(b)``, the byte-level reading of a
token's distance to the top logit. Both use the member's own distribution of
the next byte, whatever its tokenizer.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from brf.bytes import DEFAULT_BEAM, DEFAULT_MAX_LAG, DEFAULT_THRESHOLD
from brf.bytes.lm import ByteLM, score_text
from brf.bytes.masses import N_EVENTS
from brf.bytes.state import check_bounds
from brf.event_table import EventTable
from brf.runtime import RELEASE_ABOVE, release_memory

STORE_VERSION = 2
# score_segments hands freed memory back after a segment once this much scoring time
# has passed since it last did (a study's segments take minutes: after each of them).
RELEASE_EVERY_S = 20.0
ROW_FIELDS = ("logp", "gap", "pruned", "merged", "n_hyp")
ROW_DTYPES = {"logp": np.float32, "gap": np.float32, "pruned": np.float32, "merged": np.float32,
              "n_hyp": np.int32}
STAT_FIELDS = ("byte_ll", "canonical_ll", "canonical_ll_raw", "lost", "merged_total",
               "canonical_tokens", "context_tokens", "extra_tokens", "padded_tokens", "tree_calls",
               "lookaheads", "speculated", "tables", "used_tables", "max_hyp", "seconds")


class ByteScores(dict):
    """A member's byte-level scores of a corpus cut into segments.

    Keys (arrays): ``gold`` uint8 [P] (the bytes), ``byte_starts`` int64 [S+1]
    (segment s is rows byte_starts[s]:byte_starts[s+1]), the row fields
    ``logp`` float32 [P, 257], ``gap``, ``pruned``, ``merged`` float32 [P], ``n_hyp`` int32
    [P], and one float64 [S] array per stat of `brf.bytes.lm.score_text`
    (``byte_ll``, ``canonical_ll``, ..., ``seconds``: wall time).
    """

    @property
    def n_segments(self) -> int:
        return int(self["byte_starts"].shape[0] - 1)

    @property
    def n_bytes(self) -> int:
        return int(self["gold"].shape[0])


def assemble(segments: Sequence[bytes], rows: list[dict]) -> ByteScores:
    """Joins per-segment results (dicts of row fields and stats) into ByteScores."""
    done = segments[:len(rows)]
    lens = np.asarray([len(s) for s in done], np.int64)
    out = ByteScores(gold=np.frombuffer(b"".join(done), np.uint8).copy(),
                     byte_starts=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    for name in ROW_FIELDS:
        shape = (0, N_EVENTS) if name == "logp" else (0,)
        out[name] = (np.concatenate([np.asarray(r[name], ROW_DTYPES[name]) for r in rows])
                     if rows else np.zeros(shape, ROW_DTYPES[name]))
    for name in STAT_FIELDS:
        out[name] = np.asarray([r[name] for r in rows], np.float64)
    return out


def save_partial(path: str, segments: Sequence[bytes], rows: list[dict], meta: dict) -> None:
    """Writes the segments scored so far, atomically (temp file + rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, **assemble(segments, rows), _meta=np.asarray(repr(sorted(meta.items()))),
             _version=np.asarray(STORE_VERSION))
    os.replace(tmp, path)


def store_meta(meta: dict | None, member: str, segments: Sequence[bytes],
               prefix_ids: Sequence[int], *, beam: int, threshold: float,
               max_lag: int) -> dict:
    """The key a store is made with: a store whose key differs is rescored."""
    return dict(meta or {}, member=member, beam=int(beam), threshold=float(threshold),
                max_lag=int(max_lag), prefix=tuple(int(i) for i in prefix_ids),
                n_segments=len(segments), version=STORE_VERSION)


def load_partial(path: str, segments: Sequence[bytes], meta: dict) -> list[dict]:
    """Per-segment results already in the store: [] when there is none, when it was
    made with other settings, or when it is damaged (then with a warning)."""
    if not path or not os.path.isfile(path):
        return []
    try:
        with np.load(path) as z:
            if int(z["_version"]) != STORE_VERSION or str(z["_meta"]) != repr(
                    sorted(meta.items())):
                return []
            starts = z["byte_starts"]
            gold = z["gold"]
            s_done = starts.shape[0] - 1
            want = b"".join(segments[:s_done])
            lens = [len(s) for s in segments[:s_done]]
            if (s_done > len(segments) or gold.tobytes() != want
                    or not np.array_equal(np.diff(starts), lens)
                    or z["logp"].shape != (len(want), N_EVENTS)):
                raise ValueError("its bytes or shapes do not match the segments")
            rows = []
            for s in range(s_done):
                a, b = int(starts[s]), int(starts[s + 1])
                row = {name: z[name][a:b] for name in ROW_FIELDS}
                row.update({name: float(z[name][s]) for name in STAT_FIELDS})
                if not np.isfinite(row["byte_ll"]):
                    raise ValueError(f"segment {s} has a non-finite log-likelihood")
                rows.append(row)
            return rows
    except Exception as e:  # noqa: BLE001 -- any unreadable store is rescored
        warnings.warn(f"byte store {path} is damaged ({type(e).__name__}: {e}); rescoring it",
                      stacklevel=2)
        return []


def score_segments(lm: ByteLM, segments: Sequence[str | bytes], *,
                   prefix_ids: Sequence[int] = (), beam: int = DEFAULT_BEAM,
                   threshold: float = DEFAULT_THRESHOLD, max_lag: int = DEFAULT_MAX_LAG,
                   chunk: int = 256, store_path: str | None = None, meta: dict | None = None,
                   desc: str = "byte scoring", pad_to: int = 0,
                   release: bool = True, stored: Sequence[dict] | None = None) -> ByteScores:
    """Scores every byte of every segment (each read after BOS and the prefix tokens),
    resuming from and saving to ``store_path``.

    Args:
        lm: the member.
        segments: texts (str are UTF-8 encoded).
        prefix_ids: tokens every segment is read after (a prompt prefix).
        beam, threshold, max_lag: pruning and merging (`brf.bytes.lm.score_text`).
        chunk: tokens per canonical forward pass.
        store_path: the member's ``.npz`` store (None: in memory only).
        meta: what the store must have been made with to be reused (the
            settings above are added).
        desc: progress-bar label.
        pad_to: pad every segment's canonical pass to at least this many tokens
            (calls with different segments then share compiled shapes).
        release: hand the memory the segments freed back to the system
            (`brf.runtime.release_memory`) after each segment once
            ``RELEASE_EVERY_S`` seconds of scoring have passed since the last
            time, and at the end, while the process holds at least
            ``brf.runtime.RELEASE_ABOVE`` bytes; without it glibc keeps the heap's high-water
            mark, which grew a whole study past 24 GB. (Each release is a full
            garbage collection, about half a second in a process that has traced
            many programs: after every segment of a short text it cost more than
            the scoring.)
        stored: the segments already read from ``store_path`` with this key
            (:func:`load_partial`'s rows), for a caller that read it first: the
            store is then not read again (nor a damaged one reported twice).

    Returns:
        ByteScores over all segments.
    """
    check_bounds(beam, threshold, max_lag)
    data = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in segments]
    meta = store_meta(meta, lm.name, data, prefix_ids, beam=beam, threshold=threshold,
                      max_lag=max_lag)
    if stored is not None:
        done = list(stored)
    else:
        done = load_partial(store_path, data, meta) if store_path else []
    ctx = len(lm.context(prefix_ids))
    # One KV-cache shape for every segment (one compilation): the longest, padded.
    longest = max([ctx + len(lm.encode(lm.lead + s)) for s in data] + [pad_to, 1])
    pad_to = -(-longest // chunk) * chunk
    bar = tqdm(total=sum(len(s) for s in data), initial=sum(len(s) for s in data[:len(done)]),
               desc=desc, unit="B", unit_scale=True, dynamic_ncols=True)
    last_release, unreleased = time.perf_counter(), False
    while len(done) < len(data):
        t0 = time.perf_counter()
        sc = score_text(lm, data[len(done)], prefix_ids=prefix_ids, beam=beam,
                        threshold=threshold, max_lag=max_lag, chunk=chunk, pad_to=pad_to)
        row = {"logp": sc.logp, "gap": sc.gap, "pruned": sc.pruned, "merged": sc.merged,
               "n_hyp": sc.n_hyp}
        row.update({name: float(sc.stats.get(name, 0.0)) for name in STAT_FIELDS})
        row["merged_total"] = sc.stats["merged"]
        row["seconds"] = time.perf_counter() - t0
        done.append(row)
        del sc
        unreleased = True
        if release and time.perf_counter() - last_release >= RELEASE_EVERY_S:
            release_memory(RELEASE_ABOVE)
            last_release, unreleased = time.perf_counter(), False
        bar.update(len(data[len(done) - 1]))
        if store_path:
            save_partial(store_path, data, done, meta)
    bar.close()
    if release and unreleased:
        release_memory(RELEASE_ABOVE)
    return assemble(data, done)


def byte_event_table(scores: Sequence[ByteScores]) -> EventTable:
    """The event table of several members over every byte (`brf.eval.fitting.EventTable`).

    Events are the 257 byte events (event b < 256 is the byte b, 256 is
    end-of-text); the gold event of a row is the actual next byte; every row
    stands for one byte (``gold_bytes`` = 1), so bits per byte are the mean NLL
    in bits. ``gap`` is each member's byte-level gap (module docstring).

    Raises:
        ValueError: the members scored different texts or segmentations.
    """
    if not scores:
        raise ValueError("no members")
    ref = scores[0]
    for i, sc in enumerate(scores[1:], 1):
        if not (np.array_equal(sc["gold"], ref["gold"])
                and np.array_equal(sc["byte_starts"], ref["byte_starts"])):
            raise ValueError(f"member {i} scored other bytes or segments than member 0")
    P = ref.n_bytes
    logp = np.stack([np.asarray(sc["logp"], np.float32) for sc in scores], axis=1)
    gap = np.stack([np.asarray(sc["gap"], np.float32) for sc in scores], axis=1)
    segment = np.repeat(np.arange(ref.n_segments), np.diff(ref["byte_starts"]))
    return EventTable(logp, ref["gold"].astype(np.int64), gap, np.ones(P, np.int64), segment)


def consistency(scores: ByteScores) -> dict:
    """A member's byte-level log-likelihood of the corpus against its canonical
    tokenization's, in bits per byte.

    ``byte`` = -byte_ll, ``canonical`` = -canonical_ll (both conditioned on text
    + EOS tokens), ``canonical_raw`` = the model's own canonical NLL (what
    token-level scoring reports); ``noncanonical`` = canonical - byte: the mass of
    the covering tokenizations other than the canonical one (log(P(x) /
    p(canonical)), per byte); ``special`` = canonical_raw - canonical: what the
    model gives control tokens other than EOS; ``lost``: the log-mass pruning
    dropped (a bound on how far ``byte`` may lie below the exact NLL: the kept
    hypotheses' mass bounds the prefix probability from below; how far above
    it may lie depends on the dropped hypotheses' futures and is not bounded).
    """
    n = max(1, scores.n_bytes)
    bits = 1.0 / (n * np.log(2.0))
    byte = -float(np.sum(scores["byte_ll"])) * bits
    canon = -float(np.sum(scores["canonical_ll"])) * bits
    raw = -float(np.sum(scores["canonical_ll_raw"])) * bits
    tokens = float(np.sum(scores["canonical_tokens"]))
    return {"bytes": scores.n_bytes, "byte": byte, "canonical": canon, "canonical_raw": raw,
            "noncanonical": canon - byte, "special": raw - canon,
            "lost": float(np.sum(scores["lost"])) * bits,
            "pruned_mean": float(np.mean(scores["pruned"])) if n else 0.0,
            "merged_mean": float(np.mean(scores["merged"])) if n else 0.0,
            "forward_per_byte": float(np.sum(scores["canonical_tokens"])
                                      + np.sum(scores["context_tokens"])
                                      + np.sum(scores["extra_tokens"])) / n,
            "extra_per_token": float(np.sum(scores["extra_tokens"])) / max(1.0, tokens),
            "hyp_mean": float(np.mean(scores["n_hyp"])) if n else 0.0,
            "seconds": float(np.sum(scores["seconds"]))}


__all__ = ["ByteScores", "ROW_FIELDS", "STAT_FIELDS", "assemble", "byte_event_table",
           "consistency", "load_partial", "save_partial", "score_segments"]
