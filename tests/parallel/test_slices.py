"""TPU slice presets: the numbers match how Cloud TPU counts devices and hosts, every mesh
fits its slice, and each mesh really builds on that many (fake CPU) devices."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_jax.parallel import slices
from grpo_jax.config import MeshConfig
from grpo_jax.errors import MeshError
from grpo_jax.parallel.sharding import resolve_mesh_shape
from grpo_jax.parallel.slices import SLICES, SlicePreset, check_devices, get_slice

REPO = Path(__file__).resolve().parents[2]

# (devices, hosts), written out from the TPU docs rather than derived: v4/v5p names count
# TensorCores (2 per chip, one JAX device per chip), v5e/v6e names count chips; multi-host
# v5e/v6e workers have 4 chips, the single-host 8-chip shape has all 8.
EXPECTED_SHAPE = {
    "v4-8": (4, 1), "v4-32": (16, 4),
    "v5litepod-8": (8, 1), "v5litepod-16": (16, 4), "v5litepod-64": (64, 16),
    "v5litepod-256": (256, 64),
    "v5p-8": (4, 1), "v5p-128": (64, 16),
    "v6e-8": (8, 1), "v6e-256": (256, 64),
}
EXPECTED_RUNTIME = {"v4": "tpu-ubuntu2204-base", "v5litepod": "v2-alpha-tpuv5-lite",
                    "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}


def test_the_presets_are_exactly_the_documented_slices():
    assert set(SLICES) == set(EXPECTED_SHAPE)


@pytest.mark.parametrize("name", sorted(EXPECTED_SHAPE))
def test_preset_devices_hosts_and_runtime(name):
    p = SLICES[name]
    assert p.name == p.accelerator_type == name
    assert (p.num_devices, p.num_hosts) == EXPECTED_SHAPE[name]
    assert p.num_devices == p.num_hosts * p.devices_per_host
    family, size = name.rsplit("-", 1)
    per_chip = 2 if family in ("v4", "v5p") else 1  # TensorCores counted in the name
    assert p.num_devices == int(size) // per_chip
    assert p.devices_per_host == (8 if p.num_hosts == 1 and family in ("v5litepod", "v6e") else 4)
    assert p.runtime_version == EXPECTED_RUNTIME[family]
    assert p.multi_host == (p.num_hosts > 1)


@pytest.mark.parametrize("name", sorted(EXPECTED_SHAPE))
def test_preset_meshes_fill_the_slice(name):
    p = SLICES[name]
    for mesh in (p.train_mesh, p.sample_mesh):
        assert len(mesh) == 3 and all(isinstance(d, int) and d >= 1 for d in mesh)
        assert math.prod(mesh) == p.num_devices
    assert p.train_mesh[0] == 1, "inside a slice, training shards over fsdp, not data"
    assert p.sample_mesh[1] == 1, "sampling never uses fsdp (it would re-gather every token)"
    assert p.sample_mesh[2] <= p.devices_per_host, "a sampling replica stays on one host"
    assert "train:" in p.notes and "sample:" in p.notes


def test_an_inconsistent_preset_is_refused():
    good = SLICES["v4-8"]
    fields = {f: getattr(good, f) for f in SlicePreset.__dataclass_fields__}
    with pytest.raises(ValueError, match="train_mesh"):
        SlicePreset(**{**fields, "train_mesh": (1, 8, 1)})
    with pytest.raises(ValueError, match="hosts"):
        SlicePreset(**{**fields, "num_hosts": 2})


def test_get_slice_and_the_v5e_alias():
    assert get_slice("v4-32") is SLICES["v4-32"]
    assert get_slice("v5e-16") is SLICES["v5litepod-16"]
    assert get_slice(" V5E-8 ") is SLICES["v5litepod-8"]


def test_unknown_slice_names_the_known_ones():
    with pytest.raises(KeyError) as err:
        get_slice("v9-8")
    message = str(err.value)
    assert "v9-8" in message
    assert all(name in message for name in SLICES)


def test_default_runtime_version_for_shapes_without_a_preset():
    assert slices.default_runtime_version("v4-64") == "tpu-ubuntu2204-base"
    with pytest.raises(KeyError, match="v2-8"):
        slices.default_runtime_version("v2-8")


def test_check_devices():
    check_devices(SLICES["v5litepod-8"], 8)  # no error
    with pytest.raises(MeshError, match=r"v4-32 has 16 devices.*but 8 device"):
        check_devices(SLICES["v4-32"], 8)
    # A run's mesh.slice is checked against the devices of each slice.
    with pytest.raises(MeshError, match=r"slice v4-32 has 16 devices \(4 host\(s\) x 4\), but 8 device"):
        resolve_mesh_shape(MeshConfig(slice="v4-32", dcn_data=2), 16)
    assert resolve_mesh_shape(MeshConfig(slice="v4-32", dcn_data=2), 32) == (SLICES["v4-32"].train_mesh, (2, 1, 1))


def test_explicit_ici_axes_win_over_the_slices_train_mesh():
    """The preset's train mesh fills ICI axes left at their defaults; data x fsdp given
    explicitly (the reduce-scatter layout of docs/tpu.md) is kept and checked."""
    assert SLICES["v5p-128"].train_mesh == (1, 64, 1)
    assert resolve_mesh_shape(MeshConfig(slice="v5p-128", ici_data=4, ici_fsdp=16), 64) == ((4, 16, 1), (1, 1, 1))
    assert resolve_mesh_shape(MeshConfig(slice="v5p-128", ici_data=4), 64) == ((4, 16, 1), (1, 1, 1))
    with pytest.raises(MeshError, match=r"asks for 32 devices"):
        resolve_mesh_shape(MeshConfig(slice="v5p-128", ici_data=2, ici_fsdp=16), 64)


def test_slices_module_does_not_import_jax():
    # Load the file on its own (not through grpo_jax/__init__, which other modules own).
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('s', {str(REPO / 'grpo_jax/parallel/slices.py')!r}); "
            "m = importlib.util.module_from_spec(spec); sys.modules['s'] = m; "
            "spec.loader.exec_module(m); "
            "assert 'jax' not in sys.modules, 'slices imported jax'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# One process per distinct device count: XLA reads the fake-device flag once per process.
_MESH_CHECK = """
import json, sys
import jax, numpy as np
from grpo_jax.parallel.slices import check_devices, get_slice
for name, train, sample in json.loads(sys.argv[1]):
    check_devices(get_slice(name), jax.device_count())
    for shape in (train, sample):
        mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), ("data", "fsdp", "tensor"))
        assert dict(mesh.shape) == dict(zip(("data", "fsdp", "tensor"), shape)), (name, mesh.shape)
print("ok", jax.device_count())
"""


def test_every_preset_mesh_builds_on_fake_cpu_devices():
    by_count: dict[int, list] = {}
    for p in SLICES.values():
        if p.num_devices <= 256:
            by_count.setdefault(p.num_devices, []).append([p.name, p.train_mesh, p.sample_mesh])
    procs = {}
    for count, presets in sorted(by_count.items()):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}",
               "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
        procs[count] = subprocess.Popen(
            [sys.executable, "-c", _MESH_CHECK, json.dumps(presets)], env=env, cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for count, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{count} devices: {err[-2000:]}"
        assert out.split() == ["ok", str(count)]
    assert sorted(procs) == [4, 8, 16, 64, 256]
