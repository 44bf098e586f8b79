"""Orbax checkpoint directories, conversion, the registry and the cache."""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from brf.checkpoints import gguf as G
from brf.checkpoints import registry, store
from tests.test_gguf import V, write_tiny


TOK_KV = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
          "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.unknown_token_id": 0}


@pytest.fixture
def tiny(tmp_path):
    """A tiny llama GGUF with a (meaningless) byte-level tokenizer."""
    path = str(tmp_path / "tiny.gguf")
    write_tiny(path, extra_kv=TOK_KV)
    return path


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("BRF_CACHE", str(root))
    return root


def _equal(a, b):
    return all(jax.tree.leaves(jax.tree.map(
        lambda x, y: x.shape == y.shape and bool((np.asarray(x) == np.asarray(y)).all()), a, b)))


def test_roundtrip_identical(tiny, tmp_path):
    cfg, params = G.load_gguf(tiny, progress=False)
    out = registry.convert(tiny, tmp_path / "ckpt", progress=False)
    assert store.is_checkpoint(out)
    cfg2, params2, tok = store.restore(out)
    assert cfg2 == cfg
    assert _equal(params, params2)
    assert all(isinstance(x, jax.Array) and x.dtype == np.float32
               for x in jax.tree.leaves(params2))
    assert len(tok) == V and tok("ab").input_ids == [5]
    _, half, _ = store.restore(out, dtype="bfloat16", with_tokenizer=False)
    assert {x.dtype.name for x in jax.tree.leaves(half)} == {"bfloat16"}


def test_layer_items_restore_to_either_layout_and_format_1_still_reads(tiny, tmp_path):
    """Format 2 (an orbax item per layer): the per-layer restore is unstack_layers of
    the stacked one, bit for bit; a format-1 checkpoint (the whole pytree as one
    item, as brf wrote before) restores the same in both layouts."""
    import json
    from brf.models.transformer import unstack_layers
    out = registry.convert(tiny, tmp_path / "ckpt", progress=False)
    assert store.read_info(out)["format_version"] == 2
    assert sorted(os.listdir(os.path.join(out, "params")))[:2] == ["embed", "final_norm"]
    cfg, stacked, _ = store.restore(out, with_tokenizer=False)
    _, layers, _ = store.restore(out, with_tokenizer=False, layout="layers")
    assert _equal(layers, unstack_layers(stacked))
    old = tmp_path / "old"
    os.makedirs(old)
    for name in ("config.json", "tokenizer"):
        os.rename(os.path.join(out, name), old / name)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(old / "params", jax.tree.map(np.asarray, stacked))
    ckptr.wait_until_finished()
    info = dict(store.read_info(out), format_version=1)
    (old / store.MARKER).write_text(json.dumps(info))
    _, again, _ = store.restore(old, with_tokenizer=False)
    assert _equal(again, stacked)
    _, again, _ = store.restore(old, with_tokenizer=False, layout="layers")
    assert _equal(again, layers)


def test_existing_checkpoint_not_overwritten(tiny, tmp_path):
    out = registry.convert(tiny, tmp_path / "ckpt", progress=False)
    with pytest.raises(FileExistsError):
        registry.convert(tiny, out, progress=False)
    assert registry.convert(tiny, out, overwrite=True, progress=False) == out
    assert store.is_checkpoint(out)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".old-" in n]


@pytest.mark.parametrize("where", ["tokenizer", "orbax"])
def test_interrupted_conversion_leaves_nothing_loadable(tiny, tmp_path, monkeypatch, where):
    def boom(*args, **kwargs):
        raise KeyboardInterrupt("simulated interrupt")

    if where == "orbax":
        monkeypatch.setattr(ocp.Checkpointer, "save", boom)
    else:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
        monkeypatch.setattr(TokenizersBackend, "save_pretrained", boom)
    out = tmp_path / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        registry.convert(tiny, out, progress=False)
    assert not out.exists()
    assert os.listdir(tmp_path) == ["tiny.gguf"] or set(os.listdir(tmp_path)) <= {
        "tiny.gguf", "cache"}
    with pytest.raises(FileNotFoundError):
        store.restore(out)
    monkeypatch.undo()
    assert store.is_checkpoint(registry.convert(tiny, out, progress=False))


def test_killed_conversion_temp_dir_is_ignored(tiny, tmp_path):
    """A conversion killed outright leaves a temp dir; nothing treats it as a checkpoint."""
    out = tmp_path / "ckpt"
    partial = tmp_path / ".ckpt.tmp-deadbeef"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    assert not store.is_checkpoint(partial) and not store.is_checkpoint(out)
    registry.convert(tiny, out, progress=False)
    assert store.is_checkpoint(out)


def test_cache_second_load_skips_conversion(tiny, monkeypatch, cache_root):
    first = registry.load(tiny, progress=False)
    assert first.path.startswith(str(cache_root))

    def no_read(*args, **kwargs):
        raise AssertionError("source read again")

    monkeypatch.setattr(registry, "read_source", no_read)
    second = registry.load(tiny)
    assert second.path == first.path and second.cfg == first.cfg
    assert _equal(first.params, second.params)
    assert registry.load(first.path).cfg == first.cfg  # a checkpoint dir is a source too


def test_cache_refreshes_when_source_changes(tiny, cache_root):
    first = registry.load(tiny, progress=False)
    from tests.test_gguf import hf_weights
    hf = hf_weights("llama", seed=7)  # rewrite the source with other weights
    os.remove(tiny)
    write_tiny(tiny, hf=hf, extra_kv=TOK_KV)
    os.utime(tiny, (1, 1))
    second = registry.load(tiny, progress=False)
    assert second.path == first.path
    assert not _equal(first.params, second.params)


def test_resolve_errors_name_the_models(tmp_path):
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        registry.resolve("no-such-model")
    assert registry.resolve(str(tmp_path)) == str(tmp_path)


@pytest.mark.slow
def test_registry_names_resolve_to_real_files():
    for name in ("smollm2-135m-instruct", "gemma3-270m"):
        path = registry.resolve(name)
        assert path.endswith(".gguf") and os.path.getsize(path) > 50e6
        assert G.open_gguf(path).metadata["general.architecture"] in G.ARCHS
    assert registry.resolve("gemma3-270m") == path  # assembled once, then reused


@pytest.mark.slow
def test_real_model_roundtrip(tmp_path):
    path = registry.resolve("smollm2-135m-instruct")
    cfg, params = G.load_gguf(path, progress=False)
    out = registry.convert(path, tmp_path / "smol", progress=False)
    cfg2, params2, tok = store.restore(out)
    assert cfg2 == cfg and _equal(params, params2)
    assert tok("Hello").input_ids == [19556]
