"""The TPU slice an ahead-of-time check compiles for, on a CPU-only machine: its devices
from ``jax.experimental.topologies`` (needs ``libtpu``), its train mesh and the sampler's
(each a half of the slice with ``mesh.sample_devices``)."""

import dataclasses
import functools
import os
from typing import Any

from grpo_jax.config import Config
from grpo_jax.sampler import Sampler
from grpo_jax.parallel.split_mesh import SplitMesh, run_meshes
from grpo_jax.parallel.slices import get_slice
from grpo_jax.aot.tpu_specs import TOPOLOGIES


def libtpu_available() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=4)
def _devices(topology: str) -> tuple:
    from jax.experimental import topologies

    # libtpu takes a machine-wide lock file by default; compiling needs no TPU, so let
    # several processes (pytest workers, concurrent checks) load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # A v4 chip has two TensorCores; the topology lists each as a device unless asked for
    # megacore, the mode a v4 TPU VM runs JAX in (one device per chip, as grpo_jax.parallel.slices counts).
    extra = {"chip_config_name": "megacore"} if topology.startswith("v4:") else {}
    return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu", **extra).devices)


def topology_devices(topology: str) -> list:
    """The TPU devices of ``topology`` (e.g. ``v5p:4x4x4``), usable for AOT compiles only."""
    return list(_devices(topology))


def _run_meshes(cfg: Config, slice_name: str) -> tuple[Any, SplitMesh | None, str]:
    """(train mesh, split or None, topology name), as ``split_mesh.run_meshes`` builds them
    for a run of ``cfg`` on the slice's devices."""
    if ":" in slice_name:
        topology, mesh_cfg = slice_name, cfg.mesh
    else:
        preset = get_slice(slice_name)
        topology, mesh_cfg = TOPOLOGIES[preset.name], dataclasses.replace(cfg.mesh, slice=preset.name)
    train, halves = run_meshes(mesh_cfg, topology_devices(topology))
    return train, halves, topology


def topology_mesh(cfg: Config, slice_name: str) -> tuple[Any, str]:
    """(train mesh, topology name) of a slice preset (``v5p-128``) or a raw topology
    (``v5e:2x2``, whose train mesh follows ``cfg.mesh``); with ``mesh.sample_devices`` the
    split's training half (``split_mesh.run_meshes``)."""
    train, _, topology = _run_meshes(cfg, slice_name)
    return train, topology


def split_of(cfg: Config, slice_name: str) -> SplitMesh | None:
    """The ``mesh.sample_devices`` split of the slice's devices (None without one)."""
    return _run_meshes(cfg, slice_name)[1]


def sample_mesh(cfg: Config, slice_name: str):
    """The sampler's mesh as the trainer builds it (``Sampler.for_run``): a split's sampling
    half, else the slice preset's ``sample_mesh`` (replicas x tensor), or the train mesh for
    a raw topology."""
    train, halves, _ = _run_meshes(cfg, slice_name)
    if halves is not None:
        return halves.sample
    if ":" not in slice_name:
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, slice=get_slice(slice_name).name))
    return Sampler.for_run(cfg, train).mesh
