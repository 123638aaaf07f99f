"""experiments/train_reward_model.py: the task comes from data.task (--operations the arithmetic
task's alone), the arithmetic default as it was; the warnings its metrics call for."""
import json
import math

import numpy as np
import pytest

from tests.cli.test_evaluate import script

from grpo_jax import config as config_lib
from grpo_jax.rl.reward_models import LabelledSample
from grpo_jax.rl.reward_models.answer_check import AnswerCheck, agreement, combine
from grpo_jax.tasks.arithmetic import tokenizer_corpus

trm = script("train_reward_model")
TINY = ["model.embed_dim=16", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.head_dim=8", "model.mlp_dim=32"]


def cfg_of(overrides=()):
    return config_lib.apply_overrides(config_lib.get_preset("cpu-tiny"), trm.DEFAULTS + list(overrides))


def test_arithmetic_default_task_and_tokenizer_text_as_before():
    task = trm.build_task(cfg_of().data)
    assert (task.name, task.operations, task.num_operands, task.max_digits) == ("arithmetic", "+", (3, 3), 1)
    before = tokenizer_corpus(50, seed=0, num_operands=3, max_digits=1, operations="+", min_carries=0)
    assert list(task.text_corpus(50, seed=0)) == list(before)
    assert trm.build_task(cfg_of().data, "+-").operations == "+-"


def test_operations_with_another_task_is_an_error(capsys):
    with pytest.raises(ValueError, match="arithmetic task only"):
        trm.build_task(cfg_of(["data.task=modular"]).data, "+-")
    with pytest.raises(SystemExit):
        trm.main(["--operations", "+-", "data.task=modular", "run.steps=1"])
    assert "--operations applies to the arithmetic task only, not data.task=modular" in capsys.readouterr().err


def test_modular_reward_model_trains_and_is_held_out_on_modular_questions(tmp_path, monkeypatch, capsys):
    held_out = []
    labelled = trm.rm_lib.labelled_samples

    def recorded(task, split, *a, **kw):
        samples = labelled(task, split, *a, **kw)
        if split == "test":
            held_out.extend(samples)
        return samples

    monkeypatch.setattr(trm.rm_lib, "labelled_samples", recorded)
    metrics = trm.main(["--kind", "process", "--trunk-steps", "0", "--train-prompts", "8", "--eval-prompts", "4",
                        "--samples-per-prompt", "2", "--batch-size", "4", "--no-progress",
                        "data.task=modular", "data.modulus=7", "data.num_operands=4", "data.num_subtractions=1",
                        "run.steps=2", f"run.run_dir={tmp_path}", "model.max_seq_len=64", *TINY])
    assert metrics["task"] == {"name": "modular", "num_operands": 4, "modulus": 7, "num_subtractions": 1}
    assert json.loads((tmp_path / "metrics.json").read_text())["task"]["name"] == "modular"
    assert (tmp_path / "reward_model" / "reward_model.json").is_file()
    assert len(held_out) == 8 == metrics["held_out_samples"]
    assert all(s.prompt.startswith("Q: ") and s.prompt.endswith(" mod 7=?\n") and s.prompt.count("-") == 1
               for s in held_out)
    assert 0 <= metrics["held_out_step_accuracy"] <= 1
    lo, hi = metrics["held_out_pairwise_interval"]
    assert (lo <= metrics["held_out_pairwise_accuracy"] <= hi) or math.isnan(lo)  # NaN: no pair
    assert (metrics["validation_samples"], metrics["kept_step"]) == (0, 2)  # by default: all trained on, last step
    # Two steps rank nothing: the run says so in one line, and metrics.json records it.
    ranks = metrics["held_out_pairwise_accuracy"] >= 0.7
    assert metrics["ranks"] is ranks and ("warning: the reward model ranks" in capsys.readouterr().out) is not ranks
    # --evaluate: the saved model on a samples file scores what training measured on the same samples
    trm.rm_lib.write_samples(tmp_path / "held_out.jsonl", held_out)
    again = trm.main(["--evaluate", str(tmp_path / "reward_model"), "--held-out-samples", str(tmp_path / "held_out.jsonl")])
    for key in ("held_out_pairwise_accuracy", "held_out_step_accuracy", "majority_baseline", "held_out_samples",
                "held_out_pairwise_without_answer_check", "trunk_greedy_accuracy", "trunk_greedy_questions",
                "held_out_pairwise_interval"):
        assert again[key] == pytest.approx(metrics[key], rel=0, abs=0, nan_ok=True), key  # NaN: no pair
    # By default the model checks answers, with the modular task's extraction, rebuilt on load.
    saved = trm.rm_lib.RewardModel.load(tmp_path / "reward_model")
    assert saved.answer_check.task == "modular"
    assert saved.answer_check.extract("1+2=3\nA: 3") == "3"
    with pytest.raises(SystemExit):
        trm.main(["--evaluate", str(tmp_path / "reward_model")])
    assert "--evaluate needs --held-out-samples" in capsys.readouterr().err


def test_an_orm_and_a_prm_of_one_seed_share_the_base_model(tmp_path, monkeypatch):
    calls, pretrain = [], trm.rm_lib.pretrain_trunk

    def counted(*a, **kw):
        calls.append(kw["seed"])
        return pretrain(*a, **kw)

    monkeypatch.setattr(trm.rm_lib, "pretrain_trunk", counted)
    monkeypatch.setattr(trm, "_TRUNKS", {})
    common = ["--trunk-steps", "2", "--train-prompts", "8", "--eval-prompts", "4", "--samples-per-prompt", "2",
              "--batch-size", "4", "--no-progress", "run.steps=1", "model.max_seq_len=48", *TINY]
    runs = [("outcome", 0, []), ("process", 0, []), ("outcome", 1, ["--no-answer-check"])]
    metrics = [trm.main(["--kind", kind, *common, *extra, f"run.seed={seed}",
                         f"run.run_dir={tmp_path / f'{kind}{seed}'}"]) for kind, seed, extra in runs]
    assert calls == [0, 1]  # seed 0's trunk once, for both kinds; seed 1's its own
    assert [m["trunk_reused"] for m in metrics] == [False, True, False]
    assert ["held_out_pairwise_without_answer_check" in m for m in metrics] == [True, True, False]
    assert trm.rm_lib.RewardModel.load(tmp_path / "outcome1" / "reward_model").answer_check is None


@pytest.fixture
def seen(monkeypatch):
    """What the script handed train_reward_model: {"train": samples, "validation": samples}."""
    seen, train = {}, trm.rm_lib.train_reward_model

    def recorded(*a, **kw):
        seen["train"], seen["validation"] = a[2], kw["validation"]
        return train(*a, **kw)

    monkeypatch.setattr(trm.rm_lib, "train_reward_model", recorded)
    return seen


def test_validation_questions_are_held_back_from_training_and_pick_the_kept_step(tmp_path, seen):
    metrics = trm.main(["--kind", "outcome", "--trunk-steps", "0", "--train-prompts", "40", "--eval-prompts", "4",
                        "--samples-per-prompt", "4", "--batch-size", "8", "--no-progress", "--eval-every", "2",
                        "--validation-fraction", "0.25", "data.wrong_step_prob=0.5", "run.steps=5",
                        f"run.run_dir={tmp_path}", *TINY])
    train_prompts = {s.prompt for s in seen["train"]}
    validation_prompts = {s.prompt for s in seen["validation"]}
    assert not train_prompts & validation_prompts
    assert len(validation_prompts) == 10 and metrics["validation_samples"] == len(seen["validation"]) == 40
    assert metrics["train_samples"] == len(seen["train"]) == 120
    history = json.loads((tmp_path / "history.json").read_text())
    logged = {h["step"] + 1: h["validation_pairwise"] for h in history if "validation_pairwise" in h}
    assert sorted(logged) == [2, 4, 5]
    assert metrics["kept_step"] == min(step for step, v in logged.items() if v == max(logged.values()))


def test_synthetic_prompts_add_rule_labelled_solutions_to_a_samples_file(tmp_path, seen):
    task = trm.build_task(cfg_of(["data.task=modular"]).data)
    policy = trm.rm_lib.labelled_samples(task, "validation", 12, seed=7, samples_per_prompt=4, wrong_step_prob=0.5)
    held_out = trm.rm_lib.labelled_samples(task, "test", 4, seed=8, samples_per_prompt=4, wrong_step_prob=0.5)
    for name, samples in (("train.jsonl", policy), ("held_out.jsonl", held_out)):
        trm.rm_lib.write_samples(tmp_path / name, samples)
    trm.main(["--kind", "outcome", "--trunk-steps", "0", "--train-samples", str(tmp_path / "train.jsonl"),
              "--held-out-samples", str(tmp_path / "held_out.jsonl"), "--synthetic-prompts", "5",
              "--samples-per-prompt", "2", "--batch-size", "8", "--no-progress", "--validation-fraction", "0.25",
              "data.task=modular", "model.max_seq_len=64", "run.steps=2", f"run.run_dir={tmp_path / 'rm'}", *TINY])
    policy_prompts = {s.prompt for s in policy}
    assert {s.prompt for s in seen["validation"]} <= policy_prompts  # validation: the file's questions only
    synthetic = [s for s in seen["train"] if s.prompt not in policy_prompts]
    assert len(synthetic) == 10 and len({s.prompt for s in synthetic}) == 5
    assert len(seen["train"]) + len(seen["validation"]) == len(policy) + 10


@pytest.mark.parametrize("argv, message", [
    (["--synthetic-prompts", "5"], "--synthetic-prompts adds to --train-samples"),
    (["--validation-fraction", "1"], "--validation-fraction must be in [0, 1)"),
    (["--eval-every", "0"], "--eval-every must be >= 1"),
    (["--train-samples", "x.jsonl"], "--train-samples needs --held-out-samples"),
    (["--lookup-error-prob", "1.5"], "--lookup-error-prob must be in [0, 1]"),
    (["--lookup-error-prob", "0.1", "--train-samples", "x.jsonl", "--held-out-samples", "y.jsonl"],
     "--lookup-error-prob shapes synthetic solutions"),
    (["--lookup-error-prob", "0.1", "--trunk-steps", "0"], "--lookup-error-prob needs data.task=modular, got arithmetic"),
])
def test_bad_validation_and_data_options_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        trm.main([*argv, "run.steps=1"])
    assert message in capsys.readouterr().err


def test_validation_without_a_right_and_wrong_pair_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        trm.main(["--trunk-steps", "0", "--train-prompts", "8", "--samples-per-prompt", "1", "--no-progress",
                  "--validation-fraction", "0.25", "data.wrong_step_prob=0.5", "run.steps=1", f"run.run_dir={tmp_path}", *TINY])
    assert "have no question with both a right and a wrong sample" in capsys.readouterr().err


def test_lookup_errors_reach_every_synthetic_draw_and_only_when_asked(tmp_path, monkeypatch):
    calls = []
    labelled = trm.rm_lib.labelled_samples

    def recorded(task, split, *a, **kw):
        calls.append((split, kw.get("lookup_error_prob")))
        return labelled(task, split, *a, **kw)

    monkeypatch.setattr(trm.rm_lib, "labelled_samples", recorded)
    argv = ["--kind", "process", "--trunk-steps", "0", "--train-prompts", "8", "--eval-prompts", "4",
            "--samples-per-prompt", "2", "--batch-size", "4", "--no-progress", "data.task=modular",
            "data.wrong_step_prob=0.0", "model.max_seq_len=64", "run.steps=1", *TINY]
    trm.main([*argv, "--lookup-error-prob", "0.5", f"run.run_dir={tmp_path / 'a'}"])
    assert calls == [("train", 0.5), ("test", 0.5)]
    calls.clear()
    trm.main([*argv, f"run.run_dir={tmp_path / 'b'}"])
    assert calls == [("train", None), ("test", None)]


def test_the_script_warns_of_a_check_that_ranks_worse_and_of_a_model_near_chance():
    base = {"held_out_pairwise_accuracy": 0.65, "held_out_pairwise_without_answer_check": 0.9,
            "trunk_greedy_accuracy": 0.2}
    lines = trm.warnings(base)
    assert len(lines) == 2 and "ranks a right answer above a wrong one on 0.650" in lines[0]
    assert "lowers held-out pairwise accuracy from 0.900 to 0.650" in lines[1]
    assert trm.warnings(dict(base, held_out_pairwise_accuracy=0.95)) == []
    assert trm.warnings({"held_out_pairwise_accuracy": 0.95}) == []  # --no-answer-check: nothing to compare


class _ChanceHeadPerfectTrunk:
    """An ORM whose own score ranks every question's pairs at exactly chance (right and wrong
    samples both scored 1 and 0) and whose trunk answers every question right, scored as
    `RewardModel.score` does (`answer_check.combine` of the own score and the agreement)."""

    kind, transform = "outcome", "identity"

    def __init__(self, answers, check=True):
        self.answers = answers
        self.answer_check = AnswerCheck(extract=lambda c: c.split()[-1], task="fake", margin=2.0,
                                        max_new_tokens=4) if check else None

    def greedy_answers(self, prompts):
        return [self.answers[p] for p in prompts]

    def score(self, prompts, completions, *, check=True):
        own = np.asarray([float(c.startswith("first")) for c in completions], np.float32)
        if self.answer_check is None or not check:
            return own
        return combine(own, agreement(self.greedy_answers(prompts), completions, self.answer_check.extract),
                       self.transform, self.answer_check.margin)


def test_a_chance_level_own_score_warns_behind_a_perfect_trunk_and_without_a_check():
    answers = {f"q{i}": str(i % 13) for i in range(40)}
    held_out = [LabelledSample(q, f"{order} ... = {a if right else (int(a) + 1) % 13}", right)
                for q, a in answers.items() for right in (True, False) for order in ("first", "second")]
    metrics = trm.held_out_metrics(_ChanceHeadPerfectTrunk(answers), held_out)
    assert metrics["held_out_pairwise_accuracy"] == 1.0  # agreement alone decides every pair
    assert metrics["held_out_pairwise_without_answer_check"] == 0.5
    assert metrics["trunk_greedy_accuracy"] == 1.0 and metrics["trunk_greedy_questions"] == 40
    lines = trm.warnings(metrics)
    assert len(lines) == 1 and "own score (without the answer check" in lines[0]
    assert "on 0.500 of held-out pairs" in lines[0] and "answer check's 1.000 is its trunk's answers" in lines[0]

    unchecked = trm.held_out_metrics(_ChanceHeadPerfectTrunk(answers, check=False), held_out)
    assert unchecked["held_out_pairwise_accuracy"] == 0.5 and "held_out_pairwise_without_answer_check" not in unchecked
    lines = trm.warnings(unchecked)
    assert len(lines) == 1 and "ranks a right answer above a wrong one on 0.500" in lines[0]
