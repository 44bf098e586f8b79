"""Scoring an analysis's members on every byte: one byte store per member.

The byte level of the study (``plan.bytes``; docs/study.md, "The study on every
byte"). Each member's byte-level view (:class:`brf.bytes.lm.ByteLM`, built once
per model from the model the token level loaded) reads every segment after BOS
and the member's prefix tokens -- the tokens the token level reads
(:func:`brf.eval.scorer.prefix_ids`) -- and gives its distribution over the 257
byte events (256 bytes, end of text) at every byte. Each member's scores go to
its store in the corpus's run directory (``bytes-<member>.npz``,
:func:`brf.bytes.scoring.score_segments`: resumable segment by segment; a store
made with another beam, threshold, prefix or other segments is rescored). A
complete store is read back without running (or even holding) the model's
weights.

The event table has one row per byte of the corpus
(:func:`brf.bytes.scoring.byte_event_table`), so the coverage is every byte;
what pruning dropped is reported per member (the mean pruned fraction of the
prefix mass per byte, and the log-mass dropped in bits per byte), with each
member's consistency numbers (:func:`brf.bytes.scoring.consistency`: its
byte-level against its canonical tokenization's bits per byte).

Multi-process runs: process 0 scores the bytes (:mod:`brf.eval.study`).
"""

from __future__ import annotations

import hashlib
import os
from typing import NamedTuple, Sequence

from brf.eval import scorer
from brf.event_table import EventTable
from brf.eval.plan import ByteSettings, Member


class ByteMemberInfo(NamedTuple):
    """What a report says about a member scored on every byte."""
    name: str
    vocab_size: int
    prefix_tokens: int
    positions: int              # bytes scored
    consistency: dict           # brf.bytes.scoring.consistency, in bits per byte

    def as_dict(self) -> dict:
        return self._asdict()


class ByteCoverage(NamedTuple):
    """Every byte of the corpus is a row; what pruning dropped, per member."""
    positions: int                   # rows of the event table (bytes scored)
    bytes_total: int                 # UTF-8 bytes of the corpus
    pruned_mean: tuple               # per member: mean fraction of the prefix mass pruned per byte
    lost_bits_per_byte: tuple        # per member: log-mass pruning dropped, bits per byte

    def as_dict(self) -> dict:
        return {"positions": self.positions, "bytes_total": self.bytes_total,
                "fraction_of_bytes": self.positions / max(1, self.bytes_total),
                "pruned_mean": list(self.pruned_mean),
                "lost_bits_per_byte": list(self.lost_bits_per_byte)}


def store_path(run_dir: str, member: Member) -> str:
    """The member's byte store in a run directory (named like its token store)."""
    name = os.path.basename(scorer.store_path(run_dir, member))
    return os.path.join(run_dir, "bytes-" + name[len("scores-"):])


def byte_lm(model, name: str):
    """A loaded model's byte-level view (its trie cached beside the alignment caches)."""
    from brf.align.union import default_cache_dir
    from brf.bytes.lm import ByteLM
    return ByteLM(model.params, model.cfg, model.tokenizer, name=name,
                  cache_dir=default_cache_dir())


def _stored_rows(path: str, name: str, data: Sequence[bytes], prefix: Sequence[int],
                 settings: ByteSettings, meta: dict) -> list[dict]:
    """The segments the member's store holds with these settings (the key of
    ``brf.bytes.scoring.score_segments``): [] when there is no store, it was made
    with other settings, or it is damaged (``load_partial`` then warns, once)."""
    from brf.bytes import scoring as byte_scoring
    if not os.path.isfile(path):
        return []
    full = byte_scoring.store_meta(meta, name, data, prefix, beam=settings.beam,
                                   threshold=settings.threshold, max_lag=settings.max_lag)
    return byte_scoring.load_partial(path, data, full)


def _stored(path: str, name: str, data: Sequence[bytes], prefix: Sequence[int],
            settings: ByteSettings, meta: dict):
    """The member's ByteScores when its store holds every segment with these settings
    (the key of ``brf.bytes.scoring.score_segments``), else None."""
    from brf.bytes import scoring as byte_scoring
    rows = _stored_rows(path, name, data, prefix, settings, meta)
    return byte_scoring.assemble(data, rows) if len(rows) == len(data) else None


def score_members(members: Sequence[Member], segments: Sequence[str], run_dir: str,
                  views, *, settings: ByteSettings, chunk: int
                  ) -> tuple[list, list[ByteMemberInfo]]:
    """Every member's byte-level scores of the segments (reusing their stores).

    Args:
      members: who to score.
      segments: the corpus, cut into segments (the token level's).
      run_dir: where the stores live.
      views: the members' views (:class:`brf.eval.levels.Views`): ``model(name)``
        (``.cfg``, ``.params``, ``.tokenizer``) and ``byte_lm(name)``, asked for only
        by a member whose store is incomplete.
      settings: the beam, prune threshold and merge lag.
      chunk: tokens per canonical forward pass.

    Returns:
      (ByteScores per member, ByteMemberInfo per member).
    """
    from brf.bytes.scoring import assemble, consistency, score_segments
    from brf.runtime import release_compiled
    data = [s.encode("utf-8") for s in segments]
    meta = {"corpus": hashlib.sha256("\x00".join(segments).encode()).hexdigest()[:16]}
    os.makedirs(run_dir, exist_ok=True)
    scores, infos = [], []
    for m in members:
        model = views.model(m.name)
        pre = scorer.prefix_ids(model.tokenizer, m.prefix)
        path = store_path(run_dir, m)
        # The store is read once: a complete one without the model's byte view, a
        # partial one resumed from these rows (a damaged one is warned about once).
        rows = _stored_rows(path, m.name, data, pre, settings, meta)
        if len(rows) == len(data):
            sc = assemble(data, rows)
        else:
            sc = score_segments(views.byte_lm(m.name), data, prefix_ids=pre, beam=settings.beam,
                                threshold=settings.threshold, max_lag=settings.max_lag,
                                chunk=chunk, store_path=path, meta=meta, stored=rows,
                                desc=f"byte scoring {m.label[:40]}")
            release_compiled()  # the walk's tree-call programs, one per shape it met
        c = {k: (int(v) if k == "bytes" else float(v)) for k, v in consistency(sc).items()}
        scores.append(sc)
        infos.append(ByteMemberInfo(m.label, int(model.cfg.vocab_size), len(pre), sc.n_bytes, c))
    return scores, infos


def event_table(members: Sequence[Member], segments: Sequence[str], run_dir: str, views,
                *, settings: ByteSettings, chunk: int
                ) -> tuple[EventTable, ByteCoverage, list[ByteMemberInfo]]:
    """The members' event table over every byte of the segments: (table, coverage,
    member infos); ``views`` as in :func:`score_members`."""
    from brf.bytes.scoring import byte_event_table
    scores, infos = score_members(members, segments, run_dir, views, settings=settings,
                                  chunk=chunk)
    table = byte_event_table(scores)
    total = sum(len(s.encode("utf-8")) for s in segments)
    if table.n_positions != total:  # every byte is a row, or the store is not this corpus
        raise ValueError(f"the byte-level table has {table.n_positions} rows for {total} bytes")
    cov = ByteCoverage(table.n_positions, total,
                       tuple(i.consistency["pruned_mean"] for i in infos),
                       tuple(i.consistency["lost"] for i in infos))
    return table, cov, infos


__all__ = ["ByteCoverage", "ByteMemberInfo", "byte_lm", "event_table", "score_members",
           "store_path"]
