"""The GSM8K and MATH tasks on the hand-written fixtures."""
import json
import os

import pytest

from grpo_jax.tasks import Example, get_task
from grpo_jax.tasks.gsm8k import Gsm8kTask
from grpo_jax.tasks.math_task import MathTask

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory):
    return get_task("gsm8k", data_dir=str(tmp_path_factory.mktemp("tfds")), manual_dir=os.path.join(FIXTURES, "gsm8k"))


@pytest.fixture(scope="module")
def math_task(tmp_path_factory):
    return get_task("math", data_dir=str(tmp_path_factory.mktemp("tfds")), manual_dir=os.path.join(FIXTURES, "math"))


def test_gsm8k_examples(gsm8k):
    with open(os.path.join(FIXTURES, "gsm8k", "train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    examples = gsm8k.examples("train", 3, seed=0)
    assert len(examples) == 3 and examples == gsm8k.examples("train", 3, seed=0)
    assert len(gsm8k.examples("train", 100, seed=0)) == len(rows)  # capped at the split
    by_question = {r["question"]: r for r in rows}
    for ex in examples:
        question = ex.prompt.split("Question: ")[1].split("\nAnswer:")[0]
        assert by_question[question]["answer"] == ex.answer
        assert ex.prompt.endswith("Answer:\n")
        assert ex.meta["final_answer"] == ex.answer.rsplit("#### ", 1)[1].strip()


def test_gsm8k_scoring(gsm8k):
    for ex in gsm8k.examples("test", -1, seed=0):
        text = gsm8k.sft_text(ex)
        assert "<<" not in text and text.rstrip().endswith("#### " + ex.meta["final_answer"])
        assert gsm8k.reward(text, ex) == 1.0
        assert gsm8k.is_correct(gsm8k.extract_answer(text), ex)
        assert gsm8k.reward(text.replace("#### ", "#### 1"), ex) == 0.0
    ex = Example(prompt="", answer="#### 2.5", meta={"final_answer": "2.5"})
    assert gsm8k.extract_answer("so 2.50 km") == "2.5"
    assert gsm8k.is_correct(gsm8k.extract_answer("#### 2.50"), ex)
    with pytest.raises(ValueError):
        gsm8k.sft_text(ex, wrong_step_prob=0.5)


def test_gsm8k_loader_yields_examples(gsm8k):
    loader = gsm8k.loader("train", batch_size=2, seed=0, num_epochs=1, shard_index=0, shard_count=1)
    batches = list(loader)
    assert all(isinstance(e, Example) for b in batches for e in b)
    assert {e.answer for b in batches for e in b} <= {e.answer for e in gsm8k.examples("train", -1, 0)}


def test_math_examples_and_scoring(math_task):
    examples = math_task.examples("test", -1, seed=1)
    assert len(examples) == 2
    by_id = {ex.meta["id"]: ex for ex in examples}
    frac = by_id["algebra/8"]
    assert frac.meta["level"] == "Level 2" and frac.meta["type"] == "Algebra"
    assert frac.prompt.startswith("Problem: If $\\frac{x}{4}") and frac.prompt.endswith("Solution:\n")
    assert math_task.reward("so $x = \\boxed{1.5}$", frac) == 1.0
    assert math_task.reward("so $x = \\boxed{\\dfrac{3}{2}}$", frac) == 1.0
    assert math_task.reward("so $x = \\boxed{2}$", frac) == 0.0
    assert math_task.extract_answer("\\boxed{1.5}") == math_task.extract_answer("\\boxed{\\frac32}")
    assert math_task.is_correct(math_task.extract_answer("\\boxed{6/4}"), frac)
    radical = by_id["prealgebra/14"]
    assert math_task.reward("\\boxed{\\sqrt{50}}", radical) == 1.0
    assert math_task.reward("\\boxed{7.07}", radical) == 0.0
    for ex in math_task.examples("train", -1, seed=0):
        assert math_task.reward(math_task.sft_text(ex), ex) == 1.0


def test_splits_are_checked(math_task):
    with pytest.raises(ValueError):
        math_task.examples("validation", 1, 0)


def test_construction_touches_no_data():
    # Scoring-only use (e.g. in the trainer's reward step) must not need the dataset.
    assert Gsm8kTask(data_dir="/nonexistent").reward("#### 3", Example("", "#### 3")) == 1.0
    assert MathTask(data_dir="/nonexistent").reward("\\boxed{3}", Example("", "\\boxed{3}")) == 1.0
