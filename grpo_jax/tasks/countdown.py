"""Countdown (as in TinyZero / GRPO-Zero): reach a target with each given number once.

Generation guarantees a solution: draw the numbers, then combine them in a random order
with random operators (``+ - * /``, keeping every intermediate a positive integer) until
one value is left; that value is the target and the combination is the reference
solution (``Example.answer``). Draws whose target falls outside ``[1, max_target]`` are
redrawn.

The prompt ends with ``<think>`` (base-model style), so a completion normally continues
the thought and closes with ``</think>\\n<answer>EXPR</answer>``. Scoring is
:func:`grpo_jax.tasks.rewards.countdown_reward` (0.1 format + 1.0 answer), which also accepts
completions that repeat the opening ``<think>``.
"""
from __future__ import annotations

import random
import zlib
from typing import Any

from grpo_jax.tasks import rewards
from grpo_jax.tasks import SPLITS, Example, Task, as_random

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}

PROMPT = (
    "A conversation between User and Assistant. The user poses a puzzle; the assistant "
    "reasons about it privately and then gives the answer.\n"
    "User: Using the numbers {numbers}, write an equation that equals {target}. You may "
    "use + - * / and parentheses, and must use every number exactly once. Reason inside "
    "<think> </think> tags, then put only the expression inside <answer> </answer> tags, "
    "for example <answer> (1 + 2) * 3 </answer>.\n"
    "Assistant: Let me work through this step by step.\n<think>"
)


def _combine(a: tuple[int, str, int], b: tuple[int, str, int], op: str):
    """Combine ``(value, text, precedence)`` items; None if not a positive integer."""
    va, vb = a[0], b[0]
    if op == "+":
        v = va + vb
    elif op == "-":
        v = va - vb
    elif op == "*":
        v = va * vb
    else:
        v = va // vb if vb and va % vb == 0 else 0
    if v <= 0:
        return None
    p = _PRECEDENCE[op]
    left = a[1] if a[2] >= p else f"({a[1]})"
    # Right operand of - and / needs parentheses at equal precedence too: a-(b+c).
    right = b[1] if b[2] > p or (b[2] == p and op in "+*") else f"({b[1]})"
    return v, f"{left} {op} {right}", p


def random_solution(rng: random.Random, numbers: list[int]) -> tuple[int, str, list[str]]:
    """A random way to combine all ``numbers``: (value, expression, reasoning steps)."""
    items = [(n, str(n), 3) for n in numbers]
    steps = []
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        ops = list("+-*/")
        rng.shuffle(ops)
        for op in ops:
            combined = _combine(items[i], items[j], op)
            if combined is not None:
                break
        else:  # unreachable: + of positive integers always succeeds
            raise AssertionError("no operator applies")
        steps.append(f"{items[i][0]} {op} {items[j][0]} = {combined[0]}")
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [combined]
    return items[0][0], items[0][1], steps


class CountdownTask(Task):
    """Countdown with ``num_numbers`` (int or inclusive range) numbers in
    ``[min_number, max_number]`` and targets in ``[1, max_target]``."""

    name = "countdown"
    stop_strings = ("</answer>",)

    def __init__(
        self,
        num_numbers: int | tuple[int, int] = (3, 4),
        min_number: int = 1,
        max_number: int = 99,
        max_target: int = 100,
    ):
        lo, hi = (num_numbers, num_numbers) if isinstance(num_numbers, int) else num_numbers
        if not 2 <= lo <= hi <= 6:
            raise ValueError(f"num_numbers must be within [2, 6], got {num_numbers}")
        if not 1 <= min_number <= max_number or max_target < 1:
            raise ValueError("need 1 <= min_number <= max_number and max_target >= 1")
        self.num_numbers = (lo, hi)
        self.min_number, self.max_number = min_number, max_number
        self.max_target = max_target

    def make_example(self, numbers: list[int], target: int, solution: str, steps: list[str]) -> Example:
        return Example(
            prompt=PROMPT.format(numbers=list(numbers), target=target),
            answer=solution,
            meta={"numbers": list(numbers), "target": target, "steps": list(steps)},
        )

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` solvable puzzles; split membership is a stable hash of (numbers, target).
        Held-out splits hold distinct puzzles; training puzzles may repeat."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rng = random.Random(f"countdown/{split}/{seed}")
        out: list[Example] = []
        seen: set[str] = set()
        for _ in range(500 * n + 1000):
            if len(out) == n:
                return out
            count = rng.randint(*self.num_numbers)
            numbers = [rng.randint(self.min_number, self.max_number) for _ in range(count)]
            target, solution, steps = random_solution(rng, numbers)
            if not 1 <= target <= self.max_target:
                continue
            key = f"{sorted(numbers)}->{target}"
            bucket = zlib.crc32(key.encode()) % 10
            if ("test" if bucket == 0 else "validation" if bucket == 1 else "train") != split or key in seen:
                continue
            if split != "train":
                seen.add(key)
            out.append(self.make_example(numbers, target, solution, steps))
        if len(out) == n:
            return out
        raise RuntimeError(f"could not draw {n} {split} puzzles with these knobs")

    def reward(self, completion: str, example: Example) -> float:
        return rewards.countdown_reward(completion, example.meta["numbers"], example.meta["target"])

    def extract_answer(self, completion: str) -> str | None:
        """The last ``<answer>`` expression with spaces removed (None if absent, empty or
        longer than ``rewards.MAX_ANSWER_CHARS``)."""
        if not isinstance(completion, str) or len(completion) > rewards.MAX_COMPLETION_CHARS:
            return None
        answer = rewards.countdown_answer(completion)
        answer = None if answer is None else "".join(answer.split())
        return answer if answer and len(answer) <= rewards.MAX_ANSWER_CHARS else None

    def is_correct(self, answer: str | None, example: Example) -> bool:
        return answer is not None and rewards.countdown_answer_correct(
            answer, example.meta["numbers"], example.meta["target"]
        )

    def sft_text(self, example: Example, rng: Any = 0, wrong_step_prob: float = 0.0) -> str:
        """Reasoning (the construction steps) and the answer; with probability
        ``wrong_step_prob`` the answer is replaced by another combination of the numbers
        that misses the target."""
        rng = as_random(rng)
        steps, solution = example.meta["steps"], example.answer
        if rng.random() < wrong_step_prob:
            for _ in range(20):
                value, expression, wrong_steps = random_solution(rng, list(example.meta["numbers"]))
                if value != example.meta["target"]:
                    steps, solution = wrong_steps, expression
                    break
        return " " + ", ".join(steps) + ".</think>\n<answer>" + solution + "</answer>"
