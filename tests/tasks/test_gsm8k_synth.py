"""The GSM8K-format generator: deterministic, arithmetically right, GSM8K-readable, split-disjoint."""
from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction

import pytest

from grpo_jax.tasks import rewards
from grpo_jax.tasks import get_task, register_task
from grpo_jax.tasks.gsm8k_synth import TEMPLATES, Gsm8kSynthTask, generate_record

# Each template's answer, written again from its drawn values (independently of the generator).
EXPECTED = {
    "shopping": lambda v: v["n1"] * v["p1"] + v["n2"] * v["p2"],
    "change": lambda v: v["m"] - v["n"] * v["p"],
    "ages": lambda v: v["k"] * v["b"] + v["y"],
    "age_sum": lambda v: 2 * v["b"] + v["d"],
    "trip": lambda v: v["s1"] * v["h1"] + v["s2"] * v["h2"],
    "reading": lambda v: v["total"] - v["p"] * v["d"],
    "sharing": lambda v: Fraction(v["n"] - v["e"], v["k"]),
    "wages": lambda v: v["w"] * v["h"] * v["d"],
    "discount": lambda v: v["n"] * v["p"] * Fraction(100 - v["pct"], 100),
    "boxes": lambda v: v["b"] * v["a"] - v["r"],
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]+)>>")


def _arith(expr: str) -> Fraction:
    """Exact value of an integer + - * / expression (the test's own evaluator)."""
    def walk(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        raise ValueError(f"unexpected syntax in {expr!r}")
    return walk(ast.parse(expr, mode="eval").body)


def _final(solution: str) -> Fraction:
    last = solution.strip().split("\n")[-1]
    m = re.fullmatch(r"#### (-?\d+)", last)
    assert m, f"last line is not '#### N': {last!r}"
    return Fraction(int(m.group(1)))


def test_expected_covers_every_template():
    assert set(EXPECTED) == set(TEMPLATES)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_answer_is_the_templates_arithmetic(name):
    rng = random.Random(f"test/{name}")
    for _ in range(300):
        rec = generate_record(rng, name)
        v, solution = rec["values"], rec["answer"]
        expected = EXPECTED[name](v)
        assert Fraction(expected).denominator == 1
        assert _final(solution) == expected, (rec["question"], solution)
        # every calculator annotation is right, and the last one is the final answer
        notes = _ANNOTATION.findall(solution)
        assert 2 <= len(notes) <= 3
        for expr, shown in notes:
            assert _arith(expr) == Fraction(int(shown)), (expr, shown)
            assert int(shown) > 0
        assert Fraction(int(notes[-1][1])) == expected
        # the drawn numbers are the ones the question states
        for key, value in v.items():
            if isinstance(value, int):
                assert re.search(rf"(?<![\d.]){value}(?!\d)", rec["question"]), (key, value, rec["question"])


def test_reference_solution_gets_full_reward():
    task = Gsm8kSynthTask()
    for ex in task.examples("train", 200, seed=3) + task.examples("test", 50, seed=3):
        assert rewards.gsm8k_reward(ex.answer, ex.answer) == 1.0
        assert task.reward(ex.answer, ex) == 1.0
        assert task.is_correct(task.extract_answer(ex.answer), ex)
        assert task.reward(ex.answer.rsplit("####", 1)[0] + "#### 100000", ex) == 0.0
        assert ex.meta["question"] in ex.prompt
        assert "<<" not in task.sft_text(ex)


def test_deterministic_per_seed():
    a = Gsm8kSynthTask().examples("train", 40, seed=7)
    b = Gsm8kSynthTask().examples("train", 40, seed=7)
    c = Gsm8kSynthTask().examples("train", 40, seed=8)
    assert [(e.prompt, e.answer) for e in a] == [(e.prompt, e.answer) for e in b]
    assert [e.prompt for e in a] != [e.prompt for e in c]
    assert len({e.prompt for e in a}) == 40  # distinct within a call


def test_train_test_disjoint():
    task = Gsm8kSynthTask()
    train = {e.meta["question"] for s in range(3) for e in task.examples("train", 400, seed=s)}
    test = {e.meta["question"] for s in range(3) for e in task.examples("test", 100, seed=s)}
    val = {e.meta["question"] for e in task.examples("validation", 100, seed=0)}
    assert train and test and val
    assert not train & test and not train & val and not test & val
    with pytest.raises(ValueError):
        task.examples("dev", 1, 0)


def test_every_template_appears_and_registry():
    task = Gsm8kSynthTask()
    seen = {e.meta["template"] for e in task.examples("train", 300, seed=0)}
    assert seen == set(TEMPLATES)
    only = Gsm8kSynthTask(templates=("ages",))
    assert {e.meta["template"] for e in only.examples("test", 10, 0)} == {"ages"}
    with pytest.raises(ValueError):
        Gsm8kSynthTask(templates=("nope",))
    register_task("gsm8k_synth", "grpo_jax.tasks.gsm8k_synth:Gsm8kSynthTask")
    assert isinstance(get_task("gsm8k_synth"), Gsm8kSynthTask)
