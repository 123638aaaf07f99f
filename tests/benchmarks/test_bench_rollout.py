"""bench_rollout's accuracy half: the sampler/trainer log-prob mismatch it reports for `--bf16`."""

import jax
import numpy as np
import pytest

@pytest.fixture
def bench_rollout(benchmark_module):
    return benchmark_module("bench_rollout")


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
    from grpo_jax.model import transformer as model
    from grpo_jax import sampler
    from grpo_jax.config import ModelConfig

    cfg = ModelConfig(vocab_size=101, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_dim=64, max_seq_len=64)
    params = model.init_params(cfg, jax.random.key(0))
    prompts = [[5, 9, 13, 2], [3, 4, 60, 11, 12], [7, 7], [1, 2, 3]]
    got = bench_rollout.measure_mismatch(
        cfg, params, {"float32": params, "bfloat16": sampler.sampling_copy(cfg, params, "bfloat16")},
        prompts, new_tokens=12)
    assert got["float32"]["tokens"] == got["bfloat16"]["tokens"] == 4 * 12  # no stop token
    assert got["float32"]["max_abs"] < 1e-5, got
    assert got["bfloat16"]["mean_abs"] > 100 * got["float32"]["mean_abs"], got


class _FakeRunner:
    """(prompts, new_tokens) -> seconds from a formula of batch size and length; logs calls."""

    def __init__(self, name, log, per_row, fixed=0.5):
        self.name, self.log, self.per_row, self.fixed = name, log, per_row, fixed

    def __call__(self, prompts, new_tokens):
        self.log.append((self.name, len(prompts), new_tokens))
        return self.fixed + self.per_row * len(prompts) * new_tokens


def test_rollout_rates_by_batch_interleaves_batches_within_every_rep(bench_rollout):
    import common

    log = []
    runners = {"a": _FakeRunner("a", log, 0.01), "b": _FakeRunner("b", log, 0.02)}
    prompts = {2: [[1] * 4] * 2, 8: [[1] * 4] * 8}
    got = common.rollout_rates_by_batch(runners, prompts, new_tokens=5, reps=3)
    warmup = [(r, b, n) for b in (2, 8) for r in ("a", "b") for n in (1, 5)]
    one_rep = [(r, b, n) for b in (2, 8) for r in ("a", "b") for n in (1, 5)]
    assert log == warmup + one_rep * 3
    t1, tn = 0.5 + 0.02 * 8, 0.5 + 0.02 * 8 * 5  # runner b at batch 8
    assert got[8]["b"]["t1_samples"] == [pytest.approx(t1)] * 3
    assert got[8]["b"]["prefill"] == pytest.approx(8 * 4 / t1)
    assert got[8]["b"]["decode"] == pytest.approx(8 * 4 / (tn - t1))
    assert got[8]["b"]["e2e"] == pytest.approx(8 * 5 / tn)
    # the single-batch form is the same computation
    single = common.rollout_rates(runners, prompts[2], new_tokens=5, reps=2)
    assert single["a"]["prefill"] == pytest.approx(got[2]["a"]["prefill"])


def test_per_token_gains_pair_each_rep_of_adjacent_batch_sizes(bench_rollout):
    rates = lambda t1, tn: {"t1_samples": t1, "tn_samples": tn}
    by_batch = {
        8: {"jax": rates([1.0, 2.0], [3.0, 6.0]), "torch": rates([1.0, 1.0], [2.0, 2.0])},
        32: {"jax": rates([2.0, 8.0], [4.0, 16.0]), "torch": rates([8.0, 8.0], [10.0, 10.0])},
    }
    gains = bench_rollout.per_token_gains(by_batch)
    assert list(gains) == [(8, 32)]
    g = gains[(8, 32)]
    # prefill per rep, (32 / t1_large) / (8 / t1_small): 4 * 1/2 = 2 and 4 * 2/8 = 1 (sorted)
    assert g["prefill_jax"]["samples"] == [pytest.approx(1.0), pytest.approx(2.0)]
    # decode per rep, on t(N) - t(1): 4 * 2/2 = 4 and 4 * 4/8 = 2 (sorted)
    assert g["decode_jax"]["samples"] == [pytest.approx(2.0), pytest.approx(4.0)]
    assert g["prefill_torch"]["median"] == pytest.approx(0.5)  # 4 * 1/8
    assert g["decode_torch"]["median"] == pytest.approx(2.0)  # 4 * 1/2
