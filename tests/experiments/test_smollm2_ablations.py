"""experiments/smollm2_ablations.py: the claims' verdicts from finished seeds, paired by seed."""
import json
import sys

import pytest

from grpo_jax.errors import DataError
from tests.cli.test_evaluate import script


@pytest.fixture(autouse=True)
def siblings(monkeypatch):
    """The script imports figure5_sparse (its claims' judge) as a sibling, as it runs from experiments/."""
    monkeypatch.setitem(sys.modules, "figure5_sparse", script("figure5_sparse"))


def write_seed(root, arm_folder, seed, curve, *, steps=20, shortcut=0.12):
    folder = root / arm_folder / f"seed{seed}" if arm_folder else root / f"seed{seed}"
    folder.mkdir(parents=True)
    last = max(curve)
    (folder / "summary.json").write_text(json.dumps({
        "seed": seed, "steps": steps, "accuracy_before": curve[0], "accuracy_after": curve[last],
        "eval_accuracy_at_step": {str(k): v for k, v in curve.items()}}))
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"step": k, "eval_accuracy": v, "eval_shortcut_best": shortcut}) + "\n"
        for k, v in curve.items() if k))


def test_claims_are_paired_by_seed_on_the_seeds_both_arms_have(tmp_path, monkeypatch):
    ablations = script("smollm2_ablations")
    plotted = []
    monkeypatch.setattr("grpo_jax.eval.plots.plot_runs",
                        lambda curves, steps, path, **kw: plotted.append((curves, kw)) or path)
    grpo = {0: 0.40, 1: 0.30, 2: 0.50}
    online = {0: 0.30, 1: 0.25, 2: 0.35, 3: 0.90}  # seed 3 has no GRPO twin: left out of (c)
    for seed, final in grpo.items():
        write_seed(tmp_path, "", seed, {0: 0.2, 10: 0.25, 20: final})
    for seed, final in online.items():
        write_seed(tmp_path, "online_rft", seed, {0: 0.2, 10: 0.22, 20: final})
    out = ablations.main(["--root", str(tmp_path), "--out", str(tmp_path / "out")])

    claim = out["claims"]["(c) GRPO+OS beats Online RFT"]
    assert claim["seeds"] == [0, 1, 2]
    assert claim["gaps"] == pytest.approx([0.10, 0.05, 0.15])
    # t-interval by hand: mean 0.10, sd 0.05, t(0.975, df=2) = 4.3027
    half = 4.302653 * 0.05 / 3 ** 0.5
    assert (claim["mean"], claim["low"], claim["high"]) == pytest.approx((0.10, 0.10 - half, 0.10 + half), abs=1e-5)
    assert claim["verdict"] == "not resolved"  # the interval [-0.024, 0.224] holds 0
    assert set(out["claims"]) == {"(c) GRPO+OS beats Online RFT"}  # no RFT, no GRPO+PS seeds: no claims on them
    assert out["shortcut_best"] == 0.12
    # The bar (best shortcut + 10 points) is a reference line, not an arm with seeds.
    curves, kw = plotted[0]
    assert set(curves) == {"GRPO+OS", "Online RFT"}
    assert kw["references"] == {"bar: best shortcut + 10 points": pytest.approx(0.22)}
    assert json.loads((tmp_path / "out" / "ablations.json").read_text())["seeds"] == {
        "GRPO+OS": [0, 1, 2], "Online RFT": [0, 1, 2, 3]}


def test_a_gap_whose_interval_lies_above_zero_reproduces(tmp_path, monkeypatch):
    ablations = script("smollm2_ablations")
    monkeypatch.setattr("grpo_jax.eval.plots.plot_runs", lambda curves, steps, path, **kw: path)
    for seed, (online, rft) in enumerate([(0.40, 0.20), (0.42, 0.21), (0.41, 0.20)]):
        write_seed(tmp_path, "online_rft", seed, {0: 0.2, 20: online})
        write_seed(tmp_path, "rft", seed, {0: 0.2, 20: rft})
    out = ablations.main(["--root", str(tmp_path), "--out", str(tmp_path / "out")])
    assert out["claims"]["(a) Online RFT beats RFT"]["verdict"] == "reproduces"


def test_arms_that_ran_other_budgets_or_held_out_sets_are_refused(tmp_path, monkeypatch):
    ablations = script("smollm2_ablations")
    monkeypatch.setattr("grpo_jax.eval.plots.plot_runs", lambda curves, steps, path, **kw: path)
    write_seed(tmp_path, "", 0, {0: 0.2, 10: 0.3, 20: 0.4})
    write_seed(tmp_path, "online_rft", 0, {0: 0.2, 10: 0.3, 20: 0.4}, steps=10)
    with pytest.raises(DataError, match="same budget.*Online RFT seed 0: steps 10"):
        ablations.main(["--root", str(tmp_path), "--out", str(tmp_path / "out")])

    other = tmp_path / "other"
    write_seed(other, "", 0, {0: 0.2, 20: 0.4}, shortcut=0.12)
    write_seed(other, "rft", 0, {0: 0.2, 20: 0.3}, shortcut=0.30)
    with pytest.raises(DataError, match="different best shortcuts"):
        ablations.main(["--root", str(other), "--out", str(tmp_path / "out")])


def test_a_malformed_summary_is_named(tmp_path, monkeypatch):
    ablations = script("smollm2_ablations")
    (tmp_path / "rft" / "seed1").mkdir(parents=True)
    (tmp_path / "rft" / "seed1" / "summary.json").write_text('{"accuracy_after": 0.3}')
    with pytest.raises(DataError, match=r"rft/seed1/summary.json: not a finished seed's summary"):
        ablations.main(["--root", str(tmp_path), "--out", str(tmp_path / "out")])


def test_no_seed_at_all_is_a_usage_error_that_says_where_it_looked(tmp_path, capsys):
    ablations = script("smollm2_ablations")
    with pytest.raises(SystemExit) as exit_:
        ablations.main(["--root", str(tmp_path / "nothing"), "--layout", "runs", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert f"no finished seed under {tmp_path / 'nothing'}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
