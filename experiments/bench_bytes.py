r"""Byte-level scoring and generation (brf.bytes) against token level, side by side.

Scoring (--parts=score), per member: the corpus's first --n_bytes bytes, cut into
--segment-byte segments (at UTF-8 boundaries), are scored twice, each after a
warm-up segment (compilation excluded): token level (the canonical tokens,
`brf.models.score_tokens`, one segment at a time in chunks of 256) and byte
level (`brf.bytes.scoring.score_segments`, every byte's 257-event distribution
with --beam / --threshold pruning and --max_lag merging; with --thresholds, once per
threshold, one after another; with --score_cold, without the warm-up segment and
with JAX's compiled programs dropped first, as a fresh process scores a store). Reported:
forward tokens per byte (the canonical pass, and with the alternative
tokenizations' tree-attention tokens), the wall time of each and their ratio,
the trie's memory, the pruned mass and the consistency numbers (bits per byte:
byte level, canonical tokenization, their gap = the non-canonical mass).

Accuracy (--parts=accuracy): each of --models scores the corpus's bytes
[--skip_bytes, --skip_bytes + --n_bytes) once per --settings entry
(threshold:beam:max_lag; the first is the reference): time, extra forward
tokens per canonical token, tree calls and their padded tokens, bits per byte
and its difference from the reference's, the total variation between each
byte's distribution and the reference's (mean and 99th percentile), the pruned
log-mass (nats) and the merged mass. With --accuracy_again each setting is
scored once more after every setting has run (``seconds_again``: every call
shape compiled, what a long store pays per byte).

Memory (--parts=memory): each of --models scores the same segments one at a
time, first keeping freed heap memory (`score_segments(release=False)`), then
returning it after each segment (the default); the process's resident memory
(RSS) after each segment, its starting point and the peak of each pass.

Tree calls (--parts=calls), per member: the segments are scored byte level as in
--parts=score with every model call timed to its result (`jax.block_until_ready`
around the canonical pass's chunks and each alternative tokenizations' tree call),
which gives the seconds per real token of each: what a token in a tree call costs
against a canonical token, per call size (the tree buckets the calls were padded
to), with and without the calls of a shape (tokens, cache slots) that no call before
had, warm-up included: those include XLA's compilation. Then the same two programs on
a cache of the run's size, timed alone for every tree bucket (median of
--call_repeats): the per-token cost of a T-token tree call against a 256-token
canonical chunk, which shows the call size a token needs to cost at most 1.5
canonical tokens.

Look-ahead (--parts=lookahead), per member: the segments scored byte level
(`brf.bytes.lm.score_text`) once per --lookahead entry (max_speculation:window[:fill]:
how many canonical tokens of a surviving alternative are computed ahead, how many
bytes one look-ahead walk reads, and whether a call's padding runs more of them,
1 by default), each with JAX's caches cleared and after a warm-up segment with the
same entry: wall time (with the programs compiled for shapes the warm-up did not
have, and counted), then again with every shape compiled; tree calls, extra and
padded tokens, and how far each entry's distributions lie from the first's (largest
difference of a finite log-prob, and whether the same events are impossible): the
entries change which tokens share a call, not which distributions are computed, so
only float32 rounding may differ.

Generation (--parts=generate): the default pair (configs/generate.py: SmolLM2 +
Gemma 3, BRF, greedy) on one prompt, token level (`max_new_tokens`) and byte level
(`max_new_bytes`), each after a warm-up run; generated UTF-8 bytes per second.

  python experiments/bench_bytes.py --corpus=hamlet --n_bytes=4096
  python experiments/bench_bytes.py --parts=score --models=gemma3-270m --threshold=1e-2
  python experiments/bench_bytes.py --parts=calls --n_bytes=3000 --segment=3000
  python experiments/bench_bytes.py --parts=lookahead --n_bytes=3000 --segment=3000 \
      --lookahead=4:512:0,4:512,16:512,64:3000
  python experiments/bench_bytes.py --parts=memory --models=gemma3-270m --corpus=ataturk-1920 \
      --n_bytes=15000 --segment=1500
  python experiments/bench_bytes.py --parts=accuracy --n_bytes=1000 --skip_bytes=3000 \
      --settings=1e-3:16:0,3e-3:16:2,1e-2:16:0
"""

import json
import platform
import time

from absl import flags

from brf import cli

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", ["score", "generate"],
                  "score, generate, accuracy, memory, calls, lookahead")
flags.DEFINE_list("models", ["smollm2-135m-instruct", "gemma3-270m"], "members")
flags.DEFINE_string("corpus", "hamlet", "a brf.eval.corpus.CORPORA name")
flags.DEFINE_integer("skip_bytes", 0, "bytes of the corpus skipped first")
flags.DEFINE_integer("n_bytes", 4096, "bytes of the corpus scored")
flags.DEFINE_integer("segment", 1024, "bytes per segment")
flags.DEFINE_integer("beam", 16, "hypotheses kept per byte")
flags.DEFINE_float("threshold", None, "prune threshold (default: brf.bytes.DEFAULT_THRESHOLD)")
flags.DEFINE_integer("max_lag", None, "merge lag (default: brf.bytes.DEFAULT_MAX_LAG; 0: never)")
flags.DEFINE_list("settings", ["1e-3:16:0", "3e-3:16:2"],
                  "accuracy: threshold:beam:max_lag per run, the first the reference")
flags.DEFINE_integer("new_tokens", 48, "generation: tokens at the token level")
flags.DEFINE_integer("new_bytes", 192, "generation: bytes at the byte level")
flags.DEFINE_list("thresholds", [],
                  "score: the byte level once per threshold, one after another "
                  "(default: --threshold)")
flags.DEFINE_bool("score_cold", False,
                  "score: no warm-up segment; JAX's compiled programs dropped before each member "
                  "and threshold, so the time includes compiling, as in a fresh process")
flags.DEFINE_bool("accuracy_again", False,
                  "accuracy: score each setting again with every shape compiled")
flags.DEFINE_integer("call_repeats", 5, "calls: timings per tree bucket (the median is kept)")
flags.DEFINE_list("curve_buckets", [],
                  "calls: the tree buckets the curve times (default: every one, "
                  "brf.bytes.lm.TREE_BUCKETS; each is a program compiled for the member)")
flags.DEFINE_list("lookahead", ["4:512:0", "4:512", "16:512"],
                  "lookahead: max_speculation:window[:fill] per run, the first the reference")
flags.DEFINE_string("out", "", "write the results as JSON here")


def segments_of(data: bytes, size: int) -> list[bytes]:
    """``data`` cut into pieces of about ``size`` bytes, never inside a UTF-8 character."""
    out, i = [], 0
    while i < len(data):
        j = min(len(data), i + size)
        while j < len(data) and (data[j] & 0xC0) == 0x80:
            j += 1
        out.append(data[i:j])
        i = j
    return out


def _padded_width(lengths) -> int:
    """The canonical pass's width for rows of these token lengths (chunks of 256)."""
    return -(-max(lengths) // 256) * 256


def bench_member(name: str, segs: list[bytes], warm: bytes, beam: int,
                 thresholds: list[float], max_lag: int, cold: bool = False) -> list[dict]:
    """The member loaded and its token level timed once; its byte level once per threshold."""
    import numpy as np
    from brf.bytes.lm import ByteLM
    from brf.bytes.scoring import consistency, score_segments
    from brf.models import score_tokens

    lm = ByteLM.load(name)
    ctx = lm.context()
    rows = [ctx + lm.encode(s) for s in [warm] + segs]
    width = _padded_width(map(len, rows))

    def token_level():  # each segment alone, in chunks of 256 (as the study scores)
        for row in rows[1:]:
            w = _padded_width([len(row)])
            toks = np.zeros((1, w), np.int32)
            toks[0, :len(row)] = row
            score_tokens(lm.params, lm.cfg, toks, np.arange(w)[None] < len(row))

    token_level()  # warm-up (compile)
    t0 = time.perf_counter()
    token_level()
    token_s = time.perf_counter() - t0

    out = []
    for threshold in thresholds:
        # The warm-up segment is padded like the others, so it compiles their shapes; cold:
        # none, and JAX's compiled programs dropped first (a store as a fresh process scores it).
        kw = dict(beam=beam, threshold=threshold, max_lag=max_lag, pad_to=width)
        if cold:
            import jax
            jax.clear_caches()
        else:
            score_segments(lm, [warm], desc="warm-up", **kw)
        t0 = time.perf_counter()
        sc = score_segments(lm, segs, desc=f"{name} bytes", **kw)
        byte_s = time.perf_counter() - t0
        cons = consistency(sc)
        n = sc.n_bytes
        canonical = float(sum(map(len, rows[1:])))
        out.append(dict(member=name, threshold=threshold, beam=beam, max_lag=max_lag, cold=cold,
                        bytes=n, canonical_tokens=int(canonical),
                        token_forward_per_byte=canonical / n,
                        byte_forward_per_byte=cons["forward_per_byte"],
                        forward_ratio=cons["forward_per_byte"] * n / canonical,
                        padded_per_byte=float(np.sum(sc["padded_tokens"])) / n,
                        tree_calls=int(np.sum(sc["tree_calls"])),
                        token_seconds=token_s, byte_seconds=byte_s, wall_ratio=byte_s / token_s,
                        token_bytes_per_s=n / token_s, byte_bytes_per_s=n / byte_s,
                        trie_mb=lm.trie.nbytes() / 2**20, trie_nodes=lm.trie.n_nodes,
                        vocab=lm.trie.vocab_size, pruned_mean=cons["pruned_mean"],
                        lost_bits_per_byte=cons["lost"], bpb_byte=cons["byte"],
                        bpb_canonical=cons["canonical"],
                        noncanonical_bits_per_byte=cons["noncanonical"],
                        merged_mean=cons["merged_mean"], hyp_mean=cons["hyp_mean"]))
        print(json.dumps(out[-1]), flush=True)
    return out


def bench_accuracy(name: str, data: bytes, warm: bytes, settings: list[str],
                   again: bool = False) -> list[dict]:
    import numpy as np
    from brf.bytes.lm import ByteLM, score_text
    lm = ByteLM.load(name)
    score_text(lm, warm[:400], beam=16, threshold=1e-3)  # compile
    gold = np.frombuffer(data, np.uint8)
    rows, ref = [], None

    def scored(setting):
        thr, beam, lag = setting.split(":")
        t0 = time.perf_counter()
        s = score_text(lm, data, beam=int(beam), threshold=float(thr), max_lag=int(lag))
        return s, time.perf_counter() - t0

    for setting in settings:
        s, seconds = scored(setting)
        ref = ref or s
        st, n = s.stats, len(data)
        tv = 0.5 * np.abs(np.exp(s.logp) - np.exp(ref.logp)).sum(1)
        bpb = -st["byte_ll"] / n / np.log(2)
        rows.append(dict(member=name, setting=setting, bytes=n, seconds=seconds,
                         canonical_tokens=st["canonical_tokens"],
                         extra_tokens=st["extra_tokens"], padded_tokens=st["padded_tokens"],
                         tree_calls=st["tree_calls"],
                         extra_per_canonical=st["extra_tokens"] / st["canonical_tokens"],
                         bpb=bpb, dbpb=bpb + ref.stats["byte_ll"] / n / np.log(2),
                         bpb_canonical=-st["canonical_ll"] / n / np.log(2),
                         tv_mean=float(tv.mean()), tv_p99=float(np.quantile(tv, 0.99)),
                         tv_max=float(tv.max()),
                         lost_nats=float(st["lost"]), merged=float(st["merged"]),
                         gold_logp_sum=float(s.logp[np.arange(n), gold].sum()),
                         max_hyp=int(st["max_hyp"])))
        print(json.dumps(rows[-1]), flush=True)
    for row in rows if again else ():
        row["seconds_again"] = scored(row["setting"])[1]
        print(json.dumps(dict(member=name, setting=row["setting"],
                              seconds_again=row["seconds_again"])), flush=True)
    return rows


class _Timed:
    """``brf.bytes.lm``'s two model calls wrapped so that each is timed to its result:
    ``rows`` gets (kind, padded tokens, real tokens, seconds, new shape) per call, where
    a new shape is a (kind, tokens, cache slots, slots read and gathered) no earlier call
    had (``seen`` is kept across uses, so a warm-up's shapes count as seen)."""

    def __init__(self):
        import brf.bytes.lm as lm_module
        self.module, self.rows, self.seen = lm_module, [], set()
        self.prefill, self.tree = lm_module.prefill_donated, lm_module.forward_tree

    def _record(self, kind, tokens, real, cache, seconds, reads_key=None):
        shape = (kind, tokens.shape[1], cache["pos"].shape[1], reads_key)
        self.rows.append((kind, tokens.shape[1], real, seconds, shape not in self.seen))
        self.seen.add(shape)

    def __enter__(self):
        import jax
        import numpy as np

        def prefill(params, cfg, tokens, valid, cache, **kw):
            t0 = time.perf_counter()
            out = jax.block_until_ready(self.prefill(params, cfg, tokens, valid, cache, **kw))
            self._record("canonical", tokens, int(np.sum(valid)), out[1],
                         time.perf_counter() - t0)
            return out

        def tree(params, cfg, cache, tokens, pos, *args, **kw):
            t0 = time.perf_counter()
            out = jax.block_until_ready(self.tree(params, cfg, cache, tokens, pos, *args, **kw))
            gather = kw.get("gather")
            self._record("tree", tokens, int(np.sum(np.asarray(pos) >= 0)), out[1],
                         time.perf_counter() - t0,
                         (kw.get("reads"), None if gather is None else gather[0].shape))
            return out

        self.module.prefill_donated, self.module.forward_tree = prefill, tree
        return self

    def __exit__(self, *exc):
        self.module.prefill_donated, self.module.forward_tree = self.prefill, self.tree


def _call_curve(lm, slots: int, width: int, filled: int, repeats: int,
                buckets: tuple[int, ...]) -> list[dict]:
    """Seconds per token of a 256-token canonical chunk and of a tree call of each bucket's
    size, each call donating a fresh copy of its cache as the scoring does and timed to
    its result (the median of ``repeats``, after one call that compiles). The chunk runs
    as the canonical pass's last one: on that pass's cache of ``width`` slots, after
    ``width - 256`` tokens. The tree calls run on a cache of ``slots`` slots whose first
    ``filled`` hold a context, and read what the scoring's read: the canonical pass's
    ``width`` slots and T gathered slots (`brf.bytes.lm.ancestor_gather`, its smallest
    size), for each of ``buckets``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from brf.bytes.lm import ancestor_gather
    from brf.models.transformer import Reads
    from brf.models import forward_tree, init_cache, prefill_donated
    from brf.models.cache import grow
    rng = np.random.default_rng(0)
    ids = rng.integers(0, lm.cfg.vocab_size, (1, filled)).astype(np.int32)
    cache = init_cache(lm.cfg, 1, filled, lm.dtype)
    _, cache = prefill_donated(lm.params, lm.cfg, jnp.asarray(ids), jnp.ones((1, filled), bool),
                               cache, dtype=lm.dtype, logits="all")
    cache = dict(grow(cache, slots), end=jnp.asarray(filled, jnp.int32))

    def median(fn, on=cache):
        times = []
        for _ in range(repeats + 1):  # the first compiles
            fresh = jax.block_until_ready(jax.tree.map(jnp.copy, on))
            t0 = time.perf_counter()
            jax.block_until_ready(fn(fresh))
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    # a canonical chunk as the scoring runs the last one: the canonical pass's own cache
    # of ``width`` slots (no alternatives' region yet), its last 256 slots written
    canon = init_cache(lm.cfg, 1, width, lm.dtype)
    if width > 256:
        _, canon = prefill_donated(lm.params, lm.cfg, jnp.asarray(ids[:, :width - 256]),
                                   jnp.ones((1, width - 256), bool), canon, dtype=lm.dtype,
                                   logits="all")
    chunk = jnp.asarray(rng.integers(0, lm.cfg.vocab_size, (1, 256)).astype(np.int32))
    base = median(lambda c: prefill_donated(lm.params, lm.cfg, chunk, jnp.ones((1, 256), bool),
                                            c, dtype=lm.dtype, logits="all"), canon) / 256
    rows = [dict(call="canonical chunk", tokens=256, s_per_token=base, vs_canonical=1.0)]
    for T in buckets:
        toks = jnp.asarray(rng.integers(0, lm.cfg.vocab_size, (1, T)).astype(np.int32))
        pos = jnp.asarray((filled - 8 + np.arange(T) % 8)[None].astype(np.int32))
        c_allow = jnp.asarray(np.arange(slots)[None, None] < filled - 8).repeat(T, 1)
        t_allow = jnp.asarray(np.tril(np.ones((T, T), bool))[None])
        s = median(lambda c: forward_tree(lm.params, lm.cfg, c, toks, pos, c_allow, t_allow,
                                          dtype=lm.dtype, donate=True,
                                          reads=Reads(span=width),
                                          gather=ancestor_gather([[]] * T, T))) / T
        rows.append(dict(call="tree call", tokens=T, s_per_token=s, vs_canonical=s / base))
    return rows


def bench_calls(name: str, segs: list[bytes], warm: bytes, beam: int, threshold: float,
                max_lag: int, repeats: int, buckets: tuple[int, ...]) -> dict:
    """Every model call of byte-level scoring timed (``_Timed``), then ``_call_curve``."""
    import numpy as np
    from brf.bytes.lm import ALT_SLOTS, ByteLM
    from brf.bytes.scoring import score_segments
    lm = ByteLM.load(name)
    width = _padded_width(len(lm.context()) + len(lm.encode(s)) for s in segs + [warm])
    kw = dict(beam=beam, threshold=threshold, max_lag=max_lag, pad_to=width)
    timed = _Timed()
    with timed:
        score_segments(lm, [warm], desc="warm-up", **kw)  # compiles the shapes
    timed.rows = []
    with timed:
        t0 = time.perf_counter()
        sc = score_segments(lm, segs, desc=f"{name} bytes, calls timed", **kw)
        wall = time.perf_counter() - t0
    rows = np.asarray([r[1:] for r in timed.rows], np.float64)
    kinds = np.asarray([r[0] for r in timed.rows])
    new = rows[:, 3] > 0
    per = {}
    for kind in ("canonical", "tree"):
        m = kinds == kind
        per[kind] = dict(calls=int(m.sum()), padded=int(rows[m, 0].sum()),
                         real=int(rows[m, 1].sum()), seconds=float(rows[m, 2].sum()),
                         new_shapes=int((m & new).sum()),
                         new_shape_seconds=float(rows[m & new, 2].sum()))
        old = m & ~new
        per[kind]["s_per_real_token"] = per[kind]["seconds"] / max(per[kind]["real"], 1)
        per[kind]["s_per_real_token_seen_shapes"] = (float(rows[old, 2].sum())
                                                     / max(float(rows[old, 1].sum()), 1.0))
    by_bucket = []
    tree = kinds == "tree"
    for T in sorted(set(rows[tree, 0].astype(int))):
        m = tree & (rows[:, 0] == T)
        per_token = float(rows[m, 2].sum() / rows[m, 1].sum())
        seen = m & ~new
        per_token_seen = float(rows[seen, 2].sum() / max(rows[seen, 1].sum(), 1.0))
        by_bucket.append(dict(bucket=int(T), calls=int(m.sum()), new_shapes=int((m & new).sum()),
                              s_per_real_token_seen_shapes=per_token_seen,
                              mean_real=float(rows[m, 1].mean()),
                              s_per_call=float(rows[m, 2].mean()), s_per_real_token=per_token,
                              vs_canonical=per_token / per["canonical"]["s_per_real_token"]))
    # the scoring's own counts, which the timed calls must add up to
    out = dict(member=name, bytes=sum(map(len, segs)), wall_seconds=wall,
               extra_tokens=int(np.sum(sc["extra_tokens"])),
               padded_tokens=int(np.sum(sc["padded_tokens"])),
               model_seconds=float(rows[:, 2].sum()), canonical=per["canonical"],
               tree=per["tree"],
               tree_vs_canonical=per["tree"]["s_per_real_token"]
               / per["canonical"]["s_per_real_token"],
               tree_vs_canonical_seen_shapes=per["tree"]["s_per_real_token_seen_shapes"]
               / per["canonical"]["s_per_real_token_seen_shapes"], by_bucket=by_bucket)
    out["curve"] = _call_curve(lm, width + ALT_SLOTS, width, width - 64, repeats, buckets)
    print(json.dumps(out), flush=True)
    return out


def bench_lookahead(name: str, segs: list[bytes], warm: bytes, beam: int, threshold: float,
                    max_lag: int, entries: list[str]) -> list[dict]:
    """``segs`` scored once per max_speculation:window[:fill] entry, against the first
    entry: ``seconds`` with the programs of shapes the warm-up did not compile
    (``compiled`` of them), ``seconds_again`` the same segments once more."""
    import jax
    import numpy as np
    from brf.models.transformer import compiled_count
    from brf.bytes.lm import ByteLM, score_text
    lm = ByteLM.load(name)
    width = _padded_width(len(lm.context()) + len(lm.encode(s)) for s in segs + [warm])
    rows, ref = [], None
    for entry in entries:
        spec, window, *fill = (int(v) for v in entry.split(":"))
        fill = bool(fill[0]) if fill else True
        kw = dict(beam=beam, threshold=threshold, max_lag=max_lag, pad_to=width,
                  max_speculation=spec, window=window, fill=fill)
        jax.clear_caches()  # each entry compiles its own shapes, as in a process of its own
        score_text(lm, warm, **kw)  # compiles this entry's shapes
        n0 = compiled_count()
        t0 = time.perf_counter()
        scores = [score_text(lm, s, **kw) for s in segs]
        seconds = time.perf_counter() - t0
        compiled = compiled_count() - n0
        t0 = time.perf_counter()  # again, every shape compiled
        for s in segs:
            score_text(lm, s, **kw)
        again = time.perf_counter() - t0
        logp = np.concatenate([s.logp for s in scores])
        st = {k: int(sum(s.stats[k] for s in scores))
              for k in ("tree_calls", "extra_tokens", "padded_tokens", "lookaheads",
                        "speculated", "canonical_tokens")}
        ref = logp if ref is None else ref
        finite = np.isfinite(ref) & np.isfinite(logp)
        tv = 0.5 * np.abs(np.exp(logp) - np.exp(ref)).sum(1)
        rows.append(dict(member=name, max_speculation=spec, window=window, fill=fill,
                         seconds=seconds, compiled=compiled, seconds_again=again,
                         bytes=int(logp.shape[0]), **st,
                         same_impossible=bool(np.array_equal(np.isfinite(ref),
                                                             np.isfinite(logp))),
                         max_abs_dlogp=float(np.abs(logp - ref)[finite].max(initial=0.0)),
                         max_tv=float(tv.max(initial=0.0))))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_memory(name: str, segs: list[bytes], beam: int, threshold: float,
                 max_lag: int) -> dict:
    from brf.bytes.lm import ByteLM
    from brf.bytes.scoring import score_segments
    from brf.runtime import release_memory, resident_bytes
    lm = ByteLM.load(name)
    width = _padded_width(len(lm.context()) + len(lm.encode(s)) for s in segs)
    out = dict(member=name, bytes=sum(map(len, segs)), segments=len(segs))
    for release in (False, True):
        release_memory()
        start, after = resident_bytes() / 1e9, []
        for seg in segs:
            score_segments(lm, [seg], beam=beam, threshold=threshold, max_lag=max_lag,
                           pad_to=width, release=release, desc=f"{name} release={release}")
            after.append(resident_bytes() / 1e9)
        key = "release" if release else "keep"
        out[key] = dict(start_gb=start, after_segment_gb=after, peak_gb=max(after))
        print(json.dumps({key: out[key]}), flush=True)
    return out


def bench_generate(beam: int, threshold: float) -> dict:
    import importlib.util
    import pathlib
    from brf.ensemble.run import run
    path = pathlib.Path(__file__).resolve().parent.parent / "configs" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_config", path)
    gen_config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_config)

    out = {}
    for level in ("tokens", "bytes"):
        c = gen_config.get_config("bytes" if level == "bytes" else None)
        c.prompts = ("Write one sentence about the sea.",)
        c.sampler, c.stream = "greedy", False
        c.max_new_tokens, c.max_new_bytes = FLAGS.new_tokens, FLAGS.new_bytes
        c.beam, c.threshold = beam, threshold
        run(c)  # warm-up (compile)
        t0 = time.perf_counter()
        rows = run(c)
        seconds = time.perf_counter() - t0
        n = len(rows[0]["text"].encode("utf-8"))
        out[level] = dict(bytes=n, seconds=seconds, bytes_per_s=n / seconds,
                          text=rows[0]["text"])
    out["ratio_bytes_per_s"] = out["bytes"]["bytes_per_s"] / out["tokens"]["bytes_per_s"]
    return out


def main(argv):
    del argv
    from brf.bytes import DEFAULT_MAX_LAG, DEFAULT_THRESHOLD
    from brf.bytes.lm import TREE_BUCKETS
    from brf.errors import UserError
    from brf.eval.corpus import CORPORA
    buckets = tuple(int(b) if b.strip().isdigit() else -1 for b in FLAGS.curve_buckets)
    if not set(buckets) <= set(TREE_BUCKETS):
        raise UserError(f"--curve_buckets={','.join(FLAGS.curve_buckets)}: each must be one "
                        f"of the tree buckets {', '.join(map(str, TREE_BUCKETS))}")
    buckets = buckets or TREE_BUCKETS
    threshold = DEFAULT_THRESHOLD if FLAGS.threshold is None else FLAGS.threshold
    max_lag = DEFAULT_MAX_LAG if FLAGS.max_lag is None else FLAGS.max_lag
    res = dict(machine=platform.platform(), corpus=FLAGS.corpus, beam=FLAGS.beam,
               threshold=threshold, max_lag=max_lag, segment=FLAGS.segment,
               started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    needs_corpus = set(FLAGS.parts) - {"generate"}
    text = CORPORA.get(FLAGS.corpus)()[0].encode("utf-8") if needs_corpus else b""
    # score and memory: the corpus's bytes [skip_bytes, skip_bytes + n_bytes) in segments
    segs = segments_of(text[FLAGS.skip_bytes:FLAGS.skip_bytes + FLAGS.n_bytes], FLAGS.segment)
    warm = text[FLAGS.skip_bytes + FLAGS.n_bytes:][:FLAGS.segment]  # score, calls, lookahead
    if "score" in FLAGS.parts:
        res["score"] = []
        for m in FLAGS.models:
            res["score"] += bench_member(m, segs, warm, FLAGS.beam,
                                         [float(t) for t in FLAGS.thresholds] or [threshold],
                                         max_lag, FLAGS.score_cold)
            _write(res)  # each part as soon as it is measured
    if "calls" in FLAGS.parts:
        res["calls"] = [bench_calls(m, segs, warm, FLAGS.beam, threshold, max_lag,
                                    FLAGS.call_repeats, buckets) for m in FLAGS.models]
        _write(res)
    if "lookahead" in FLAGS.parts:
        res["lookahead"] = []
        for m in FLAGS.models:
            res["lookahead"] += bench_lookahead(m, segs, warm, FLAGS.beam, threshold, max_lag,
                                                FLAGS.lookahead)
            _write(res)
    if "memory" in FLAGS.parts:
        res["memory"] = [bench_memory(m, segs, FLAGS.beam, threshold, max_lag)
                         for m in FLAGS.models]
        _write(res)
    if "accuracy" in FLAGS.parts:
        data = segments_of(text[FLAGS.skip_bytes:], FLAGS.n_bytes)[0]
        compile_on = text[:FLAGS.skip_bytes] or text[-1000:]
        res["accuracy"] = []
        for m in FLAGS.models:
            res["accuracy"] += bench_accuracy(m, data, compile_on, FLAGS.settings,
                                              FLAGS.accuracy_again)
            _write(res)
    if "generate" in FLAGS.parts:
        res["generate"] = bench_generate(FLAGS.beam, threshold)
        _write(res)
    print(json.dumps(res, indent=1))


def _write(res: dict) -> None:
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    cli.run(main)
