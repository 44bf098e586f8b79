r"""brf's byte-level view against genlm-bytes (the PyTorch peer), side by side in one run.

The same model (SmolLM2-135M-Instruct: brf's JAX model, and transformers' PyTorch
model of the same GGUF file, converted by transformers itself), the same text (a
corpus slice, read after BOS by both), matched settings: beam K and prune threshold,
no merging in brf (max_lag=0), no healing in genlm-bytes. For each setting, each
library scores every byte of the text (its next-byte distribution before the byte is
read, then reads it), after a warm-up run on other text, and the report gives:

* bytes per second of each, and their ratio (brf / genlm);
* the agreement of their next-byte distributions: per-byte total variation over the
  256 bytes and end of text (each renormalised over those events: genlm keeps an
  end-of-token entry that is not an event of the text), mean / p99 / max, and the
  difference in bits per byte.

genlm-bytes prunes by a hypothesis's share of the beam's total like brf does (and
keeps the K heaviest); it builds each next-token distribution's masses over its
whole token trie, brf only along the text. genlm conditions nothing away: its
vocabulary holds the special tokens' strings, brf conditions each next-token
distribution on text tokens or EOS (brf/bytes/masses.py), so the two differ by the
mass the model gives special tokens (tiny for SmolLM2).

Needs the benchmark extra (`pip install -e ".[bench]"`: genlm-bytes 0.2.0, torch CPU).

  python experiments/bench_bytes_peer.py --corpus=pyparsing --skip_bytes=20000 --n_bytes=300 \
      --settings=16:3e-3,64:1e-6 --out=runs/bench_bytes_peer.json
"""

import asyncio
import json
import os
import platform
import sys
import time

from absl import flags

from brf import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "a registered model")
flags.DEFINE_string("corpus", "pyparsing", "a brf.eval.corpus.CORPORA name")
flags.DEFINE_integer("skip_bytes", 20000, "bytes of the corpus skipped first")
flags.DEFINE_integer("n_bytes", 300, "bytes scored")
flags.DEFINE_list("settings", ["16:3e-3", "64:1e-6"], "beam:threshold per run")
flags.DEFINE_integer("threads", 2, "torch threads (brf's XLA uses every core)")
flags.DEFINE_string("out", "", "write the results as JSON here")


def _genlm(name: str):
    """genlm-bytes' language model over transformers' PyTorch model of the same GGUF.
    The peer and torch come from the benchmark extra; brf itself never imports them."""
    try:
        import torch
        from genlm.backend.llm import AsyncTransformer
    except ImportError as e:
        raise cli.UserError(f"{e.name or e} is missing: this benchmark needs the benchmark "
                            "extra, pip install -e \".[bench]\"") from None
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from brf.checkpoints import registry
    from tests.pt_reference import reference_model
    torch.set_num_threads(FLAGS.threads)
    model = registry.load(name, progress=False)
    return AsyncTransformer(reference_model(registry.resolve(name)), model.tokenizer), model


async def _genlm_rows(llm, data: bytes, beam: int, threshold: float, eos: list[bytes]):
    import numpy as np
    from genlm.bytes import BeamParams, ByteBeamState
    state = await ByteBeamState.initial(llm, BeamParams(K=beam, prune_threshold=threshold,
                                                        heal=False, eos_byte_strings=eos))
    rows = []
    for b in data:
        ps = np.asarray((await state.logp_next()).ps, np.float64)
        rows.append(np.concatenate([ps[:256], ps[257:258]]))  # bytes, end of text (EOS)
        state = await (state.prune() << b)
    await state.cleanup()
    rows = np.stack(rows)
    top = rows.max(1, keepdims=True)
    return rows - (top + np.log(np.exp(rows - top).sum(1, keepdims=True)))


def main(argv):
    del argv
    import numpy as np
    from brf.bytes.lm import ByteLM, score_text
    from brf.bytes.precision import compare
    from brf.eval.corpus import CORPORA
    text = CORPORA.get(FLAGS.corpus)()[0].encode("utf-8")
    data = text[FLAGS.skip_bytes:FLAGS.skip_bytes + FLAGS.n_bytes]
    warm = text[:200]
    llm, model = _genlm(FLAGS.model)
    lm = ByteLM(model.params, model.cfg, model.tokenizer, name=FLAGS.model)
    eos = [lm.codec.table.token_bytes[i] or model.tokenizer.convert_ids_to_tokens(i).encode()
           for i in lm.eos_ids]
    res = dict(machine=platform.platform(), model=FLAGS.model, corpus=FLAGS.corpus,
               skip_bytes=FLAGS.skip_bytes, bytes=len(data), threads=FLAGS.threads,
               started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), runs=[])
    gold = np.frombuffer(data, np.uint8).astype(np.int64)
    for setting in FLAGS.settings:
        beam, threshold = int(setting.split(":")[0]), float(setting.split(":")[1])
        # warm-up (compilation, caches) on other text, then the measured runs
        score_text(lm, warm, beam=beam, threshold=threshold, max_lag=0)
        asyncio.run(_genlm_rows(llm, warm[:40], beam, threshold, eos))
        llm.clear_cache()
        t0 = time.perf_counter()
        ours = score_text(lm, data, beam=beam, threshold=threshold, max_lag=0)
        brf_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        theirs = asyncio.run(_genlm_rows(llm, data, beam, threshold, eos))
        genlm_s = time.perf_counter() - t0
        llm.clear_cache()
        agree = compare(ours.logp, theirs, gold)
        row = dict(beam=beam, threshold=threshold, brf_seconds=brf_s, genlm_seconds=genlm_s,
                   brf_bytes_per_s=len(data) / brf_s, genlm_bytes_per_s=len(data) / genlm_s,
                   speed_ratio=genlm_s / brf_s, brf_extra_tokens=ours.stats["extra_tokens"],
                   **{f"agree_{k}": v for k, v in agree.items()})
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
        if FLAGS.out:
            with open(FLAGS.out, "w") as f:
                json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    cli.run(main)
