"""Teacher-forced scoring of a corpus by one member, into a compact store.

For every position t of the member's tokenization (predicting token t + 1) the
store keeps what the analyses need, not the logits: the top-k token ids and
log-probabilities, the gold token's log-prob, the entropy, the top-1 minus
top-2 logit gap and the log-normaliser. Logits are produced chunk by chunk
(:func:`brf.models.iter_logits_chunks`), so memory stays bounded even for
Gemma's 262144-token vocabulary. A store is one ``.npz`` file per member,
written atomically; a run that finds it reuses it without running the model.
"""

from __future__ import annotations

import functools
import os
import zipfile
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from brf import sharding as sharding_lib
from brf.eval import caches
from brf.models import iter_logits_chunks

STORE_VERSION = 1


class MemberScores(NamedTuple):
    """One member's teacher-forced scores of a corpus cut into segments.

    Segment s holds tokens ``token_ids[tok_starts[s]:tok_starts[s+1]]`` (its
    own BOS first if the model has one) and rows
    ``row_starts[s]:row_starts[s+1]``; row r of a segment predicts the token
    after the r-th one. Row arrays:

    Attributes:
      token_ids: [N] all segments' tokens, concatenated.
      tok_starts: [S+1] segment offsets into token_ids.
      row_starts: [S+1] segment offsets into the row arrays (N_s - 1 rows each).
      topk_ids: [R, K] ids of the K most likely next tokens.
      topk_logp: [R, K] their log-probabilities (descending).
      gold_logp: [R] log-prob of the actual next token.
      entropy: [R] entropy (nats) of the next-token distribution.
      gap: [R] top-1 minus top-2 logit.
      log_norm: [R] log-sum-exp of the logits.
      vocab_size: V.
    """
    token_ids: np.ndarray
    tok_starts: np.ndarray
    row_starts: np.ndarray
    topk_ids: np.ndarray
    topk_logp: np.ndarray
    gold_logp: np.ndarray
    entropy: np.ndarray
    gap: np.ndarray
    log_norm: np.ndarray
    vocab_size: int


ROW_FIELDS = ("topk_ids", "topk_logp", "gold_logp", "entropy", "gap", "log_norm")


def chunked_top_k(x_CxV: jax.Array, k: int, chunk: int = 256):
    """Exact top-k along the last axis, two-stage (XLA:CPU's top_k on the full
    row is the slow part: measured 5.9 s for 256 x 262144 on the host, 0.2 s
    this way).

    Every top-k element lies in one of the k chunks with the largest maxima
    (otherwise k other chunks would each hold a larger element), so the top-k
    of those k chunks' elements is the exact answer.

    Returns:
      (values [C, k] descending, ids [C, k] int32).
    """
    c, v = x_CxV.shape
    if v % chunk or v // chunk < k:
        vals, ids = jax.lax.top_k(x_CxV, k)
        return vals, ids.astype(jnp.int32)
    xb = x_CxV.reshape(c, v // chunk, chunk)
    _, top_chunks = jax.lax.top_k(jnp.max(xb, axis=-1), k)
    cand = jnp.take_along_axis(xb, top_chunks[:, :, None], axis=1).reshape(c, k * chunk)
    vals, j = jax.lax.top_k(cand, k)
    ids = jnp.take_along_axis(top_chunks, j // chunk, axis=1) * chunk + j % chunk
    return vals, ids.astype(jnp.int32)


def raw_summary(logits_CxV, gold_C, k: int):
    """One pass over V: (top-k logits [C, k], their ids, the gold token's logit [C],
    log-normaliser [C], entropy [C]), all from the raw logits.

    Top-k and the gap are shift invariant, and entropy = log Z - E_p[logit - max].
    The log-normaliser and the small [C, k] consumers leave behind an optimization
    barrier: without it XLA:CPU fuses the [C, V] log-sum-exp reduction into each
    small consumer and recomputes it per element (measured 1.31 s for 256 x 49152
    that way, 0.14 s this way). Call it inside a jitted function.
    """
    m = jnp.max(logits_CxV, axis=-1, keepdims=True)
    z = logits_CxV - m
    e = jnp.exp(z)
    s0 = jnp.sum(e, axis=-1)
    s1 = jnp.sum(jnp.where(e > 0, e * z, 0.0), axis=-1)  # -inf logits add nothing
    log_s0 = jnp.log(s0)
    log_norm = m[:, 0] + log_s0
    entropy = log_s0 - s1 / s0
    top, top_ids = chunked_top_k(logits_CxV, k)
    gold = jnp.take_along_axis(logits_CxV, gold_C[:, None], axis=-1)[:, 0]
    log_norm, top, gold = jax.lax.optimization_barrier((log_norm, top, gold))
    return top, top_ids, gold, log_norm, entropy


@functools.partial(jax.jit, static_argnames=("k",))
def _summarise(logits_CxV, gold_C, k):
    """The per-position row fields of one chunk of logits (:func:`raw_summary`), with
    the log-normaliser subtracted at the end: (top_ids, top log-probs, gold log-prob,
    entropy, gap, log-normaliser)."""
    top, top_ids, gold, log_norm, entropy = raw_summary(logits_CxV, gold_C, k)
    return (top_ids, top - log_norm[:, None], gold - log_norm, entropy, top[:, 0] - top[:, 1],
            log_norm)


def _check_length(n: int, cfg) -> None:
    if n < 2:
        raise ValueError(f"need at least 2 tokens to score; got {n}")
    if n > cfg.max_seq_len:
        raise ValueError(f"a segment of {n} tokens exceeds the model's context of "
                         f"{cfg.max_seq_len}; use shorter segments")


def score_tokens_summary(params, cfg, token_ids: np.ndarray, *, top_k: int = 64,
                         chunk: int = 256, dtype=jnp.float32, bar=None,
                         pad_to: int | None = None) -> dict:
    """Summaries (the row arrays of :class:`MemberScores`) of one token sequence.

    ``pad_to`` right-pads the sequence (masked out) so that sequences of
    different lengths share one KV-cache shape and one compilation.
    """
    ids = np.asarray(token_ids, np.int32)
    n = ids.shape[0]
    _check_length(n, cfg)
    k = min(top_k, cfg.vocab_size)
    out = {name: [] for name in ROW_FIELDS}
    padded = np.zeros(max(n, pad_to or 0), np.int32)
    padded[:n] = ids
    valid = np.arange(padded.shape[0]) < n
    for start, logits_1xCxV in iter_logits_chunks(params, cfg, padded[None], valid[None],
                                                  chunk=chunk, dtype=dtype):
        c = min(logits_1xCxV.shape[1], n - 1 - start)
        if c <= 0:
            break
        gold = jnp.asarray(ids[start + 1:start + 1 + c])
        logits = logits_1xCxV[0, :c]
        if c < chunk:  # keep one compiled shape: pad the last chunk
            logits = jnp.pad(logits, ((0, chunk - c), (0, 0)))
            gold = jnp.pad(gold, (0, chunk - c))
        parts = jax.device_get(_summarise(logits, gold, k))
        for name, part in zip(out, parts):
            out[name].append(np.asarray(part[:c]))
        if bar is not None:
            bar.update(c)
    return {name: np.concatenate(v) for name, v in out.items()}


def score_batch_summary(params, cfg, batch_ids: list[np.ndarray], *, top_k: int = 64,
                        chunk: int = 256, dtype=jnp.float32, bar=None,
                        pad_to: int | None = None, mesh=None) -> list[dict]:
    """:func:`score_tokens_summary` of several sequences at once, one per batch row.

    With a mesh (:mod:`brf.sharding`) the rows are split over its 'data' axis
    (``len(batch_ids)`` must divide by its size) and the params are used as
    placed (``brf.sharding.shard_params`` splits them over 'model'); XLA
    partitions the forward pass and the summaries from that placement. Row b
    gives the same numbers as scoring sequence b alone (float32 rounding).

    Returns:
      One row dict per sequence, as :func:`score_tokens_summary` returns.
    """
    lens = [int(np.asarray(x).shape[0]) for x in batch_ids]
    for n in lens:
        _check_length(n, cfg)
    k = min(top_k, cfg.vocab_size)
    B, width = len(batch_ids), max(max(lens), pad_to or 0)
    padded = np.zeros((B, width), np.int32)
    for b, x in enumerate(batch_ids):
        padded[b, :lens[b]] = x
    valid = np.arange(width)[None] < np.asarray(lens)[:, None]
    out = [{name: [] for name in ROW_FIELDS} for _ in range(B)]
    for start, logits_BxCxV in iter_logits_chunks(params, cfg, padded, valid, chunk=chunk,
                                                  dtype=dtype, mesh=mesh):
        c_B = [min(logits_BxCxV.shape[1], n - 1 - start) for n in lens]
        if max(c_B) <= 0:
            break
        gold_BxC = np.zeros((B, chunk), np.int32)
        for b, c in enumerate(c_B):
            if c > 0:
                gold_BxC[b, :c] = padded[b, start + 1:start + 1 + c]
        logits = logits_BxCxV
        if logits.shape[1] < chunk:
            logits = jnp.pad(logits, ((0, 0), (0, chunk - logits.shape[1]), (0, 0)))
        gold = gold_BxC if mesh is None else sharding_lib.shard_batch(gold_BxC, mesh)
        parts = jax.device_get(_summarise_batch(logits, gold, k))
        for b, c in enumerate(c_B):
            if c > 0:
                for name, part in zip(ROW_FIELDS, parts):
                    out[b][name].append(np.asarray(part[b, :c]))
        if bar is not None:
            bar.update(sum(max(c, 0) for c in c_B))
    return [{name: np.concatenate(v) for name, v in o.items()} for o in out]


@functools.partial(jax.jit, static_argnames=("k",))
def _summarise_batch(logits_BxCxV, gold_BxC, k):
    """`_summarise` of every row of a batch (rows stay where they are placed)."""
    B, C, V = logits_BxCxV.shape
    parts = _summarise.__wrapped__(logits_BxCxV.reshape(B * C, V), gold_BxC.reshape(B * C), k)
    return tuple(p.reshape((B, C) + p.shape[1:]) for p in parts)


def score_segments(params, cfg, segments_ids: list[np.ndarray], *, top_k: int = 64,
                   chunk: int = 256, dtype=jnp.float32, store_path: str | None = None,
                   meta: dict | None = None, desc: str = "scoring", mesh=None) -> MemberScores:
    """Scores every segment, resuming from (and saving to) ``store_path``.

    After each segment the store is rewritten atomically, so an interrupted
    run loses at most the segment in progress.

    Args:
      params, cfg: the model.
      segments_ids: token ids of each segment.
      top_k, chunk, dtype: see :func:`score_tokens_summary`.
      store_path: the member's ``.npz`` store (None: keep in memory only).
      meta: what the store must have been made with to be reused.
      desc: progress-bar label.
      mesh: optional mesh (:mod:`brf.sharding`): segments are scored as
        batches of its 'data' size, one segment per device (the params as
        placed by the caller). None: one segment at a time on one device.

    Returns:
      MemberScores over all segments.
    """
    meta = dict(meta or {}, top_k=top_k, n_segments=len(segments_ids))
    done = load_partial(store_path, meta) if store_path else []
    total = sum(len(s) - 1 for s in segments_ids)
    bar = tqdm(total=total, initial=sum(len(segments_ids[i]) - 1 for i in range(len(done))),
               desc=desc, unit="tok", dynamic_ncols=True)
    longest = max(len(s) for s in segments_ids)
    pad_to = -(-longest // chunk) * chunk  # one cache shape for every segment
    step = 1 if mesh is None else sharding_lib.data_size(mesh)
    while len(done) < len(segments_ids):
        if mesh is None:
            done.append(score_tokens_summary(params, cfg, segments_ids[len(done)], top_k=top_k,
                                             chunk=chunk, dtype=dtype, bar=bar, pad_to=pad_to))
        else:
            group = list(segments_ids[len(done):len(done) + step])
            n_real = len(group)
            group += [group[-1]] * (step - n_real)  # a short last batch: repeat, then drop
            rows = score_batch_summary(params, cfg, group, top_k=top_k, chunk=chunk,
                                       dtype=dtype, bar=None, pad_to=pad_to, mesh=mesh)
            done.extend(rows[:n_real])
            bar.update(sum(len(x) - 1 for x in group[:n_real]))
        if store_path:
            save_partial(store_path, segments_ids[:len(done)], done, meta,
                         int(cfg.vocab_size))
    bar.close()
    return assemble(segments_ids, done, int(cfg.vocab_size))


def assemble(segments_ids, rows: list[dict], vocab_size: int) -> MemberScores:
    lens = np.array([len(s) for s in segments_ids[:len(rows)]], np.int64)
    tok_starts = np.concatenate([[0], np.cumsum(lens)])
    row_starts = np.concatenate([[0], np.cumsum(lens - 1)])
    token_ids = (np.concatenate([np.asarray(s, np.int32) for s in segments_ids[:len(rows)]])
                 if rows else np.zeros(0, np.int32))
    fields = {name: (np.concatenate([r[name] for r in rows]) if rows else np.zeros(0))
              for name in ROW_FIELDS}
    return MemberScores(token_ids, tok_starts, row_starts, **fields, vocab_size=vocab_size)


def save_partial(path: str, segments_ids, rows: list[dict], meta: dict,
                 vocab_size: int) -> None:
    """Writes the segments scored so far, atomically (temp file + rename)."""
    scores = assemble(segments_ids, rows, vocab_size)
    with caches.atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, **{k: np.asarray(v) for k, v in scores._asdict().items()},
                 _meta=np.asarray(repr(sorted(meta.items()))),
                 _version=np.asarray(STORE_VERSION))


def load_partial(path: str, meta: dict) -> list[dict]:
    """Row dicts of the segments already in the store.

    Empty when there is none or it was made with other settings (``meta``), and
    empty with a warning naming the file when it is damaged: every member's
    CRC-32 is checked before any number is read (a flipped byte anywhere in
    the data fails it), so damaged scores are rescored, never used.
    """
    if not path or not os.path.isfile(path):
        return []
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
        if bad is not None:
            raise zipfile.BadZipFile(f"bad CRC-32 for {bad}")
        with np.load(path) as z:
            if int(z["_version"]) != STORE_VERSION or str(z["_meta"]) != repr(
                    sorted(meta.items())):
                return []
            rs = z["row_starts"]
            fields = {name: z[name] for name in ROW_FIELDS}
        if rs[0] != 0 or np.any(np.diff(rs) < 0) or any(
                len(v) != rs[-1] for v in fields.values()):
            raise ValueError("row_starts does not match the stored rows")
        return [{name: v[rs[s]:rs[s + 1]] for name, v in fields.items()}
                for s in range(len(rs) - 1)]
    except (OSError, ValueError, KeyError, EOFError, IndexError, zipfile.BadZipFile) as e:
        caches.warn_unreadable("score store", path, e, "it is rescored")
        return []


def strip_prefix(scores: MemberScores, n_prefix: int, has_bos: bool) -> MemberScores:
    """Scores of ``[BOS] + prefix + segment`` sequences as if they were ``[BOS] + segment``.

    Every segment was scored after a conditioning prefix of ``n_prefix`` tokens
    (between BOS, when the model has one, and the segment's tokens). The result
    has the layout of unprefixed scores: the prefix tokens are dropped from
    ``token_ids`` and the rows that predict prefix tokens are dropped, so row 0
    of a segment again predicts its first token (after BOS), now conditioned on
    the prefix too. The row count per segment equals the unprefixed one.
    """
    if n_prefix == 0:
        return scores
    b = 1 if has_bos else 0
    keep_tok, keep_row = [], []
    for s in range(len(scores.tok_starts) - 1):
        t0, t1 = int(scores.tok_starts[s]), int(scores.tok_starts[s + 1])
        r0, r1 = int(scores.row_starts[s]), int(scores.row_starts[s + 1])
        keep_tok.append(np.r_[t0:t0 + b, t0 + b + n_prefix:t1])
        keep_row.append(np.arange(r0 + n_prefix, r1))
    tok = np.concatenate(keep_tok) if keep_tok else np.zeros(0, np.int64)
    row = np.concatenate(keep_row) if keep_row else np.zeros(0, np.int64)
    lens = np.array([len(k) for k in keep_tok], np.int64)
    rows = np.array([len(k) for k in keep_row], np.int64)
    fields = {name: getattr(scores, name)[row] for name in ROW_FIELDS}
    return MemberScores(scores.token_ids[tok], np.concatenate([[0], np.cumsum(lens)]),
                        np.concatenate([[0], np.cumsum(rows)]), **fields,
                        vocab_size=scores.vocab_size)


def truncate_top_k(scores: MemberScores, k: int) -> MemberScores:
    """The same scores with only the top ``k`` (<= stored K) tokens kept."""
    if k > scores.topk_ids.shape[1]:
        raise ValueError(f"cannot keep the top {k} of {scores.topk_ids.shape[1]} stored tokens")
    return scores._replace(topk_ids=scores.topk_ids[:, :k], topk_logp=scores.topk_logp[:, :k])


def part_path(store_path: str, index: int, count: int) -> str:
    """The file of process ``index``'s share of a member's store (of ``count`` shares)."""
    root, ext = os.path.splitext(store_path)
    return f"{root}.part{index}of{count}{ext}"


def merge_parts(store_path: str, part_paths: list[str], segments_ids, meta: dict, *,
                top_k: int, vocab_size: int) -> MemberScores:
    """Joins the processes' shares (:func:`part_path`) into one store.

    Each part holds a contiguous block of segments (``brf.sharding.process_share``),
    in process order; the merged store is what a single process would have
    written (same meta, same rows), so later runs reuse it.

    Raises:
      ValueError: a part that is missing or incomplete.
    """
    count = len(part_paths)
    rows = []
    for i, path in enumerate(part_paths):
        lo = i * len(segments_ids) // count
        hi = (i + 1) * len(segments_ids) // count
        part_meta = dict(meta, share=(lo, hi, count), top_k=top_k, n_segments=hi - lo)
        got = load_partial(path, part_meta)
        if len(got) != hi - lo:
            raise ValueError(f"{path}: {len(got)} of {hi - lo} segments scored (a process "
                             "stopped early, or its store is from another run)")
        rows.extend(got)
    full_meta = dict(meta, top_k=top_k, n_segments=len(segments_ids))
    save_partial(store_path, segments_ids, rows, full_meta, vocab_size)
    return assemble(segments_ids, rows, vocab_size)
