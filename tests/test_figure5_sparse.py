"""experiments/figure5_sparse.py: which runs are left, the speed test's step, the claims' verdicts."""
import math

import pytest

from test_evaluate_cli import script

f5 = script("figure5_sparse")
T975_DF2 = 4.302652729911275  # two-sided 95% Student t, 2 degrees of freedom (printed tables)


def test_pending_skips_finished_seed_files(tmp_path):
    (tmp_path / "GRPO_OS").mkdir()
    (tmp_path / "GRPO_OS" / "seed1.json").write_text("{}")
    (tmp_path / "GRPO_OS" / "seed0").mkdir()  # a run dir with checkpoints is not a finished seed
    plan = {"GRPO+OS": [0, 1, 2], "Online RFT": [1]}
    assert f5.pending(str(tmp_path), plan) == [("GRPO+OS", 0), ("Online RFT", 1), ("GRPO+OS", 2)]


def test_steps_to_reach_first_step_at_the_level_else_censored():
    steps, acc = [0, 10, 20, 30], [0.1, 0.49, 0.5, 0.9]
    assert f5.steps_to_reach(steps, acc, 0.5, censor=40) == 20
    assert f5.steps_to_reach(steps, acc, 0.95, censor=40) == 40
    assert f5.steps_to_reach(steps, acc, 0.05, censor=40) == 0


def test_judge_pairs_by_seed_and_signs_speed():
    finals = {"A": {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.9}, "B": {0: 0.3, 1: 0.3, 2: 0.3}}
    got = f5.judge(finals, {"A beats B": ("A", "B"), "A beats C": ("A", "C")})
    assert list(got) == ["A beats B"]  # no seed of C: no verdict
    half = T975_DF2 * 0.1 / math.sqrt(3)
    c = got["A beats B"]
    assert c["seeds"] == [0, 1, 2] and c["gaps"] == pytest.approx([0.2, 0.3, 0.4])
    assert (c["mean"], c["low"], c["high"]) == pytest.approx((0.3, 0.3 - half, 0.3 + half))
    assert c["verdict"] == "reproduces"
    reach = {"A": {0: 10, 1: 20, 2: 30}, "B": {0: 50, 1: 50, 2: 50}}  # A gets there 40, 30, 20 steps sooner
    speed = f5.judge(reach, {"A beats B": ("A", "B")}, sign=-1.0)["A beats B"]
    assert speed["gaps"] == [40, 30, 20] and speed["mean"] == pytest.approx(30.0)
    assert speed["verdict"] == "reproduces"  # 30 ± 4.30·10/√3 = 30 ± 24.8 lies above 0
