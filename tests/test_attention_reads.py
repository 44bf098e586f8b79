"""Bounded cache reads (brf.models.transformer.Reads): a decoding step that reads only
the slots written so far, and sliding-window layers only their window, gives the
logits of a step that reads every slot, and of a cache-free pass over the text."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from brf.models import ModelConfig, init_cache, init_params
from brf.models import transformer as T

WINDOW = 8


def _cfg():
    types = ("local", "global", "local", "local")
    return ModelConfig(arch="gemma3", vocab_size=97, d_model=32, n_layers=4, n_heads=4,
                       n_kv_heads=2, head_dim=8, d_ff=48, norm_eps=1e-6, rope_theta=10000.0,
                       rope_local_theta=1000.0, sliding_window=WINDOW, layer_types=types,
                       query_pre_attn_scalar=8, act="gelu_tanh", embed_scale=True,
                       max_seq_len=512)


def test_bounded_reads_equal_full_reads_and_a_cache_free_pass():
    cfg = _cfg()
    params = T.unstack_layers(init_params(cfg, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(0)
    S, lengths = 128, (13, 5)
    tokens = np.zeros((2, 16), np.int32)
    valid = np.zeros((2, 16), bool)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(3, 97, n)
        valid[b, :n] = True
    texts = [list(tokens[b, :n]) for b, n in enumerate(lengths)]
    # One program per (shape, reads): the whole step, as a decoding loop compiles it.
    fwd = jax.jit(T.forward, static_argnames=("cfg", "logits", "reads"))
    _, full = fwd(params, cfg, tokens, valid, init_cache(cfg, 2, S), logits="last")
    bounded = jax.tree.map(jnp.copy, full)
    end, n_read = 16, list(lengths)
    used = set()
    for step in range(20):
        # Now and then sequence 1 reads three tokens and sequence 0 one (padding slots).
        k = 3 if step == 10 else 1
        new = rng.integers(3, 97, (2, k)).astype(np.int32)
        ok = np.ones((2, k), bool)
        ok[0, 1:] = False
        reads = T.cache_reads(cfg, end, S, n_read, k, smallest=16)
        used.add(reads)
        want, full = fwd(params, cfg, new, ok, full, logits="last")
        got, bounded = fwd(params, cfg, new, ok, bounded, logits="last", reads=reads)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
        for b in range(2):
            texts[b] += list(new[b, ok[b]])
            n_read[b] += int(ok[b].sum())
        end += k
    # The steps read less than the allocation: spans below S, windows below the span.
    assert any(r is not None and r.span is not None and r.span < S for r in used)
    assert any(r is not None and r.local is not None and r.local < (r.span or S) for r in used)
    # The last step against a pass without a cache over each whole text.
    for b in range(2):
        ids = np.asarray(texts[b], np.int32)[None]
        ref, _ = fwd(params, cfg, ids, logits="last")
        np.testing.assert_allclose(np.asarray(got)[b], np.asarray(ref)[0], atol=1e-4, rtol=0)


def test_cache_reads_are_exact_bounds():
    cfg = _cfg()
    # Short context in a large cache: read the next power of two of what is written.
    assert T.cache_reads(cfg, 100, 1024, [90], 1, smallest=16) == T.Reads(128, 32)
    # The window grows with the padding a sequence has among its slots.
    assert T.cache_reads(cfg, 100, 1024, [70], 1, smallest=16).local == 64
    assert T.cache_reads(cfg, 100, 1024, [40], 1, smallest=16).local is None  # >= the span
    # Spans below the smallest are rounded up to it (few compiled shapes).
    assert T.cache_reads(cfg, 100, 8192, [90], 1) == T.Reads(1024, 32)
    # Nothing to save: the whole allocation is about what is written.
    assert T.cache_reads(dataclasses.replace(cfg, layer_types=("global",) * 4,
                                             sliding_window=None), 600, 1024, [600],
                         smallest=16) is None
