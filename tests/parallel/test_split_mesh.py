"""mesh.sample_devices: the devices cut into a sampling and a training mesh, the policy handed
from one to the other, and the loop overlapping the rollout of batch t + 1 with the update of
batch t (8 fake CPU devices, conftest), trained exactly as the single-mesh rl.async_steps=1
loop trains."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.parallel import split_mesh
from grpo_jax.config import ConfigError, MeshConfig
from grpo_jax.errors import MeshError
from grpo_jax.model.transformer import init_params, param_shardings
from grpo_jax.parallel.sharding import make_mesh, mesh_from_shape
from tests.rl.test_async_steps import _fingerprint, _Sampler, _Step
from tests.parallel.test_preemption import _comparable
from tests.rl.test_trainer import _cfg, _trainer, tok  # noqa: F401 (tok: the fixture)


def _devices(mesh):
    return set(mesh.devices.flat)


def test_the_split_cuts_the_devices_in_two_meshes():
    devices = jax.devices()
    halves = split_mesh.split(MeshConfig(sample_devices=2), devices)
    assert _devices(halves.sample) == set(devices[:2]) and _devices(halves.train) == set(devices[2:])
    assert dict(halves.train.shape) == {"data": 1, "fsdp": 6, "tensor": 1}
    assert dict(halves.sample.shape) == {"data": 1, "fsdp": 2, "tensor": 1}
    # A tensor degree for the sampler, and a train shape written for all 8 devices (its fsdp fills).
    halves = split_mesh.split(MeshConfig(ici_data=2, ici_fsdp=4, sample_tensor=2, sample_devices=4), devices)
    assert dict(halves.sample.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
    assert dict(halves.train.shape) == {"data": 2, "fsdp": 2, "tensor": 1}
    # A slice preset: its sampling tensor degree, its training mesh's fsdp filled from the rest.
    halves = split_mesh.split(MeshConfig(slice="v5litepod-8", sample_devices=4), devices)
    assert dict(halves.sample.shape) == {"data": 1, "fsdp": 1, "tensor": 4}
    assert dict(halves.train.shape) == {"data": 1, "fsdp": 4, "tensor": 1}
    # One device, or no split asked for: every device trains (and samples, in turn).
    assert split_mesh.run_meshes(MeshConfig(sample_devices=4), devices[:1])[1] is None
    mesh, halves = split_mesh.run_meshes(MeshConfig(), devices)
    assert halves is None and mesh.size == 8


@pytest.mark.parametrize("mesh, message", [
    (MeshConfig(sample_devices=8), r"mesh.sample_devices=8 leaves no device to train on: 8 device\(s\)"),
    (MeshConfig(sample_devices=9), "mesh.sample_devices=9 leaves no device to train on"),
    (MeshConfig(sample_devices=4, sample_tensor=3),
     "mesh.sample_devices=4: the sampling mesh on 4 of 8 devices: mesh.sample_tensor=3 does not divide"),
    (MeshConfig(sample_devices=5, ici_tensor=2, sample_tensor=1), "mesh.sample_devices=5 leaves 3 devices to train on"),
    (MeshConfig(sample_devices=4, slice="v5p-128"), "slice v5p-128 has 64 devices"),
    (MeshConfig(sample_devices=4, dcn_data=2), "a multi-slice mesh"),
    # The TPU compiler refuses a program on part of a large v5e slice (slices.SlicePreset.splittable).
    (MeshConfig(sample_devices=4, slice="v5litepod-256"), r"runs no program on part of a v5litepod-256 slice"),
])
def test_a_split_that_does_not_fit_names_the_problem(mesh, message):
    with pytest.raises(MeshError, match=message):
        split_mesh.split(mesh, jax.devices())


def test_a_split_is_refused_without_async_steps_or_below_zero(tmp_path, tok):
    with pytest.raises(ConfigError, match="mesh.sample_devices=4 needs rl.async_steps >= 1"):
        _cfg(tmp_path, tok, "mesh.sample_devices=4")
    with pytest.raises(ConfigError, match="mesh.sample_devices must be >= 0"):
        MeshConfig(sample_devices=-1).validate()


def test_the_hand_off_puts_a_bf16_copy_on_exactly_the_sampling_devices(tmp_path, tok):
    cfg = _cfg(tmp_path, tok)
    halves = split_mesh.split(MeshConfig(sample_devices=4, sample_tensor=2), jax.devices())
    params = jax.device_put(init_params(cfg.model, jax.random.key(0)), param_shardings(cfg.model, halves.train))
    before = jax.tree.map(np.asarray, params)
    copy = split_mesh.hand_off(params, param_shardings(cfg.model, halves.sample), "bfloat16")
    for x, y in zip(jax.tree.leaves(copy), jax.tree.leaves(before)):
        assert x.sharding.device_set == _devices(halves.sample) and x.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(x), y.astype(jnp.bfloat16))
    jax.tree.map(np.testing.assert_array_equal, params, before)  # pure: the policy is untouched
    # The bytes one copy moves: the bf16 tree's, counted from the arrays themselves.
    assert split_mesh.hand_off_bytes(params, "bfloat16") == sum(np.asarray(x).nbytes for x in jax.tree.leaves(copy))
    assert split_mesh.hand_off_bytes(params, "float32") == sum(y.nbytes for y in jax.tree.leaves(before))


def test_the_overlapped_step_is_the_slower_half_plus_the_hand_off():
    assert split_mesh.overlapped_step(30.0, 20.0, 0.5) == 30.5
    assert split_mesh.overlapped_step(10.0, 20.0, 0.5) == 20.5
    # 4 sampling replicas of tensor 2 on 8 chips, 8 training chips: each sampling chip takes in
    # half the copy (8 GB), each training chip sends its eighth to 4 replicas (8 GB).
    devices = np.array(jax.devices())
    halves = split_mesh.SplitMesh(sample=make_mesh(MeshConfig(ici_data=4, ici_fsdp=1, ici_tensor=2), devices),
                                  train=make_mesh(MeshConfig(), devices))
    assert split_mesh.split_hand_off_seconds(16e9, halves, 100e9) == pytest.approx(0.08)
    # 2 training chips: each sends half the copy to 4 replicas (32 GB), which binds.
    halves = dataclasses.replace(halves, train=mesh_from_shape((1, 2, 1)))
    assert split_mesh.split_hand_off_seconds(16e9, halves, 100e9) == pytest.approx(0.32)
    assert split_mesh.hand_off_seconds(16e9, 4, 2, 2, 100e9) == pytest.approx(0.32)


def _timeless(history):
    """Metrics without the timings (every key ending in _time_s)."""
    return [{k: v for k, v in h.items() if not k.endswith("_time_s")} for h in _comparable(history)]


def test_the_split_loop_trains_what_the_one_mesh_loop_trains(tmp_path, tok):
    """4 sampling / 4 training devices at k = 1: the batch trained at step t was sampled with
    the weights of step t - 1 (those handed off before the update of step t - 1), and every
    metric equals, bit for bit, the loop that samples and trains on one mesh of 4 devices of
    the same shape (each half's programs are the ones-mesh loop's on other devices)."""
    over = ("rl.async_steps=1", "run.steps=3", "run.checkpoint_every=0")
    split = _trainer(_cfg(tmp_path / "split", tok, *over, "mesh.sample_devices=4"), tok)
    assert _devices(split.mesh).isdisjoint(_devices(split.sampler.mesh))
    assert split.mesh.size == split.sampler.mesh.size == 4
    sampled, trained = [], []
    split.sampler, split.step_fn = _Sampler(split.sampler, sampled), _Step(split.step_fn, trained)
    history = split.train()
    split.close()
    assert len(sampled) == 4  # batches 0 and 1 by the first weights, then one a step
    for t, (_, batch) in enumerate(trained):
        [weights] = [w for w, tokens, _ in sampled if np.array_equal(tokens, batch.tokens)]
        assert weights == trained[max(t - 1, 0)][0], t
        assert history[t]["staleness"] == min(t, 1)
    assert all(h["hand_off_time_s"] >= 0 and "sample_wait_time_s" in h for h in history[1:])
    one = _trainer(_cfg(tmp_path / "one", tok, *over), tok, mesh=make_mesh(MeshConfig(), jax.devices()[4:]))
    assert one.split is None and one.sampler.mesh is one.mesh
    assert _timeless(one.train()) == _timeless(history)
    one.close()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(split.params), jax.device_get(one.params))


def test_a_split_run_killed_after_a_checkpoint_resumes_exactly(tmp_path, tok):
    """k = 1: the batch the sampler thread drew during the last step before the checkpoint is
    saved with it, and the resumed run trains what the uninterrupted one trained."""
    over = ("rl.async_steps=1", "mesh.sample_devices=4", "run.steps=3", "run.checkpoint_every=2")
    whole = _trainer(_cfg(tmp_path / "whole", tok, *over), tok)
    want = whole.train()
    whole.close()
    first = _trainer(_cfg(tmp_path / "part", tok, *over), tok)
    first.train(steps=2)  # "killed" after the checkpoint at step 2, its pool never shut down
    resumed = _trainer(_cfg(tmp_path / "part", tok, *over), tok)
    assert resumed.start_step == 2 and list(resumed.in_flight) == [2]
    assert _timeless(first.history + resumed.train()) == _timeless(want)
    resumed.close()
    first.close()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), jax.device_get(whole.params))


def test_one_device_falls_back_to_sampling_ahead_in_turn(tmp_path, tok):
    """The one-device loop is rl.async_steps' own (test_async_steps): nothing is split."""
    cfg = _cfg(tmp_path, tok, "rl.async_steps=1", "mesh.sample_devices=4")
    trainer = _trainer(cfg, tok, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    assert trainer.split is None and trainer._pool is None and trainer.sampler.mesh is trainer.mesh
    trainer.close()
