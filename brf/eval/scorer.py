"""Scoring an analysis's members on a corpus: one store per member, every device used.

Each member reads every segment teacher-forced (``[BOS] + segment``, or ``[BOS]
+ prefix + segment`` for a member with a prefix, scored on the segment's own
tokens only, so its rows line up with the unprefixed model's) into its store in
the run directory (:mod:`brf.eval.scoring`), which later runs reuse. A model
shared by several members is loaded once. With a mesh, segments go over its
'data' axis and the member's weights over 'model'; members on different device
groups are scored at the same time. In a multi-process run every process scores
its share of the segments into its own part of the store, and process 0 merges
the parts.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from brf import sharding
from brf.align.vocab import encode_text
from brf.eval import scoring
from brf.eval.plan import Member, ValidationError


class MemberInfo(NamedTuple):
    """What a report says about a scored member."""
    name: str
    vocab_size: int
    prefix_tokens: int
    positions: int | None

    def as_dict(self) -> dict:
        return self._asdict()


class Scored(NamedTuple):
    """Every member's scores of one corpus (on the lead process)."""
    infos: list[MemberInfo]
    scores: list[scoring.MemberScores]
    token_bytes: list[list[bytes]]


class _Job(NamedTuple):
    member: Member
    model: Any
    ids: list[np.ndarray]
    n_prefix: int
    has_bos: bool


# Barrier names must be unique per use; every process makes the same score_members
# calls in the same order, so their counters agree (the members of one call are
# told apart by their index, whatever order threads reach their barriers in).
_BARRIERS = itertools.count()


def encode(tokenizer, model_cfg, text: str) -> np.ndarray:
    """``[BOS] + tokens(text)`` (no BOS for a model without one), int32."""
    ids = encode_text(tokenizer, text)
    if model_cfg.bos_id is not None:
        ids = [model_cfg.bos_id] + list(ids)
    return np.asarray(ids, np.int32)


def prefix_ids(tokenizer, prefix: str) -> list[int]:
    """A member's prefix as the tokens it reads between BOS and each segment (the byte
    level reads the same ones, :mod:`brf.eval.byte_scorer`)."""
    return encode_text(tokenizer, prefix) if prefix else []


def member_token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """id -> decoded bytes (b"" for special tokens and embedding rows past the tokenizer)."""
    from brf.align.vocab import token_table
    tb = list(token_table(tokenizer).token_bytes)
    return tb[:vocab_size] + [b""] * (vocab_size - len(tb))


def check_distinct(members: Sequence[Member], models: dict[str, Any]) -> None:
    """Refuses two members that load the same model with the same prefix, by what they
    load (`brf.checkpoints.store.identity` of the checkpoint), not by how they are
    named: a registered name and the cache's path to its checkpoint, or one GGUF by
    two paths, would study a model against itself. (config.members naming one
    member twice is refused before any model loads, brf.eval.plan.)

    Raises:
        ValidationError: naming both members as given.
    """
    from brf.checkpoints import store
    seen: dict[tuple, Member] = {}
    for m in members:
        path = getattr(models[m.name], "path", None)
        if not path or not os.path.isdir(path) or not store.is_checkpoint(path):
            continue  # a model built in memory (tests): nothing to compare
        key = (store.identity(path), m.prefix)
        if key in seen and seen[key].label != m.label:
            raise ValidationError(
                f"config.members: {seen[key].label!r} and {m.label!r} load the same model "
                f"(the same checkpoint content), so the study would compare a model with "
                f"itself; give one of them another prefix= (a prompt ensemble) or name "
                f"another model")
        seen.setdefault(key, m)


def _job(member: Member, model, segments: Sequence[str]) -> _Job:
    """The member's token ids per segment, checked against its context."""
    pre = prefix_ids(model.tokenizer, member.prefix)
    ids = [encode(model.tokenizer, model.cfg, s) for s in segments]
    b = 1 if model.cfg.bos_id is not None else 0
    if pre:
        ids = [np.concatenate([x[:b], np.asarray(pre, np.int32), x[b:]]) for x in ids]
    longest = max(len(x) for x in ids)
    if longest > model.cfg.max_seq_len:
        raise ValidationError(
            f"{member.label}: prefix ({len(pre)} tokens) + the longest segment make "
            f"{longest} tokens, more than its context {model.cfg.max_seq_len}; shorten the "
            f"prefix or lower scoring.segment_chars")
    return _Job(member, model, ids, len(pre), bool(b))


def store_path(run_dir: str, member: Member) -> str:
    """The member's score store in a run directory."""
    safe = member.name.replace("/", "_").replace(os.sep, "_")
    if member.prefix:
        safe += "-" + hashlib.sha256(member.prefix.encode()).hexdigest()[:10]
    return os.path.join(run_dir, f"scores-{safe}.npz")


def score_members(members: Sequence[Member], segments: Sequence[str], run_dir: str,
                  load_model: Callable[[str], Any], *, top_k: int, chunk: int,
                  meshes: Sequence[Any] | None = None) -> Scored | None:
    """Scores every member on the segments (reusing their stores).

    Every member's encoding is checked against its context before any member is
    scored.

    Args:
      members: who to score.
      segments: the corpus, cut into segments.
      run_dir: where the stores live.
      load_model: name -> model (``.cfg``, ``.params``, ``.tokenizer``).
      top_k: top tokens kept per position.
      chunk: tokens per forward pass.
      meshes: None (one device), or one mesh per member (:mod:`brf.sharding`).

    Returns:
      The scores on process 0 (or a single process); None on the others.
    """
    fingerprint = hashlib.sha256("\x00".join(segments).encode()).hexdigest()[:16]
    models: dict[str, Any] = {}
    jobs = []
    for m in members:
        if m.name not in models:
            models[m.name] = load_model(m.name)
    check_distinct(members, models)
    for m in members:
        jobs.append(_job(m, models[m.name], segments))
    meshes = sharding.per_member(meshes, len(jobs))
    call = next(_BARRIERS)  # this call's barrier names, the same on every process

    def score_one(j: int):
        job = jobs[j]
        path = store_path(run_dir, job.member)
        meta = {"member": job.member.label, "corpus": fingerprint, "segments": len(segments)}
        placed = (None if job.model.params is None
                  else sharding.shard_params(job.model.params, meshes[j]))
        if sharding.process_count() == 1:
            sc = scoring.score_segments(placed, job.model.cfg, job.ids, top_k=top_k,
                                        chunk=chunk, store_path=path, meta=meta,
                                        desc=f"scoring {job.member.label[:40]}",
                                        mesh=meshes[j])
        else:
            sc = _score_share(placed, job, path, meta, top_k=top_k, chunk=chunk,
                              mesh=meshes[j], barrier=f"brf.validate.scored.{call}.{j}")
        del placed
        return None if sc is None else scoring.strip_prefix(sc, job.n_prefix, job.has_bos)

    results = sharding.per_device_group(meshes, score_one)  # members apart: at once
    if sharding.process_count() > 1:
        sharding.barrier(f"brf.validate.merged.{call}")  # process 0 has merged
        if sharding.process_index() != 0:
            return None
    infos = [MemberInfo(job.member.label, int(job.model.cfg.vocab_size), job.n_prefix,
                        int(sc.row_starts[-1])) for job, sc in zip(jobs, results)]
    tbs = [member_token_bytes(job.model.tokenizer, job.model.cfg.vocab_size) for job in jobs]
    return Scored(infos, list(results), tbs)


def _score_share(params, job: _Job, path: str, meta: dict, *, top_k: int, chunk: int, mesh,
                 barrier: str):
    """Multi-process scoring of one member: this process's share into its part of the
    store; process 0 then merges every part into ``path`` (the single-process store,
    byte for byte the same format) and returns the scores; the others None."""
    index, count = sharding.process_index(), sharding.process_count()
    vocab = int(job.model.cfg.vocab_size)
    done = scoring.load_partial(path, dict(meta, top_k=top_k, n_segments=len(job.ids)))
    if len(done) == len(job.ids):  # merged (or scored by one process) before: reuse it
        return scoring.assemble(job.ids, done, vocab) if index == 0 else None
    share = sharding.process_share(len(job.ids), index, count)
    parts = [scoring.part_path(path, i, count) for i in range(count)]
    scoring.score_segments(params, job.model.cfg, job.ids[share.start:share.stop],
                           top_k=top_k, chunk=chunk, store_path=parts[index],
                           meta=dict(meta, share=(share.start, share.stop, count)),
                           desc=f"scoring {job.member.label[:40]} [{index}/{count}]",
                           mesh=mesh)
    sharding.barrier(barrier)
    if index != 0:
        return None
    return scoring.merge_parts(path, parts, job.ids, meta, top_k=top_k, vocab_size=vocab)


def member_meshes(mesh_spec, n_members: int) -> list | None:
    """One mesh per member from the plan's mesh settings
    (:func:`brf.sharding.member_meshes`); None when every member runs on one device."""
    meshes = sharding.member_meshes(mesh_spec, n_members)
    return None if sharding.on_one_device(meshes) else meshes


def registry_loader(members: Sequence[Member], mesh_spec) -> Callable[[str], Any]:
    """``name -> model`` from brf.checkpoints, each model read straight onto the devices
    it is scored on (``registry.load(mesh=)``): the plan's mesh, or with
    ``placement='apart'`` the group of the first member that uses it. Every name is
    resolved first: an unknown model fails before anything is loaded or scored."""
    from brf.checkpoints import registry
    for m in members:
        registry.resolve(m.name)
    meshes = sharding.per_member(member_meshes(mesh_spec, len(members)), len(members))
    home: dict[str, Any] = {}
    for m, mesh in zip(members, meshes):
        home.setdefault(m.name, mesh)
    return lambda name: registry.load(name, mesh=home.get(name))
