"""GSM8K with a chain-of-thought prompt; scored by :func:`grpo_jax.tasks.rewards.gsm8k_reward`.

Prompt::

    Solve the math word problem. Reason step by step, then write the final answer
    as a number on the last line, in the form "#### <number>".

    Question: <question>
    Answer:
    <- the model writes here

``Example.answer`` is GSM8K's full solution (ending in ``#### N``); ``sft_text`` is that
solution with its calculator annotations ``<<48/2=24>>`` removed.
"""
from __future__ import annotations

import re
from typing import Any

from grpo_jax.tasks import rewards
from grpo_jax.tasks import Example
from grpo_jax.tasks.dataset_task import DatasetTask

PROMPT = (
    "Solve the math word problem. Reason step by step, then write the final answer as a "
    'number on the last line, in the form "#### <number>".\n\n'
    "Question: {question}\nAnswer:\n"
)
_CALCULATOR = re.compile(r"<<[^<>]*>>")


class Gsm8kTask(DatasetTask):
    name = "gsm8k"
    dataset = "gsm8k"
    stop_strings = ("\n\nQuestion:",)
    prompt_style = "gsm8k"

    def to_example(self, record: dict) -> Example:
        final = rewards.gsm8k_extract(record["answer"])
        return Example(
            prompt=PROMPT.format(question=record["question"].strip()),
            answer=record["answer"],
            meta={"final_answer": None if final is None else rewards.format_number(final),
                  "question": record["question"].strip()},
        )

    def reward(self, completion: str, example: Example) -> float:
        return rewards.gsm8k_reward(completion, example.answer)

    def extract_answer(self, completion: str) -> str | None:
        """Canonical text of the completion's number (``72``, ``2.5``), or None."""
        try:
            value = rewards.gsm8k_extract(completion)
        except Exception:  # noqa: BLE001
            return None
        return None if value is None else rewards.format_number(value)

    def is_correct(self, answer: str | None, example: Example) -> bool:
        return answer is not None and answer == example.meta["final_answer"]

    def sft_text(self, example: Example, rng: Any = 0, wrong_step_prob: float = 0.0) -> str:
        """The reference solution without calculator annotations (``wrong_step_prob`` must
        be 0: there is no rule to make a plausible wrong step in free text)."""
        if wrong_step_prob:
            raise ValueError("gsm8k has no synthetic wrong steps; use wrong_step_prob=0")
        return _CALCULATOR.sub("", example.answer).strip() + "\n"
