"""Dumping one model's logits to a logit CSV (:mod:`brf.eval.logit_csv`).

Two producers, both streaming rows block by block and resuming an
interrupted file:

* :func:`dump_scores` — teacher-forced: the text's tokens are scored in
  segments of at most ``segment_tokens`` tokens, each read after the model's
  BOS and the optional system prompt / prefix (its own context), through the
  same chunked forward pass as the validation experiment
  (:func:`brf.models.iter_logits_chunks`, one cache shape for every segment).
  Row t is the distribution over text token t given the context and the
  segment's tokens before it; a segment's first token gets no row when there
  is no context at all (no BOS, no prefix).
* :func:`dump_generations` — prompts, greedy or sampled with
  :func:`brf.fusion.sample` (keys folded from seed, prompt and step, so a
  resumed run draws the same tokens). Row t is the step-t distribution (raw
  logits, before temperature or truncation) and the token chosen from it.

The per-position statistics are computed on the device in one pass over the
vocabulary per chunk (:func:`row_stats`); the CSV text is formatted per
block on the host.
"""

from __future__ import annotations

import functools
import hashlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from brf import schema as S
from brf.align.vocab import encode_template, encode_text
from brf.errors import UserError
from brf.eval.logit_csv import CsvWriter, RowBlock, vocab_texts
from brf.eval.scoring import raw_summary
from brf.models import iter_logits_chunks


class DumpError(UserError):
    """Bad dump settings (text, prompts, sizes), reported before any model runs."""


@functools.partial(jax.jit, static_argnames=("k",))
def row_stats(logits_CxV: jax.Array, token_C: jax.Array, k: int):
    """Per-position row fields from raw logits, one pass over V.

    Same computation as the validation's scoring (:mod:`brf.eval.scoring`),
    but the top-k values and the token's logit stay raw (not log-probs).

    Returns:
      (top_logits [C, k], top_ids [C, k], token_logit [C], lse [C],
      entropy [C], gap [C]).
    """
    top, ids, tok, lse, entropy = raw_summary(logits_CxV, token_C, k)
    return top, ids, tok, lse, entropy, top[:, 0] - top[:, 1]


def context_ids(model, *, system: str = "", prefix: str = "") -> list[int]:
    """BOS (if the model has one), the chat-templated system turn, then the prefix."""
    tok, cfg = model.tokenizer, model.cfg
    ids = [cfg.bos_id] if cfg.bos_id is not None else []
    if system:
        if getattr(tok, "chat_template", None) is None:
            raise DumpError("system prompt given but the model's tokenizer has no chat "
                            "template; use prefix instead")
        out = encode_template(tok, lambda f: tok.apply_chat_template(
            [{"role": "system", "content": f["system"]}], tokenize=False), {"system": system})
        ids += out[1:] if ids and out and out[0] == ids[0] else out
    if prefix:
        ids += encode_text(tok, prefix)
    return ids


def check_segment_tokens(segment_tokens: int) -> None:
    """Refuses a segment of fewer than 2 tokens (checked before any model loads)."""
    if segment_tokens < 2:
        raise DumpError(f"segment_tokens={segment_tokens} must be at least 2 (text tokens "
                        f"per forward context)")


def dump_scores(model, text: str, path: str, *, k: int = 20, system: str = "",
                prefix: str = "", segment_tokens: int = 2048, chunk: int = 256,
                max_positions: int = 0, meta: dict | None = None, resume: bool = True,
                desc: str = "dumping") -> dict:
    """Teacher-forced scores of ``text`` into a logit CSV.

    Args:
      model: a loaded model (``brf.checkpoints.registry.load``).
      text: the text to score.
      path: the CSV file.
      k: top entries per row.
      system, prefix: the context before the text (see :func:`context_ids`).
      segment_tokens: text tokens per forward context.
      chunk: tokens per forward pass.
      max_positions: stop after this many text tokens (0: all).
      meta: extra metadata (the model's name...).
      resume: continue an interrupted file with the same settings.
      desc: progress-bar label.

    Returns:
      {"rows", "rows_written", "seconds", "positions_per_second", "path"}.
    """
    cfg, tok = model.cfg, model.tokenizer
    if not text:
        raise DumpError("nothing to score: the text is empty")
    if k < 2 or k > cfg.vocab_size:
        raise DumpError(f"k={k} must lie in [2, vocab size {cfg.vocab_size}]")
    if max_positions < 0 or chunk < 1:  # a negative count would cut from the end
        raise DumpError(f"max_positions={max_positions} must be >= 0 (0: all) and "
                        f"chunk={chunk} >= 1")
    ctx = context_ids(model, system=system, prefix=prefix)
    ids = np.asarray(encode_text(tok, text), np.int32)
    if max_positions:
        ids = ids[:max_positions]
    n_ctx = len(ctx)
    check_segment_tokens(segment_tokens)
    if n_ctx + segment_tokens > cfg.max_seq_len:
        raise DumpError(f"segment_tokens={segment_tokens} plus {n_ctx} context tokens must "
                        f"fit the model's context of {cfg.max_seq_len} tokens")
    texts_V = vocab_texts(tok, cfg.vocab_size)
    meta = dict(meta or {}, mode="score", vocab_size=int(cfg.vocab_size), system=system,
                prefix=prefix, text_sha256=hashlib.sha256(text.encode()).hexdigest(),
                text_tokens=int(len(ids)), segment_tokens=segment_tokens,
                context_tokens=n_ctx, context_ids=[int(i) for i in ctx],
                context_text=texts_V[np.asarray(ctx, np.int64)].tolist())
    starts = list(range(0, len(ids), segment_tokens))
    total = sum(min(segment_tokens, len(ids) - a) - (n_ctx == 0) for a in starts)
    pad_to = -(-(n_ctx + min(segment_tokens, len(ids))) // chunk) * chunk
    t0 = time.perf_counter()
    with CsvWriter(path, meta, k, texts_V, resume=resume) as w:
        done = w.done.get(0, 0)
        bar = tqdm(total=total, initial=done, desc=desc, unit="pos", dynamic_ncols=True)
        written, seen = 0, 0
        for a in starts:
            seg = ids[a:a + segment_tokens]
            n_rows = len(seg) - (n_ctx == 0)
            if seen + n_rows <= done:  # a finished segment of a resumed file
                seen += n_rows
                continue
            n_new = _dump_segment(w, model, ids, np.asarray(ctx, np.int32), a, len(seg),
                                  k=k, chunk=chunk, pad_to=pad_to, seen=seen, done=done)
            seen += n_rows
            written += n_new
            bar.update(n_new)
        bar.close()
        rows = w.n_rows
    sec = time.perf_counter() - t0
    return {"rows": rows, "rows_written": written, "seconds": sec,
            "positions_per_second": written / max(sec, 1e-9), "path": path}


def _dump_segment(w: CsvWriter, model, ids: np.ndarray, ctx: np.ndarray, a: int, n: int, *,
                  k: int, chunk: int, pad_to: int, seen: int, done: int) -> int:
    """Writes the rows of text tokens ``ids[a:a + n]`` read after ``ctx``, skipping the
    first ``done - seen`` of them (written before a resume); returns the rows written."""
    n_ctx = len(ctx)
    seq_ids = np.concatenate([ctx, ids[a:a + n]])
    padded = np.zeros(pad_to, np.int32)
    padded[:len(seq_ids)] = seq_ids
    valid = np.arange(pad_to) < len(seq_ids)
    written = 0
    for start, logits_1xCxV in iter_logits_chunks(model.params, model.cfg, padded[None],
                                                  valid[None], chunk=chunk):
        # Logits at sequence index j predict index j + 1 = text token a + j + 1 - n_ctx.
        j = start + np.arange(logits_1xCxV.shape[1])
        t = a + j + 1 - n_ctx
        in_seg = (t >= a) & (t < a + n)
        keep = in_seg & (seen + np.cumsum(in_seg) - 1 >= done)
        seen += int(in_seg.sum())
        if not keep.any():
            continue
        gold = np.zeros(chunk, np.int32)
        c = logits_1xCxV.shape[1]
        gold[:c] = np.where(keep, ids[np.clip(t, 0, len(ids) - 1)], 0)
        logits = logits_1xCxV[0]
        if c < chunk:  # one compiled shape
            logits = jnp.pad(logits, ((0, chunk - c), (0, 0)))
        top, top_ids, tl, lse, ent, gap = jax.device_get(row_stats(logits, jnp.asarray(gold), k))
        sel = np.nonzero(keep)[0]
        w.write(RowBlock(np.zeros(len(sel), np.int64), t[sel], gold[sel], tl[sel], lse[sel],
                         ent[sel], gap[sel], top[sel], top_ids[sel]))
        written += len(sel)
    return written


def dump_generations(model, prompts: Sequence[str], path: str, *, k: int = 20,
                     system: str = "", prefix: str = "", chat: bool = True,
                     template: str | None = None, sampler: Any = "greedy",
                     max_new_tokens: int = 64, seed: int = 0, meta: dict | None = None,
                     resume: bool = True, desc: str = "generating") -> dict:
    """Generates from each prompt and dumps every step's distribution.

    Args:
      model: a loaded model.
      prompts: the prompts; prompt i is sequence ``seq = i``.
      path: the CSV file.
      k: top entries per row.
      system: system prompt (chat members), prefix: text before the prompt
        (plain members); see :class:`brf.ensemble.member.Member`.
      chat, template: how the prompt is wrapped (Member's fields).
      sampler: a :class:`brf.fusion.Sampler` spec ("greedy",
        "temperature=0.7,top_p=0.9").
      max_new_tokens: steps per prompt (stops earlier at EOS).
      seed: sampling seed.
      meta, resume, desc: as in :func:`dump_scores`.

    Returns:
      {"rows", "rows_written", "seconds", "texts", "path"}.
    """
    from brf.ensemble.member import Member, check_prompt_fits, check_prompts
    from brf.fusion import Sampler
    cfg, tok = model.cfg, model.tokenizer
    prompts = check_prompts(prompts)
    if max_new_tokens < 1:
        raise DumpError(f"max_new_tokens={max_new_tokens} must be >= 1")
    sampler = Sampler.parse(sampler)
    member = Member("dump", cfg, model.params, tok, prefix=system or prefix,
                    chat=chat and template is None, template=template)
    texts_V = vocab_texts(tok, cfg.vocab_size)
    prompt_ids = [[int(i) for i in member.prompt_ids(p)] for p in prompts]
    meta = dict(meta or {}, mode="generate", vocab_size=int(cfg.vocab_size), system=system,
                prefix=prefix, chat=chat, template=template, prompts=list(prompts),
                sampler=str(sampler), seed=seed, max_new_tokens=max_new_tokens,
                context_ids=prompt_ids,
                context_text=[texts_V[np.asarray(p, np.int64)].tolist() for p in prompt_ids])
    t0 = time.perf_counter()
    outs = []
    with CsvWriter(path, meta, k, texts_V, resume=resume) as w:
        last_seq = max(w.done) if w.done else -1
        bar = tqdm(total=len(prompts) * max_new_tokens, desc=desc, unit="tok",
                   dynamic_ncols=True)
        written = 0
        for s, prompt in enumerate(prompts):
            if s < last_seq:
                bar.update(max_new_tokens)
                outs.append(None)
                continue
            check_prompt_fits(member, prompt_ids[s], max_new_tokens)
            gen, block = _generate_one(model, prompt_ids[s], jax.random.fold_in(
                jax.random.PRNGKey(seed), s), k=k, sampler=sampler,
                max_new_tokens=max_new_tokens, eos=member.eos_ids(), skip=w.done.get(s, 0),
                bar=bar)
            if block:
                st = [np.concatenate([b[2][i] for b in block]) for i in range(6)]
                top, top_ids, tl, lse, ent, gap = st
                w.write(RowBlock(np.full(len(block), s), np.array([b[0] for b in block]),
                                 np.array([b[1] for b in block]), tl, lse, ent, gap, top,
                                 top_ids))
                written += len(block)
            outs.append(tok.decode(gen, skip_special_tokens=True))
        bar.close()
        rows = w.n_rows
    return {"rows": rows, "rows_written": written, "seconds": time.perf_counter() - t0,
            "texts": outs, "path": path}


def _generate_one(model, p_ids: list[int], key, *, k: int, sampler, max_new_tokens: int,
                  eos, skip: int, bar) -> tuple[list[int], list]:
    """One prompt's generation: (tokens, [(step, token, row stats)] for steps >= skip)."""
    from brf.fusion import sample
    from brf.models import decode_step_donated, init_cache, prefill_donated
    cfg = model.cfg
    cache = init_cache(cfg, 1, len(p_ids) + max_new_tokens)
    logits, cache = prefill_donated(model.params, cfg, jnp.asarray([p_ids], jnp.int32), None,
                                    cache, logits="last")
    gen, block = [], []
    for t in range(max_new_tokens):
        nxt = sample(jax.random.fold_in(key, t), jax.nn.log_softmax(logits), sampler)
        stats = jax.device_get(row_stats(logits, nxt, k))
        token = int(nxt[0])
        gen.append(token)
        if t >= skip:
            block.append((t, token, stats))
        bar.update(1)
        if token in eos or t == max_new_tokens - 1:
            break
        logits, cache = decode_step_donated(model.params, cfg, nxt, cache)
    return gen, block


def dump_mesh(spec):
    """The mesh of a dump config's ``mesh`` (``model=m``: the weights split over m
    devices; a dump reads one sequence at a time, so there is no data axis);
    None for one device."""
    from brf import sharding
    spec = dict(spec.to_dict() if hasattr(spec, "to_dict") else (spec or {}))
    if set(spec) - {"model"}:
        raise DumpError(f"config.mesh: only 'model' applies to a dump (one sequence at a "
                        f"time); got {sorted(spec)}")
    try:
        mesh = sharding.make_mesh(dict(data=1, model=int(spec.get("model", 1))))
    except sharding.ShardingError as e:
        raise DumpError(str(e)) from None
    return None if mesh.size == 1 else mesh


def load_model(source: str, mesh=None):
    """``brf.checkpoints.registry.load`` (onto ``mesh`` when given, weights split
    over its 'model' axis) with a missing model as a user error."""
    from brf.checkpoints import registry
    if not source:
        raise DumpError("config.model is empty; give a model name, .gguf file or directory")
    try:
        model = registry.load(source, mesh=mesh)  # bars only while a first use converts
    except FileNotFoundError as e:
        raise DumpError(f"model {source!r}: {e.args[0] if e.args else e}") from None
    except (OSError, KeyError) as e:  # an unreadable file or directory given as a model
        raise DumpError(f"model {source!r} cannot be loaded: {type(e).__name__}: {e}") from None
    if model.tokenizer is None:
        raise DumpError(f"model {source!r} has no tokenizer; the CSV needs token texts")
    return model


def _score_text(c) -> str:
    if c.text:
        return c.text
    from brf.eval import corpus
    if c.text_file:
        return corpus.load_corpus(c.text_file, min_chars=1)
    text = corpus.load_default_corpus()
    return text[:c.max_chars] if c.max_chars else text


# Top entries per row: a row holds 3k + 9 fields.
K_MAX = 1024
# Tokens per forward pass: a pass's logits are chunk x vocabulary floats.
CHUNK_MAX = 4096


def _model_check(value: str) -> None:
    from brf.ensemble.run import check_model_source
    if value.startswith("random:"):
        raise DumpError(f"model {value!r}: a dump needs a real model (a registered name, "
                        ".gguf file, HF directory or brf checkpoint)")
    try:
        check_model_source(value)
    except UserError as e:
        raise DumpError(f"model {value!r}: {e}") from None


def _file_check(value: str) -> None:
    from brf.ensemble.run import check_file
    check_file(value)


def _template_check(value: str) -> None:
    if value:
        from brf.ensemble.member import check_template
        check_template(value, "config.template")


def _sampler_check(value: str) -> None:
    from brf.fusion import Sampler
    Sampler.parse(value)


def _output_check(value: str) -> None:
    if value.strip() == "-":  # generate.py's stdout: a dump is a file it can resume
        raise UserError("config.output='-' would be a file named '-' (generate.py's --config.output=- "
                        "prints to stdout, but a dump is a CSV file it resumes and appends "
                        "to); give a file path, e.g. runs/logits.csv")


# configs/dump_logits.py, every key (brf.schema): checked by run before the model loads.
SCHEMA = {
    "model": S.text(empty=False, check=_model_check,
                    note="give a model name, .gguf file or directory"),
    "mode": S.text(choices=("score", "generate")),
    "output": S.text(check=_output_check),
    "overwrite": S.flag(),
    "k": S.integer(2, K_MAX, note="and at most the model's vocabulary"),
    "system": S.text(),
    "prefix": S.text(),
    "text": S.text(),
    "text_file": S.text(check=_file_check),
    "max_chars": S.integer(0, S.COUNT_MAX, note="0: all"),
    "max_positions": S.integer(0, S.COUNT_MAX, note="0: all"),
    "segment_tokens": S.integer(2, 10**6),
    "chunk": S.integer(1, CHUNK_MAX),
    "prompts": S.text(),
    "prompts_file": S.text(check=_file_check),
    "chat": S.flag(),
    "template": S.text(check=_template_check),
    "sampler": S.text(check=_sampler_check),
    "max_new_tokens": S.integer(1, 10**6),
    "seed": S.seed(),
    "compilation_cache": S.flag(),
    "mesh.model": S.integer(1, S.DEVICES_MAX, special=(-1,), note="-1: every device"),
}


def check_config(c) -> None:
    """Every key of a dump config against :data:`SCHEMA` (types, ranges, names).

    Raises:
        DumpError: the first key that is wrong, named.
    """
    S.check(c, SCHEMA, error=DumpError)


def _prompts(c) -> list[str]:
    from brf.ensemble.run import read_prompts
    return read_prompts(c.prompts, c.prompts_file, lines=True)


def run(c) -> dict:
    """What experiments/dump_logits.py runs, for a configs/dump_logits.py config."""
    check_config(c)
    if c.get("compilation_cache"):
        from brf.runtime import enable_compilation_cache
        enable_compilation_cache()
    # Settings are checked before the model is loaded.
    text = _score_text(c) if c.mode == "score" else None
    prompts = _prompts(c) if c.mode == "generate" else None
    model = load_model(c.model, dump_mesh(c.get("mesh")))
    meta = {"model": c.model}
    if c.mode == "score":
        return dump_scores(model, text, c.output, k=c.k, system=c.system, prefix=c.prefix,
                           segment_tokens=c.segment_tokens, chunk=c.chunk,
                           max_positions=c.max_positions, meta=meta,
                           resume=not c.overwrite, desc=f"dumping {c.model}")
    return dump_generations(model, prompts, c.output, k=c.k, system=c.system,
                            prefix=c.prefix, chat=c.chat, template=c.template or None,
                            sampler=c.sampler, max_new_tokens=c.max_new_tokens, seed=c.seed,
                            meta=meta, resume=not c.overwrite, desc=f"generating {c.model}")
