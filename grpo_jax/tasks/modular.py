"""Modular chains: a testbed whose answers no shortcut finds.

Format (the line grammar of `grpo_jax.tasks.arithmetic`, values taken modulo a prime ``P``)::

    prompt:      "Q: 9+4-5+10-8+0 mod 11=?\\n"
    completion:  "9+4=2\\n2-5=8\\n8+10=7\\n7-8=10\\n10+0=10\\nA: 10\\n"

A question has ``num_operands`` operands drawn uniformly from ``0..P-1`` joined by ``+`` and
``-``, exactly ``num_subtractions`` of its operators ``-`` (their positions drawn uniformly).
Each step line ``a op b = c`` is one lookup in the table of ``+`` or ``-`` modulo ``P``; the
last line is ``A: <n>``. The outcome reward, answer extraction and step rewards are the
arithmetic task's: a step line is right when its operator and operand are the question's
next ones and the value it writes is the true value of the chain so far (modulo ``P``), so a
slip zeroes its own line and every later line that carries it on (progress labels).

Why this task: the answer is uniform over ``P`` values and no digit of it can be read off
the prompt, so every rule that skips the lookups (a constant, the chain with its signs
flipped or some subtractions read as additions, a chain that drops an operand or stops early,
the commonest answer per operator order, ...; :meth:`ModularTask.shortcuts`) scores near
chance, ``1/P``. A modulus that is not prime leaks: modulo 10, the chain with every sign
flipped agrees with the true one whenever twice the subtracted part is 0 modulo 10.

The SFT corpus reads ``-`` as ``+`` with probability ``wrong_step_prob`` at each subtraction
(the line still writes ``-``; the later lines carry the slip on), so the SFT model writes
the lookups right and the signs wrong often enough that few of its samples, but some, are
right: what GRPO re-ranks.

With ``tool_prob`` > 0 (docs/studies/tools_learning/design.md) a worked solution is, with that
probability, a call of the task's Python tool (``ModularTask.tool``) instead of the chain::

    completion:  "```python\nprint((9+4-5+10-8+0) % 11)\n```\n```output\n10\n```\nA: 10\n"

one line that prints the question's expression modulo ``P``, copied from the prompt, then
the tool's output as `PythonTool.output` gives it back, then the answer line. The reward
takes either form (`format_ok`); in the tool form the code may only be ``print(...)`` of
digits, ``+``, ``-``, ``%``, brackets and spaces, whose output is a number or a status line,
so the ``A:`` line after the output block is always the model's own.
"""
from __future__ import annotations

import itertools
import random
import re
from typing import Any, Sequence

from grpo_jax.config import is_prime
from grpo_jax.tasks.shortcuts import lookup_rule
from grpo_jax.tasks import SPLITS, Example, as_random, draw_distinct, split_of
from grpo_jax.tasks.arithmetic import _STEP_RE, MAX_STEPS, ArithmeticTask, _lines
from grpo_jax.tools import ExecutionResult, PythonTool

# The tool form of a solution (module docstring): the code, the output block, the answer.
# Blank space may stand between the fences where a tokenizer's fence token holds a newline.
_TOOL_FORM = re.compile(r"```python\n(print\([0-9+\-() %]{1,200}\))\n```\s*```output\n([^`]{0,600})\n```\s*"
                        r"(A: -?\d{1,48})\s*")


def step(value: int, op: str, b: int, modulus: int) -> int:
    """``value op b`` modulo ``modulus`` (``op`` is ``+`` or ``-``)."""
    return (value + b) % modulus if op == "+" else (value - b) % modulus


def chain_values(operands: Sequence[int], ops: Sequence[str], modulus: int) -> list[int]:
    """The chain's value after each step, modulo ``modulus``."""
    out, value = [], operands[0] % modulus
    for op, b in zip(ops, operands[1:]):
        value = step(value, op, b, modulus)
        out.append(value)
    return out


def chain_value(operands: Sequence[int], ops: Sequence[str], modulus: int) -> int:
    return chain_values(operands, ops, modulus)[-1] if ops else operands[0] % modulus


class ModularTask(ArithmeticTask):
    """Chains of ``num_operands`` operands modulo the prime ``modulus`` with exactly
    ``num_subtractions`` subtractions; see the module docstring. ``format_reward`` is the
    reward of a well-formed wrong answer (0 by default: the reward is correctness only)."""

    name = "modular"

    def __init__(self, modulus: int = 13, num_operands: int = 6, num_subtractions: int = 2,
                 format_reward: float = 0.0, tool_prob: float = 0.0):
        if not is_prime(modulus) or modulus < 5:
            raise ValueError(f"modulus must be a prime >= 5 (a composite one leaks the answer to "
                             f"sign-flip rules), got {modulus}")
        if num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {num_operands}")
        if not 0 <= num_subtractions <= num_operands - 1:
            raise ValueError(f"num_subtractions must be in [0, num_operands - 1], got {num_subtractions} "
                             f"with {num_operands} operands")
        if not 0 <= tool_prob <= 1:
            raise ValueError(f"tool_prob (the share of worked solutions that call the tool) must be in [0, 1], "
                             f"got {tool_prob}")
        self.modulus, self.num_subtractions = modulus, num_subtractions
        self.tool_prob = tool_prob
        # The trainer calls it where rl.max_tool_calls > 0; a task without tool solutions has
        # none, as before.
        self.tool = PythonTool() if tool_prob > 0 else None
        self.num_operands = (num_operands, num_operands)
        self.format_reward = format_reward
        # ArithmeticTask attributes its scoring never reads for this task, kept coherent.
        self.max_digits, self.operations, self.allow_negative = len(str(modulus - 1)), "+-", False
        self.slip, self.min_carries = "random", 0

    # ------------------------------------------------------------------ data
    def make_example(self, operands: Sequence[int], ops: Sequence[str]) -> Example:
        expression = str(operands[0]) + "".join(f"{op}{b}" for op, b in zip(ops, operands[1:]))
        return Example(prompt=f"Q: {expression} mod {self.modulus}=?\n",
                       answer=str(chain_value(operands, ops, self.modulus)),
                       meta={"operands": list(operands), "ops": list(ops), "expression": expression,
                             "modulus": self.modulus})

    def draw(self, rng: random.Random) -> tuple[list[int], list[str]]:
        n = self.num_operands[0]
        operands = [rng.randrange(self.modulus) for _ in range(n)]
        subtractions = set(rng.sample(range(n - 1), self.num_subtractions))
        return operands, ["-" if i in subtractions else "+" for i in range(n - 1)]

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` questions of ``split`` (a stable hash of the question text decides its
        split, so training never draws a held-out question); held-out splits hold distinct
        questions, training questions may repeat."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rng = random.Random(f"modular/{split}/{seed}")

        def draw() -> Example:
            return self.make_example(*self.draw(rng))

        if split != "train":
            return draw_distinct(draw, lambda example: example.prompt, split, n, tries=200 * n + 1000)
        out: list[Example] = []
        while len(out) < n:  # eight questions in ten are training ones
            example = draw()
            if split_of(example.prompt) == "train":
                out.append(example)
        return out

    def chain_values(self, example: Example) -> list[int]:
        return chain_values(example.meta["operands"], example.meta["ops"], self.modulus)

    def sft_text(self, example: Example, rng: Any = 0, wrong_step_prob: float = 0.0,
                 lookup_error_prob: float = 0.0) -> str:
        """The worked solution: with probability ``tool_prob`` the tool form (`tool_text`),
        else the chain, where each subtraction is computed as an addition with probability
        ``wrong_step_prob`` (the line keeps its ``-``), later lines carrying the wrong value
        on. A draw is made for the form only where ``tool_prob`` > 0 (a corpus without tool
        solutions draws as before), and at subtractions only.

        ``lookup_error_prob`` > 0 adds the SFT policy's other error (reward-model data,
        docs/reward_models.md): each line's value, with that probability, is a wrong one drawn
        uniformly, carried on. Two wrong values can then cancel, as in the policy's samples.
        At 0 nothing more is drawn, so the corpus stays as it was."""
        rng = as_random(rng)
        if self.tool_prob > 0 and rng.random() < self.tool_prob:
            return self.tool_text(example)
        operands, ops = example.meta["operands"], example.meta["ops"]
        lines, value = [], operands[0]
        for op, b in zip(ops, operands[1:]):
            done = "+" if op == "-" and rng.random() < wrong_step_prob else op
            c = step(value, done, b, self.modulus)
            if lookup_error_prob > 0 and rng.random() < lookup_error_prob:
                c = (c + rng.randrange(1, self.modulus)) % self.modulus
            lines.append(f"{value}{op}{b}={c}\n")
            value = c
        lines.append(f"A: {value}\n")
        return "".join(lines)

    def tool_code(self, example: Example) -> str:
        """The tool form's one line of code: the question's expression modulo ``P``, printed."""
        return f"print(({example.meta['expression']}) % {self.modulus})"

    def tool_text(self, example: Example) -> str:
        """The tool form of the worked solution (module docstring): the code block, the output
        block exactly as the tool gives back what the code prints, the answer line."""
        tool = self.tool or PythonTool()
        printed = ExecutionResult("ok", f"{example.answer}\n", "", 0)
        return f"{tool.open}{self.tool_code(example)}\n{tool.close}{tool.output(printed)}A: {example.answer}\n"

    def is_tool_form(self, completion: str) -> bool:
        """Whether ``completion`` is a well-formed tool solution (only where ``tool_prob`` > 0)."""
        return (self.tool_prob > 0 and isinstance(completion, str) and len(completion) < 2000
                and _TOOL_FORM.fullmatch(completion) is not None)

    def format_ok(self, completion: str) -> bool:
        """The chain's line grammar (`ArithmeticTask.format_ok`), or where ``tool_prob`` > 0
        the tool form."""
        return self.is_tool_form(completion) or super().format_ok(completion)

    def _line_checks(self, completion: str, example: Example, slip_reading: bool) -> tuple[int, int]:
        operands, ops, p = example.meta["operands"], example.meta["ops"], self.modulus
        right = seen = 0
        for _, line in _lines(completion, MAX_STEPS):
            match = _STEP_RE.fullmatch(line)
            if match is None:
                continue
            a, op, b, c = int(match.group(1)), match.group(2), int(match.group(3)), int(match.group(4))
            readings = {op, "+"} if slip_reading and op == "-" else {op}
            copied = seen < len(ops) and op == ops[seen] and b == operands[seen + 1]
            right += copied and 0 <= a < p and c in {step(a, r, b, p) for r in readings}
            seen += 1
        return right, max(seen, len(ops))

    def locally_right(self, completion: str, example: Example) -> tuple[int, int]:
        """(step lines locally right, step lines): a line is locally right when its operator
        and operand are the question's next ones and its value is its own ``a op b`` modulo
        ``P``, whatever ``a`` is. Lines a completion leaves out count as wrong."""
        return self._line_checks(completion, example, slip_reading=False)

    def lookups_right(self, completion: str, example: Example) -> tuple[int, int]:
        """As :meth:`locally_right`, but a ``-`` line computed as ``+`` (the SFT corpus's slip)
        counts as right: whether the model has learned the tables and copies the question,
        whichever reading of the sign it took. A tool solution has no lookups: (0, 0), so
        the share over a set of completions is that of their chains."""
        if self.is_tool_form(completion):
            return 0, 0
        return self._line_checks(completion, example, slip_reading=True)

    # ------------------------------------------------------------- shortcuts
    def shortcuts(self, train: Sequence[Example]) -> dict:
        """Rules that skip the lookups or misread the question's surface, each answering
        modulo ``P`` where it computes: the chain with some (or all) subtractions read as
        additions (what the SFT corpus's slip writes), with every sign flipped, with one
        operand dropped, stopped after k operands; the last operand; every wrapping step
        written one too high; and the commonest training answer per operator order, per
        first operand, per signed last operand.

        Not a rule: the chain in integers without the modulus, right whenever the integer
        value lands in ``0..P-1`` (often: about 0.4 of the 6-operand chains modulo 11). It
        skips no step: it computes every sum and reads every sign right, which is the skill
        the SFT corpus's slip leaves out, in a table the model never sees."""
        p, n = self.modulus, self.num_operands[0]

        def chain_rule(transform):
            def guess(ex: Example) -> str | None:
                operands, ops = transform(list(ex.meta["operands"]), list(ex.meta["ops"]))
                return str(chain_value(operands, ops, p))
            return guess

        def read_as_plus(ranks):  # ranks: which subtractions (0 = the first one) become "+"
            def transform(operands, ops):
                subs = [i for i, op in enumerate(ops) if op == "-"]
                return operands, ["+" if i in {subs[r] for r in ranks if r < len(subs)} else op
                                  for i, op in enumerate(ops)]
            return transform

        rules = {}
        for size in range(1, self.num_subtractions + 1):
            for ranks in itertools.combinations(range(self.num_subtractions), size):
                name = ("every subtraction read as +" if size == self.num_subtractions else
                        "subtraction " + "+".join(str(r + 1) for r in ranks) + " read as +")
                rules[name] = chain_rule(read_as_plus(ranks))
        rules["every sign flipped"] = chain_rule(
            lambda operands, ops: (operands, ["-" if op == "+" else "+" for op in ops]))
        for k in range(1, n):
            rules[f"operand {k + 1} dropped"] = chain_rule(
                lambda operands, ops, k=k: (operands[:k] + operands[k + 1:], ops[:k - 1] + ops[k:]))
        for k in range(1, n):
            rules[f"chain stopped after {k} operand{'s' if k > 1 else ''}"] = chain_rule(
                lambda operands, ops, k=k: (operands[:k], ops[:k - 1]))
        rules["last operand"] = lambda ex: str(ex.meta["operands"][-1])

        def wrap_high(ex: Example) -> str:
            value = ex.meta["operands"][0]
            for op, b in zip(ex.meta["ops"], ex.meta["operands"][1:]):
                raw = value + b if op == "+" else value - b
                value = (raw + (not 0 <= raw < p)) % p
            return str(value)

        rules["every wrapping step one too high"] = wrap_high

        answer = lambda ex: ex.answer  # noqa: E731
        keep = lambda ex, predicted: predicted  # noqa: E731
        rules["commonest answer by operator order"] = lookup_rule(train, lambda ex: tuple(ex.meta["ops"]), answer, keep)
        rules["commonest answer by first operand"] = lookup_rule(train, lambda ex: ex.meta["operands"][0], answer, keep)
        rules["commonest answer by signed last operand"] = lookup_rule(
            train, lambda ex: (ex.meta["ops"][-1], ex.meta["operands"][-1]), answer, keep)
        return rules


__all__ = ["ModularTask", "chain_value", "chain_values", "step"]
