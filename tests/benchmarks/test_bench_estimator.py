"""bench_estimator: its table's ratios come from the numbers given, and the CPU estimate it
calibrates counts a decode step's FLOPs as the analytic count does."""

import jax
import numpy as np
import pytest

@pytest.fixture
def bench_estimator(benchmark_module):
    return benchmark_module("bench_estimator")


def test_roofline_takes_the_binding_limit_and_the_serial_sum(bench_estimator):
    memory = bench_estimator.roofline_seconds(np.array([2e9, 3e9]), flops_per_s=1e10, bytes_per_s=1e9)
    assert memory["estimated"] == pytest.approx(3.0) and memory["bound"] == "memory"
    assert memory["serial"] == pytest.approx(3.2)
    compute = bench_estimator.roofline_seconds(np.array([5e10, 1e9]), flops_per_s=1e10, bytes_per_s=1e9)
    assert compute["estimated"] == pytest.approx(5.0) and compute["bound"] == "compute"
    assert compute["serial"] == pytest.approx(6.0)


def test_calibration_rows_ratios_and_claim_flags(bench_estimator):
    roof = lambda f, b: bench_estimator.roofline_seconds(np.array([f, b]), flops_per_s=1e9, bytes_per_s=1e9)
    estimates = {8: {"prefill": roof(2e9, 1e9), "decode": roof(1e9, 4e9)}}  # 2 s compute, 4 s memory
    seconds = lambda *xs: {"median": float(np.median(xs)), "min": min(xs), "max": max(xs)}
    measured = {8: {"prefill": seconds(1.9, 3.0, 3.2), "decode": seconds(13.0, 14.0, 15.0)}}
    rows = bench_estimator.calibration_rows(estimates, measured)
    pre, dec = rows
    assert (pre["batch"], pre["phase"], dec["phase"]) == (8, "prefill", "decode")
    assert pre["ratio"] == pytest.approx(3.0 / 2.0) and pre["ratio_serial"] == pytest.approx(3.0 / 3.0)
    assert pre["ratio_min_rep"] == pytest.approx(1.9 / 2.0)
    assert not pre["lower_bound"] and pre["within"]  # one rep ran under the estimate
    assert dec["ratio"] == pytest.approx(14.0 / 4.0) and dec["lower_bound"] and not dec["within"]
    res = bench_estimator.summary_results(rows)
    assert res["estimator_min_ratio"] == pytest.approx(0.95)
    assert res["estimator_max_ratio"] == pytest.approx(3.5)
    assert res["estimator_max_ratio_measured_s"] == 14.0 and res["estimator_max_ratio_estimated_s"] == 4.0
    cells = bench_estimator.table_cells(dec)
    assert len(cells) == len(bench_estimator.HEADERS)
    assert cells[0] == "8 × decode" and "3.50×" in cells[6] and cells[-1] == "yes / **no**"


def test_cpu_decode_estimate_matches_the_analytic_flops(bench_estimator):
    """The single-device (feature-major) decode's FLOPs per token: 2 per multiply-add of every
    row's matmuls plus attention over every cache slot, within 20%."""
    from grpo_jax import aot, shapes

    cfg = bench_estimator.sampler_config(24, preset="cpu-tiny")
    prompts, prompt_len = 4, 16
    def draw_hlo() -> str:  # jax's own CPU lowering of a random draw, through its public API
        return jax.jit(lambda key: jax.random.bits(key, (64,))).lower(jax.random.key(0)).as_text()

    before = draw_hlo()
    cost = bench_estimator.estimator_cost(cfg, prompts, prompt_len)
    m = cfg.model
    slots = prompt_len + shapes.bucket_length(cfg.rl.max_new_tokens)
    flops = prompts * (2 * aot.matmul_params(m) + 4 * m.num_layers * m.num_heads * m.head_dim * slots)
    assert abs(cost["decode_per_token"][0] / flops - 1) < 0.20, (cost["decode_per_token"][0], flops)
    np.testing.assert_allclose(cost["decode"], cost["decode_per_token"] * (cfg.rl.max_new_tokens - 1),
                               rtol=0.05)  # plus the first token's draw and the loop's set-up
    # aot's unrolled threefry lowering is scoped: jax's own (rolled) CPU rule is back afterwards.
    assert draw_hlo() == before
