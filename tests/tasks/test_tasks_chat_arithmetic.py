"""The chat arithmetic task: answers recomputed from the question text, operand ranges, splits
that never share a question, and the last-number reward."""
from __future__ import annotations

import operator
import re

import pytest

from grpo_jax.tasks import prompts
from grpo_jax.config import Config, apply_overrides
from grpo_jax.tasks import get_task
from grpo_jax.tasks.chat_arithmetic import ChatArithmeticTask

from tests.tasks.test_prompts import PlainTokenizer, chat_tok  # noqa: F401 - fixture

QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def parse(question: str) -> tuple[int, str, int]:
    m = QUESTION.fullmatch(question)
    assert m, question
    return int(m[1]), m[2], int(m[3])


def test_answers_and_ranges_match_the_question_text():
    task = get_task("chat_arithmetic")
    seen_ops = set()
    for ex in task.examples("train", 300, seed=3):
        a, op, b = parse(ex.meta["question"])
        assert ex.answer == ex.meta["final_answer"] == str(OPS[op](a, b))
        assert (a, op, b) == ex.meta["operands"] and ex.meta["kind"] == op
        lo_hi = {"+": ((2, 30), (2, 30)), "-": ((10, 40), (1, 9)), "*": ((2, 9), (2, 12))}[op]
        assert lo_hi[0][0] <= a <= lo_hi[0][1] and lo_hi[1][0] <= b <= lo_hi[1][1]
        assert int(ex.answer) > 0
        seen_ops.add(op)
    assert seen_ops == {"+", "-", "*"}


def test_splits_are_disjoint_and_cover_the_space():
    task = ChatArithmeticTask()
    sizes = {s: len(task.space(s)) for s in ("train", "validation", "test")}
    assert sum(sizes.values()) == 29 * 29 + 31 * 9 + 8 * 11
    test = {ex.meta["question"] for ex in task.examples("test", 100, seed=0)}
    train = {ex.meta["question"] for seed in range(5) for ex in task.examples("train", 200, seed)}
    assert len(test) == 100 and not test & train
    assert test <= set(task.space("test"))


def test_deterministic_per_seed():
    task = ChatArithmeticTask()
    assert task.examples("train", 20, 1) == task.examples("train", 20, 1)
    assert task.examples("train", 20, 1) != task.examples("train", 20, 2)


def test_ops_restrict_the_questions():
    task = get_task("chat_arithmetic", ops="*")
    assert {parse(ex.meta["question"])[1] for ex in task.examples("train", 50, 0)} == {"*"}
    with pytest.raises(ValueError, match="ops must be"):
        ChatArithmeticTask(ops="/")
    with pytest.raises(ValueError, match="could not draw 500 distinct 'test' questions"):
        task.examples("test", 500, 0)


def test_reward_reads_the_last_number():
    task = ChatArithmeticTask()
    ex = next(e for e in task.examples("test", 50, 0) if e.meta["operands"][1] == "-")
    a, _, b = ex.meta["operands"]
    right = str(a - b)
    assert task.reward(f"{a} - {b} = {right}", ex) == 1.0
    assert task.reward(f"The answer is {right}.", ex) == 1.0
    assert task.reward(f"{right} is {a} minus {b}", ex) == 0.0  # the last number is b
    assert task.reward("I cannot say.", ex) == 0.0
    assert task.reward(f"#### {right}\nso {a} and {b}", ex) == 1.0  # "####" wins over the last number
    assert task.is_correct(task.extract_answer(task.sft_text(ex)), ex)


def test_chat_prompt_is_the_bare_question(chat_tok):  # noqa: F811
    ex = ChatArithmeticTask().examples("test", 1, 0)[0]
    text = prompts.build_prompt(ex.meta["question"], chat_tok, task=ChatArithmeticTask.prompt_style)
    user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    assert user == ex.meta["question"]
    assert text.endswith("<|im_start|>assistant\n")
    plain = prompts.build_prompt(ex.meta["question"], PlainTokenizer(), task="arithmetic")
    assert plain == f"Question: {ex.meta['question']}\nAnswer:\n"


def test_config_accepts_the_task():
    cfg = apply_overrides(Config(), ["data.task=chat_arithmetic"]).validate()
    assert cfg.data.task == "chat_arithmetic"
