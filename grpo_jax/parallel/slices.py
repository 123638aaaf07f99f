"""Cloud TPU slice presets: how many devices and hosts a slice has, and the mesh to use on it.

Pure data and a few helpers. No jax import, so the launch scripts (which run on a laptop
that may not have jax) and the config module can both read the presets.

Counting devices (checked against Google's TPU docs and the gcloud accelerator types):

* ``v4-N`` and ``v5p-N`` count TensorCores. A v4 / v5p chip has two TensorCores that JAX
  drives as one device ("megacore"), so the slice has N/2 devices, one per chip, and every
  TPU VM (host) holds 4 chips: v4-8 and v5p-8 are one host with 4 devices; v4-32 is 16
  devices on 4 hosts (topology 2x2x4); v5p-128 is 64 devices on 16 hosts (4x4x4).
* ``v5litepod-N`` (v5e) and ``v6e-N`` (Trillium) count chips; each chip has one TensorCore,
  so one device per chip. The 8-chip shape (2x4) is a single TPU VM with all 8 chips. In a
  multi-host slice every TPU VM (worker) has 4 chips (machine type ct5lp-hightpu-4t on
  v5e): v5litepod-16 is 4 workers (4x4), -64 is 16 (8x8), -256 is 64 (16x16); v6e-256 is
  likewise 64 workers of 4 chips. (The v5e/v6e spec pages quote "8 chips per host" and a
  "hosts" column of N/8: that counts physical machines. What matters here is the number
  of TPU VM workers = JAX processes, which is N/4 for the multi-host shapes.)

Runtime (software) versions, as recommended for JAX in the "TPU software versions" page:
v4 and older ``tpu-ubuntu2204-base``, v5e ``v2-alpha-tpuv5-lite``, v5p ``v2-alpha-tpuv5``,
v6e ``v2-alpha-tpuv6e``. JAX itself is installed into a venv by ``launch/setup.py``.

Meshes are ``(data, fsdp, tensor)`` *within one slice* (the ICI part); combining several
slices over the data-centre network is a separate multi-slice (DCN) factor on ``data``.
A run can instead give the rollout and the update disjoint chips of the slice, the first hosts
sampling on ``sample_mesh``'s tensor degree and the rest training on ``train_mesh``'s shape
(``mesh.sample_devices``, ``grpo_jax.parallel.split_mesh``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from grpo_jax.errors import MeshError, UnknownNameError

MESH_AXES = ("data", "fsdp", "tensor")

# Default runtime version per TPU family (the accelerator type's prefix before "-N").
RUNTIME_VERSIONS = {
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}

# Users say "v5e-16"; gcloud only knows "v5litepod-16".
_ALIAS_PREFIXES = {"v5e-": "v5litepod-"}


@dataclass(frozen=True)
class SlicePreset:
    """One TPU slice shape and the recommended meshes on it.

    ``num_devices`` is what ``jax.device_count()`` reports on the whole slice;
    ``num_hosts`` is the number of TPU VM workers (= JAX processes); meshes are
    ``(data, fsdp, tensor)`` and multiply to ``num_devices``.
    """

    name: str
    accelerator_type: str
    num_devices: int
    num_hosts: int
    devices_per_host: int
    train_mesh: tuple[int, int, int]
    sample_mesh: tuple[int, int, int]
    runtime_version: str
    notes: str
    # Whether a program may run on part of the slice (``mesh.sample_devices``). The TPU
    # compiler refuses one on part of a v5e slice of 64 chips or more: "On platforms with
    # limited ICI routing device assignment should include all slice devices" (measured with
    # launch/compile.py rl.async_steps=1 mesh.sample_devices=N on v5litepod-64 and -256; the 8-
    # and 16-chip v5e slices, v4-32, v5p-128 and v6e-256 compile their halves).
    splittable: bool = True

    def __post_init__(self):
        # A preset that contradicts itself is a bug in this file: fail at import.
        if self.num_hosts * self.devices_per_host != self.num_devices:
            raise ValueError(
                f"{self.name}: {self.num_hosts} hosts x {self.devices_per_host} devices "
                f"!= {self.num_devices} devices"
            )
        for label, mesh in (("train_mesh", self.train_mesh), ("sample_mesh", self.sample_mesh)):
            if len(mesh) != len(MESH_AXES) or math.prod(mesh) != self.num_devices:
                raise ValueError(
                    f"{self.name}: {label} {mesh} must have {len(MESH_AXES)} axes "
                    f"{MESH_AXES} multiplying to {self.num_devices} devices"
                )

    @property
    def multi_host(self) -> bool:
        """True when the slice spans several TPU VMs (commands must go to every worker)."""
        return self.num_hosts > 1


def default_runtime_version(accelerator_type: str) -> str:
    """The recommended runtime version for any accelerator type, e.g. ``v4-64``."""
    family = accelerator_type.rsplit("-", 1)[0]
    try:
        return RUNTIME_VERSIONS[family]
    except KeyError:
        raise KeyError(
            f"no default runtime version for accelerator type {accelerator_type!r}; "
            f"known families: {', '.join(sorted(RUNTIME_VERSIONS))} (pass one explicitly)"
        ) from None


# Why these meshes (the same reasoning is in each preset's notes):
# * Training: the policy's float32 master weights + AdamW moments are ~16 bytes/param
#   (112 GB for 7B), far more than one device's HBM, so shard params and batch over
#   `fsdp` across the whole slice. Inside a slice `data` stays 1: pure data parallelism
#   would replicate those states. A `tensor` axis is only added on 256-device slices,
#   where it keeps the fsdp all-gather group at 64 and cuts per-device activations.
# * Sampling: decoding is memory-bandwidth bound and embarrassingly batch-parallel, and
#   fsdp would re-gather every weight at every decoded token. So each replica holds the
#   whole bf16 policy split over a `tensor` degree t, never crossing a host, and the G
#   samples of each question spread over N/t replicas. Each chip reads 1/t of the
#   weights per decoded token while its share of the KV cache does not depend on t, at
#   the price of two small all-reduces per layer; v4 and v5p take their host's 4 chips for
#   that reason (docs/tpu.md measures both), the others the smallest t that leaves room for
#   a 7B model's KV cache (16 GB v5e -> 4, 32 GB v6e -> 2). `mesh.sample_tensor` overrides it.
_TRAIN_NOTE = (
    "train: fsdp over all {n} devices (float32 params + AdamW states sharded; data=1 "
    "inside a slice, use data for multi-slice). "
)
_SAMPLE_NOTE = (
    "sample: {r} data-parallel replicas x tensor={t} (decode is bandwidth-bound and "
    "batch-parallel; each chip reads 1/t of the bf16 policy per token; {why}; "
    "mesh.sample_tensor=T overrides it)."
)
_FITS = "t is the smallest split that fits a 7B bf16 policy + KV cache in {hbm} GB/device"
_HOST = "t spans the host's chips: the weight read, not the {hbm} GB of HBM, bounds the decode"


def _preset(name: str, num_devices: int, num_hosts: int, hbm_gb: int, sample_tensor: int,
            train_mesh: tuple[int, int, int] | None = None, extra: str = "",
            host_split: bool = False, splittable: bool = True) -> SlicePreset:
    why = (_HOST if host_split else _FITS).format(hbm=hbm_gb)
    train = train_mesh or (1, num_devices, 1)
    if train_mesh is None:
        train_note = _TRAIN_NOTE.format(n=num_devices)
    else:
        train_note = (
            f"train: fsdp={train[1]} x tensor={train[2]} (fsdp alone also works for <= 7B; "
            "the tensor axis keeps the all-gather group small and cuts per-device "
            "activations, which larger policies need). "
        )
    return SlicePreset(
        name=name,
        accelerator_type=name,
        num_devices=num_devices,
        num_hosts=num_hosts,
        devices_per_host=num_devices // num_hosts,
        train_mesh=train,
        sample_mesh=(num_devices // sample_tensor, 1, sample_tensor),
        runtime_version=default_runtime_version(name),
        splittable=splittable,
        notes=(
            extra
            + train_note
            + _SAMPLE_NOTE.format(r=num_devices // sample_tensor, t=sample_tensor, why=why)
        ),
    )


SLICES: dict[str, SlicePreset] = {
    p.name: p
    for p in (
        # v4: 32 GB HBM per chip (megacore device); 4 chips per host.
        _preset("v4-8", 4, 1, 32, 4, extra="Single host, 4 chips. ", host_split=True),
        _preset("v4-32", 16, 4, 32, 4, extra="4 hosts x 4 chips (2x2x4). ", host_split=True),
        # v5e: 16 GB per chip; the 8-chip shape is one host, pods use 4-chip workers.
        _preset("v5litepod-8", 8, 1, 16, 4,
                extra="Single host, 8 chips (2x4): the quickstart / small-model slice. "),
        _preset("v5litepod-16", 16, 4, 16, 4, extra="4 hosts x 4 chips (4x4). "),
        _preset("v5litepod-64", 64, 16, 16, 4, extra="16 hosts x 4 chips (8x8). ", splittable=False),
        _preset("v5litepod-256", 256, 64, 16, 4, train_mesh=(1, 64, 4),
                extra="Full v5e pod: 64 hosts x 4 chips (16x16). ", splittable=False),
        # v5p: 95 GB per chip (megacore device); 4 chips per host.
        _preset("v5p-8", 4, 1, 95, 4, extra="Single host, 4 chips. ", host_split=True),
        _preset("v5p-128", 64, 16, 95, 4, extra="16 hosts x 4 chips (4x4x4). ", host_split=True),
        # v6e (Trillium): 32 GB per chip; same host layout as v5e.
        _preset("v6e-8", 8, 1, 32, 2, extra="Single host, 8 chips (2x4). "),
        _preset("v6e-256", 256, 64, 32, 2, train_mesh=(1, 64, 4),
                extra="Full v6e pod: 64 hosts x 4 chips (16x16). "),
    )
}


def get_slice(name: str) -> SlicePreset:
    """The preset called ``name`` (``v5e-N`` is accepted for ``v5litepod-N``).

    Raises KeyError listing the known names.
    """
    key = name.strip().lower()
    for alias, real in _ALIAS_PREFIXES.items():
        if key.startswith(alias):
            key = real + key[len(alias):]
    try:
        return SLICES[key]
    except KeyError:
        raise UnknownNameError(
            f"unknown TPU slice {name!r}; known slices: {', '.join(SLICES)} "
            "(v5e-N is accepted for v5litepod-N)"
        ) from None


def check_devices(preset: SlicePreset, num_devices: int) -> None:
    """Raise MeshError unless ``num_devices`` is what ``preset`` expects.

    ``sharding.resolve_mesh_shape`` calls it for ``mesh.slice`` with the devices of one
    slice, so a wrong slice name fails with both numbers and the slice's hosts instead of a
    mesh of the wrong size.
    """
    if num_devices != preset.num_devices:
        raise MeshError(
            f"slice {preset.name} has {preset.num_devices} devices "
            f"({preset.num_hosts} host(s) x {preset.devices_per_host}), but "
            f"{num_devices} device(s) are visible; pick the preset that matches this "
            "machine (on CPU, fake devices come from "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )

