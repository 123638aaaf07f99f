"""experiments/figure5_sparse.py: which runs are left, the speed test's step, the claims' verdicts,
the reward models' task, draws and held-out seed."""
import json
import math
import os
import sys
import types

import pytest

from tests.cli.test_evaluate import script

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


def test_reward_model_arm_seed_s_is_scored_by_draw_s_mod_n():
    assert [f5.draw_of_seed(s, 3) for s in range(5)] == [0, 1, 2, 0, 1]
    assert [f5.reward_model_name("orm", f5.draw_of_seed(s, 1), 1) for s in range(3)] == ["orm"] * 3
    assert [f5.reward_model_name("prm", f5.draw_of_seed(s, 2), 2) for s in range(3)] == [
        "prm_draw0", "prm_draw1", "prm_draw0"]


def trained_reward_models(monkeypatch, tmp_path, overrides, draws, rm_loss=None, rm_validation_fraction=0.0,
                          rm_answer_check=False):
    """reward_model() for every kind and draw, experiments/train_reward_model.py replaced by a
    stand-in that records its arguments: {run dir name: argv}."""
    from grpo_jax import config as config_lib

    monkeypatch.setitem(sys.modules, "common", script("common"))  # the script's sibling, not benchmarks'
    calls = {}

    def fake_main(argv):
        run_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("run.run_dir="))
        calls[os.path.basename(run_dir)] = argv
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "metrics.json"), "w") as f:
            json.dump({"held_out_pairwise_accuracy": 0.5}, f)

    monkeypatch.setitem(sys.modules, "train_reward_model", types.SimpleNamespace(main=fake_main))
    cfg = config_lib.apply_overrides(config_lib.get_preset("cpu-tiny"), overrides)
    args = types.SimpleNamespace(rm_draws=draws, rm_trunk_steps=2, rm_steps=3, no_progress=True, rm_loss=rm_loss,
                                 rm_validation_fraction=rm_validation_fraction, rm_answer_check=rm_answer_check)
    for kind in ("outcome", "process"):
        for draw in range(draws):
            path, metrics = f5.reward_model(kind, cfg, str(tmp_path), ("train.jsonl", "held_out.jsonl"), args, draw)
            assert path == os.path.join(str(tmp_path), "reward_models", f5.reward_model_name(
                f5.RM_NAMES[kind], draw, draws), "reward_model")
            assert metrics == {"held_out_pairwise_accuracy": 0.5}
    return calls


def test_reward_model_draws_train_on_the_regimes_task_with_seed_d(monkeypatch, tmp_path):
    modular = ["data.task=modular", "data.modulus=13", "data.num_operands=6", "data.num_subtractions=2"]
    calls = trained_reward_models(monkeypatch, tmp_path, modular, draws=3)
    assert sorted(calls) == ["orm_draw0", "orm_draw1", "orm_draw2", "prm_draw0", "prm_draw1", "prm_draw2"]
    for name, argv in calls.items():
        assert f"run.seed={name[-1]}" in argv
        assert {"data.task=modular", "data.modulus=13", "data.num_operands=6", "data.num_subtractions=2"} <= set(argv)
        assert "--operations" not in argv  # the arithmetic task's knob only
        assert argv[argv.index("--kind") + 1] == ("outcome" if name.startswith("orm") else "process")
        assert "--loss" not in argv  # train_reward_model.py's recipe decides
        # the committed studies' models kept their last step: no validation split unless asked for
        assert argv[argv.index("--validation-fraction") + 1] == "0.0"
        assert "--no-answer-check" in argv  # nor an answer check: the committed studies had none
    # One draw: the arithmetic studies' folders and options, as before draws existed.
    calls = trained_reward_models(monkeypatch, tmp_path / "one", ["data.num_operands=8", "data.min_carries=4"], draws=1)
    assert sorted(calls) == ["orm", "prm"]
    for argv in calls.values():
        assert not any(a.startswith("run.seed=") for a in argv)
        assert argv[argv.index("--operations") + 1] == "+-"
        assert {"data.num_operands=8", "data.min_carries=4"} <= set(argv)


def test_reward_model_arms_only_needs_the_rule_arms_seeds_first(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "common", script("common"))  # the script's sibling, not benchmarks'
    for arm in ("GRPO+OS-rule", "GRPO+PS-rule", "Online RFT", "RFT"):
        (tmp_path / f5.slug(arm)).mkdir(exist_ok=True)
        (tmp_path / f5.slug(arm) / "seed0.json").write_text("{}")
    with pytest.raises(SystemExit):  # seed 1 of every rule arm is missing: stop before any training
        f5.main(["--regime", "modular", "--reward-model-arms-only", "--seeds", "0", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "Online_RFT/seed1.json" in err and "seed0.json" not in err
    with pytest.raises(SystemExit):
        f5.main(["--rule-arms-only", "--reward-model-arms-only", "--out", str(tmp_path)])
    assert "give one" in capsys.readouterr().err


def test_rm_loss_reaches_both_kinds(monkeypatch, tmp_path):
    calls = trained_reward_models(monkeypatch, tmp_path, [], draws=1, rm_loss="pointwise")
    assert {argv[argv.index("--loss") + 1] for argv in calls.values()} == {"pointwise"}
    calls = trained_reward_models(monkeypatch, tmp_path / "v", [], draws=1, rm_validation_fraction=0.1)
    assert {argv[argv.index("--validation-fraction") + 1] for argv in calls.values()} == {"0.1"}
    calls = trained_reward_models(monkeypatch, tmp_path / "c", [], draws=1, rm_answer_check=True)
    assert not any("--no-answer-check" in argv for argv in calls.values())


def test_rm_held_out_seed_draws_and_samples_the_held_out_set(monkeypatch, tmp_path):
    """--rm-held-out-seed reaches the held-out questions' draw and their sampling; --rm-data-only
    stops once the labelled samples are written, before any reward model."""
    from grpo_jax.rl.reward_models import read_samples

    common = script("common")
    monkeypatch.setitem(sys.modules, "common", common)  # the script's sibling, not benchmarks'
    monkeypatch.setattr(common, "tokenizer_for", lambda task, cfg, root, vocab: (None, cfg))
    monkeypatch.setattr(common, "sft_start", lambda *a, **k: (None, None))  # no SFT: the data step alone
    seeds, tasks = [], []

    def sample_groups(cfg, params, task, tok, mesh, examples, group, seed):
        seeds.append(seed)
        tasks.append(task)
        return [[f"#{i}"] * group for i in range(len(examples))]

    monkeypatch.setitem(sys.modules, "figure5_premise", types.SimpleNamespace(sample_groups=sample_groups))
    monkeypatch.setitem(sys.modules, "train_reward_model", None)  # importing it would fail: no training
    for seed, out in ((None, tmp_path / "old"), (1234, tmp_path / "fresh")):
        f5.main(["--regime", "modular", "--rm-data-only", "--rm-questions", "0", "--rm-held-out", "40",
                 "--rm-group", "2", *(["--rm-held-out-seed", str(seed)] if seed else []), "--out", str(out)])
        assert read_samples(str(out / "reward_models" / "train.jsonl")) == []
        assert sorted(os.listdir(out / "reward_models")) == ["held_out.jsonl", "train.jsonl"]  # no model
    assert seeds == [f5.RM_HELD_OUT_SEED, f5.RM_HELD_OUT_SEED + 32, 1234, 1234 + 32]  # 32 questions a call
    for seed, out in ((f5.RM_HELD_OUT_SEED, tmp_path / "old"), (1234, tmp_path / "fresh")):
        rows = read_samples(str(out / "reward_models" / "held_out.jsonl"))
        want = [e.prompt for e in tasks[0].examples("validation", 40, seed) for _ in range(2)]
        assert [r.prompt for r in rows] == want
    old = {r.prompt for r in read_samples(str(tmp_path / "old" / "reward_models" / "held_out.jsonl"))}
    assert old != {r.prompt for r in read_samples(str(tmp_path / "fresh" / "reward_models" / "held_out.jsonl"))}


def _run(arm, seed, finals, steps=(0, 10, 20)):
    return {"arm": arm, "seed": seed, "steps": list(steps), "eval_accuracy": [0.1, 0.2, finals],
            "history": [{"groups_varying_fraction": 0.5}] * 6 + [{"groups_varying_fraction": 1.0}] * 6}


def test_publish_writes_the_curve_without_history(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "common", script("common"))
    f5.publish(str(tmp_path / "new"), _run("GRPO+PS-rule", 7, 0.6))  # the folder is made
    got = json.loads((tmp_path / "new" / "GRPO_PS-rule_seed7.json").read_text())
    assert got == {"arm": "GRPO+PS-rule", "seed": 7, "steps": [0, 10, 20], "eval_accuracy": [0.1, 0.2, 0.6],
                   "groups_varying_first_10_steps": pytest.approx(0.7)}  # 6 x 0.5 and 4 x 1.0


def test_pool_finals_joins_fresh_seeds_and_refuses_overlap_or_other_steps(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "common", script("common"))
    for arm, seed, final in (("Online RFT", 0, 0.5), ("Online RFT", 1, 0.55), ("GRPO+OS-rule", 0, 0.6),
                             ("RFT", 0, 0.3)):  # RFT is not in this study: not pooled
        f5.publish(str(tmp_path), _run(arm, seed, final))
    finals = {"Online RFT": {5: 0.4}, "GRPO+OS-rule": {5: 0.7}}
    pooled = f5.pool_finals(str(tmp_path), finals, [0, 10, 20])
    assert pooled == {"Online RFT": {0: 0.5, 1: 0.55, 5: 0.4}, "GRPO+OS-rule": {0: 0.6, 5: 0.7}}
    assert finals == {"Online RFT": {5: 0.4}, "GRPO+OS-rule": {5: 0.7}}  # not modified
    with pytest.raises(ValueError, match="seed 0 of Online RFT"):
        f5.pool_finals(str(tmp_path), {"Online RFT": {0: 0.4}}, [0, 10, 20])
    with pytest.raises(ValueError, match="evaluated at steps"):
        f5.pool_finals(str(tmp_path), finals, [0, 10, 20, 30])


def test_publish_keeps_a_reward_model_arms_training_series(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "common", script("common"))
    run = _run("GRPO+OS", 5, 0.4)
    run["history"] = [{"reward_mean": 0.1 * i, "accuracy_train": 0.5, "completion_length": 40.0 - i,
                       "groups_varying_fraction": 1.0} for i in range(3)]
    run["history"][1]["eval_reward_model_score"] = 0.7
    f5.publish(str(tmp_path), run)
    got = json.loads((tmp_path / "GRPO_OS_seed5.json").read_text())
    assert got["train_reward_mean"] == pytest.approx([0.0, 0.1, 0.2])
    assert got["train_rule_accuracy"] == [0.5] * 3 and got["train_completion_length"] == [40.0, 39.0, 38.0]
    assert got["eval_reward_model_score"] == [0.7]
    f5.publish(str(tmp_path), _run("Online RFT", 5, 0.4))  # a rule arm: its curve only
    assert "train_reward_mean" not in json.loads((tmp_path / "Online_RFT_seed5.json").read_text())
