"""experiments/maj_pass_at_k.py, --regime modular: chunks combined, finished stages read not
remeasured, the paired differences and their verdicts."""
import json
import math
import sys

import pytest

from tests.cli.test_evaluate import script

f7 = script("maj_pass_at_k")
T975_DF1 = 12.706204736174707  # two-sided 95% Student t, 1 degree of freedom


def test_combine_weights_each_chunk_by_its_questions():
    got = f7.combine([(3, {"pass@1": 1.0, "maj@1": 0.0}), (1, {"pass@1": 0.0, "maj@1": 1.0})])
    assert got == pytest.approx({"pass@1": 0.75, "maj@1": 0.25})


def test_uniform_pass_at_k():
    assert f7.uniform_pass_at_k(1) == pytest.approx(1 / 13)
    assert f7.uniform_pass_at_k(64) == pytest.approx(1 - (12 / 13) ** 64)


def stage(maj, pas):
    ks = [1, 2, 4, 8]
    return {"accuracy": maj, "best_shortcut": 0.1, "step": 1, "wall_s": 0.0, "ks": ks,
            **{f"maj@{k}": maj for k in ks}, **{f"pass@{k}": pas for k in ks}}


def test_finished_stages_are_read_and_paired(tmp_path, monkeypatch):
    results = {(0, "sft"): stage(0.1, 0.5), (0, "grpo"): stage(0.4, 0.6),
               (1, "sft"): stage(0.1, 0.5), (1, "grpo"): stage(0.6, 0.6)}
    for (seed, name), r in results.items():
        (tmp_path / f"seed{seed}_{name}.json").write_text(json.dumps(r))

    def never(*args, **kwargs):
        raise AssertionError("a finished stage was measured again")

    monkeypatch.setattr(f7, "measure_stage", never)
    # The script imports its sibling `common`; another test file in this process may already hold
    # benchmarks/common.py under that name.
    monkeypatch.setitem(sys.modules, "common", script("common"))
    summary = f7.main(["--regime", "modular", "--seeds", "0", "1", "--samples", "8", "--out", str(tmp_path),
                       "--no-progress"])
    assert summary["seeds"] == [0, 1] and summary["ks"] == [1, 2, 4, 8]
    maj = summary["tests"]["maj@8"]
    assert maj["gaps"] == pytest.approx([0.3, 0.5])
    half = T975_DF1 * math.sqrt(0.02) / math.sqrt(2)  # sd of (0.3, 0.5) is sqrt(0.02)
    assert (maj["mean"], maj["low"], maj["high"]) == pytest.approx((0.4, 0.4 - half, 0.4 + half))
    assert maj["interval"] == "includes 0"
    assert summary["tests"]["pass@8"]["gaps"] == pytest.approx([0.1, 0.1])
    assert summary["tests"]["maj@8 - pass@8"]["gaps"] == pytest.approx([0.2, 0.4])
    assert "maj@1 - pass@1" not in summary["tests"]  # the same quantity at K = 1
    assert summary["maj_after_clears_shortcut_every_seed"]  # 0.4 and 0.6 against 0.1 + 0.10
    assert (tmp_path / "summary.json").exists() and (tmp_path / "figure7_testbed.png").exists()


def test_a_seed_missing_a_stage_is_left_out_of_the_pairs():
    summary = f7.summarize({(0, "sft"): stage(0.1, 0.5)}, [0], [1, 2, 4, 8])
    assert summary["seeds"] == [] and summary["tests"] == {}
