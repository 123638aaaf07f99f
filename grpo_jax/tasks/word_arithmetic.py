"""Two-operation arithmetic asked in words, for chat models, held out balanced by kind.

"Start with 8 and add 10. Then multiply the result by 7. What do you get?" The task the real-model study
runs (issue #84; design: docs/studies/smollm2_words/design.md). It is built so that no rule that
skips part of the arithmetic scores more than 15% of its held-out set, where
``chat_arithmetic`` gave "a + b whatever the operator" 61% (61 of its 100 held-out
questions were additions):

- every question has two operations, done in the order the words give; the default kinds
  (``KINDS``) are ``(a + b) * c`` and ``a * b + c``, and ``(a - b) * c`` and ``a * b - c``
  can be asked for (``kinds=``). No kind repeats an operation, so "one operation whatever
  the operator" is right only where two readings happen to agree; no question has one
  operation only, since "stop after the first operation" would score every such question;
- operands (``RANGES``): a number added or subtracted (a difference included) lies in
  [2, 19], a factor in [2, 9]; the answer is at least 2, so no step is an identity;
- held-out sets are balanced by kind: ``examples(split, n)`` holds n / k questions of each
  of the k kinds (the first kinds one more when k does not divide n), drawn per kind (a
  kind's questions do not depend on the other kinds), interleaved;
- a question's split is a crc32 bucket of its text (``split_of``: 10% test), so held-out
  questions are never trained on.

The chat prompt (style ``word_arithmetic``) puts an instruction before the question, "Work
it out one operation per line, then give the answer.": SmolLM2-135M-Instruct then often
writes one calculation a line ("2. Add 18: 8 + 18 = 26"), which a step reward can read. The outcome reward is ``chat_arithmetic``'s
(``rewards.gsm8k_reward``): the number after the last ``####``, else the completion's last
number, must equal the answer; nothing is evaluated. ``step_rewards`` scores each non-blank
line: a line whose last calculation ``x op y = z`` (op one of ``+ - * x ×``) is the next
step of the chain (x the value so far, op and y the question's next operation and operand,
z its result) scores 1, any other line 0; the outcome reward follows as a last step at the
completion's end.
"""
from __future__ import annotations

import random
import re
from typing import Any, Sequence

from grpo_jax.tasks import Example, draw_distinct, split_of
from grpo_jax.tasks.gsm8k import Gsm8kTask
from grpo_jax.tasks import rewards

# The kinds a task holds by default: chosen from the candidates of docs/studies/smollm2_words/design.md.
KINDS = ("+*", "*+")
# kind -> (a's range, b's range, c's range, inclusive, and the largest first result): every
# number added or subtracted (a difference included) in [2, 19], every factor in [2, 9].
RANGES = {
    "+*": ((2, 19), (2, 19), (2, 9), 38),
    "-*": ((4, 38), (2, 19), (2, 9), 19),
    "*+": ((2, 9), (2, 9), (2, 19), 81),
    "*-": ((2, 9), (2, 9), (2, 19), 81),
}
WORDS = {"+": "add {x}", "-": "subtract {x}", "*": "multiply by {x}"}
# The second operation names what it acts on: asked "..., then multiply by 7", SmolLM2 often
# wrote "10 + 2 * 3" (docs/studies/smollm2_words/design.md, phrasings).
THEN = {"+": "add {x} to the result", "-": "subtract {x} from the result", "*": "multiply the result by {x}"}
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


PHRASINGS = ("result", "then")


def question_text(a: int, ops: Sequence[str], b: int, c: int, phrasing: str = "result") -> str:
    """The question; phrasing "then" is the first one measured ("Start with 8, add 10, then
    multiply by 7. What do you get?")."""
    if phrasing == "then":
        return (f"Start with {a}, {WORDS[ops[0]].format(x=b)}, then {WORDS[ops[1]].format(x=c)}. "
                "What do you get?")
    return f"Start with {a} and {WORDS[ops[0]].format(x=b)}. Then {THEN[ops[1]].format(x=c)}. What do you get?"


def valid(a: int, ops: Sequence[str], b: int, c: int, first_max: int) -> bool:
    """The first result lies in [2, first_max] and the answer is at least 2 (no identity
    step, no echo of an operand)."""
    first, last = chain(a, ops, b, c)
    return 2 <= first <= first_max and last >= 2


class WordArithmeticTask(Gsm8kTask):
    """Two operations in words, ``Start with a and <op1> b. Then <op2> c to the result.``,
    scored on the last number."""

    name = "word_arithmetic"
    prompt_style = "word_arithmetic"
    stop_strings = ("\nQuestion:",)

    def __init__(self, kinds: Sequence[str] = KINDS, ranges: dict | None = None, phrasing: str = "result"):
        super().__init__()
        if phrasing not in PHRASINGS:
            raise ValueError(f"phrasing must be one of {PHRASINGS}, got {phrasing!r}")
        self.phrasing = phrasing
        kinds = tuple(kinds.split(",") if isinstance(kinds, str) else kinds)
        self.ranges = {**RANGES, **(ranges or {})}
        bad = [k for k in kinds if k not in self.ranges]
        if not kinds or bad:
            raise ValueError(f"kinds must be some of {sorted(self.ranges)}, got {kinds!r}")
        self.kinds = kinds

    def operand_ranges(self, kind: str) -> tuple[range, range, range]:
        (a_lo, a_hi), (b_lo, b_hi), (c_lo, c_hi), _ = self.ranges[kind]
        return range(a_lo, a_hi + 1), range(b_lo, b_hi + 1), range(c_lo, c_hi + 1)

    def valid(self, a: int, kind: str, b: int, c: int) -> bool:
        return valid(a, kind, b, c, self.ranges[kind][3])

    def make_example(self, a: int, ops: Sequence[str], b: int, c: int) -> Example:
        question = question_text(a, ops, b, c, self.phrasing)
        answer = str(chain(a, ops, b, c)[-1])
        return Example(prompt=PROMPT.format(question=question), answer=answer,
                       meta={"final_answer": answer, "question": question, "operands": (a, b, c),
                             "ops": tuple(ops), "kind": "".join(ops)})

    def draw(self, rng: random.Random, kind: str) -> Example:
        ra, rb, rc = self.operand_ranges(kind)
        while True:
            a, b, c = rng.choice(ra), rng.choice(rb), rng.choice(rc)
            if self.valid(a, kind, b, c):
                return self.make_example(a, kind, b, c)

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` distinct questions of ``split``, balanced by kind and interleaved (kind 1, 2,
        3, 4, 1, ...); the same (split, n, seed) gives the same list."""
        per_kind = []
        for i, kind in enumerate(self.kinds):
            count = n // len(self.kinds) + (i < n % len(self.kinds))
            rng = random.Random(f"word_arithmetic/{kind}/{self.ranges[kind]}/{split}/{seed}")
            per_kind.append(draw_distinct(lambda rng=rng, kind=kind: self.draw(rng, kind),
                                          lambda ex: ex.meta["question"], split, count, tries=100 * count + 1000))
        return [group[i] for i in range(max(map(len, per_kind), default=0)) for group in per_kind if i < len(group)]

    def space(self, split: str, kind: str) -> list[str]:
        """Every question of ``kind`` in ``split`` (to size held-out sets)."""
        ra, rb, rc = self.operand_ranges(kind)
        return [q for a in ra for b in rb for c in rc
                if self.valid(a, kind, b, c) and split_of(q := question_text(a, kind, b, c, self.phrasing)) == split]

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
