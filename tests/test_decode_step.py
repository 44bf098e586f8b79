"""The compiled decoding step (brf.ensemble.step) against the host loop it replaces:
the same events for the same seed, in a shared vocabulary and across vocabularies,
greedy and sampled, fused and mixture-sampled (the same members run at the same
steps); one compiled program reused across calls."""

import dataclasses

import numpy as np
import pytest

from brf.ensemble import generate
from brf.ensemble import step as dstep

PROMPTS = ["the cat sat", "in a hat"]


def _same(a, b):
    for x, y in zip(a, b):
        assert (x.data, x.text, x.finish_reason, x.n_events) == \
            (y.data, y.text, y.finish_reason, y.n_events)
        assert x.member_ids == y.member_ids and x.members_run == y.members_run


@pytest.mark.parametrize("ensemble,kw", [
    ("pair", dict(method="born", method_params={"phase": "tanh(rate=0.5, offset=[0, 1.0])"},
                  sampler="temperature=0.9,top_k=50", weights=[0.3, 0.7], seed=3)),
    ("pair", dict(method="loglinear", sampler="greedy", stop=["e"])),
    ("cross_pair", dict(aligner="union", method="born", method_params={"phase": "token_tanh"},
                        seed=2, weights=[0.4, 0.6])),
    ("cross_pair", dict(aligner="topk_union", aligner_params={"k": 8}, method="linear",
                        sampler="greedy")),
    # Mixture sampling: lazy catch-up of the pending events inside the step.
    ("pair", dict(mode="mixture_exact", choice="shared", weights=[0.3, 0.7], seed=5)),
    ("pair", dict(mode="mixture_per_member", sampler="temperature=0.8,top_k=20", seed=7)),
])
def test_device_engine_draws_what_the_host_loop_draws(request, ensemble, kw):
    members = request.getfixturevalue(ensemble)
    host = generate(members, PROMPTS, max_new_tokens=20, engine="host", **kw)
    pieces = []
    device = generate(members, PROMPTS, max_new_tokens=20, engine="device", block_steps=6,
                      on_piece=pieces.append, **kw)
    _same(host, device)
    for i, g in enumerate(device):
        assert "".join(p.text for p in pieces if p.index == i) == g.text


def test_device_engine_compiles_once_and_stops_at_eos(pair):
    first = generate(pair, PROMPTS, sampler="greedy", max_new_tokens=12, engine="host")
    compiled = dstep.compiled_count()
    runs = [generate(pair, PROMPTS, sampler="greedy", max_new_tokens=12, engine="device",
                     seed=s) for s in (0, 1)]
    assert dstep.compiled_count() <= compiled + 1  # one program for both calls
    _same(first, runs[0])
    # A member whose EOS is an event the pair draws: both engines stop there.
    events = first[0].member_ids[0][len(pair[0].prompt_ids(PROMPTS[0])):]
    t = next(t for t in range(1, len(events)) if events[t] not in events[:t])
    a = dataclasses.replace(pair[0], cfg=dataclasses.replace(pair[0].cfg, eos_ids=(2, events[t])))
    host, device = (generate([a, pair[1]], PROMPTS, sampler="greedy", max_new_tokens=12,
                             engine=e) for e in ("host", "device"))
    _same(host, device)
    assert device[0].finish_reason == "eos" and device[0].n_events == t + 1
    np.testing.assert_array_equal(device[0].member_ids[0], first[0].member_ids[0][:len(
        pair[0].prompt_ids(PROMPTS[0])) + t])


def test_the_step_updates_the_caches_in_place(pair, monkeypatch):
    """No copy of a KV cache inside the compiled block: XLA writes the new keys and
    values in place (a copy per step would cost the whole cache's bytes)."""
    import re

    import jax
    from brf.models import transformer as T
    members = [dataclasses.replace(m, params=T.unstack_layers(m.params)) for m in pair]
    seen = {}
    real = dstep._run_rounds_jit

    def spy(*args, **kw):
        seen.update(args=args, kw=kw)
        return real(*args, **kw)

    monkeypatch.setattr(dstep, "_run_rounds_jit", spy)
    generate(members, PROMPTS[:1], max_new_tokens=2, sampler="greedy", method="linear")
    spec, params, tables, st, *rest = seen["args"]
    shapes = {tuple(a.shape) for c in st.dec.caches for a in c["k"] + c["v"]}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), st)
    hlo = real.lower(spec, params, tables, abstract, *rest, **seen["kw"]).compile().as_text()
    copied = [m.group(1) for m in re.finditer(r"= f32\[([0-9,]+)\]\{[0-9,]*\} copy\(", hlo)]
    assert not [c for c in copied if tuple(int(d) for d in c.split(",")) in shapes]


def test_event_tokens_are_each_events_own_encoding_and_survive_the_disk(cross_pair, tmp_path,
                                                                       monkeypatch):
    from brf import align
    from brf.align.reencode import encode_bytes
    from brf.ensemble import aligned
    codecs = [align.make_codec(m.tokenizer) for m in cross_pair]
    union = align.make_aligner("union", [c.table for c in codecs]).union
    monkeypatch.setenv("BRF_CACHE", str(tmp_path))
    monkeypatch.setattr(aligned, "_DISK_ABOVE", 0)
    for codec in codecs:
        monkeypatch.setattr(aligned, "_EVENT_TOKENS", {})
        built = aligned.event_tokens(codec, union)
        monkeypatch.setattr(aligned, "_EVENT_TOKENS", {})
        read = aligned.event_tokens(codec, union)  # from the file just written
        for a, b in zip(built, read):
            np.testing.assert_array_equal(a, b)
        for u, data in enumerate(union.strings):
            got = tuple(built.flat[built.starts[u]:][:max(built.lengths[u], 0)])
            if u == align.CONTROL:
                assert built.lengths[u] == 0
                continue
            try:
                want = tuple(encode_bytes(codec, data))
            except ValueError:
                assert built.lengths[u] == -1
                continue
            assert got == want, (u, data)
    assert len(list(tmp_path.rglob("events-*.npz"))) == 2


def test_sliding_window_reads_on_the_device_follow_the_pending_event(tok):
    """Members with sliding-window layers (a window of 4) and prompts of very different
    lengths (padding slots among the shorter one's): with the local layers reading
    only their window (bounds computed from the tokens really read, the pending event
    not among them), the device gives the host loop's text. The bounds round up to a
    power of two, so an off-by-one in that count stays inside them and this test
    does not see it."""
    import jax

    from brf.ensemble.member import Member
    from brf.models import ModelConfig, init_params
    cfgs = [ModelConfig(arch="gemma3", vocab_size=len(tok), d_model=32, n_layers=3,
                        n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, norm_eps=1e-6,
                        rope_theta=10000.0, rope_local_theta=1000.0, sliding_window=4,
                        layer_types=("local", "local", "global"), query_pre_attn_scalar=8,
                        act="gelu_tanh", embed_scale=True, max_seq_len=256, bos_id=1,
                        eos_ids=(tok.eos_token_id,), pad_id=0) for _ in range(2)]
    members = []
    for seed, cfg in enumerate(cfgs):
        params = init_params(cfg, jax.random.PRNGKey(seed))
        params["final_norm"] = params["final_norm"] * 20.0
        members.append(Member(name=f"g{seed}", cfg=cfg, params=params, tokenizer=tok))
    prompts = ["the cat sat on the mat in a hat the cat sat on the mat in a hat the cat",
               "a"]
    kw = dict(method="linear", sampler="greedy", max_new_tokens=40, block_steps=6)
    host, device = (generate(members, prompts, engine=e, **kw) for e in ("host", "device"))
    _same(host, device)
    assert all(g.n_events == 40 for g in device)
