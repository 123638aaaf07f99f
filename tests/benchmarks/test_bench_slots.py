"""bench_slots: the length model's rows are the two schedules' on the same drawn lengths, and
the tool workload counts what each path puts through the model (a real run of it is the
slot engine's tests' rollout, at other shapes)."""

import numpy as np
import pytest

from grpo_jax.sampler import slots


@pytest.fixture
def bench_slots(benchmark_module):
    return benchmark_module("bench_slots")


def test_length_model_rows_are_the_schedules_of_their_lengths(bench_slots):
    rows = bench_slots.length_model(rows_in_flight=8, calls=16, cap=64, seed=1)
    assert [r["queue_per_slot"] for r in rows] == [1, 4, 16, 16]  # calls=16 is the last size too
    for r in rows:
        assert r["rows"] == 8 * r["queue_per_slot"]
        assert 0 < r["static_utilization"] <= r["slot_utilization"] <= 1
        assert r["slot_steps"] <= r["static_steps"]
        assert r["expected_rollout_ratio"] == pytest.approx(r["slot_steps"] / r["static_steps"])
    # one call's rows on as many slots: every row starts at once, both run to the longest
    assert rows[0]["slot_steps"] == rows[0]["static_steps"]


def test_static_steps_run_each_call_to_its_longest_row():
    assert slots.static_steps([5, 1, 2, 7, 3], 2) == 5 + 7 + 3
    lengths = np.array([4, 4, 4, 4])
    assert slots.schedule(lengths, 2) == (8, 16) and slots.static_steps(lengths, 2) == 8
