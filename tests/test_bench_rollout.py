"""bench_rollout's accuracy half: the sampler/trainer log-prob mismatch it reports for `--bf16`."""

from pathlib import Path

import jax
import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench_rollout(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_rollout

    return bench_rollout


def test_mismatch_stats_counts_real_tokens_only(bench_rollout):
    sample = np.log([[0.5, 0.2, 0.9], [0.1, 0.3, 0.7]])
    trainer = np.log([[0.5, 0.5, 0.1], [0.3, 0.3, 0.7]])
    mask = np.array([[True, True, False], [True, True, True]])
    got = bench_rollout.mismatch_stats(sample, trainer, mask, cap=2.0)
    gaps = np.abs(np.log([0.5 / 0.5, 0.2 / 0.5, 0.1 / 0.3, 1.0, 1.0]))
    assert got["tokens"] == 5
    assert got["mean_abs"] == pytest.approx(gaps.mean())
    assert got["max_abs"] == pytest.approx(np.log(3.0))
    assert got["kl_k1"] == pytest.approx((np.log(0.2 / 0.5) + np.log(0.1 / 0.3)) / 5)
    assert got["tis_capped_fraction"] == pytest.approx(2 / 5)  # 0.5/0.2 and 0.3/0.1 exceed 2


def test_bf16_copy_mismatch_is_measured_against_a_float32_control(bench_rollout):
    from grpo_jax import model, sampling
    from grpo_jax.config import ModelConfig

    cfg = ModelConfig(vocab_size=101, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_dim=64, max_seq_len=64)
    params = model.init_params(cfg, jax.random.key(0))
    prompts = [[5, 9, 13, 2], [3, 4, 60, 11, 12], [7, 7], [1, 2, 3]]
    got = bench_rollout.measure_mismatch(
        cfg, params, {"float32": params, "bfloat16": sampling.sampling_copy(cfg, params, "bfloat16")},
        prompts, new_tokens=12)
    assert got["float32"]["tokens"] == got["bfloat16"]["tokens"] == 4 * 12  # no stop token
    assert got["float32"]["max_abs"] < 1e-5, got
    assert got["bfloat16"]["mean_abs"] > 100 * got["float32"]["mean_abs"], got
