"""brf checkpoint directories: orbax params + config JSON + tokenizer files.

Layout of a checkpoint directory::

    <dir>/params/<name>/    one orbax item per top-level weight (embed, final_norm, lm_head)
    <dir>/params/layer_<i>/ one orbax item per layer: that layer's slice of every
                            stacked weight (attn_norm, wq, ..., w_down)
    <dir>/config.json       ModelConfig.to_dict()
    <dir>/tokenizer/        tokenizer.json, tokenizer_config.json (+ chat template)
    <dir>/brf_checkpoint.json   format version, dtype, where it came from

The weights go in one orbax item per layer (format 2) rather than one item for
the whole pytree (format 1, still read): orbax copies every array it writes to
host buffers before writing, and reads into buffers of its own, so one item for
everything held the model twice; item by item, a save or a restore holds the
model plus one layer (BENCHMARKS.md, "Large checkpoints"), and `restore` can
hand back the per-layer layout that `brf.models.prefill` runs, layer by layer,
without a stacked copy beside it.

Writing is atomic: everything goes into a hidden sibling temp directory that is
renamed onto <dir> only once complete (a rename within one file system is
atomic), and `brf_checkpoint.json` is written last. A conversion interrupted
by an exception removes its temp directory; one killed outright leaves a
`.<name>.tmp-*` directory that nothing loads (`is_checkpoint` is False for it
and `save` never reuses it).

`brf_checkpoint.json` also records every file's size (``contents``), so that
`damage` finds a file cut short or emptied since (a copy that stopped, a full
disk) before orbax or the tokenizer reads it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from brf.checkpoints.progress import folder_bytes, watched
from brf.models.config import ModelConfig
from brf.models.transformer import param_shapes

FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)  # format 1: the whole params pytree as one orbax item
MARKER = "brf_checkpoint.json"


def is_checkpoint(directory: str | os.PathLike) -> bool:
    """True when `directory` is a complete brf checkpoint of a format this version reads."""
    marker = os.path.join(os.fspath(directory), MARKER)
    if not os.path.isfile(marker):
        return False
    try:
        with open(marker) as f:
            return json.load(f).get("format_version") in READ_VERSIONS
    except (OSError, ValueError):
        return False


def read_info(directory: str | os.PathLike) -> dict[str, Any]:
    """The contents of a checkpoint's brf_checkpoint.json."""
    with open(os.path.join(os.fspath(directory), MARKER)) as f:
        return json.load(f)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, mesh=None) -> dict:
    """The params pytree of `cfg` as jax.ShapeDtypeStruct leaves (a restore target).

    With a ``mesh`` (:mod:`brf.sharding`) each leaf carries its tensor-parallel
    NamedSharding, so a restore writes every device's shard straight from the
    files and no device ever holds a whole weight it is not meant to.
    """
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype), sharding=one),
                        param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
    if mesh is None:
        return tree
    from brf import sharding
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        tree, sharding.param_shardings(tree, mesh))


def save(directory: str | os.PathLike, cfg: ModelConfig, params: dict, tokenizer=None,
         info: dict[str, Any] | None = None, overwrite: bool = False,
         progress: bool = False) -> str:
    """Writes a checkpoint directory atomically.

    Args:
        directory: where the checkpoint goes (must not exist unless overwrite).
        cfg: the ModelConfig (saved as config.json).
        params: the params pytree (NumPy or jax arrays; all one dtype).
        tokenizer: a transformers tokenizer saved under tokenizer/, or None.
        info: extra JSON-serialisable facts for brf_checkpoint.json (e.g. the source).
        overwrite: replace an existing checkpoint at `directory`.
        progress: a bar of the bytes written so far (orbax writes in one call).

    Returns:
        The absolute checkpoint path.

    Raises:
        FileExistsError: `directory` exists and overwrite is False.
    """
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and not overwrite:
        raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it")
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    try:
        dtypes = {np.dtype(x.dtype).name for x in jax.tree.leaves(params)}
        if len(dtypes) != 1:
            raise ValueError(f"params mix dtypes {sorted(dtypes)}; cast them to one first")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(cfg.to_json())
        with watched(f"writing {name}", lambda: folder_bytes(tmp), enabled=progress):
            if tokenizer is not None:
                tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
            _save_params(os.path.join(tmp, "params"), params)
        marker = dict(info or {}, format_version=FORMAT_VERSION, dtype=dtypes.pop(),
                      has_tokenizer=tokenizer is not None, contents=_contents(tmp),
                      content_sha256=params_digest(cfg, params))
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(directory):  # overwrite: move the old one aside, then drop it
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
            os.rename(directory, old)
            os.rename(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, directory)
            except OSError:
                if os.path.exists(directory):  # another process finished first
                    raise FileExistsError(f"{directory} was written by another process "
                                          "meanwhile") from None
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def params_digest(cfg: ModelConfig, params: dict) -> str:
    """SHA-256 (hex) of a model's config and every weight's name, dtype, shape and
    bytes: what a checkpoint holds, wherever it came from (recorded at `save`)."""
    h = hashlib.sha256(cfg.to_json().encode())
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    for path, leaf in flat:
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)}:{a.dtype.name}:{a.shape}".encode())
        h.update(memoryview(a.reshape(-1).view(np.uint8)))
    return h.hexdigest()


def identity(directory: str | os.PathLike) -> str:
    """What a checkpoint holds, as a key: two checkpoints with the same key load the
    same model. The content digest recorded at `save`; a checkpoint written before
    digests were recorded is known by its real path."""
    directory = os.path.realpath(os.fspath(directory))
    try:
        digest = read_info(directory).get("content_sha256")
    except (OSError, ValueError):
        digest = None
    return f"content:{digest}" if digest else f"path:{directory}"


def _contents(directory: str) -> dict[str, int]:
    """{path relative to ``directory``: size in bytes} of every file under it."""
    out = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(parent, name)
            out[os.path.relpath(path, directory)] = os.path.getsize(path)
    return dict(sorted(out.items()))


def damage(directory: str | os.PathLike) -> str | None:
    """What is wrong with a checkpoint directory, in a few words, or None.

    Cheap (no file is read but brf_checkpoint.json and config.json): not a
    complete checkpoint, a file written with it missing or of another size
    now, or a config.json that is not JSON. Checkpoints written before sizes
    were recorded are checked for the first and last of these only.
    """
    directory = os.fspath(directory)
    if not is_checkpoint(directory):
        return (f"no readable {MARKER} of a format version brf reads "
                f"({', '.join(map(str, READ_VERSIONS))})")
    try:
        recorded = read_info(directory).get("contents") or {}
    except (OSError, ValueError) as e:
        return f"{MARKER}: {e}"
    for rel, size in recorded.items():
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != size:
            return f"{rel} holds {os.path.getsize(path)} bytes, written as {size}"
    try:
        load_config(directory)
    except (OSError, ValueError, TypeError, KeyError) as e:
        return f"config.json: {type(e).__name__}: {e}"
    return None


def _checkpointer() -> ocp.Checkpointer:
    """A synchronous orbax checkpointer of standard pytrees (one item at a time)."""
    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def _on_host(a) -> jax.Array:
    """A jax.Array of `a` (a NumPy array is wrapped, on the CPU without a copy)."""
    return a if isinstance(a, jax.Array) else jax.device_put(np.asarray(a))


def _layer_dir(params_dir: str, i: int) -> str:
    return os.path.join(params_dir, f"layer_{i:04d}")


def _save_params(params_dir: str, params: dict) -> None:
    """Writes the params pytree (stacked layers) as one orbax item per top-level
    weight and one per layer."""
    os.makedirs(params_dir)
    ckptr = _checkpointer()
    for name, a in params.items():
        if name != "layers":
            ckptr.save(os.path.join(params_dir, name), args=ocp.args.StandardSave(
                {name: _on_host(a)}))
    layers = params["layers"]
    n = len(next(iter(layers.values())))
    for i in range(n):
        item = {k: _on_host(np.asarray(v)[i] if not isinstance(v, jax.Array) else v[i])
                for k, v in layers.items()}
        ckptr.save(_layer_dir(params_dir, i), args=ocp.args.StandardSave(item))
    ckptr.close()


def _restore_params(params_dir: str, cfg: ModelConfig, target: dict, layout: str,
                    mesh=None) -> dict:
    """Reads format 2 item by item into the stacked layout (target: `abstract_params`)
    or, layer by layer, into the per-layer layout of `unstack_layers`."""
    from brf.models.transformer import unstack_layers
    ckptr = _checkpointer()
    out = {name: ckptr.restore(os.path.join(params_dir, name), args=ocp.args.StandardRestore(
        {name: t}))[name] for name, t in target.items() if name != "layers"}
    layers_t = target["layers"]
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    per_layer = {k: jax.ShapeDtypeStruct(t.shape[1:], t.dtype, sharding=one)
                 for k, t in layers_t.items()}
    stacked = None if layout == "layers" else {
        k: jnp.zeros(t.shape, t.dtype, device=one) for k, t in layers_t.items()}
    fused = []
    for i in range(cfg.n_layers):
        lp = ckptr.restore(_layer_dir(params_dir, i), args=ocp.args.StandardRestore(per_layer))
        if stacked is None:  # this layer's fused, transposed weights; the rest is freed
            one_layer = {k: v[None] for k, v in lp.items()}
            fused.append(unstack_layers({"layers": one_layer})["layers"][0])
        else:  # written in place into the stacked weights (donated)
            for k, v in lp.items():
                stacked[k] = _put_layer(stacked[k], v, i)
        del lp
    ckptr.close()
    if stacked is None:
        out["layers"] = tuple(fused)
        if mesh is not None:
            from brf import sharding
            out = sharding.shard_params(out, mesh)
        return out
    if mesh is not None:
        for k in list(stacked):  # one weight at a time onto the mesh
            stacked[k] = jax.device_put(stacked[k], layers_t[k].sharding)
    out["layers"] = stacked
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(stacked_LxS, layer_S, i):
    """stacked with layer i replaced by `layer` (in place: the stacked buffer is donated)."""
    return jax.lax.dynamic_update_index_in_dim(stacked_LxS, layer_S.astype(stacked_LxS.dtype),
                                               i, 0)


def load_config(directory: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored in a checkpoint directory."""
    with open(os.path.join(os.fspath(directory), "config.json")) as f:
        return ModelConfig.from_dict(json.load(f))


def restore(directory: str | os.PathLike, dtype=None,
            with_tokenizer: bool = True, mesh=None,
            layout: str = "stacked") -> tuple[ModelConfig, dict, Any]:
    """Loads a checkpoint directory.

    Args:
        directory: a directory written by `save`.
        dtype: parameter dtype to restore into (None: the stored dtype). The
            restore target is a tree of jax.ShapeDtypeStruct built from the
            config, so nothing is traced or initialised first.
        with_tokenizer: also load the tokenizer (None when the checkpoint has none).
        mesh: restore each weight split over the mesh's 'model' axis
            (:func:`brf.sharding.param_shardings`); None: on the default device.
        layout: 'stacked' (the [L, ...] arrays of notes/MODEL_CONTRACT.md) or
            'layers' (`brf.models.transformer.unstack_layers`'s per-layer layout,
            built layer by layer as the layers are read).

    Returns:
        (cfg, params, tokenizer) with params a pytree of jax.Arrays.

    Raises:
        FileNotFoundError: `directory` is not a complete brf checkpoint.
        brf.checkpoints.assemble.CheckpointTooLargeError: the parameters in that
            dtype would not fit in the host's available memory (one line).
    """
    directory = os.path.abspath(os.fspath(directory))
    if not is_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a complete brf checkpoint "
                                f"(no {MARKER} of format version {READ_VERSIONS})")
    if layout not in ("stacked", "layers"):
        raise ValueError(f"layout={layout!r}; use 'stacked' or 'layers'")
    info = read_info(directory)
    cfg = load_config(directory)
    from brf.checkpoints.assemble import check_fits
    check_fits(cfg, dtype or info["dtype"], directory)
    target = abstract_params(cfg, dtype or info["dtype"], mesh)
    if info["format_version"] >= 2:
        params = _restore_params(os.path.join(directory, "params"), cfg, target, layout, mesh)
    else:
        ckptr = ocp.StandardCheckpointer()
        params = ckptr.restore(os.path.join(directory, "params"), target)
        ckptr.close()
        if layout == "layers":
            from brf.models.transformer import unstack_layers
            params = unstack_layers(params)
            if mesh is not None:
                from brf import sharding
                params = sharding.shard_params(params, mesh)
    tokenizer = None
    if with_tokenizer and info.get("has_tokenizer"):
        from brf.checkpoints.tokenizer import tokenizer_from_dir
        tokenizer = tokenizer_from_dir(os.path.join(directory, "tokenizer"))
    return cfg, params, tokenizer


__all__ = ["FORMAT_VERSION", "MARKER", "READ_VERSIONS", "abstract_params", "damage",
           "is_checkpoint", "load_config", "read_info", "restore", "save"]
