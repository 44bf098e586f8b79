"""brf checkpoint directories: orbax params + config JSON + tokenizer files.

Layout of a checkpoint directory::

    <dir>/params/           orbax (StandardCheckpointer) params pytree
    <dir>/config.json       ModelConfig.to_dict()
    <dir>/tokenizer/        tokenizer.json, tokenizer_config.json (+ chat template)
    <dir>/brf_checkpoint.json   format version, dtype, where it came from

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

FORMAT_VERSION = 1
MARKER = "brf_checkpoint.json"


def is_checkpoint(directory: str | os.PathLike) -> bool:
    """True when `directory` is a complete brf checkpoint of this format version."""
    marker = os.path.join(os.fspath(directory), MARKER)
    if not os.path.isfile(marker):
        return False
    try:
        with open(marker) as f:
            return json.load(f).get("format_version") == FORMAT_VERSION
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
            ckptr = ocp.StandardCheckpointer()
            ckptr.save(os.path.join(tmp, "params"), params)
            ckptr.wait_until_finished()
            ckptr.close()
        marker = dict(info or {}, format_version=FORMAT_VERSION, dtype=dtypes.pop(),
                      has_tokenizer=tokenizer is not None, contents=_contents(tmp))
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
        return f"no readable {MARKER} of format version {FORMAT_VERSION}"
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


def load_config(directory: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored in a checkpoint directory."""
    with open(os.path.join(os.fspath(directory), "config.json")) as f:
        return ModelConfig.from_dict(json.load(f))


def restore(directory: str | os.PathLike, dtype=None,
            with_tokenizer: bool = True, mesh=None) -> tuple[ModelConfig, dict, Any]:
    """Loads a checkpoint directory.

    Args:
        directory: a directory written by `save`.
        dtype: parameter dtype to restore into (None: the stored dtype). The
            restore target is a tree of jax.ShapeDtypeStruct built from the
            config, so nothing is traced or initialised first.
        with_tokenizer: also load the tokenizer (None when the checkpoint has none).
        mesh: restore each weight split over the mesh's 'model' axis
            (:func:`brf.sharding.param_shardings`); None: on the default device.

    Returns:
        (cfg, params, tokenizer) with params a pytree of jax.Arrays.

    Raises:
        FileNotFoundError: `directory` is not a complete brf checkpoint.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not is_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a complete brf checkpoint "
                                f"(no {MARKER} of format version {FORMAT_VERSION})")
    info = read_info(directory)
    cfg = load_config(directory)
    target = abstract_params(cfg, dtype or info["dtype"], mesh)
    ckptr = ocp.StandardCheckpointer()
    params = ckptr.restore(os.path.join(directory, "params"), target)
    ckptr.close()
    tokenizer = None
    if with_tokenizer and info.get("has_tokenizer"):
        from brf.checkpoints.tokenizer import tokenizer_from_dir
        tokenizer = tokenizer_from_dir(os.path.join(directory, "tokenizer"))
    return cfg, params, tokenizer


__all__ = ["FORMAT_VERSION", "MARKER", "abstract_params", "damage", "is_checkpoint", "load_config",
           "read_info", "restore", "save"]
