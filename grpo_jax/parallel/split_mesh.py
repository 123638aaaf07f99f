"""Disjoint device sets for sampling and training (``mesh.sample_devices``, with rl.async_steps).

With rl.async_steps = k the rollout of batch t + k reads the weights of step t only, so it can
run while the update of batch t does, if the two run on different chips. ``mesh.sample_devices
= N`` cuts the devices in two: the first N (in ``device_order``) form the sampling mesh, the
rest the training mesh, and each step hands the updated policy from one to the other
(``hand_off``: cast to the sampler's dtype on the training chips, then copied onto the
sampling mesh's shardings). The step then takes

    overlapped = max(rollout on N chips, update on the rest) + hand-off

instead of rollout + update on every chip (``overlapped_step``); the ahead-of-time check
(``launch/compile.py mesh.sample_devices=N``) estimates each term.

``run_meshes`` is the one place that builds a run's meshes from its config and its devices,
for the trainer and the ahead-of-time check alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from grpo_jax.config import MeshConfig
from grpo_jax.errors import MeshError
from grpo_jax.parallel.sharding import make_mesh, make_sample_mesh
from grpo_jax.parallel.slices import check_devices, get_slice

_DEFAULT_ICI = (MeshConfig.ici_data, MeshConfig.ici_fsdp, MeshConfig.ici_tensor)


@dataclasses.dataclass(frozen=True)
class SplitMesh:
    """The two halves of a split: ``sample`` (the rollout's mesh, on the first
    ``mesh.sample_devices`` devices) and ``train`` (the update's, on the rest)."""

    sample: Mesh
    train: Mesh

    @property
    def sample_devices(self) -> int:
        return self.sample.size

    @property
    def train_devices(self) -> int:
        return self.train.size


def device_order(devices: Sequence) -> list:
    """The order the split cuts devices in: by process, then by position on the torus
    (``coords``, outermost axis first) where devices have one, then by id. The first N are
    then whole hosts (a host's chips are one process) and, on a TPU slice, whole planes of
    the torus when N is a multiple of a plane's chips, so neither half's mesh crosses the
    other's links more than it must."""
    def key(d):
        coords = tuple(reversed(getattr(d, "coords", ()) or ()))
        return (getattr(d, "process_index", 0), coords, d.id)

    return sorted(devices, key=key)


def split(cfg: MeshConfig, devices: Sequence) -> SplitMesh:
    """The ``mesh.sample_devices`` = N split of ``devices``: the sampling mesh on the first N
    (``sharding.make_sample_mesh``: replicas x mesh.sample_tensor, or the slice preset's tensor
    degree, else ``cfg``'s ICI shape with -1 filled from N) and the training mesh on the rest
    (``cfg``'s ICI shape, or the slice preset's training mesh, with its fsdp axis filled from
    their count). MeshError naming the problem when N leaves no device to either half, when
    the slice is not the one ``mesh.slice`` names or one the TPU compiler does not split
    (``SlicePreset.splittable``), when a mesh spans several slices (DCN) or when either half's
    shape does not fit its devices."""
    n, total = cfg.sample_devices, len(devices)
    if n <= 0:
        raise ValueError(f"mesh.sample_devices={n}: no split asked for")
    if not n < total:
        raise MeshError(f"mesh.sample_devices={n} leaves no device to train on: {total} device(s) are "
                        f"visible; give the sampler fewer than {total}")
    if math.prod((cfg.dcn_data, cfg.dcn_fsdp, cfg.dcn_tensor)) > 1:
        raise MeshError(f"mesh.sample_devices={n} splits the devices of one slice; a multi-slice mesh "
                        f"(dcn={cfg.dcn_data, cfg.dcn_fsdp, cfg.dcn_tensor}) is not split")
    ordered = device_order(devices)
    ici = (cfg.ici_data, cfg.ici_fsdp, cfg.ici_tensor)
    if cfg.slice:
        preset = get_slice(cfg.slice)
        if not preset.splittable:
            raise MeshError(f"mesh.sample_devices={n}: the TPU compiler runs no program on part of a "
                            f"{preset.name} slice (limited ICI routing: a program's devices must be the whole "
                            f"slice); sample and train on one mesh (mesh.sample_devices=0), or on two slices")
        check_devices(preset, total)
        if ici == _DEFAULT_ICI:
            ici = preset.train_mesh
    if -1 not in ici:  # a shape written for every device: its fsdp axis fills the rest
        ici = (ici[0], -1, ici[2])
    train_cfg = dataclasses.replace(cfg, slice="", sample_devices=0, ici_data=ici[0], ici_fsdp=ici[1],
                                    ici_tensor=ici[2])
    try:
        sample = make_sample_mesh(dataclasses.replace(train_cfg, slice=cfg.slice), ordered[:n])
    except MeshError as e:
        raise MeshError(f"mesh.sample_devices={n}: the sampling mesh on {n} of {total} devices: {e}") from None
    try:
        train = make_mesh(train_cfg, ordered[n:])
    except MeshError as e:
        raise MeshError(f"mesh.sample_devices={n} leaves {total - n} devices to train on: {e}") from None
    return SplitMesh(sample=sample, train=train)


def run_meshes(cfg: MeshConfig, devices: Sequence | None = None) -> tuple[Mesh, SplitMesh | None]:
    """(the training mesh, the split or None) of a run on ``devices`` (default every
    device): with ``mesh.sample_devices`` > 0 and more than one device, the split's training
    mesh and the split; else the mesh of every device (``sharding.make_mesh``) and None, so
    one device samples and trains in turn (rl.async_steps still samples ahead)."""
    devices = list(jax.devices() if devices is None else devices)
    if cfg.sample_devices and len(devices) > 1:
        halves = split(cfg, devices)
        return halves.train, halves
    return make_mesh(dataclasses.replace(cfg, sample_devices=0), devices), None


# ---------------------------------------------------------------------- the hand-off

@functools.partial(jax.jit, static_argnames="dtype")
def _cast(params, dtype: str):
    """float32 leaves cast to ``dtype``, where the params are (the training chips)."""
    return jax.tree.map(lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x, params)


def hand_off(params, shardings, dtype: str):
    """The policy ``params`` (on the training mesh) as the sampler reads it: float32 leaves
    cast to ``dtype`` on the training chips first, so the copy moves ``hand_off_bytes`` and
    not the float32 bytes, then ``jax.device_put`` onto ``shardings`` (the sampling mesh's).
    Pure: ``params`` is left as it was."""
    if dtype != "float32":
        params = _cast(params, dtype)
    return jax.device_put(params, shardings)


def hand_off_bytes(params, dtype: str) -> int:
    """Bytes one hand-off moves: every leaf of ``params`` (arrays or ShapeDtypeStructs) at
    ``dtype`` where it is float32, at its own dtype otherwise, counted once (each sampling
    replica receives a copy of them; ``hand_off_seconds`` counts those)."""
    size = jnp.dtype(dtype).itemsize
    return sum(math.prod(x.shape) * (size if x.dtype == jnp.float32 else jnp.dtype(x.dtype).itemsize)
               for x in jax.tree.leaves(params))


def hand_off_seconds(policy_bytes: float, sample_replicas: int, sample_tensor: int, train_chips: int,
                     ici_bandwidth: float) -> float:
    """A roofline bound on one hand-off: each of the ``sample_replicas`` sampling replicas
    receives the whole copy of ``policy_bytes``, split over its ``sample_tensor`` chips, and
    each of the ``train_chips`` sends its 1/train_chips of the copy to every replica, each
    chip at ``ici_bandwidth`` (``tpu_specs.ChipSpec.ici_bandwidth``, the all-reduce bandwidth
    per chip the roofline charges collectives with; a copy runs over the same links): max(bytes
    in per sampling chip, bytes out per training chip) / bandwidth. Which links the copy
    crosses between the halves is not modelled: a cut with few links binds earlier."""
    bytes_in = policy_bytes / sample_tensor
    bytes_out = policy_bytes * sample_replicas / train_chips
    return max(bytes_in, bytes_out) / ici_bandwidth


def split_hand_off_seconds(policy_bytes: float, halves: SplitMesh, ici_bandwidth: float) -> float:
    """``hand_off_seconds`` of a split: the sampling mesh's data x fsdp groups are its
    replicas, its tensor axis their degree."""
    tensor = halves.sample.shape["tensor"]
    return hand_off_seconds(policy_bytes, halves.sample.size // tensor, tensor, halves.train.size, ici_bandwidth)


def overlapped_step(rollout_seconds: float, update_seconds: float, hand_off_seconds: float) -> float:
    """The step with the rollout of batch t + k on the sampling chips while the update of
    batch t runs on the training chips: the slower of the two, plus the hand-off of the
    updated policy, which neither can overlap (the next rollout reads it, the update wrote it)."""
    return max(rollout_seconds, update_seconds) + hand_off_seconds
