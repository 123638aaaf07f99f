"""Two-operation arithmetic asked in words, for chat models, held out balanced by kind.

"Start with 14, subtract 6, then multiply by 3. What do you get?" The task the real-model
study runs (issue #84; design: docs/smollm2_words_design.md). It is built so that no rule
that skips part of the arithmetic scores more than 15% of its held-out set, where
``chat_arithmetic`` gave "a + b whatever the operator" 61% (61 of its 100 held-out
questions were additions):

- every question has two operations, one of them a multiplication, in one of four kinds
  (``KINDS``): ``(a + b) * c``, ``(a - b) * c``, ``a * b + c``, ``a * b - c``, done in the
  order the words give. No kind repeats an operation, so "one operation whatever the
  operator" is right only where two readings happen to agree; no question has one
  operation only, since "stop after the first operation" would score every such question;
- operands: a number that is added or subtracted lies in [2, ``add_max``], a factor in
  [2, ``mul_max``]; a difference is at least 2 and the answer at least 2, so no step is
  an identity and no answer echoes an operand by construction;
- held-out sets are balanced by kind: ``examples(split, n)`` holds n / 4 questions of each
  kind (the first kinds one more when 4 does not divide n), drawn per kind, interleaved;
- a question's split is a crc32 bucket of its text (``split_of``: 10% test), so held-out
  questions are never trained on.

The chat prompt (style ``word_arithmetic``) puts the instruction "Work it out one operation
per line, then give the answer." before the question: SmolLM2-135M-Instruct then writes
one calculation a line ("2. Multiply by 3: 8 * 3 = 24"), which a step reward can read. The
outcome reward is ``chat_arithmetic``'s (``rewards.gsm8k_reward``): the number after the
last ``####``, else the completion's last number, must equal the answer; nothing is
evaluated. ``step_rewards`` scores each non-blank line: a line whose last calculation
``x op y = z`` (op one of ``+ - * x ×``) is the next step of the chain (x the value so far,
op and y the question's next operation and operand, z its result) scores 1, any other line
0; the outcome reward follows as a last step at the completion's end.
"""
from __future__ import annotations

import random
import re
from typing import Any, Sequence

from grpo_jax.tasks import Example, draw_distinct, split_of
from grpo_jax.tasks.gsm8k import Gsm8kTask
from grpo_jax.tasks import rewards

KINDS = ("+*", "-*", "*+", "*-")
WORDS = {"+": "add {x}", "-": "subtract {x}", "*": "multiply by {x}"}
PROMPT = "Question: {question}\nAnswer:"
# Lines read for step rewards; a longer completion's rest is one more step scoring 0.
MAX_STEP_LINES = 16
_CALC_RE = re.compile(r"(-?\d{1,12})\s*([-+*x×])\s*(-?\d{1,12})\s*=\s*(-?\d{1,24})")


def apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y if op == "-" else x * y


def chain(a: int, ops: Sequence[str], b: int, c: int) -> list[int]:
    """The value after each operation, in the order the question gives them."""
    first = apply(a, ops[0], b)
    return [first, apply(first, ops[1], c)]


def question_text(a: int, ops: Sequence[str], b: int, c: int) -> str:
    return (f"Start with {a}, {WORDS[ops[0]].format(x=b)}, then {WORDS[ops[1]].format(x=c)}. "
            "What do you get?")


def operand_ranges(kind: str, add_max: int, mul_max: int) -> tuple[range, range, range]:
    """(a, b, c) ranges of a kind before the kind's constraints (``valid``)."""
    add, mul = range(2, add_max + 1), range(2, mul_max + 1)
    if kind[0] == "*":
        return mul, mul, add
    if kind[0] == "-":  # a - b spans [2, add_max] as a + b would (``valid``)
        return range(4, 2 * add_max + 1), add, mul
    return add, add, mul


def valid(a: int, ops: Sequence[str], b: int, c: int, add_max: int) -> bool:
    """A first difference lies in [2, add_max] and the answer is at least 2 (no identity
    step, no echo of an operand)."""
    first, last = chain(a, ops, b, c)
    return first >= 2 and last >= 2 and (ops[0] != "-" or first <= add_max)


class WordArithmeticTask(Gsm8kTask):
    """Two operations in words, ``Start with a, <op1> b, then <op2> c.``, scored on the last number."""

    name = "word_arithmetic"
    prompt_style = "word_arithmetic"
    stop_strings = ("\nQuestion:",)

    def __init__(self, kinds: Sequence[str] = KINDS, add_max: int = 19, mul_max: int = 9):
        super().__init__()
        kinds = tuple(kinds.split(",") if isinstance(kinds, str) else kinds)
        bad = [k for k in kinds if len(k) != 2 or set(k) - set(WORDS)]
        if not kinds or bad:
            raise ValueError(f"kinds must be two-character strings of {''.join(WORDS)}, got {kinds!r}")
        if add_max < 4 or mul_max < 2:
            raise ValueError(f"add_max must be >= 4 and mul_max >= 2, got {add_max}, {mul_max}")
        self.kinds, self.add_max, self.mul_max = kinds, add_max, mul_max

    def make_example(self, a: int, ops: Sequence[str], b: int, c: int) -> Example:
        question = question_text(a, ops, b, c)
        answer = str(chain(a, ops, b, c)[-1])
        return Example(prompt=PROMPT.format(question=question), answer=answer,
                       meta={"final_answer": answer, "question": question, "operands": (a, b, c),
                             "ops": tuple(ops), "kind": "".join(ops)})

    def draw(self, rng: random.Random, kind: str) -> Example:
        ra, rb, rc = operand_ranges(kind, self.add_max, self.mul_max)
        while True:
            a, b, c = rng.choice(ra), rng.choice(rb), rng.choice(rc)
            if valid(a, kind, b, c, self.add_max):
                return self.make_example(a, kind, b, c)

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` distinct questions of ``split``, balanced by kind and interleaved (kind 1, 2,
        3, 4, 1, ...); the same (split, n, seed) gives the same list."""
        per_kind = []
        for i, kind in enumerate(self.kinds):
            count = n // len(self.kinds) + (i < n % len(self.kinds))
            rng = random.Random(f"word_arithmetic/{kind}/{self.add_max}/{self.mul_max}/{split}/{seed}")
            per_kind.append(draw_distinct(lambda rng=rng, kind=kind: self.draw(rng, kind),
                                          lambda ex: ex.meta["question"], split, count, tries=100 * count + 1000))
        return [group[i] for i in range(max(map(len, per_kind), default=0)) for group in per_kind if i < len(group)]

    def space(self, split: str, kind: str) -> list[str]:
        """Every question of ``kind`` in ``split`` (to size held-out sets)."""
        ra, rb, rc = operand_ranges(kind, self.add_max, self.mul_max)
        return [q for a in ra for b in rb for c in rc
                if valid(a, kind, b, c, self.add_max) and split_of(q := question_text(a, kind, b, c)) == split]

    # ------------------------------------------------------------- step rewards
    def step_rewards(self, completion: str, example: Example) -> list[tuple[int, float]]:
        """``[(end, r), ...]`` per non-blank line, then the outcome at the completion's end (see
        the module docstring)."""
        if not isinstance(completion, str) or len(completion) > rewards.MAX_COMPLETION_CHARS:
            return [(len(completion) if isinstance(completion, str) else 0, 0.0)]
        a, b, c = example.meta["operands"]
        ops = example.meta["ops"]
        truth = chain(a, ops, b, c)
        steps = [(a, ops[0], b, truth[0]), (truth[0], ops[1], c, truth[1])]
        out: list[tuple[int, float]] = []
        j, start = 0, 0
        for line in completion.splitlines(keepends=True):
            end = start + len(line)
            start = end
            if not line.strip():
                continue
            if len(out) == MAX_STEP_LINES:
                out.append((len(completion.rstrip()), 0.0))
                break
            calcs = _CALC_RE.findall(line)
            ok = False
            if calcs:
                x, op, y, z = calcs[-1]
                op = "*" if op in "x×" else op
                ok = j < len(steps) and (int(x), op, int(y), int(z)) == steps[j]
                j += 1
            out.append((end, 1.0 if ok else 0.0))
        out.append((len(completion), self.reward(completion, example)))
        return out

    # ------------------------------------------------------------- shortcuts
    def shortcuts(self, train: Sequence[Example]) -> dict:
        """Rules that skip part of the arithmetic (see `grpo_jax.tasks.shortcuts`; the commonest
        training answer is added there): each operation for both operators; one operation
        only; an operand dropped; the operations swapped, or done last first (precedence
        read into ``a + b * c``); + and - swapped; an operand echoed; the commonest answer
        per kind; the right units digit with the digits above it the commonest in training
        (overall, per kind)."""
        from grpo_jax.tasks.shortcuts import lookup_rule, numeric_rules

        def rule(value):
            return lambda ex: str(value(*ex.meta["operands"], ex.meta["ops"]))

        flip = {"+": "-", "-": "+", "*": "*"}
        rules = {f"every operation read as {op}": rule(lambda a, b, c, ops, op=op: apply(apply(a, op, b), op, c))
                 for op in "+-*"}
        rules.update({
            "first operation only (c dropped)": rule(lambda a, b, c, ops: apply(a, ops[0], b)),
            "second operation only (a dropped)": rule(lambda a, b, c, ops: apply(b, ops[1], c)),
            "b dropped": rule(lambda a, b, c, ops: apply(a, ops[1], c)),
            "operations swapped": rule(lambda a, b, c, ops: apply(apply(a, ops[1], b), ops[0], c)),
            "last operation first": rule(lambda a, b, c, ops: apply(a, ops[0], apply(b, ops[1], c))),
            "+ and - swapped": rule(lambda a, b, c, ops: apply(apply(a, flip[ops[0]], b), flip[ops[1]], c)),
            "echo a": rule(lambda a, b, c, ops: a),
            "echo b": rule(lambda a, b, c, ops: b),
            "echo c": rule(lambda a, b, c, ops: c),
            "commonest answer per kind": lookup_rule(train, lambda ex: ex.meta["kind"], lambda ex: ex.answer,
                                                     lambda ex, answer: answer),
        })
        rules.update(numeric_rules(train))
        return rules

    def sft_text(self, example: Example, rng: Any = 0, wrong_step_prob: float = 0.0) -> str:
        if wrong_step_prob:
            raise ValueError("word_arithmetic has no synthetic wrong steps; use wrong_step_prob=0")
        a, b, c = example.meta["operands"]
        ops = example.meta["ops"]
        first, last = chain(a, ops, b, c)
        return f"{a} {ops[0]} {b} = {first}\n{first} {ops[1]} {c} = {last}\nThe answer is {last}.\n"


__all__ = ["KINDS", "WordArithmeticTask", "apply", "chain", "question_text", "valid"]
