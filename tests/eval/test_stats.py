"""Seed intervals: Student-t half-widths checked against textbook quantiles."""
import math

import numpy as np
import pytest

from grpo_jax.eval.stats import format_interval, paired_verdict, t_band, t_interval

# Two-sided 95% quantiles of Student's t from printed tables (df = 2, 4) and the normal limit.
T975_DF2 = 4.302652729911275
T975_DF4 = 2.7764451051977987


def test_three_seeds_use_t_with_two_degrees_of_freedom():
    mean, low, high = t_interval([0.7, 0.8, 0.9])
    half = T975_DF2 * 0.1 / math.sqrt(3)
    assert mean == pytest.approx(0.8)
    assert (low, high) == pytest.approx((0.8 - half, 0.8 + half), abs=1e-9)


def test_five_seeds_and_other_levels_narrow_the_interval():
    vals = [1.0, 2.0, 3.0, 4.0, 5.0]
    _, low, high = t_interval(vals)
    assert (high - low) / 2 == pytest.approx(T975_DF4 * np.std(vals, ddof=1) / math.sqrt(5), rel=1e-12)
    _, low90, high90 = t_interval(vals, level=0.9)
    assert high90 - low90 < high - low


def test_single_seed_and_constant_values_have_zero_width():
    assert t_interval([0.5]) == (0.5, 0.5, 0.5)
    assert t_interval([0.25, 0.25, 0.25]) == pytest.approx((0.25, 0.25, 0.25))


def test_band_is_pointwise_interval():
    runs = [[0.0, 0.7], [0.0, 0.8], [0.0, 0.9]]
    mean, low, high = t_band(runs)
    np.testing.assert_allclose(mean, [0.0, 0.8])
    np.testing.assert_allclose([low[1], high[1]], t_interval([0.7, 0.8, 0.9])[1:])
    assert low[0] == high[0] == 0.0


def test_format_and_bad_input():
    assert format_interval([0.7, 0.8, 0.9]) == "0.800 [0.552, 1.048] (n=3)"
    with pytest.raises(ValueError, match="non-empty"):
        t_interval([])
    with pytest.raises(ValueError, match="level"):
        t_interval([1.0, 2.0], level=1.5)
    with pytest.raises(ValueError, match="seeds, points"):
        t_band([1.0, 2.0])


def test_paired_verdict_needs_the_whole_interval_on_one_side():
    half = T975_DF2 * 0.1 / math.sqrt(3)  # three gaps one apart by 0.1: sd 0.1
    assert paired_verdict([0.2, 0.3, 0.4]) == pytest.approx((0.3, 0.3 - half, 0.3 + half, "reproduces"))
    assert paired_verdict([0.1, 0.2, 0.3])[3] == "not resolved"  # low = 0.2 - 0.248 < 0
    assert paired_verdict([-0.4, -0.3, -0.2])[3] == "contradicts"
    assert paired_verdict([0.5]) == (0.5, 0.5, 0.5, "not resolved")  # one seed separates nothing
