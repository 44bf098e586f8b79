"""Multi-device checks, run in a process of their own by tests/test_sharding.py.

tests/test_sharding.py calls ``python -c "import sharded_checks as s; s.run_all(...)"``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set in the
environment before JAX is imported (so the flag takes effect), so the process sees 8
CPU devices. ``run_all`` runs each check in turn and reports each failed assertion's
traceback under the check's name; the test reports it.

The reference for every sharded number is the same computation on one
device (float32 tolerance), which the tests of the single-device code
(test_models_hf.py, test_validate.py, test_fusion.py) in turn check against
transformers and float64 NumPy.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from brf import sharding
from brf.models.transformer import unstack_layers
from tiny_lm import tiny_config, tiny_params

assert jax.device_count() == 8, f"expected 8 virtual devices, got {jax.devices()}"

MESHES = {"data": dict(data=8, model=1), "model": dict(data=1, model=8),
          "mixed": dict(data=2, model=4)}


def _segments(vocab: int, lengths=(100, 77, 130, 40, 200), seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).astype(np.int32) for n in lengths]


def scoring(mesh_name: str) -> None:
    """Teacher-forced scoring on a mesh equals one device.

    The 'data' and 'model' meshes run the per-layer params layout (what
    ``registry.load`` returns), 'mixed' the stacked one (``lax.scan``).
    """
    from brf.eval.scoring import ROW_FIELDS, score_segments
    from brf.models import iter_logits_chunks, score_tokens

    mesh = sharding.make_mesh(MESHES[mesh_name])
    d, m = sharding.data_size(mesh), sharding.model_size(mesh)
    cfg = tiny_config(512, max_seq_len=512)
    segs = _segments(cfg.vocab_size, lengths=(100, 77, 130))
    params = tiny_params(cfg, 0)
    if mesh_name != "mixed":
        params = unstack_layers(params)
    placed = sharding.shard_params(params, mesh)
    # The weights really are split over 'model' (1/m of the vocabulary per device).
    shard_rows = {s.data.shape[0] for s in placed["lm_head"].addressable_shards}
    assert shard_rows == {cfg.vocab_size // m}, shard_rows
    ref = score_segments(params, cfg, segs, top_k=8, chunk=64)
    got = score_segments(placed, cfg, segs, top_k=8, chunk=64, mesh=mesh)
    for f in ("token_ids", "tok_starts", "row_starts", "topk_ids"):
        np.testing.assert_array_equal(getattr(got, f), getattr(ref, f), err_msg=f)
    for f in ROW_FIELDS[1:]:
        np.testing.assert_allclose(getattr(got, f), getattr(ref, f), rtol=1e-5, atol=2e-5,
                                   err_msg=f)
    # The logits come out split as placed: batch over 'data', vocabulary over
    # 'model' (same shapes as the scoring above: no new compilation).
    tokens = np.zeros((d, 192), np.int32)
    for b in range(d):
        tokens[b, :len(segs[b % 3])] = segs[b % 3]
    _, logits = next(iter_logits_chunks(placed, cfg, tokens, chunk=64, mesh=mesh))
    spec = tuple(logits.sharding.spec) + (None,) * 3
    assert (spec[0] == "data") == (d > 1), logits.sharding
    assert (spec[2] == "model") == (m > 1), logits.sharding
    if mesh_name == "data":
        # score_tokens pads a batch that does not divide over 'data'.
        batch = np.stack([s[:77] for s in segs])
        np.testing.assert_allclose(score_tokens(placed, cfg, batch, chunk=64, mesh=mesh),
                                   score_tokens(params, cfg, batch, chunk=64),
                                   rtol=1e-5, atol=2e-5)
    print("ok", mesh_name)


def _all_gathers(hlo: str) -> list[tuple[int, ...]]:
    """Output shapes of the all-gathers in compiled HLO text."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]* all-gather(-start)?\(", line)
        if m:
            out.append(tuple(int(d) for d in m.group(2).split(",") if d))
    return out


def fusion(mesh_name: str) -> None:
    """Every fusion method on vocabulary-sharded logits equals one device, and the
    compiled program never gathers the vocabulary onto one device."""
    from brf.fusion import METHODS
    from brf.fusion import methods as M

    mesh = sharding.make_mesh(MESHES[mesh_name])
    m = sharding.model_size(mesh)
    rng = np.random.default_rng(1)
    V = 4096
    x = (3 * rng.standard_normal((4, 2, V))).astype(np.float32)
    x[1, 0, :700] = -np.inf  # masked tokens, all in the first vocabulary shard
    w = jnp.asarray([0.3, 0.7], jnp.float32)
    xs = jax.device_put(x, sharding.vocab_sharding(mesh, 3))
    assert {s.data.shape[-1] for s in xs.addressable_shards} == {V // m}
    # The HLO check can fail: a program that does gather the vocabulary is caught.
    gather = jax.jit(lambda l: jax.lax.with_sharding_constraint(
        l, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())) * 2.0)
    assert (2, 2, V) in _all_gathers(gather.lower(xs).compile().as_text()) or \
        (4, 2, V) in _all_gathers(gather.lower(xs).compile().as_text())
    # Every method that needs no extra input; the softmax-bottleneck methods solve a
    # program per position over a token support and take the members' unembeddings,
    # and the phase-shuffled control permutes phases across the whole vocabulary:
    # they are not vocabulary-sharded kernels.
    cases = [(name, {}) for name in METHODS.names()
             if not any(p.kind == "array" for p in METHODS.get(name).params.values())
             and name != "born_shuffled"] + [
        ("born", {"phase": "tanh(rate=0.5, offset=[0, 1])"}),
        ("born", {"phase": "token_tanh(rate=0.5, offset=[0, 2])"}),
        ("born", {"phase": "constant(offset=[0, 3.1])"})]
    for name, params in cases:
        method = M.get_method(name)
        static, dynamic = M.split_params(method, M.resolve_params(method, params))
        f = jax.jit(lambda l, w, d: method.fn(l, w, **M.join_params(static, d)))
        ref, ref_info = f(jnp.asarray(x), w, dynamic)
        compiled = f.lower(xs, w, dynamic).compile()
        got, info = compiled(xs, w, dynamic)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5,
                                   err_msg=f"{name} {params}")
        for k in ref_info:
            np.testing.assert_allclose(np.asarray(info[k]), np.asarray(ref_info[k]),
                                       rtol=2e-5, atol=2e-5, err_msg=f"{name} info {k}")
        if m > 1:
            # The fused distribution stays split over the vocabulary ...
            assert "model" in tuple(got.sharding.spec), (name, got.sharding)
            # ... and no all-gather brings a vocabulary-sized axis together: the
            # normalisers and the top-2 gap are reductions (only per-shard
            # partial results, one value per shard, may be gathered).
            hlo = compiled.as_text()
            big = [s for s in _all_gathers(hlo) if s and max(s) >= V // m]
            assert not big, f"{name} {params}: all-gather of {big}"
    # The public entry point (input checks included) takes split logits too.
    import brf
    got = brf.fuse("born", xs, w, phase="tanh(rate=0.5)")
    np.testing.assert_allclose(np.asarray(got), np.asarray(
        brf.fuse("born", jnp.asarray(x), w, phase="tanh(rate=0.5)")), rtol=2e-5, atol=2e-5)
    assert "model" in tuple(got.sharding.spec), got.sharding
    print("ok", mesh_name)


def generation() -> None:
    """Greedy ensemble generation with model-sharded members equals one device."""
    import importlib.util
    import pathlib

    from brf.ensemble.run import run

    path = pathlib.Path(__file__).parent.parent / "configs" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config("tiny")
    c.sampler, c.max_new_tokens = "greedy", 5
    c.mesh.data, c.mesh.model = 1, 1
    ref = [r["text"] for r in run(c)]
    c.mesh.data, c.mesh.model = 2, 4
    got = [r["text"] for r in run(c)]
    assert got == ref and all(ref), (got, ref)
    print("ok", ref)


def _generate_config(*flags: str):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "configs" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(",".join(("tiny",) + flags))


def generation_data_parallel() -> None:
    """The prompts of a batch go over 'data' (each data shard decodes its own
    sequences, the weights over 'model'); the text equals one device."""
    from brf.ensemble import catchup
    from brf.ensemble.run import load_members, member_specs, place_members, run

    c = _generate_config()
    c.sampler, c.max_new_tokens = "greedy", 5
    c.prompts = ("Write one sentence about the sea.", "What is the capital of France?",
                 "Name a colour.", "Count to three.")
    c.mesh.data, c.mesh.model = 1, 1
    ref = [r["text"] for r in run(c)]
    c.mesh.data, c.mesh.model = 4, 2
    got = [r["text"] for r in run(c)]
    assert got == ref and all(ref), (got, ref)
    # The decoding state really is split: 4 sequences, one per data shard.
    members = place_members(load_members(member_specs(c.members))[:1],
                            sharding.make_mesh(dict(data=4, model=2)))
    state = catchup.start(members[0], [[1, 2, 3]] * 4)
    for x in (state.cache["k"][0], state.cache["pos"], state.logits_BxV):
        assert {s.data.shape[0] for s in x.addressable_shards} == {1}, x.sharding
    print("ok", ref)


def generation_apart() -> None:
    """Members apart (each on its own 4 devices, weights over 'model' there):
    fused and mixture decoding equal one device, and no member's weights share a
    device with another member's."""
    from brf.ensemble.run import load_members, member_specs, place_members, run

    for flags in ((), ("me",)):
        c = _generate_config(*flags)
        c.max_new_tokens = 5
        if not flags:
            c.sampler = "greedy"  # mixture_exact draws (seeded): the same draws apart
        c.mesh.data, c.mesh.model = 1, 1
        ref = [r["text"] for r in run(c)]
        c.mesh.data, c.mesh.model, c.mesh.placement = -1, 2, "apart"
        got = [r["text"] for r in run(c)]
        assert got == ref and all(ref), (flags, got, ref)
    members = load_members(member_specs(c.members))
    placed = place_members(members, sharding.member_meshes(c.mesh, len(members)))
    sets = [sharding.device_set(m.params) for m in placed]
    assert [len(s) for s in sets] == [4, 4] and not sets[0] & sets[1], sets
    print("ok", ref)


def _speculative_config(drafter: str, sampler: str):
    """The tiny pair without a chat template (so a prompt that repeats ends in text the
    n-gram drafter continues), four prompts, 10 tokens, speculating with ``drafter``."""
    c = _generate_config()
    c.members = ("random:smollm2-135m-instruct:0(weight=0.6), "
                 "random:smollm2-135m-instruct:1(weight=0.4)")
    c.speculative, c.sampler, c.max_new_tokens = drafter, sampler, 10
    c.prompts = ("a b a b a b a b a b", "What is the capital of France?",
                 "one two one two one two", "Count to three.")
    return c


_SPECULATIVE = (("ngram(n=2, k=4)", "greedy"),
                ("member(k=3, cost=0)", "temperature=0.8"))


def _spec_rows(rows):
    return [(r["text"], {k: v for k, v in r["speculative"].items() if k != "engine"})
            for r in rows]


def speculative_data_parallel() -> None:
    """Speculative decoding with the prompts over 'data' and the weights over 'model'
    runs its rounds on the device (the batch split over the data shards), and the
    host's rounds with compiled paused blocks, with the text and statistics of one
    device's, for both drafters, greedy and sampled."""
    from brf.ensemble.run import run

    for drafter, sampler in _SPECULATIVE:
        c = _speculative_config(drafter, sampler)
        c.mesh.data, c.mesh.model, c.engine = 1, 1, "host"
        ref = run(c)
        c.mesh.data, c.mesh.model = 4, 2
        for engine in ("device", "host"):
            c.engine = engine
            got = run(c)
            assert [r["speculative"]["engine"] for r in got] == [engine] * 4, got
            assert _spec_rows(got) == _spec_rows(ref), (drafter, engine, _spec_rows(got),
                                                        _spec_rows(ref))
        assert sum(r["speculative"]["drafted"] for r in ref) > 0, ref
    print("ok")


def speculative_apart() -> None:
    """Speculative decoding with members apart (each on its own 4 devices) fuses their
    rows on member 0's devices in host rounds, with one device's text and statistics;
    compiled rounds, which hold every member in one program, are refused by name."""
    from brf.ensemble.member import EnsembleInputError
    from brf.ensemble.run import run

    for drafter, sampler in _SPECULATIVE:
        c = _speculative_config(drafter, sampler)
        c.mesh.data, c.mesh.model = 1, 1
        ref = run(c)
        c.mesh.data, c.mesh.model, c.mesh.placement = -1, 2, "apart"
        got = run(c)
        assert [r["speculative"]["engine"] for r in got] == ["host"] * 4, got
        assert _spec_rows(got) == _spec_rows(ref), (drafter, _spec_rows(got), _spec_rows(ref))
        assert sum(r["speculative"]["drafted"] for r in ref) > 0, ref
    c.engine = "device"
    try:
        run(c)
    except EnsembleInputError as e:
        assert "same devices" in str(e), e
    else:
        raise AssertionError("engine='device' with members apart was not refused")
    print("ok")


def scoring_apart() -> None:
    """The validation's scoring with members apart (two members, each on a 2x2
    mesh of its own 4 devices, scored at the same time) equals one device, store
    for store."""
    import os
    import tempfile

    from test_validate import tiny_members

    from brf.eval import plan as plan_lib, scorer
    from brf.eval.corpus import load_default_corpus
    from brf.eval.scoring import ROW_FIELDS

    text = load_default_corpus(min_chars=100)[:3000]
    members = tiny_members(text)
    pair = [plan_lib.Member("tiny-a"), plan_lib.Member("tiny-b")]
    segs = plan_lib.split_segments(text, 500)
    # Groups: contiguous, equal, disjoint; members take turns when devices are few.
    apart = dict(data=-1, model=1, placement="apart")
    ids = lambda ms: [[d.id for d in sharding.mesh_devices(m)] for m in ms]
    assert ids(sharding.member_meshes(apart, 3)) == [[0, 1], [2, 3], [4, 5]]
    nine = ids(sharding.member_meshes(apart, 9))
    assert nine == [[i] for i in range(8)] + [[0]], nine
    assert len({id(m) for m in sharding.member_meshes(dict(apart, placement="shared"), 3)}) == 1
    try:
        sharding.member_meshes(dict(data=1, model=8, placement="apart"), 2)
        raise AssertionError("a mesh larger than a member's group was accepted")
    except sharding.ShardingError as e:
        assert "this process has 4 in each of 2 member groups" in str(e), e
    meshes = scorer.member_meshes(dict(data=-1, model=2, placement="apart"), 2)
    assert [m.devices.shape for m in meshes] == [(2, 2), (2, 2)]
    assert not set(sharding.mesh_devices(meshes[0])) & set(sharding.mesh_devices(meshes[1]))
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as apart:
        _, ref, _ = scorer.score_members(pair, segs, one, members.__getitem__, top_k=8,
                                         chunk=64)
        _, got, _ = scorer.score_members(pair, segs, apart, members.__getitem__, top_k=8,
                                         chunk=64, meshes=meshes)
        assert sorted(os.listdir(one)) == sorted(os.listdir(apart))
    for r, g in zip(ref, got):
        for f in ("token_ids", "tok_starts", "row_starts", "topk_ids"):
            np.testing.assert_array_equal(getattr(g, f), getattr(r, f), err_msg=f)
        for f in ROW_FIELDS[1:]:
            np.testing.assert_allclose(getattr(g, f), getattr(r, f), rtol=1e-5, atol=2e-5,
                                       err_msg=f)
    print("ok")


def checkpoint_on_mesh() -> None:
    """A checkpoint read straight onto a mesh (store.restore / registry.load /
    registry.load_module with ``mesh=``): every split weight arrives as 1/m of
    itself per device, in both layouts, with the values of a one-device restore;
    the module's logits and scoring on it equal one device's."""
    import tempfile

    from brf.checkpoints import registry, store
    from brf.eval.scoring import score_segments

    mesh = sharding.make_mesh(MESHES["mixed"])  # data 2 x model 4
    cfg = tiny_config(512, max_seq_len=512)
    with tempfile.TemporaryDirectory() as tmp:
        path = store.save(f"{tmp}/ckpt", cfg, jax.device_get(tiny_params(cfg, 3)))
        for layout in ("stacked", "layers"):
            ref = registry.load(path, layout=layout).params
            got = registry.load(path, layout=layout, mesh=mesh).params
            n_split = 0
            for (kp, r), g in zip(jax.tree_util.tree_leaves_with_path(ref),
                                  jax.tree_util.tree_leaves(got)):
                name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp)
                want = sharding.param_spec(name, r.shape)
                assert tuple(g.sharding.spec) == tuple(want) or (
                    not tuple(want) and not any(g.sharding.spec)), (name, g.sharding, want)
                if sharding.MODEL in tuple(want):
                    n_split += 1
                    dim = tuple(want).index(sharding.MODEL)
                    assert {s.data.shape[dim] for s in g.addressable_shards} == \
                        {r.shape[dim] // 4}, name
                np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
            assert n_split >= 5, (layout, n_split)
            _module_on_mesh(path, layout, mesh, got, ref)
        params = registry.load(path).params
        segs = _segments(cfg.vocab_size, lengths=(60, 45, 80))
        a = score_segments(params, cfg, segs, top_k=8, chunk=64)
        b = score_segments(registry.load(path, mesh=mesh).params, cfg, segs, top_k=8, chunk=64,
                           mesh=mesh)
        np.testing.assert_allclose(b.gold_logp, a.gold_logp, rtol=1e-5, atol=2e-5)
    print("ok")


def _module_on_mesh(path, layout, mesh, placed, ref) -> None:
    """registry.load_module(mesh=) holds the arrays registry.load(mesh=) places, with
    the same shardings, and its logits are one device's."""
    from brf.checkpoints import registry
    from brf.models import prefill
    module, _ = registry.load_module(path, layout=layout, mesh=mesh)
    for m, g in zip(jax.tree.leaves(module.to_params()), jax.tree.leaves(placed)):
        assert m.sharding == g.sharding, (m.sharding, g.sharding)
    tokens = np.asarray(_segments(module.cfg.vocab_size, lengths=(24,))[0])[None]
    want = prefill(ref, module.cfg, tokens, None, None)[0]
    np.testing.assert_allclose(module(tokens), want, rtol=1e-5, atol=2e-5)


def dump_on_mesh() -> None:
    """experiments/dump_logits.py with the weights split over 4 devices writes the
    CSVs one device writes (scores and greedy generations)."""
    import importlib.util
    import pathlib
    import tempfile

    from brf.checkpoints import store
    from brf.eval import dump
    from brf.eval.logit_csv import read_csv
    from tiny_lm import tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = tiny_config(272, max_seq_len=512, eos_id=tok.eos_token_id)  # V splits over 4
    path = pathlib.Path(__file__).parent.parent / "configs" / "dump_logits.py"
    spec = importlib.util.spec_from_file_location("dump_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = store.save(f"{tmp}/ckpt", cfg, jax.device_get(tiny_params(cfg, 5)), tok)
        for mode in ("score", "generate"):
            runs = []
            for m in (1, 4):
                c = mod.get_config("tiny" + (",generate" if mode == "generate" else ""))
                c.model, c.mesh.model, c.output = ckpt, m, f"{tmp}/{mode}-{m}.csv"
                c.text, c.segment_tokens, c.chunk = "the theme is in the air. " * 12, 64, 32
                c.template, c.compilation_cache = "{prompt}", False
                out = dump.run(c)
                assert out["rows"] > 0, out
                runs.append(read_csv(c.output))
            a, b = runs
            for f in ("seq", "position", "token_id", "top_ids"):
                np.testing.assert_array_equal(getattr(b, f), getattr(a, f), err_msg=f)
            for f in ("token_logit", "lse", "gap", "entropy", "top_logits"):
                np.testing.assert_allclose(getattr(b, f), getattr(a, f), rtol=1e-4, atol=1e-4,
                                           err_msg=f)
        model = dump.load_model(ckpt, dump.dump_mesh(dict(model=4)))
        assert {s.data.shape[0] for s in model.params["lm_head"].addressable_shards} == \
            {272 // 4}
    print("ok")


def run_all(calls: dict[str, str]) -> None:
    """Runs every check named in ``calls`` (id -> call, as ``"scoring('data')"``) in
    this one process and prints one JSON line: each id's "ok" or its traceback. One
    process for all of them spares the start and the shared compilations of ten."""
    import json
    import traceback

    results = {}
    for name, call in calls.items():
        try:
            eval(call, globals())
            results[name] = "ok"
        except Exception:  # reported per check by the test; the others still run
            results[name] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))
