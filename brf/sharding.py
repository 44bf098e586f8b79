"""Devices, meshes and hosts: brf on JAX's own sharding machinery.

brf runs on one device, on many devices of one host, and on many hosts with
nothing of its own beyond naming: a :class:`jax.sharding.Mesh` with two axes,

- ``data``: positions and prompts (a batch of segments is split over it);
- ``model``: a member's weights (matmuls split along their output or
  reduction dimension; the vocabulary of the embedding and the output head).

Arrays are placed with :class:`jax.sharding.NamedSharding` and the jitted model
and fusion code is left as it is: XLA's SPMD partitioner follows the placement
of the inputs (computation follows data), so the model code carries no
sharding logic and runs unchanged, at unchanged speed, without a mesh.

Multi-host: :func:`initialize_distributed` calls ``jax.distributed.initialize``
from a config (coordinator address, number of processes, this process's id;
or auto-detection on TPU pods and SLURM). Each host then builds its mesh from
its own devices (:func:`make_mesh`), scores its share of the corpus
(:func:`process_share`) and writes its share of the store; the report step
merges the shares (``brf.eval.scorer``).

Members of an ensemble share the mesh (``placement="shared"``: every member
on every device, each split as above), or are kept apart
(``placement="apart"``, :func:`member_meshes`): the devices are cut into one
contiguous group per member and each member gets a ('data', 'model') mesh of
its own group. Apart, the members run at the same time on different devices
and no member's layer waits on another device's all-reduce; shared, each
member is spread over every device (the choice for a member too large for a
group, or for one member).

Config (``configs/validate.py``, ``configs/generate.py``)::

    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1, placement="shared"))
    c.distributed = ml_collections.ConfigDict(dict(
        enabled=False, coordinator_address="", num_processes=1, process_id=0))

``data=-1`` takes every device (of the member's group, when apart) not used
by ``model``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from brf.errors import UserError

DATA, MODEL = "data", "model"
PLACEMENTS = ("shared", "apart")


class ShardingError(UserError):
    """A mesh or multi-host setting that this machine cannot satisfy."""


def mesh_shape(spec: Mapping[str, int] | None, n_devices: int) -> tuple[int, int]:
    """(data, model) sizes for ``spec`` on ``n_devices`` devices.

    Args:
      spec: ``{"data": d, "model": m}``; -1 (at most one of them) takes what
        the other leaves; None means ``data=-1, model=1``.
      n_devices: devices available.

    Returns:
      (d, m) with d * m <= n_devices.

    Raises:
      ShardingError: sizes that are not positive, or more devices than exist.
    """
    spec = dict(spec or {})
    unknown = set(spec) - {DATA, MODEL, "placement"}
    if unknown:
        raise ShardingError(f"config.mesh: unknown axes {sorted(unknown)}; use data, model "
                            "(and placement)")
    placement(spec)
    d, m = int(spec.get(DATA, -1)), int(spec.get(MODEL, 1))
    if d == -1 and m == -1:
        raise ShardingError("config.mesh: only one of data, model may be -1")
    for name, v in ((DATA, d), (MODEL, m)):
        if v == 0 or v < -1:
            raise ShardingError(f"config.mesh.{name} must be >= 1 or -1; got {v}")
    if d == -1:
        d = n_devices // m
    if m == -1:
        m = n_devices // d
    if d < 1 or m < 1 or d * m > n_devices:
        raise ShardingError(
            f"config.mesh asks for data={spec.get(DATA, -1)} x model={spec.get(MODEL, 1)} "
            f"devices; this process has {n_devices}")
    return d, m


def make_mesh(spec: Mapping[str, Any] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'model') mesh over this process's devices.

    Args:
      spec: axis sizes, see :func:`mesh_shape` (an ml_collections ConfigDict works).
      devices: default ``jax.local_devices()``: each host scores on its own
        devices (multi-host runs split the corpus, not one computation).

    Returns:
      The mesh; devices along 'model' are neighbours (on GPUs and TPUs, the
      fastest links), so a member's weight shards talk over them.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if spec is not None and hasattr(spec, "to_dict"):
        spec = spec.to_dict()
    d, m = mesh_shape(spec, len(devices))
    return Mesh(np.array(devices[:d * m], dtype=object).reshape(d, m), (DATA, MODEL))


def placement(spec: Mapping[str, Any] | None) -> str:
    """The members' placement of a mesh spec: 'shared' (default) or 'apart'."""
    spec = dict(spec.to_dict() if hasattr(spec, "to_dict") else (spec or {}))
    value = spec.get("placement", "shared") or "shared"
    if value not in PLACEMENTS:
        raise ShardingError(f"config.mesh.placement={value!r}: use one of {list(PLACEMENTS)}")
    return value


def member_meshes(spec: Mapping[str, Any] | None, n_members: int,
                  devices: Sequence[jax.Device] | None = None) -> list[Mesh]:
    """One mesh per member, by ``spec['placement']``.

    Args:
      spec: axis sizes (:func:`mesh_shape`) and ``placement``: 'shared' gives
        every member the same mesh over all devices; 'apart' cuts the devices
        into ``min(n_members, n_devices)`` contiguous groups of equal size and
        gives member i a mesh over group ``i % groups`` (with fewer devices than
        members, members take turns on the groups). Apart, the axis sizes are
        those of each group's mesh (``data=-1`` fills the group).
      n_members: members to place.
      devices: default ``jax.local_devices()``.

    Returns:
      ``n_members`` meshes; apart, members on different groups share no device.
    """
    if n_members < 1:
        raise ValueError(f"n_members must be >= 1; got {n_members}")
    devices = list(jax.local_devices() if devices is None else devices)
    if placement(spec) == "shared":
        return [make_mesh(spec, devices)] * n_members
    groups = min(n_members, len(devices))
    size = len(devices) // groups
    try:
        meshes = [make_mesh(spec, devices[g * size:(g + 1) * size]) for g in range(groups)]
    except ShardingError as e:
        raise ShardingError(f"{e} in each of {groups} member groups (placement='apart')"
                            ) from None
    return [meshes[i % groups] for i in range(n_members)]


def per_member(mesh: Mesh | Sequence[Mesh | None] | None, n_members: int) -> list:
    """One mesh (or None) per member: a sequence as given (it must have one entry
    per member), or one mesh (or None) for every member."""
    meshes = list(mesh) if isinstance(mesh, (list, tuple)) else [mesh] * n_members
    if len(meshes) != n_members:
        raise ValueError(f"{len(meshes)} meshes for {n_members} members")
    return meshes


def on_one_device(meshes: Sequence[Mesh | None]) -> bool:
    """True when no member has a mesh, or every member's mesh is the same single
    device: the callers then keep the one-device path."""
    given = [m for m in meshes if m is not None]
    return not given or (len({mesh_devices(m) for m in given}) == 1 and given[0].size == 1)


def leaf_sharding(tree: Any):
    """The sharding of a pytree's first jax.Array (None for host data): where a
    model's weights live, its mesh when it was placed on one."""
    leaf = next((x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)), None)
    return None if leaf is None else leaf.sharding


def mesh_devices(mesh: Mesh) -> tuple:
    """A mesh's devices in mesh order (hashable: tells meshes on the same devices)."""
    return tuple(mesh.devices.flat)


def per_device_group(meshes: Sequence[Mesh | None], fn: Callable[[int], Any]) -> list:
    """``[fn(0), ..., fn(n-1)]``, member j's work on ``meshes[j]``, at the same time
    across device groups.

    Members whose meshes share devices (or have none) run one after another in
    one thread; members on different devices (:func:`member_meshes`, 'apart')
    run in one thread per group, at once: JAX releases the GIL while a device
    computes, so each group's programs are dispatched and run side by side. An
    exception in any member is raised here, after every group has stopped.
    """
    groups: dict[Any, list[int]] = {}
    for j, m in enumerate(meshes):
        groups.setdefault(None if m is None else mesh_devices(m), []).append(j)
    if len(groups) <= 1:
        return [fn(j) for j in range(len(meshes))]
    from concurrent.futures import ThreadPoolExecutor
    out: dict[int, Any] = {}
    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        futures = [pool.submit(lambda js: [(j, fn(j)) for j in js], js)
                   for js in groups.values()]
        for f in futures:
            out.update(f.result())
    return [out[j] for j in range(len(meshes))]


def device_set(tree: Any) -> frozenset:
    """The devices holding a pytree's arrays (empty for host data)."""
    out = set()
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            out |= set(leaf.sharding.device_set)
    return frozenset(out)


def data_size(mesh: Mesh | None) -> int:
    """Devices along 'data' (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape[DATA]


def model_size(mesh: Mesh | None) -> int:
    """Devices along 'model' (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape[MODEL]


def _fits(shape: Sequence[int], spec: P, mesh: Mesh) -> bool:
    """True when every sharded dimension divides evenly over its mesh axes."""
    for dim, axes in zip(shape, tuple(spec)):
        if axes is None:
            continue
        axes = axes if isinstance(axes, tuple) else (axes,)
        if dim % math.prod(mesh.shape[a] for a in axes):
            return False
    return True


def sharding(mesh: Mesh, spec: P, shape: Sequence[int] | None = None) -> NamedSharding:
    """NamedSharding of ``spec``, replicated instead where ``shape`` does not divide."""
    if shape is not None and not _fits(shape, spec, mesh):
        spec = P()
    return NamedSharding(mesh, spec)


# Which dimension of each weight goes over 'model' (Megatron-style tensor
# parallelism: column-split projections feed row-split ones, so a layer needs
# one all-reduce after attention and one after the MLP). Keys are parameter
# names; the value is the dimension counted from the end (stacked [L, ...]
# weights then share the per-layer rule). Norm scales are replicated.
_MODEL_DIM = {
    # [in, out] layout (notes/MODEL_CONTRACT.md): split the output of q/k/v,
    # gate and up, the input of o and down.
    "wq": -1, "wk": -1, "wv": -1, "w_gate": -1, "w_up": -1, "wo": -2, "w_down": -2,
    # [out, in] layout of `unstack_layers`.
    "wqkv_t": -2, "w_gate_up_t": -2, "wo_t": -1, "w_down_t": -1,
    "wqkv": -1, "w_gate_up": -1,
    # The vocabulary: embedding rows and output-head rows.
    "embed": -2, "lm_head": -2,
}


def param_spec(path: str, shape: Sequence[int]) -> P:
    """The PartitionSpec of one parameter (its name is the last key in ``path``)."""
    dim = _MODEL_DIM.get(path.rsplit("/", 1)[-1])
    if dim is None or len(shape) < 2:
        return P()
    spec = [None] * len(shape)
    spec[len(shape) + dim] = MODEL
    return P(*spec)


def _key_name(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "idx", entry)))


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """NamedShardings for a params pytree: weights over 'model', replicated over 'data'.

    A weight whose split dimension does not divide by the 'model' size is
    replicated (correct, only less spread out).
    """
    def one(path, x):
        name = "/".join(_key_name(p) for p in path)
        return sharding(mesh, param_spec(name, x.shape), x.shape)
    return jax.tree_util.tree_map_with_path(one, params)


def shard_params(params: Any, mesh: Mesh | None) -> Any:
    """Places a params pytree on ``mesh`` (:func:`param_shardings`); no mesh: unchanged."""
    if mesh is None:
        return params
    return jax.device_put(params, param_shardings(params, mesh))


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """Sharding of an array whose ``batch_axis`` is split over 'data'."""
    spec = [None] * ndim
    spec[batch_axis] = DATA
    return NamedSharding(mesh, P(*spec))


def shard_batch(x, mesh: Mesh | None, batch_axis: int = 0):
    """Places ``x`` (host or device array) with its batch axis over 'data'."""
    if mesh is None:
        return x
    return jax.device_put(x, batch_sharding(mesh, np.ndim(x), batch_axis))


def shard_cache(cache: dict, mesh: Mesh | None) -> dict:
    """A KV cache (``brf.models.cache``) with its batch axis over 'data'."""
    if mesh is None:
        return cache
    out = {k: tuple(shard_batch(c, mesh) for c in cache[k]) for k in ("k", "v")}
    out["pos"] = shard_batch(cache["pos"], mesh)
    out["next_pos"] = shard_batch(cache["next_pos"], mesh)
    out["end"] = jax.device_put(cache["end"], NamedSharding(mesh, P()))
    return out


def vocab_sharding(mesh: Mesh, ndim: int, batch_axis: int | None = 0) -> NamedSharding:
    """Sharding of logits ``[..., V]``: V over 'model', the batch axis over 'data'."""
    spec = [None] * ndim
    spec[-1] = MODEL
    if batch_axis is not None and ndim > 1:
        spec[batch_axis] = DATA
    return NamedSharding(mesh, P(*spec))


# --------------------------------------------------------------------------- hosts


def initialize_distributed(spec: Mapping[str, Any] | None) -> bool:
    """``jax.distributed.initialize`` from a config; call before any other JAX use.

    Args:
      spec: ``enabled`` (False: single process, nothing happens),
        ``coordinator_address`` ("host:port" of process 0; "" lets JAX detect
        it on TPU pods, SLURM and Open MPI), ``num_processes`` and
        ``process_id`` (0 / -1 also mean: detect).

    Returns:
      True when this call joined (or had joined) a multi-process run.
    """
    spec = dict(spec or {})
    if not spec.get("enabled", False):
        return False
    if jax.distributed.is_initialized():
        return True
    addr = spec.get("coordinator_address") or None
    n = int(spec.get("num_processes", 0) or 0) or None
    pid = spec.get("process_id", -1)
    pid = None if pid is None or int(pid) < 0 or (n is None and addr is None) else int(pid)
    if addr is not None and n is None:
        raise ShardingError("config.distributed: coordinator_address given without "
                            "num_processes")
    if addr is not None and pid is None:
        raise ShardingError("config.distributed: coordinator_address given without "
                            "process_id")
    if n is not None and pid is not None and not 0 <= pid < n:
        raise ShardingError(f"config.distributed.process_id={pid} must lie in [0, {n})")
    try:
        jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=pid)
    except ValueError as e:  # nothing given, and no cluster JAX can read them from
        if addr is not None:
            raise
        raise ShardingError(
            "config.distributed.enabled=True, but no coordinator_address is given and "
            "JAX found no cluster (TPU pod, SLURM, Open MPI) to read it from: set "
            "coordinator_address, num_processes and process_id "
            f"(JAX: {str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return True


def process_index() -> int:
    """This process's index in a multi-process run (0 when alone)."""
    return jax.process_index()


def process_count() -> int:
    """Processes in this run (1 unless :func:`initialize_distributed` joined several)."""
    return jax.process_count()


def process_share(n_items: int, index: int | None = None, count: int | None = None
                  ) -> range:
    """The contiguous block of ``range(n_items)`` this process handles.

    Blocks differ in length by at most one and, taken over all processes in
    order, cover ``range(n_items)`` exactly once.
    """
    index = process_index() if index is None else index
    count = process_count() if count is None else count
    lo = index * n_items // count
    hi = (index + 1) * n_items // count
    return range(lo, hi)


def barrier(name: str, timeout_s: float = 3600.0) -> None:
    """Waits until every process reaches ``name`` (no-op in a single process).

    Uses the coordination service that ``jax.distributed.initialize`` started
    (no device computation, so it works whatever the devices are).
    """
    if process_count() == 1:
        return
    from jax._src import distributed  # the coordination client; no public barrier API
    client = distributed.global_state.client
    client.wait_at_barrier(name, int(timeout_s * 1000))


__all__ = ["DATA", "MODEL", "PLACEMENTS", "ShardingError", "barrier", "batch_sharding",
           "data_size", "device_set", "initialize_distributed", "leaf_sharding", "make_mesh",
           "member_meshes", "mesh_devices", "mesh_shape", "model_size", "on_one_device",
           "param_shardings", "param_spec", "per_device_group", "per_member", "placement",
           "process_count", "process_index", "process_share",
           "shard_batch", "shard_cache", "shard_params", "sharding", "vocab_sharding"]
