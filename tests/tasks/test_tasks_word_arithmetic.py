"""The word arithmetic task (issue #84): answers recomputed from the question's words, held-out
sets balanced by kind and never trained on, exact rewards and step rewards, answer extraction
on hostile text, and the shortcut audit's scores recomputed here without the task's rules."""
from __future__ import annotations

import collections
import re

import pytest

from grpo_jax.config import Config, apply_overrides
from grpo_jax.tasks import get_task, prompts, split_of
from grpo_jax.tasks.shortcuts import fit_examples, shortcut_baselines
from grpo_jax.tasks.word_arithmetic import KINDS, WordArithmeticTask

QUESTION = re.compile(r"Start with (\d+) and (add|subtract|multiply by) (\d+)\. "
                      r"Then (add|subtract|multiply the result by) (\d+)(?: to the result| from the result)?\. "
                      r"What do you get\?")
WORD_OP = {"add": "+", "subtract": "-", "multiply by": "*", "multiply the result by": "*"}
ALL_KINDS = ("+*", "-*", "*+", "*-")


def parse(question: str):
    m = QUESTION.fullmatch(question)
    assert m, question
    return int(m[1]), WORD_OP[m[2]], int(m[3]), WORD_OP[m[4]], int(m[5])


def value(x: int, op: str, y: int) -> int:
    return {"+": x + y, "-": x - y, "*": x * y}[op]


def test_answers_and_ranges_match_the_question_words():
    task = get_task("word_arithmetic", kinds=ALL_KINDS)
    for ex in task.examples("train", 400, seed=3):
        a, op1, b, op2, c = parse(ex.meta["question"])
        first = value(a, op1, b)
        assert ex.answer == ex.meta["final_answer"] == str(value(first, op2, c))
        assert ex.meta["operands"] == (a, b, c) and ex.meta["ops"] == (op1, op2) and ex.meta["kind"] == op1 + op2
        assert ex.meta["kind"] in ALL_KINDS and int(ex.answer) >= 2 and first >= 2
        if op1 == "*":
            assert 2 <= a <= 9 and 2 <= b <= 9 and 2 <= c <= 19
        elif op1 == "+":
            assert 2 <= a <= 19 and 2 <= b <= 19 and 2 <= c <= 9
        else:  # the difference, not a, lies in [2, 19]
            assert 2 <= b <= 19 and 2 <= c <= 9 and 2 <= first <= 19
        assert ex.prompt == f"Question: {ex.meta['question']}\nAnswer:"


def test_held_out_set_is_balanced_by_kind_distinct_and_never_trained_on():
    task = WordArithmeticTask()
    assert task.kinds == KINDS == ("+*", "*+")
    held_out = task.examples("test", 192, seed=0)
    assert collections.Counter(ex.meta["kind"] for ex in held_out) == {"+*": 96, "*+": 96}
    assert [ex.meta["kind"] for ex in held_out[:4]] == ["+*", "*+", "+*", "*+"]  # interleaved
    assert len({ex.meta["question"] for ex in held_out}) == 192
    assert all(split_of(ex.meta["question"]) == "test" for ex in held_out)
    train = {ex.meta["question"] for seed in range(5) for ex in task.examples("train", 400, seed)}
    assert not train & {ex.meta["question"] for ex in held_out}
    # 4 does not divide 10: the first kinds get one more.
    assert collections.Counter(ex.meta["kind"] for ex in WordArithmeticTask(kinds=ALL_KINDS).examples("test", 10, 0)) == {
        "+*": 3, "-*": 3, "*+": 2, "*-": 2}
    four = WordArithmeticTask(kinds=ALL_KINDS).examples("test", 192, 0)
    assert collections.Counter(ex.meta["kind"] for ex in four) == {k: 48 for k in ALL_KINDS}
    assert task.examples("test", 192, 0) == held_out and task.examples("test", 192, 1) != held_out


def test_space_counts_every_valid_question_once():
    task = WordArithmeticTask(kinds=ALL_KINDS)
    total = {k: sum(len(task.space(s, k)) for s in ("train", "validation", "test")) for k in ALL_KINDS}
    # (a + b) * c: 18 * 18 * 8; (a - b) * c: b and a - b in [2, 19], 18 * 18 * 8;
    # a * b + c: 8 * 8 * 18; a * b - c >= 2: counted by hand below.
    minus = sum(1 for a in range(2, 10) for b in range(2, 10) for c in range(2, 20) if a * b - c >= 2)
    assert total == {"+*": 2592, "-*": 2592, "*+": 1152, "*-": minus}
    assert minus == 954
    assert {k: len(task.space("test", k)) for k in ALL_KINDS} == {"+*": 219, "-*": 252, "*+": 129, "*-": 101}


def test_reward_is_exact_on_the_last_number():
    task = WordArithmeticTask()
    ex = task.make_example(8, "+*", 8, 2)
    assert ex.answer == "32" and ex.meta["question"] == (
        "Start with 8 and add 8. Then multiply the result by 2. What do you get?")
    assert WordArithmeticTask(phrasing="then").make_example(8, "+*", 8, 2).meta["question"] == (
        "Start with 8, add 8, then multiply by 2. What do you get?")
    assert task.make_example(9, "*-", 5, 7).meta["question"] == (
        "Start with 9 and multiply by 5. Then subtract 7 from the result. What do you get?")
    right = "1. Add 8: 8 + 8 = 16\n2. Multiply by 2: 16 * 2 = 32\n\nSo, the answer is 32."
    assert task.reward(right, ex) == 1.0
    assert task.reward("8 + 8 = 16\n16 * 2 = 32\nSo the answer is 32, not 30.", ex) == 0.0
    assert task.reward("#### 32\nor maybe 31", ex) == 1.0
    assert task.reward("32.00", ex) == 1.0
    assert task.reward("", ex) == 0.0
    assert task.reward("thirty-two", ex) == 0.0


@pytest.mark.parametrize("text, answer", [
    ("", None), ("\n\n", None), ("no number here", None), ("thirty-two", None),
    ("So, the answer is 32.", "32"), ("$1,032.", "1032"), ("#### 7\nthen 9", "7"),
    ("The answer is 20 or 21", "21"), ("3.50", "3.5"), ("-5", "-5"), ("20/1", "1"),
    ("1e5", "5"), ("２０", None), ("x" * 200_000, None),
    ("1. Add 8: 8 + 8 = 10\n2. Multiply by 2: 10 * 2 = 20\n\nSo, the answer is 20.", "20"),
])
def test_extract_answer_on_hostile_text(text, answer):
    assert WordArithmeticTask().extract_answer(text) == answer


def test_step_rewards_score_each_line_then_the_outcome():
    task = WordArithmeticTask()
    ex = task.make_example(14, "-*", 6, 3)  # 14 - 6 = 8, 8 * 3 = 24
    text = "1. Subtract 6: 14 - 6 = 8\n2. Multiply by 3: 8 × 3 = 24\n\nSo, the answer is 24."
    assert task.step_rewards(text, ex) == [(26, 1.0), (55, 1.0), (77, 0.0), (77, 1.0)]
    # a wrong first value: the second line copies it, so neither is the chain's step
    wrong = "14 - 6 = 9\n9 x 3 = 27\nThe answer is 27."
    assert task.step_rewards(wrong, ex) == [(11, 0.0), (22, 0.0), (39, 0.0), (39, 0.0)]
    # steps out of order are not the chain's next step, and the last number is 8
    swapped = "8 * 3 = 24\n14 - 6 = 8\n"
    assert task.step_rewards(swapped, ex) == [(11, 0.0), (22, 0.0), (22, 0.0)]
    assert task.step_rewards("", ex) == [(0, 0.0)]
    many = "1 + 1 = 2\n" * 40
    steps = task.step_rewards(many, ex)
    assert len(steps) == 18 and steps[-2] == (len(many.rstrip()), 0.0) and steps[-1] == (len(many), 0.0)


def test_shortcut_rules_give_the_wrong_readings():
    task = WordArithmeticTask()
    rules = task.shortcuts(task.examples("train", 200, 0))
    ex = task.make_example(14, "-*", 6, 3)
    expect = {"every operation read as +": "23", "every operation read as -": "5", "every operation read as *": "252",
              "first operation only (c dropped)": "8", "second operation only (a dropped)": "18", "b dropped": "42",
              "operations swapped": "81", "last operation first": "-4", "+ and - swapped": "60",
              "echo a": "14", "echo b": "6", "echo c": "3"}
    assert {name: rules[name](ex) for name in expect} == expect


def test_the_audit_scores_recomputed_without_the_rules():
    task = WordArithmeticTask()
    held_out = task.examples("test", 192, seed=0)
    b = shortcut_baselines(task, held_out)
    train = fit_examples(task)
    # 4,000 balanced questions would need 2,000 distinct a * b + c training questions of a
    # kind whose training split holds fewer: fit_examples falls back to 1,000 (500 a kind).
    assert len(train) == b.fit_questions == 1000
    # units digit right, the digits above it the commonest in training for the question's kind
    rest = {k: collections.Counter(int(ex.answer) // 10 for ex in train if ex.meta["kind"] == k).most_common(1)[0][0]
            for k in KINDS}
    units = sum(int(ex.answer) // 10 == rest[ex.meta["kind"]] for ex in held_out)
    assert b.scores["units digit + commonest rest by prompt shape"] == units / 192 == 22 / 192
    overall = collections.Counter(int(ex.answer) // 10 for ex in train).most_common(1)[0][0]
    assert b.scores["units digit + commonest rest overall"] == sum(
        int(ex.answer) // 10 == overall for ex in held_out) / 192 == 23 / 192
    constant = collections.Counter(ex.answer for ex in train).most_common(1)[0][0]
    assert b.scores["constant"] == sum(ex.answer == constant for ex in held_out) / 192 == 2 / 192
    plus = sum(str((a + b_) + c) == ex.answer for ex in held_out for a, b_, c in [ex.meta["operands"]])
    assert b.scores["every operation read as +"] == plus / 192 == 2 / 192
    assert b.best == ("units digit + commonest rest overall", 23 / 192) and b.best[1] <= 0.15


def test_registered_configurable_and_asked_one_operation_a_line():
    cfg = apply_overrides(Config(), ["data.task=word_arithmetic"]).validate()
    assert cfg.data.task == "word_arithmetic"
    assert isinstance(get_task("word_arithmetic"), WordArithmeticTask)
    assert WordArithmeticTask.prompt_style == "word_arithmetic"
    assert prompts.get_style("word_arithmetic").instruction == "Work it out one operation per line, then give the answer."
    with pytest.raises(ValueError, match="kinds must be"):
        WordArithmeticTask(kinds=("+",))
    with pytest.raises(ValueError, match="kinds must be"):
        WordArithmeticTask(kinds=("++",))
    assert WordArithmeticTask(kinds="*+,*-").kinds == ("*+", "*-")
    ex = WordArithmeticTask().make_example(9, "*-", 5, 7)
    assert WordArithmeticTask().sft_text(ex) == "9 * 5 = 45\n45 - 7 = 38\nThe answer is 38.\n"


def test_smollm2_grpo_task_flag_picks_the_word_task_defaults(monkeypatch, capsys):
    import json

    from tests.scripts import REPO, import_script

    smollm2_grpo = import_script(monkeypatch, REPO / "experiments", "smollm2_grpo")
    assert smollm2_grpo.main(["--task", "word_arithmetic", "--print-config", "run.steps=3"]) == {}
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["data"]["task"], cfg["data"]["eval_size"], cfg["rl"]["max_new_tokens"], cfg["run"]["run_dir"],
            cfg["run"]["steps"], cfg["rl"]["group_size"], cfg["model"]["lora_rank"], cfg["optimizer"]["peak_lr"]) == (
        "word_arithmetic", 192, 64, "runs/smollm2_words", 3, 8, 8, 1e-4)
    assert smollm2_grpo.main(["--print-config"]) == {}
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["data"]["task"], cfg["data"]["eval_size"], cfg["rl"]["max_new_tokens"]) == ("chat_arithmetic", 100, 32)
    with pytest.raises(SystemExit):
        smollm2_grpo.main(["--task", "word_arithmetic", "data.data_dir=/nowhere"])
    assert "data.data_dir is not read by data.task=word_arithmetic" in capsys.readouterr().err
