"""The synthetic arithmetic task: generation, format, rewards, step offsets, SFT text."""
import ast
import operator
import random
import re
from fractions import Fraction

import pytest

from grpo_jax.tasks import available_tasks, get_task
from grpo_jax.tasks.arithmetic import ArithmeticTask, carry_slip, carrying_steps, expression_text, solution_steps, tokenizer_corpus


def test_registry():
    assert {"arithmetic", "countdown", "gsm8k", "math"} <= set(available_tasks())
    task = get_task("arithmetic", num_operands=4, max_digits=1)
    assert isinstance(task, ArithmeticTask) and task.num_operands == (4, 4)
    with pytest.raises(KeyError):
        get_task("no-such-task")


def test_examples_deterministic_and_disjoint_splits():
    task = ArithmeticTask(num_operands=(2, 4), operations="+-*/")
    a = task.examples("train", 50, seed=3)
    assert a == task.examples("train", 50, seed=3)
    assert a != task.examples("train", 50, seed=4)
    test = task.examples("test", 50, seed=3)
    assert not {e.prompt for e in a} & {e.prompt for e in test}
    with pytest.raises(ValueError):
        task.examples("dev", 1, 0)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def python_value(expression: str) -> Fraction:
    def walk(node):
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise AssertionError(ast.dump(node))

    return walk(ast.parse(expression, mode="eval").body)


@pytest.mark.parametrize("operations", ["+-", "*", "+-*/", "/"])
def test_examples_are_correct_and_well_formed(operations):
    task = ArithmeticTask(num_operands=(2, 4), max_digits=2, operations=operations)
    for ex in task.examples("train", 40, seed=0):
        m = re.fullmatch(r"Q: ([-+*/()0-9]+)=\?\n", ex.prompt)
        assert m, ex.prompt
        # The question means what ordinary precedence says: an independent check
        # with Python's grammar (ast) and exact rationals.
        assert Fraction(int(ex.answer)) == python_value(m.group(1))
        assert 2 <= len(ex.meta["operands"]) <= 4
        assert all(0 <= x < 100 for x in ex.meta["operands"])
        assert set(ex.meta["ops"]) <= set(operations)
        if "-" in operations:  # negative intermediates are off by default
            assert all(not line.split("=")[1].startswith("-") for line in task.sft_text(ex).splitlines()[:-1])


def test_expression_parentheses():
    assert expression_text([23, 45, 12], ["+", "-"]) == "23+45-12"
    assert expression_text([7, 5, 3], ["+", "*"]) == "(7+5)*3"
    assert expression_text([7, 5, 3], ["*", "+"]) == "7*5+3"
    assert expression_text([8, 2, 3, 4], ["-", "/", "*"]) == "(8-2)/3*4"


EX = ArithmeticTask().make_example([23, 45, 12], ["+", "-"])


def test_prompt_and_solution_format():
    assert EX.prompt == "Q: 23+45-12=?\n"
    assert EX.answer == "56"
    assert ArithmeticTask().sft_text(EX) == "23+45=68\n68-12=56\nA: 56\n"


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("23+45=68\n68-12=56\nA: 56\n", 1.0),
        ("23+45=68\n68-12=56\nA: 56", 1.0),  # final newline optional
        ("23+45=68\n68-12=56\nA: 56\n\n  ", 1.0),  # trailing whitespace ignored
        ("23+45=68\n68-12=55\nA: 55\n", 0.1),  # well-formed, wrong
        ("23+45=99\n99-12=87\nA: 56\n", 1.0),  # outcome only looks at the answer
        ("A: 56\n", 0.0),  # no steps
        ("23+45=68\n68-12=56\n", 0.0),  # no answer line
        ("23 + 45 = 68\n68-12=56\nA: 56\n", 0.0),  # spaces are not the format
        ("23+45=68\n\n68-12=56\nA: 56\n", 0.0),  # blank line inside
        ("23+45=68\n68-12=56\nA: 56\nQ: 1+1=?\n", 0.0),  # text after the answer
        ("23+45=68\n68-12=56\nA:56\n", 0.0),
        ("", 0.0),
    ],
)
def test_outcome_reward(completion, reward):
    assert ArithmeticTask().reward(completion, EX) == reward


@pytest.mark.parametrize(
    "completion, expected",
    [
        # Hand-counted: "23+45=68\n" is 9 characters, "68-12=56\n" 9, "A: 56\n" 6.
        ("23+45=68\n68-12=56\nA: 56\n", [(9, 1.0), (18, 1.0), (24, 1.0)]),
        # A slip in step 1; step 2 carries the wrong value on, locally right but off the
        # true chain, so it cannot lead to the right answer: 0.
        ("23+45=67\n67-12=55\nA: 55\n", [(9, 0.0), (18, 0.0), (24, 0.0)]),
        # A compensating slip: step 2 is locally wrong but writes the true value again.
        ("23+45=67\n67-12=56\nA: 56\n", [(9, 0.0), (18, 1.0), (24, 1.0)]),
        # Step 2 does not chain from step 1's written result.
        ("23+45=68\n69-12=57\nA: 56\n", [(9, 1.0), (18, 0.0), (24, 1.0)]),
        # Wrong operand / operator for the step.
        ("23+44=67\n67+12=79\nA: 79", [(9, 0.0), (18, 0.0), (23, 0.0)]),
        # No answer line: one more step, the missing answer, scoring 0 where the lines end.
        ("23+45=68\n68-12=56", [(9, 1.0), (17, 1.0), (17, 0.0)]),
        # Blank lines are not steps; other lines score 0 without shifting the step
        # count; steps beyond the question's score 0.
        ("\n23+45=68\n\nhmm\n68-12=56\n56-0=56\n", [(10, 1.0), (15, 0.0), (24, 1.0), (32, 0.0), (32, 0.0)]),
        ("", [(0, 0.0)]),
        ("   \n", [(4, 0.0)]),
    ],
)
def test_step_rewards_and_offsets(completion, expected):
    steps = ArithmeticTask().step_rewards(completion, EX)
    assert steps == expected
    # Each step's text is completion[previous_end:end], ending with its newline if any.
    previous = 0
    for end, _ in steps:
        piece = completion[previous:end]
        assert end == len(completion) or piece.endswith("\n")
        previous = end


def test_step_rewards_cap_long_completions():
    completion = "1+1=2\n" * 100
    steps = ArithmeticTask().step_rewards(completion, EX)
    assert len(steps) == 65  # MAX_STEPS lines + one merged remainder
    assert steps[-1] == (len(completion.rstrip()), 0.0)


def test_extract_answer():
    task = ArithmeticTask()
    assert task.extract_answer("23+45=68\nA: 0056\n") == "56"
    assert task.extract_answer("A: -3") == "-3"
    assert task.extract_answer("x\nA: 5\nA: 7\n") == "7"
    assert task.extract_answer("no answer") is None
    assert task.extract_answer("xA: 5") is None
    assert task.is_correct("56", EX) and not task.is_correct("57", EX) and not task.is_correct(None, EX)


def test_sft_wrong_step_fraction():
    """Random slips leave the true chain at a step with probability p: among steps whose
    prefix is still on it (label 1 before them), the fraction labelled 0 is about p."""
    task = ArithmeticTask(num_operands=4)
    examples = task.examples("train", 300, seed=1)
    rng = random.Random(0)
    for p, low, high in [(0.0, 0.0, 0.0), (0.3, 0.2, 0.4), (1.0, 1.0, 1.0)]:
        left = on_chain = 0
        for ex in examples:
            text = task.sft_text(ex, rng, wrong_step_prob=p)
            rewards = [r for _, r in task.step_rewards(text, ex)][:-1]  # step lines only
            for before, r in zip([1.0] + rewards[:-1], rewards):
                if before == 1.0:
                    on_chain += 1
                    left += r == 0.0
            assert task.reward(text, ex) in (0.1, 1.0)  # always well-formed
        assert low <= left / on_chain <= high, (p, left / on_chain)


def _carry_free(a, op, b):
    """Schoolbook column arithmetic with the carry/borrow forgotten, written via strings."""
    width = max(len(str(a)), len(str(b)))
    da, db = str(a).zfill(width), str(b).zfill(width)
    sign = 1 if op == "+" else -1
    return int("".join(str((int(x) + sign * int(y)) % 10) for x, y in zip(da, db)))


@pytest.mark.parametrize("op", "+-")
def test_carry_slip_matches_column_arithmetic(op):
    for a in range(0, 250):
        for b in range(0, 40):
            expected = None if op == "-" and a < b else _carry_free(a, op, b)
            if expected is not None and expected == (a + b if op == "+" else a - b):
                expected = None  # no column carried or borrowed: no slip to make
            assert carry_slip(a, op, b) == expected, (a, op, b)


def test_carry_slip_examples_and_undefined_cases():
    assert (carry_slip(7, "+", 5), carry_slip(12, "-", 5), carry_slip(95, "+", 7)) == (2, 17, 92)
    assert carry_slip(3, "+", 4) is None and carry_slip(4, "*", 6) is None
    assert carry_slip(-3, "+", 9) is None and carry_slip(3, "-", 9) is None


def test_carry_slip_sft_text_is_systematic():
    """Only carrying steps go wrong, always to the carry-free result; p=1 makes the SFT answer
    exactly the carry-free chain, p=0 the right one."""
    task = ArithmeticTask(num_operands=3, max_digits=1, slip="carry")
    rng = random.Random(0)
    carrying = 0
    for ex in task.examples("train", 200, seed=3):
        assert task.sft_text(ex, rng, 0.0) == ArithmeticTask().sft_text(ex, 0, 0.0)
        value, chain = ex.meta["operands"][0], []
        for op, b in zip(ex.meta["ops"], ex.meta["operands"][1:]):
            right = value + b if op == "+" else value - b
            slipped = carry_slip(value, op, b)
            chain.append(f"{value}{op}{b}={right if slipped is None else slipped}\n")
            value = right if slipped is None else slipped
        assert task.sft_text(ex, rng, 1.0) == "".join(chain) + f"A: {value}\n"
        carrying += any(carry_slip(a, op, b) is not None for a, op, b, _ in solution_steps(ex.meta["operands"], ex.meta["ops"]))
    assert 0.3 < carrying / 200 < 0.7  # enough carrying questions to learn from
    with pytest.raises(ValueError, match="slip"):
        ArithmeticTask(slip="sometimes")


def test_carry_habit_drops_all_carries_of_a_solution_or_none():
    """Every habit solution is either the right chain or the all-carries-dropped chain (never
    a mix), the dropped one with frequency wrong_step_prob over carrying questions."""
    habit = ArithmeticTask(num_operands=4, max_digits=1, slip="carry_habit")
    per_step = ArithmeticTask(num_operands=4, max_digits=1, slip="carry")
    rng, dropped, carrying, mixed_per_step = random.Random(1), 0, 0, 0
    for ex in habit.examples("train", 400, seed=5):
        right, slipped = per_step.sft_text(ex, 0, 0.0), per_step.sft_text(ex, 0, 1.0)
        text = habit.sft_text(ex, rng, 0.6)
        assert text in (right, slipped)
        if right != slipped:
            carrying += 1
            dropped += text == slipped
            mixed_per_step += per_step.sft_text(ex, rng, 0.6) not in (right, slipped)
        assert habit.sft_text(ex, rng, 1.0) == slipped and habit.sft_text(ex, rng, 0.0) == right
    assert carrying > 150
    assert abs(dropped / carrying - 0.6) < 0.1
    assert mixed_per_step > 0  # the per-step slip does mix, on questions with 2+ carries


def test_sft_text_accepts_numpy_rng_and_seed():
    import numpy as np

    a = ArithmeticTask().sft_text(EX, np.random.default_rng(0), 0.5)
    b = ArithmeticTask().sft_text(EX, np.random.default_rng(0), 0.5)
    assert a == b and ArithmeticTask().sft_text(EX, 7) == "23+45=68\n68-12=56\nA: 56\n"


def test_sft_examples():
    task = ArithmeticTask()
    pairs = task.sft_examples("train", 50, seed=4, wrong_step_prob=0.5)
    assert pairs == task.sft_examples("train", 50, seed=4, wrong_step_prob=0.5)
    assert [ex for ex, _ in pairs] == task.examples("train", 50, seed=4)
    rewards = [task.reward(text, ex) for ex, text in pairs]
    assert 0.1 in rewards and 1.0 in rewards and set(rewards) <= {0.1, 1.0}
    assert {task.reward(t, ex) for ex, t in task.sft_examples("train", 20, seed=4)} == {1.0}


def test_tokenizer_corpus():
    docs = list(tokenizer_corpus(20, seed=2, operations="+-*"))
    assert len(docs) == 20 and docs == list(tokenizer_corpus(20, seed=2, operations="+-*"))
    task = ArithmeticTask(operations="+-*")
    for doc, ex in zip(docs, task.examples("train", 20, 2)):
        assert doc.startswith(ex.prompt)
        assert task.reward(doc[len(ex.prompt) :], ex) == 1.0


def test_invalid_knobs():
    for kwargs in [dict(num_operands=1), dict(operations="%"), dict(operations=""), dict(max_digits=0)]:
        with pytest.raises(ValueError):
            ArithmeticTask(**kwargs)


def _carries_by_columns(a: int, op: str, b: int) -> bool:
    """Whether a + b carries or a - b borrows in some decimal column (a, b >= 0)."""
    while a or b:
        if (op == "+" and a % 10 + b % 10 >= 10) or (op == "-" and a % 10 < b % 10):
            return True
        a, b = a // 10, b // 10
    return False


@pytest.mark.parametrize("k", [1, 2, 3])
def test_min_carries_keeps_the_questions_whose_chain_carries_that_often(k):
    task = ArithmeticTask(num_operands=4, max_digits=2, min_carries=k)
    for ex in task.examples("train", 40, seed=1):
        value, carrying = ex.meta["operands"][0], 0
        for op, b in zip(ex.meta["ops"], ex.meta["operands"][1:]):
            carrying += value >= 0 and b >= 0 and _carries_by_columns(value, op, b)
            value = value + b if op == "+" else value - b
        assert carrying >= k, ex.prompt
    # 0 is the stream without the knob; an impossible count is refused.
    assert ArithmeticTask(num_operands=4, min_carries=0).examples("train", 30, 2) == \
        ArithmeticTask(num_operands=4).examples("train", 30, 2)
    with pytest.raises(ValueError, match="min_carries must be in"):
        ArithmeticTask(num_operands=4, min_carries=4)


def test_a_rare_carry_count_still_fills_the_small_splits():
    # Chains carrying at 6 of 7 steps are rare in the test split: the draw must still find them.
    task = ArithmeticTask(num_operands=8, max_digits=1, min_carries=6)
    got = task.examples("test", 40, seed=0)
    assert len(got) == 40
    assert all(carrying_steps(ex.meta["operands"], ex.meta["ops"]) >= 6 for ex in got)


def test_format_reward_from_the_config_is_the_wrong_answers_reward():
    from grpo_jax.config import ConfigError, load_config
    from grpo_jax.cli.runs import make_task

    task = make_task("arithmetic", load_config("cpu-tiny", ["data.format_reward=0", "data.num_operands=2"]).data)
    ex = task.examples("train", 1, 0)[0]
    right = task.sft_text(ex)
    wrong = right.replace(f"A: {ex.answer}", f"A: {int(ex.answer) + 1}")
    assert (task.reward(right, ex), task.reward(wrong, ex)) == (1.0, 0.0)
    assert make_task("arithmetic", load_config("cpu-tiny", ["data.num_operands=2"]).data).reward(wrong, ex) == 0.1
    with pytest.raises(ConfigError, match="data.format_reward must be in"):
        load_config("cpu-tiny", ["data.format_reward=1"])
    with pytest.raises(ConfigError, match="data.min_carries must be in"):
        load_config("cpu-tiny", ["data.min_carries=3"])
