"""Countdown: every generated puzzle is solvable (independent brute force), prompts,
rewards of reference / corrupted solutions, SFT text."""
import random
from fractions import Fraction
from functools import lru_cache

import pytest

from grpo_jax.tasks.rewards import countdown_reward
from grpo_jax.tasks import get_task
from grpo_jax.tasks.countdown import CountdownTask


@lru_cache(maxsize=None)
def reachable(values: tuple) -> frozenset:
    """Every value an expression using each of ``values`` exactly once can take
    (+ - * / over exact rationals, any bracketing)."""
    if len(values) == 1:
        return frozenset(values)
    out = set()
    n = len(values)
    for mask in range(1, 2**n - 1):  # split into two non-empty groups
        left = tuple(sorted(values[i] for i in range(n) if mask >> i & 1))
        right = tuple(sorted(values[i] for i in range(n) if not mask >> i & 1))
        for a in reachable(left):
            for b in reachable(right):
                out.update((a + b, a - b, a * b))
                if b != 0:
                    out.add(a / b)
    return frozenset(out)


def test_every_puzzle_is_solvable():
    task = CountdownTask()
    examples = task.examples("train", 60, seed=0)
    counts = set()
    for ex in examples:
        numbers, target = ex.meta["numbers"], ex.meta["target"]
        counts.add(len(numbers))
        assert 3 <= len(numbers) <= 4 and all(1 <= x <= 99 for x in numbers)
        assert 1 <= target <= 100
        assert Fraction(target) in reachable(tuple(sorted(Fraction(x) for x in numbers)))
        # The stored reference solution itself earns the full reward.
        assert countdown_reward(f"x</think>\n<answer>{ex.answer}</answer>", numbers, target) == pytest.approx(1.1)
    assert counts == {3, 4}


def test_deterministic_and_split_disjoint():
    task = get_task("countdown", num_numbers=3, max_number=20)
    a = task.examples("train", 30, seed=5)
    assert a == task.examples("train", 30, seed=5)
    assert a != task.examples("train", 30, seed=6)
    key = lambda e: (tuple(sorted(e.meta["numbers"])), e.meta["target"])
    assert not {key(e) for e in a} & {key(e) for e in task.examples("test", 30, seed=5)}


def test_prompt_ends_with_think_and_states_the_puzzle():
    ex = CountdownTask().examples("validation", 1, seed=0)[0]
    assert ex.prompt.endswith("<think>")
    assert str(ex.meta["numbers"]) in ex.prompt and f"equals {ex.meta['target']}." in ex.prompt


def test_reward_extract_and_is_correct():
    task = CountdownTask()
    ex = task.examples("train", 1, seed=3)[0]
    good = f" thinking</think>\n<answer> {ex.answer} </answer>"
    assert task.reward(good, ex) == pytest.approx(1.1)
    assert task.reward("<think>" + good.lstrip(), ex) == pytest.approx(1.1)
    assert task.extract_answer(good) == ex.answer.replace(" ", "")
    assert task.is_correct(task.extract_answer(good), ex)
    bad = good.replace(ex.answer, ex.answer + " + 1")
    assert task.reward(bad, ex) == pytest.approx(0.1)
    assert not task.is_correct(task.extract_answer(bad), ex)
    assert task.extract_answer("no tags") is None
    assert task.step_rewards(good, ex) == [(len(good), pytest.approx(1.1))]


def test_sft_text():
    task = CountdownTask()
    examples = task.examples("train", 200, seed=1)
    rng = random.Random(0)
    rewards_clean = [task.reward(task.sft_text(ex, rng), ex) for ex in examples]
    assert all(r == pytest.approx(1.1) for r in rewards_clean)
    rewards_noisy = [task.reward(task.sft_text(ex, rng, wrong_step_prob=0.5), ex) for ex in examples]
    wrong = sum(r == pytest.approx(0.1) for r in rewards_noisy) / len(examples)
    assert 0.35 <= wrong <= 0.65  # well-formed but wrong about half the time
    assert all(r in (pytest.approx(0.1), pytest.approx(1.1)) for r in rewards_noisy)


def test_invalid_knobs():
    with pytest.raises(ValueError):
        CountdownTask(num_numbers=1)
    with pytest.raises(ValueError):
        CountdownTask(min_number=5, max_number=4)


def test_held_out_puzzles_are_distinct():
    """A small puzzle space (two numbers up to 9) would repeat puzzles in a held-out set of
    this size; the test split holds each (numbers, target) once."""
    task = CountdownTask(num_numbers=(2, 2), max_number=9)
    held_out = task.examples("test", 12, seed=0)
    keys = [(tuple(sorted(ex.meta["numbers"])), ex.meta["target"]) for ex in held_out]
    assert len(set(keys)) == len(keys) == 12
