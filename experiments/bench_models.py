r"""Real-model speed: brf (JAX) vs transformers (PyTorch), float32, same thread count.

For each model, in one run and interleaving the two frameworks' repeats:
prefill tokens/s on a --prompt_len prompt (batch 1, logits of the last position
only on both sides), greedy decode tokens/s over --new_tokens steps with a KV
cache, and time to first token (TTFT: compile if needed + 512-token prefill + argmax) of
a fresh process, cold (empty JAX persistent compilation cache) and warm (the
cache the cold run filled); the orbax load from the brf cache is reported
separately.

  python experiments/bench_models.py                       # both models
  python experiments/bench_models.py --models=smollm2-135m-instruct --threads=2
  python experiments/bench_models.py --threads=2 --prefill_parts   # + where prefill time goes

The thread count goes to XLA (intra_op_parallelism_threads) and to torch
(set_num_threads); it must be set before jax is imported, so it is read from
the command line at import time.
"""

import json
import os
import subprocess
import sys
import tempfile
import time


def _threads_from_argv() -> int:
    for a in sys.argv[1:]:
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return os.cpu_count() or 1


THREADS = _threads_from_argv()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_cpu_multi_thread_eigen=true "
                           f"intra_op_parallelism_threads={THREADS}")

from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from brf import cli  # noqa: E402
from brf.align.vocab import encode_text  # noqa: E402
from brf.benchmark import memory_bandwidth, markdown_table  # noqa: E402
from brf.checkpoints import registry  # noqa: E402
from brf.models import decode_step_donated, init_cache, prefill_donated  # noqa: E402
from brf.models.transformer import stack_layers  # noqa: E402
from brf.runtime import enable_compilation_cache  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("models", "smollm2-135m-instruct,gemma3-270m", "comma-separated")
flags.DEFINE_integer("threads", THREADS, "threads for XLA and torch (read at import)")
flags.DEFINE_integer("prompt_len", 512, "prefill length")
flags.DEFINE_integer("new_tokens", 32, "greedy decode steps timed")
flags.DEFINE_integer("repeats", 3, "timed repeats per measurement (median)")
flags.DEFINE_string("jax_cache", None, "persistent compilation cache dir "
                    "(default $BRF_CACHE/jax_cache)")
flags.DEFINE_string("ttft_child", None, "internal: run one TTFT measurement for this model")
flags.DEFINE_bool("prefill_parts", False, "also time the prefill's pieces on both sides: "
                  "its projection matmuls (same shapes and weights in XLA and torch) and "
                  "brf's causal attention, interleaved with whole prefills")
flags.DEFINE_bool("skip_torch", False, "JAX only")


def _prompt_ids(m, n):
    text = ("The history of the Roman Empire spans many centuries, from the founding of the "
            "city to the fall of Constantinople; its roads, laws and languages shaped Europe. ")
    ids = encode_text(m.tokenizer, text * (n // 8 + 8), add_special_tokens=True)[:n]
    assert len(ids) == n
    return ids


def _jax_prefill(m, ids, max_len):
    cache = init_cache(m.cfg, 1, max_len)
    return prefill_donated(m.params, m.cfg, jnp.asarray([ids], jnp.int32), None, cache,
                           logits="last")


def _jax_decode(m, logits_BxV, cache, n):
    for _ in range(n):
        tok_B = jnp.argmax(logits_BxV, -1).astype(jnp.int32)
        logits_BxV, cache = decode_step_donated(m.params, m.cfg, tok_B, cache)
    return jax.block_until_ready(logits_BxV)


def ttft_child(name):
    """One fresh-process TTFT: load (cached checkpoint), then compile+prefill+1 token."""
    enable_compilation_cache(FLAGS.jax_cache)
    t0 = time.perf_counter()
    m = registry.load(name, progress=False)
    jax.block_until_ready(m.params)
    t1 = time.perf_counter()
    ids = _prompt_ids(m, FLAGS.prompt_len)
    logits_BxV, _ = _jax_prefill(m, ids, FLAGS.prompt_len + FLAGS.new_tokens)
    int(jnp.argmax(logits_BxV[0]))
    t2 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "ttft_s": t2 - t1}))


def _torch_reference(path, threads):
    """The tests' PyTorch reference (tests/pt_reference.py), with SDPA attention."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from pt_reference import reference_model, torch
    return reference_model(path, attn="sdpa", threads=threads), torch


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def prefill_parts(m, ids, jax_pre, torch_pre, torch):
    """Where a prefill's time goes, and what that bounds.

    Times, interleaved over --repeats: every layer's projection matmuls for a
    --prompt_len prompt in XLA (one call per matmul, as the model runs them) and
    in torch (`F.linear` on copies of the same weights), brf's causal attention
    over the prompt once per layer, and both whole prefills. Matmuls are most of
    either side's prefill, so `prefill_bound_vs_torch` (torch's prefill over
    brf's matmuls plus attention alone, everything else free) is the most any
    change outside the matmul kernels could reach.
    """
    from brf.models import transformer as tr
    cfg, layers, T = m.cfg, m.params["layers"], len(ids)
    rng = np.random.RandomState(0)
    names = sorted(k for k in layers[0] if k.endswith("_t"))  # [out, in] projections
    xs = {k: rng.standard_normal((1, T, layers[0][k].shape[1])).astype(np.float32)
          for k in names}
    jxs = {k: jnp.asarray(v) for k, v in xs.items()}
    mm = jax.jit(lambda x, w: jnp.einsum("bti,oi->bto", x, w))

    def jax_gemms():
        return jax.block_until_ready([mm(jxs[k], lp[k]) for lp in layers for k in names])

    F = torch.nn.functional
    txs = {k: torch.from_numpy(v) for k, v in xs.items()}
    tws = [{k: torch.from_numpy(np.array(lp[k])) for k in names} for lp in layers]

    def torch_gemms():
        with torch.no_grad():
            return [F.linear(txs[k], w[k]) for w in tws for k in names]

    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = (jnp.asarray(rng.standard_normal((1, T, n, E)).astype(np.float32))
               for n in (H, K, K))
    causal = jnp.tril(jnp.ones((1, T, T), bool))
    att = jax.jit(lambda q, k, v: tr._causal_attention(
        cfg, q, None, (k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), causal)))

    def jax_attention():
        return jax.block_until_ready([att(q, k, v) for _ in layers])

    fns = dict(jax_prefill=jax_pre, torch_prefill=torch_pre, jax_matmuls=jax_gemms,
               torch_matmuls=torch_gemms, jax_attention=jax_attention)
    for f in fns.values():
        f()
    times = {n: [] for n in fns}
    for _ in range(FLAGS.repeats):
        for n, f in fns.items():
            times[n].append(_median_time(f, 1))
    s = {n: float(np.median(t)) for n, t in times.items()}
    gflop = sum(2 * T * int(np.prod(lp[k].shape)) for lp in layers for k in names) / 1e9
    return {
        "parts_jax_prefill_s": s["jax_prefill"], "parts_torch_prefill_s": s["torch_prefill"],
        "parts_jax_matmul_s": s["jax_matmuls"], "parts_torch_matmul_s": s["torch_matmuls"],
        "parts_jax_attention_s": s["jax_attention"],
        "matmul_gflop_s_jax": gflop / s["jax_matmuls"],
        "matmul_gflop_s_torch": gflop / s["torch_matmuls"],
        "torch_prefill_matmul_share": s["torch_matmuls"] / s["torch_prefill"],
        "prefill_bound_vs_torch": s["torch_prefill"] / (s["jax_matmuls"] + s["jax_attention"]),
    }


def bench_model(name):
    m = registry.load(name, progress=False)
    ids = _prompt_ids(m, FLAGS.prompt_len)
    n, T = FLAGS.new_tokens, FLAGS.prompt_len
    row = {}
    # JAX: warm up (compile) then time.
    logits_BxV, cache = _jax_prefill(m, ids, T + n + 1)
    _jax_decode(m, logits_BxV, cache, 1)
    jax_pre = lambda: jax.block_until_ready(_jax_prefill(m, ids, T + n + 1))  # noqa: E731

    def jax_dec(model=m):
        lo, c = _jax_prefill(model, ids, T + n + 1)
        jax.block_until_ready(lo)
        t0 = time.perf_counter()
        _jax_decode(model, lo, c, n)
        return time.perf_counter() - t0

    if not FLAGS.skip_torch:
        ref, torch = _torch_reference(registry.resolve(name), FLAGS.threads)
        x = torch.tensor([ids])

        def torch_pre():
            with torch.no_grad():
                return ref(x, use_cache=True, logits_to_keep=1)

        def torch_dec():
            with torch.no_grad():
                out = torch_pre()
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                t0 = time.perf_counter()
                for _ in range(n):
                    out = ref(tok, past_key_values=past, use_cache=True)
                    past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                return time.perf_counter() - t0

        torch_pre()  # warm-up
        tp, td = [], []
    jp, jd = [], []
    for _ in range(FLAGS.repeats):  # interleaved, so drift hits both sides alike
        jp.append(_median_time(jax_pre, 1))
        jd.append(jax_dec())
        if not FLAGS.skip_torch:
            tp.append(_median_time(torch_pre, 1))
            td.append(torch_dec())
    if FLAGS.prefill_parts and not FLAGS.skip_torch:
        row.update(prefill_parts(m, ids, jax_pre, torch_pre, torch))
    row["jax_prefill_tok_s"] = T / float(np.median(jp))
    row["jax_decode_tok_s"] = n / float(np.median(jd))
    # The same weights in the stacked layout (one jitted lax.scan over layers),
    # decoded after the comparison so that its second copy of the weights is not
    # resident during it.
    m_stacked = m._replace(params=stack_layers(m.params, m.cfg))
    jax_dec(m_stacked)
    row["jax_decode_stacked_tok_s"] = n / float(np.median([jax_dec(m_stacked)
                                                            for _ in range(FLAGS.repeats)]))
    del m_stacked
    # Memory floor of decode: every weight is read once per token.
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(m.params))
    floor_tok_s = memory_bandwidth() / weight_bytes
    row["decode_floor_tok_s"] = floor_tok_s
    row["jax_decode_vs_floor"] = row["jax_decode_tok_s"] / floor_tok_s
    if not FLAGS.skip_torch:
        row["torch_prefill_tok_s"] = T / float(np.median(tp))
        row["torch_decode_tok_s"] = n / float(np.median(td))
        with torch.no_grad():
            t0 = time.perf_counter()
            int(torch_pre().logits[0, -1].argmax())
            row["torch_ttft_s"] = time.perf_counter() - t0
    # TTFT of fresh processes sharing a new, empty compilation cache: the first
    # compiles and fills it (cold), the second only loads the executables (warm).
    runs = []
    with tempfile.TemporaryDirectory() as jax_cache:
        for _ in range(2):
            res = subprocess.run([sys.executable, __file__, f"--ttft_child={name}",
                                  f"--threads={FLAGS.threads}", f"--prompt_len={T}",
                                  f"--new_tokens={n}", f"--jax_cache={jax_cache}"],
                                 capture_output=True, text=True, check=True)
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    row["jax_ttft_cold_cache_s"] = runs[0]["ttft_s"]
    row["jax_ttft_warm_cache_s"] = runs[1]["ttft_s"]
    row["load_from_cache_s"] = runs[1]["load_s"]
    return row


def main(argv):
    del argv
    if FLAGS.ttft_child:
        return ttft_child(FLAGS.ttft_child)
    cache = enable_compilation_cache(FLAGS.jax_cache)
    print(f"threads={FLAGS.threads} prompt_len={FLAGS.prompt_len} new_tokens={FLAGS.new_tokens} "
          f"devices={jax.devices()} jax_cache={cache} loadavg={os.getloadavg()}")
    rows = {name: bench_model(name) for name in FLAGS.models.split(",")}
    keys = sorted({k for r in rows.values() for k in r})
    print(markdown_table(["model"] + keys,
                         [[name] + [r.get(k, "") for k in keys] for name, r in rows.items()]))
    print(json.dumps(rows))


if __name__ == "__main__":
    cli.run(main)
