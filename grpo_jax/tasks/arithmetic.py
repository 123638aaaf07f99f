"""Synthetic multi-step arithmetic: the CPU default task.

Format (one expression, evaluated left to right; parentheses are written wherever
ordinary precedence would otherwise change that order)::

    prompt:      "Q: 23+45-12=?\\n"
    completion:  "23+45=68\\n68-12=56\\nA: 56\\n"

    prompt:      "Q: (7+5)*3=?\\n"
    completion:  "7+5=12\\n12*3=36\\nA: 36\\n"

Each step line is ``<a><op><b>=<c>`` (no spaces), where ``a`` is the previous step's
result (the first operand for the first step), ``op``/``b`` are the question's next
operator/operand, and ``c = a op b``. The last line is ``A: <n>``. Every line ends with
``\\n``. Numbers are decimal integers; ``a``, ``c`` and ``n`` may be negative only if the
task allows negative intermediate values; division is always exact.

Outcome reward (``reward``): the completion is well-formed if, ignoring trailing
whitespace, it is one or more step lines followed by exactly one ``A: <n>`` line and
nothing else. Then 1.0 if ``n`` is the right answer, else ``format_reward`` (0.1 by
default); a malformed completion gets 0.0.

Step rewards (``step_rewards``): a step is good when the completion can still reach the
right answer from it (the label Math-Shepherd estimates by completing each step prefix;
``grpo_jax.rl.reward_models.progress`` does that for any task, and this is its exact special
case). Every non-blank line is a step. The j-th step-shaped line scores 1.0 if ``op``/``b``
are the question's j-th operator/operand and the value it writes, ``c``, is the true value
of the chain after j steps; otherwise 0.0. So a slip zeroes its own line and every later
line that carries the wrong value on, however locally right, and a later line that
writes the true value again (a compensating slip) scores 1. Lines of any other shape score
0.0 (without shifting j). The ``A:`` line scores 1.0 if its value is the right final
answer. A completion without an ``A:`` line gets one more step, its missing answer, scoring
0.0 at the end of its last line: it never scores above the same lines with a wrong answer.
Lines beyond ``MAX_STEPS`` are merged into one last step scoring 0.0 that ends at the last
non-whitespace character.
"""
from __future__ import annotations

import random
import re
import zlib
from typing import Any, Iterator, Sequence

from grpo_jax.config import SLIPS
from grpo_jax.tasks import rewards
from grpo_jax.tasks.shortcuts import lookup_rule
from grpo_jax.tasks import SPLITS, Example, Task, as_random, split_of

MAX_STEPS = 64
_STEP_RE = re.compile(r"(-?\d{1,24})([-+*/])(\d{1,24})=(-?\d{1,48})")
_ANSWER_RE = re.compile(r"A: (-?\d{1,48})")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def apply_op(a: int, op: str, b: int) -> int | None:
    """``a op b`` on ints; None for inexact or zero division."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0 or a % b:
            return None
        return a // b
    raise ValueError(f"unknown operator {op!r}")


def carry_slip(a: int, op: str, b: int) -> int | None:
    """``a op b`` computed column by column with every carry (``+``) or borrow (``-``)
    dropped, the classic schoolbook slip: ``7+5`` gives 2, ``12-5`` gives 17. None where
    the slip is undefined (other operators, negative operands, ``a < b`` for ``-``) or
    where it changes nothing (no column carries or borrows)."""
    if op not in "+-" or a < 0 or b < 0 or (op == "-" and a < b):
        return None
    out, scale, x, y = 0, 1, a, b
    while x or y:
        digit = (x % 10 + y % 10) % 10 if op == "+" else (x % 10 - y % 10) % 10
        out, scale, x, y = out + digit * scale, scale * 10, x // 10, y // 10
    return None if out == apply_op(a, op, b) else out


def carrying_steps(operands: Sequence[int], ops: Sequence[str]) -> int:
    """How many steps of the right chain carry or borrow (where ``carry_slip`` applies)."""
    value, n = operands[0], 0
    for op, b in zip(ops, operands[1:]):
        n += carry_slip(value, op, b) is not None
        value = apply_op(value, op, b)
    return n


def _divisors(value: int, hi: int) -> list[int]:
    value = abs(value)
    if value == 0:
        return list(range(1, hi + 1))
    small = [d for d in range(1, min(hi, int(value**0.5)) + 1) if value % d == 0]
    return sorted({d for d in small} | {value // d for d in small if value // d <= hi})


def generate_problem(
    rng: random.Random,
    num_operands: int,
    max_digits: int,
    operations: str,
    allow_negative: bool,
) -> tuple[list[int], list[str]]:
    """Random operands (1..10**max_digits-1) and operators with exact, bounded steps."""
    hi = 10**max_digits - 1
    value = rng.randint(1, hi)
    operands, ops = [value], []
    for _ in range(num_operands - 1):
        op = rng.choice(operations)
        if op == "-" and not allow_negative:
            b = rng.randint(0, min(hi, value)) if value < 1 else rng.randint(1, min(hi, value))
        elif op == "/":
            b = rng.choice(_divisors(value, hi))
        else:
            b = rng.randint(1, hi)
        operands.append(b)
        ops.append(op)
        value = apply_op(value, op, b)
    return operands, ops


def expression_text(operands: Sequence[int], ops: Sequence[str]) -> str:
    """Left-to-right expression with the parentheses precedence needs: ``(7+5)*3``."""
    text, top = str(operands[0]), None
    for op, b in zip(ops, operands[1:]):
        if top is not None and _PRECEDENCE[op] > _PRECEDENCE[top]:
            text = f"({text})"
        text, top = f"{text}{op}{b}", op
    return text


def solution_steps(operands: Sequence[int], ops: Sequence[str]) -> list[tuple[int, str, int, int]]:
    """The correct steps ``(a, op, b, c)``."""
    steps, value = [], operands[0]
    for op, b in zip(ops, operands[1:]):
        c = apply_op(value, op, b)
        steps.append((value, op, b, c))
        value = c
    return steps


def _lines(completion: str, limit: int) -> list[tuple[int, str]]:
    """``(end, line)`` for the first ``limit`` non-blank lines; ``end`` is exclusive and
    includes the line's ``\\n``. Splitting in C keeps huge inputs cheap."""
    out, start = [], 0
    for part in completion.split("\n"):
        end = start + len(part) + 1
        if part.strip():
            out.append((min(end, len(completion)), part))
            if len(out) == limit:
                break
        start = end
    return out


class ArithmeticTask(Task):
    """Multi-step integer arithmetic; see the module docstring for the exact format.

    Difficulty knobs: ``num_operands`` (an int, or an inclusive ``(min, max)`` range),
    ``max_digits`` per operand, ``operations`` (a string over ``+-*/``),
    ``allow_negative`` intermediate results, and ``min_carries``: questions whose right
    chain carries or borrows at fewer steps are skipped (0 keeps every question, and the
    question stream is then the same as without the knob). ``format_reward``: the reward
    of a well-formed wrong answer; 0 makes the outcome reward correctness only.

    ``slip`` is how the SFT corpus goes wrong (see :meth:`sft_text`): ``"random"`` slips
    are noise around the right result, so the right result stays the most likely one;
    ``"carry"`` slips drop carries and borrows, a systematic error that becomes the SFT
    model's greedy answer when ``wrong_step_prob`` > 0.5 while its samples still contain
    the right one: the situation in which the paper finds RL helps (Maj@K, not Pass@K).
    ``"carry_habit"`` drops the same carries, but decides once per solution: with
    probability ``wrong_step_prob`` a solution drops every carry and borrow, otherwise none.
    """

    name = "arithmetic"
    stop_strings = ()

    def __init__(
        self,
        num_operands: int | tuple[int, int] = 3,
        max_digits: int = 2,
        operations: str = "+-",
        allow_negative: bool = False,
        format_reward: float = 0.1,
        slip: str = "random",
        min_carries: int = 0,
    ):
        if slip not in SLIPS:
            raise ValueError(f"slip must be one of {SLIPS}, got {slip!r}")
        lo, hi = (num_operands, num_operands) if isinstance(num_operands, int) else num_operands
        if not 2 <= lo <= hi:
            raise ValueError(f"num_operands must be >= 2, got {num_operands}")
        if not operations or set(operations) - set("+-*/"):
            raise ValueError(f"operations must be a non-empty string over '+-*/', got {operations!r}")
        if max_digits < 1:
            raise ValueError(f"max_digits must be >= 1, got {max_digits}")
        if not 0 <= min_carries < hi:
            raise ValueError(f"min_carries must be in [0, num_operands - 1], got {min_carries} with up to {hi} operands")
        self.num_operands = (lo, hi)
        self.max_digits = max_digits
        self.operations = operations
        self.allow_negative = allow_negative
        self.format_reward = format_reward
        self.slip = slip
        self.min_carries = min_carries

    # ------------------------------------------------------------------ data
    def make_example(self, operands: Sequence[int], ops: Sequence[str]) -> Example:
        expression = expression_text(operands, ops)
        answer = solution_steps(operands, ops)[-1][3]
        return Example(
            prompt=f"Q: {expression}=?\n",
            answer=str(answer),
            meta={"operands": list(operands), "ops": list(ops), "expression": expression},
        )

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` problems of ``split``; membership is a stable hash of the question, so
        train, validation and test never share a question. Held-out splits (validation,
        test) hold distinct questions; training questions may repeat."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        # A str seed goes through sha512 in random.Random: stable across processes.
        rng = random.Random(f"arithmetic/{split}/{seed}")
        out: list[Example] = []
        seen: set[str] = set()
        # The budget only stops a request that cannot be met; a carry filter may keep a small
        # share of a small split's chains, so it gets a larger one.
        budget = (200 * n + 1000) * (50 if self.min_carries else 1)
        for _ in range(budget):
            if len(out) == n:
                return out
            count = rng.randint(*self.num_operands)
            operands, ops = generate_problem(
                rng, count, self.max_digits, self.operations, self.allow_negative
            )
            text = expression_text(operands, ops)
            if split_of(text) != split or carrying_steps(operands, ops) < self.min_carries or text in seen:
                continue
            if split != "train":
                seen.add(text)
            out.append(self.make_example(operands, ops))
        if len(out) == n:
            return out
        distinct = " distinct" if split != "train" else ""
        raise RuntimeError(f"could not draw {n}{distinct} {split} problems (found {len(out)}); "
                           "ask for fewer or raise the difficulty knobs (max_digits, num_operands)")

    def sft_text(self, example: Example, rng: Any = 0, wrong_step_prob: float = 0.0) -> str:
        """The worked solution, later steps carrying any wrong result on.

        ``slip="random"``: each step's result is wrong with probability ``wrong_step_prob``
        (off by ±1, ±2 or ±10). ``slip="carry"``: each step that carries or borrows drops
        it (:func:`carry_slip`) with probability ``wrong_step_prob``; other steps are right.
        ``slip="carry_habit"``: one draw per solution; with probability ``wrong_step_prob``
        every carrying step drops its carry, otherwise every step is right. Per-step slips
        make a correct result after a carry rare in the corpus (a right 2-digit value is
        followed by another right step only (1 - p)^2 of the time), so the SFT model cannot
        compute the later steps that RL needs once it learns to carry; a habit keeps every
        right chain whole and leaves one decision, at the first carry, to learn.
        """
        rng = as_random(rng)
        habit = self.slip == "carry_habit" and rng.random() < wrong_step_prob
        operands, ops = example.meta["operands"], example.meta["ops"]
        lines, value = [], operands[0]
        for op, b in zip(ops, operands[1:]):
            c = apply_op(value, op, b)
            if c is None:  # a wrong earlier value left an inexact division: slip again
                c = value // b
            if self.slip in ("carry", "carry_habit"):
                slipped = carry_slip(value, op, b)
                # Per-step slips draw only at a carrying step (short-circuit), as before.
                if slipped is not None and (habit if self.slip == "carry_habit" else rng.random() < wrong_step_prob):
                    c = slipped
            elif rng.random() < wrong_step_prob:
                deltas = [d for d in (1, -1, 2, -2, 10, -10) if self.allow_negative or c + d >= 0]
                c += rng.choice(deltas)
            lines.append(f"{value}{op}{b}={c}\n")
            value = c
        lines.append(f"A: {value}\n")
        return "".join(lines)

    # --------------------------------------------------------------- scoring
    def format_ok(self, completion: str) -> bool:
        lines = completion.rstrip().split("\n")
        if len(lines) < 2 or _ANSWER_RE.fullmatch(lines[-1]) is None:
            return False
        return all(_STEP_RE.fullmatch(line) is not None for line in lines[:-1])

    def extract_answer(self, completion: str) -> str | None:
        """The integer on the last ``A: <n>`` line (format not required), canonical text."""
        if not isinstance(completion, str) or len(completion) > rewards.MAX_COMPLETION_CHARS:
            return None
        start = completion.rfind("A: ")
        if start < 0 or (start > 0 and completion[start - 1] != "\n"):
            return None
        end = completion.find("\n", start)
        match = _ANSWER_RE.fullmatch(completion[start : len(completion) if end < 0 else end].rstrip())
        return None if match is None else str(int(match.group(1)))

    def is_correct(self, answer: str | None, example: Example) -> bool:
        return answer is not None and answer == example.answer

    def reward(self, completion: str, example: Example) -> float:
        """1.0 if well-formed and right, ``format_reward`` if well-formed and wrong, else 0."""
        try:
            if not isinstance(completion, str) or len(completion) > rewards.MAX_COMPLETION_CHARS:
                return 0.0
            if not self.format_ok(completion):
                return 0.0
            right = self.is_correct(self.extract_answer(completion), example)
            return 1.0 if right else self.format_reward
        except Exception:  # noqa: BLE001 - a reward must never take down the trainer
            return 0.0

    def step_rewards(self, completion: str, example: Example) -> list[tuple[int, float]]:
        """``[(end, r), ...]`` per non-blank line, see the module docstring.

        A completion with no non-blank line is one step ``(len(completion), 0.0)``.
        """
        try:
            if not isinstance(completion, str) or len(completion) > rewards.MAX_COMPLETION_CHARS:
                return [(len(completion) if isinstance(completion, str) else 0, 0.0)]
            return self._step_rewards(completion, example)
        except Exception:  # noqa: BLE001
            return [(len(completion), 0.0)]

    def chain_values(self, example: Example) -> list[int]:
        """The true value of the chain after each step (what a right step line writes)."""
        return [c for _, _, _, c in solution_steps(example.meta["operands"], example.meta["ops"])]

    def _step_rewards(self, completion: str, example: Example) -> list[tuple[int, float]]:
        operands, ops = example.meta["operands"], example.meta["ops"]
        truth = self.chain_values(example)
        lines = _lines(completion, MAX_STEPS + 1)
        if not lines:
            return [(len(completion), 0.0)]
        out: list[tuple[int, float]] = []
        j, answered = 0, False  # j counts step-shaped lines only
        for end, line in lines[:MAX_STEPS]:
            step, answer = _STEP_RE.fullmatch(line), _ANSWER_RE.fullmatch(line)
            ok = False
            if step is not None:
                op, b, c = step.group(2), int(step.group(3)), int(step.group(4))
                ok = j < len(ops) and op == ops[j] and b == operands[j + 1] and c == truth[j]
                j += 1
            elif answer is not None:
                ok, answered = str(int(answer.group(1))) == example.answer, True
            out.append((end, 1.0 if ok else 0.0))
        if len(lines) > MAX_STEPS:  # the rest, up to the last non-blank character
            out.append((max(len(completion.rstrip()), out[-1][0]), 0.0))
        elif not answered:
            out.append((out[-1][0], 0.0))
        return out

    # ------------------------------------------------------------- shortcuts
    def shortcuts(self, train: Sequence[Example]) -> dict:
        """Rules that skip carrying, fitted on ``train`` (see `grpo_jax.tasks.shortcuts`): the
        carry-dropped chain, and (for ``+-*``) the right units digit, which needs no carry,
        with the digits above it the commonest in training overall, per count of each
        operator, or per operator sequence, or those of the carry-dropped chain moved by the
        commonest net carry of the operator sequence (counting carries from the signs)."""
        def dropped(ex: Example) -> str | None:
            value = carry_dropped_value(ex.meta["operands"], ex.meta["ops"])
            return None if value is None else str(value)

        rules = {"carry-dropped chain": dropped}
        if set(self.operations) <= set("+-*"):
            def above(ex: Example) -> int:
                return int(ex.answer) // 10

            def with_units(ex: Example, rest) -> str | None:
                return None if rest is None else str(10 * rest + int(ex.answer) % 10)

            keys = {"overall": lambda ex: None,
                    "by operator counts": lambda ex: tuple(ex.meta["ops"].count(o) for o in "+-*"),
                    "by operator order": lambda ex: tuple(ex.meta["ops"])}
            for name, key in keys.items():
                rules[f"units digit + commonest rest {name}"] = lookup_rule(train, key, above, with_units)

            def dropped_rest(ex: Example) -> int | None:
                value = carry_dropped_value(ex.meta["operands"], ex.meta["ops"])
                return None if value is None else value // 10

            def offset(ex: Example):  # what the dropped carries and borrows move the rest by
                rest = dropped_rest(ex)
                return None if rest is None else above(ex) - rest

            def corrected(ex: Example, shift) -> str | None:
                rest = dropped_rest(ex)
                return None if rest is None or shift is None else with_units(ex, rest + shift)

            rules["carry-dropped rest + commonest carry shift by operator order"] = lookup_rule(
                train, keys["by operator order"], offset, corrected)
        return rules


def carry_dropped_value(operands: Sequence[int], ops: Sequence[str]) -> int | None:
    """The chain's result with every carry and borrow dropped (`carry_slip` wherever it
    applies): the answer of a solver that never carries. None where a step is undefined."""
    value = operands[0]
    for op, b in zip(ops, operands[1:]):
        slipped = carry_slip(value, op, b)
        value = slipped if slipped is not None else apply_op(value, op, b)
        if value is None:
            return None
    return value


def tokenizer_corpus(n: int, seed: int = 0, wrong_step_prob: float = 0.0, **task_kwargs) -> Iterator[str]:
    """``n`` documents ``prompt + worked solution`` from the train split, e.g. to train a
    sentencepiece tokenizer; ``task_kwargs`` are :class:`ArithmeticTask` knobs."""
    task = ArithmeticTask(**task_kwargs)
    rng = random.Random(seed)
    for example in task.examples("train", n, seed):
        yield example.prompt + task.sft_text(example, rng, wrong_step_prob)
