"""paged_attention_bytes: its shared-engine floor is the check's own analytic count, and its
phase and page counts follow from the shapes by hand."""

import numpy as np
import pytest

from grpo_jax import aot

@pytest.fixture
def bench(benchmark_module):
    return benchmark_module("paged_attention_bytes")


def test_the_shared_floor_is_the_checks_analytic_count_on_the_7b_row(bench):
    """v5p-128 with 64 questions per call: 16 replicas x tensor 4, so a chip holds 256 rows
    in 4 prompt slots and 8 of the 32 kv heads (30 layers x k, v x 8 x 128 x 2 bytes)."""
    s = bench.shapes("deepseekmath-rl-7b", "v5p-128", ["rl.sample_prompts=64"])
    assert (s["rows"], s["slots"], s["kv_heads"], s["tc"], s["steps"]) == (256, 4, 8, 1024, 1023)
    assert s["slot_bytes"] == s["bf16_slot_bytes"] == 30 * 2 * 8 * 128 * 2
    analytic = aot.decode_bytes_analytic(s["cfg"], s["mesh"], 64, 64, bench.PROMPT_LEN)
    assert bench.per_token(s, 128)["shared floor"] == pytest.approx(analytic, rel=1e-9)


def test_phase_windows_and_pages_by_hand(bench):
    """A made-up chip: 2 rows in 1 prompt slot of 256, 4 completion slots, 3 steps."""
    s = {"weights": 1000.0, "rows": 2, "slots": 1, "slot_bytes": 10.0, "bf16_slot_bytes": 10.0, "tc": 4,
         "steps": 3}
    figures = bench.per_token(s, 128)
    prompt = 256 * 10.0
    assert figures["shared floor"] == pytest.approx(1000 + prompt + 2 * 2.0 * 10)  # steps 1, 2, 3: mean 2
    # 4 phases of 1 slot: the window is the filled slots; 8 or 16 phases of 4 slots round to 0
    # slots, so every step's window is the first one >= its step, i.e. the step itself or 4.
    assert figures["shared, 4 phases"] == pytest.approx(figures["shared floor"])
    windows = np.array([4 * (i + 1) // 8 for i in range(8)])
    assert figures["shared, 8 phases"] == pytest.approx(
        1000 + prompt + 2 * np.mean([windows[np.searchsorted(windows, t)] for t in (1, 2, 3)]) * 10)
    # Every row reads its own prompt pages: 256 + s slots round up to 3 pages of 128.
    assert figures["paged, bf16"] == pytest.approx(1000 + 2 * 384 * 10.0)
    assert figures["paged, fp8"] == pytest.approx(1000 + 2 * 384 * 5.0)
