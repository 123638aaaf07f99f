"""The mesh and the one table that maps logical axis names to mesh axes.

Model code only names logical axes (`embed`, `heads`, ...). `LOGICAL_RULES` below is the
only place that decides which mesh axis shards them; `logical_to_sharding` turns a
parameter's logical names and shape into a `NamedSharding`, dropping a mesh axis for a
dimension it does not divide (SmolLM2's 3 KV heads on a tensor axis of 2, say) rather than
failing at compile time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from grpo_jax.config import DTYPE_NAMES, MeshConfig
from grpo_jax.errors import MeshError  # noqa: F401  (re-exported: importable from here as before)
from grpo_jax.parallel.slices import MESH_AXES, get_slice  # defined there, without jax, for the launch scripts


# logical name -> mesh axes (tried in order; a tuple shards one dim over several axes).
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("seq", None),
    ("lora_rank", None),  # a LoRA adapter's rank axis (grpo_jax.model.lora): a few dozen entries
)
_RULES = dict(LOGICAL_RULES)


_DEFAULT_ICI = (MeshConfig.ici_data, MeshConfig.ici_fsdp, MeshConfig.ici_tensor)


def resolve_mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(ici, dcn) shapes with -1 filled in; raises MeshError naming devices and request."""
    ici = [cfg.ici_data, cfg.ici_fsdp, cfg.ici_tensor]
    dcn = [cfg.dcn_data, cfg.dcn_fsdp, cfg.dcn_tensor]
    num_slices = math.prod(dcn)
    if num_devices % num_slices:
        raise MeshError(f"{num_devices} devices cannot be split into {num_slices} slices (dcn={dcn})")
    per_slice = num_devices // num_slices
    if cfg.slice:
        from grpo_jax.parallel.slices import check_devices, get_slice

        preset = get_slice(cfg.slice)
        check_devices(preset, per_slice)
        if tuple(ici) == _DEFAULT_ICI:  # ICI axes given explicitly (e.g. data x fsdp) win
            ici = list(preset.train_mesh)
    if -1 in ici:
        known = math.prod(v for v in ici if v != -1)
        if per_slice % known:
            raise MeshError(
                f"mesh ici={tuple(ici)} cannot fill {per_slice} devices per slice "
                f"({num_devices} devices, {num_slices} slices): {per_slice} is not a multiple of {known}")
        ici[ici.index(-1)] = per_slice // known
    if math.prod(ici) * num_slices != num_devices:
        raise MeshError(
            f"mesh asks for {math.prod(ici) * num_slices} devices (ici={tuple(ici)} × "
            f"dcn={tuple(dcn)}) but there are {num_devices} devices")
    return tuple(ici), tuple(dcn)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the ('data','fsdp','tensor') mesh. Auto axis types: sharding is decided by the
    rules table and jit's in/out shardings, with GSPMD propagating the rest."""
    devices = list(jax.devices() if devices is None else devices)
    ici, dcn = resolve_mesh_shape(cfg, len(devices))
    if math.prod(dcn) > 1:
        if hasattr(devices[0], "slice_index"):
            from jax.experimental import mesh_utils

            arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        else:
            # CPU/fake devices have no slice_index: treat process-major order as slices,
            # with each DCN degree as the outer factor of its axis (as on real multi-slice).
            arr = np.array(devices).reshape(tuple(dcn) + tuple(ici))
            arr = arr.transpose(0, 3, 1, 4, 2, 5).reshape(tuple(d * i for d, i in zip(dcn, ici)))
    else:
        try:
            from jax.experimental import mesh_utils

            arr = mesh_utils.create_device_mesh(ici, devices)
        except (AssertionError, ValueError, NotImplementedError):
            arr = np.array(devices).reshape(ici)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def make_sample_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The sampler's mesh: replicas x ``cfg.sample_tensor`` when that is set, else the
    slice preset's ``sample_mesh`` when ``cfg.slice`` is (replicas x tensor: decode is
    bandwidth-bound, so each replica holds the whole policy rather than re-gathering fsdp
    shards at every token), with the same DCN part; else the train mesh. MeshError when
    the tensor degree does not divide the devices of a slice."""
    if not cfg.slice and not cfg.sample_tensor:
        return make_mesh(cfg, devices)
    devices = list(jax.devices() if devices is None else devices)
    tensor = cfg.sample_tensor or get_slice(cfg.slice).sample_mesh[2]
    per_slice = len(devices) // math.prod((cfg.dcn_data, cfg.dcn_fsdp, cfg.dcn_tensor))
    if per_slice % tensor:
        raise MeshError(f"mesh.sample_tensor={tensor} does not divide the {per_slice} devices of a slice")
    return make_mesh(dataclasses.replace(cfg, slice="", ici_data=per_slice // tensor, ici_fsdp=1,
                                         ici_tensor=tensor), devices)


def mesh_from_shape(shape: tuple[int, int, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Convenience for tests and benchmarks: an ICI-only mesh of an exact shape."""
    return make_mesh(MeshConfig(ici_data=shape[0], ici_fsdp=shape[1], ici_tensor=shape[2]),
                     devices if devices is not None else jax.devices()[: math.prod(shape)])


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
    """PartitionSpec for one array: each logical name -> its mesh axes, kept only where the
    axis size divides the dimension and the axis is not already used by another dim."""
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape):
        rule = _RULES.get(name) if name is not None else None
        if name is not None and name not in _RULES:
            raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_RULES")
        axes = () if rule is None else ((rule,) if isinstance(rule, str) else tuple(rule))
        kept = []
        size = 1
        for axis in axes:
            n = mesh.shape[axis]
            if axis in used or n == 1 or dim % (size * n):
                continue
            kept.append(axis)
            size *= n
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*spec)


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of axes)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def logical_to_sharding(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """An activation sharding: ``x`` constrained to the spec its logical axis names get from
    ``LOGICAL_RULES`` on the mesh being traced under (``on_mesh``). Outside a mesh (one
    device, the bare model in tests, init) ``x`` is returned unchanged."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh))


def on_mesh(mesh: Mesh | None):
    """Context for tracing (jit, lower) the model's programs on ``mesh``: there ``constrain``
    applies the rules table to activations. A mesh of None is a no-op context."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_degree(mesh: Mesh | None) -> int:
    """How many blocks a batch's rows are split into: data x fsdp (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


def batch_sharding(mesh: Mesh, ndim: int, batch_size: int) -> NamedSharding:
    """Shard dimension 0 over ('data','fsdp'), the rest replicated."""
    return logical_to_sharding(("batch",) + (None,) * (ndim - 1), (batch_size,) + (1,) * (ndim - 1), mesh)


def to_global(x: Any, sharding: NamedSharding) -> jax.Array:
    """A host array that every process holds in full → a global array on `sharding`.

    Each process materialises only its addressable shards, so the same call works on one
    host and on a multi-host pod slice (where `jax.device_put` cannot reach remote devices).
    """
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x: jax.Array) -> np.ndarray:
    """A global array → numpy on every process (gathers shards held by other hosts)."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def mesh_of(tree: Any) -> Mesh | None:
    """The one mesh every NamedSharding-placed leaf of ``tree`` lives on; None when the
    leaves are not on a mesh or on several."""
    meshes = {x.sharding.mesh for x in jax.tree.leaves(tree)
              if isinstance(getattr(x, "sharding", None), NamedSharding)}
    return meshes.pop() if len(meshes) == 1 else None


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Place every array of a pytree on the mesh, batch-sharded along its first dimension.
    Every process passes the same global batch. Raises if leaves disagree on the batch size."""
    leaves = jax.tree.leaves(batch)
    sizes = {np.shape(x)[0] for x in leaves if np.ndim(x) > 0}
    if len(sizes) > 1:
        raise ValueError(f"batch leaves have different leading sizes {sorted(sizes)}")

    def put(x):
        if isinstance(x, jax.Array) and not getattr(x, "is_fully_addressable", True):
            return x
        x = np.asarray(x)
        if x.ndim == 0:
            return to_global(x, replicated(mesh))
        return to_global(x, batch_sharding(mesh, x.ndim, x.shape[0]))

    return jax.tree.map(put, batch)


DTYPES = {name: jnp.dtype(name) for name in DTYPE_NAMES}
