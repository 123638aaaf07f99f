"""launch/compile.py's summary of a split (mesh.sample_devices): hand-off, overlapped step and
MFU over the whole slice, from the programs' reports (no compile)."""

import jax
import pytest

from grpo_jax.model import transformer as model_lib
from grpo_jax.parallel import split_mesh
from grpo_jax.config import MeshConfig, get_preset
from grpo_jax.aot.tpu_specs import CHIPS, EFFICIENCY
from launch.compile import overlap


def test_the_split_summary_adds_the_hand_off_to_the_slower_half():
    cfg = get_preset("cpu-tiny").replace(rl={"async_steps": 1, "sample_dtype": "bfloat16"}, mesh={"sample_devices": 4})
    halves = split_mesh.split(MeshConfig(sample_devices=4, sample_tensor=2), jax.devices())
    chip = CHIPS["v5e"]
    prog = lambda flops, calls: {"model_flops_per_chip": flops, "calls_per_step": calls}
    results = {"sample_prefill": prog(1e12, 2), "sample_decode": prog(3e12, 2), "train_step": prog(5e12, 1),
               "summary": {"rollout_seconds": 4.0, "update_seconds": 7.0,
                           "rollout_seconds_expected": 20.0, "update_seconds_expected": 12.0}}
    s = overlap(cfg, results, chip, halves)
    policy = split_mesh.hand_off_bytes(model_lib.param_shapes(cfg.model), "bfloat16")
    # 2 replicas of tensor 2 take in half the copy each; 4 training chips send half of it each.
    hand = policy / 2 / chip.ici_bandwidth
    assert s["hand_off_bytes"] == policy and s["hand_off_seconds"] == pytest.approx(hand)
    assert s["overlapped_seconds"] == pytest.approx(7.0 + hand)
    assert s["overlapped_seconds_expected"] == pytest.approx(20.0 + hand / EFFICIENCY["v5e"].bandwidth)
    flops = (1e12 * 2 + 3e12 * 2) * 4 + 5e12 * 4
    assert s["mfu"] == pytest.approx(flops / (8 * chip.peak_bf16_flops * (7.0 + hand)))
    assert (s["sample_devices"], s["train_devices"], s["chips"]) == (4, 4, 8)
