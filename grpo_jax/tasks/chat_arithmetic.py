"""One-operation arithmetic asked as a chat question ("What is 34 - 7?"), for chat models.

A task a small instruction-tuned model can partly solve before any RL: SmolLM2-135M-Instruct
answers some of these right and many wrong (it often talks around the question, or ends
with a wrong number), so GRPO groups on it carry signal from the first step. The kinds of
question and their operand ranges:

    "+": a + b with a, b in [2, 30]       "-": a - b with a in [10, 40], b in [1, 9]
    "*": a * b with a in [2, 9], b in [2, 12]

Each question draws its operation uniformly from ``ops``. Scoring is the ``gsm8k`` task's:
the number after the last ``####`` if there is one, else the last number of the completion,
must equal the result (``rewards.gsm8k_reward``; nothing is evaluated). ``meta["question"]``
holds the bare question, which chat experiments put in the user turn as it is (prompt
style ``arithmetic``: no instruction); ``Example.prompt`` is a plain-text form for models
without a chat template.

Splits: a question belongs to the split given by a crc32 bucket of its text (10% test,
10% validation, 80% train), so the held-out questions are never trained on, whatever the
seeds. The whole space holds about 1,200 questions: ``examples`` draws distinct ones within
a call; a long run sees each training question several times.
"""
from __future__ import annotations

import random
from typing import Any

from grpo_jax.tasks import Example, draw_distinct, split_of
from grpo_jax.tasks.gsm8k import Gsm8kTask

# op -> (first operand range, second operand range), inclusive.
RANGES = {"+": ((2, 30), (2, 30)), "-": ((10, 40), (1, 9)), "*": ((2, 9), (2, 12))}
PROMPT = "Question: {question}\nAnswer:"


def result_of(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class ChatArithmeticTask(Gsm8kTask):
    """``What is a op b?`` scored on the completion's last number (or the one after ``####``)."""

    name = "chat_arithmetic"
    prompt_style = "arithmetic"
    stop_strings = ("\nQuestion:",)

    def __init__(self, ops: str = "+-*"):
        super().__init__()
        if not ops or set(ops) - set(RANGES):
            raise ValueError(f"ops must be a non-empty string of {''.join(RANGES)}, got {ops!r}")
        self.ops = ops

    def draw(self, rng: random.Random) -> Example:
        op = rng.choice(self.ops)
        (lo_a, hi_a), (lo_b, hi_b) = RANGES[op]
        a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
        question = f"What is {a} {op} {b}?"
        result = str(result_of(a, op, b))
        return Example(prompt=PROMPT.format(question=question), answer=result,
                       meta={"final_answer": result, "question": question, "operands": (a, op, b),
                             "kind": op})

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` distinct questions of ``split``; the same (split, n, seed) gives the same list."""
        rng = random.Random(f"chat_arithmetic/{self.ops}/{split}/{seed}")
        return draw_distinct(lambda: self.draw(rng), lambda ex: ex.meta["question"], split, n,
                             tries=100 * n + 1000)

    def space(self, split: str) -> list[str]:
        """Every question of ``split`` (to size eval sets)."""
        out = []
        for op in self.ops:
            (lo_a, hi_a), (lo_b, hi_b) = RANGES[op]
            out += [q for a in range(lo_a, hi_a + 1) for b in range(lo_b, hi_b + 1)
                    if split_of(q := f"What is {a} {op} {b}?") == split]
        return out

    def shortcuts(self, train) -> dict:
        """One operation's result whatever the question's operator: with a skewed mix of
        operations, ``a + b`` alone scores every addition."""
        return {f"a {op} b whatever the operator": (lambda ex, op=op: str(result_of(
            ex.meta["operands"][0], op, ex.meta["operands"][2]))) for op in RANGES}

    def sft_text(self, example: Example, rng: Any = 0, wrong_step_prob: float = 0.0) -> str:
        if wrong_step_prob:
            raise ValueError("chat_arithmetic has no synthetic wrong steps; use wrong_step_prob=0")
        a, op, b = example.meta["operands"]
        return f"{a} {op} {b} = {example.answer}\n"
