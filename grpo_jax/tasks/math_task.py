"""MATH (Hendrycks et al.) with a chain-of-thought prompt; scored by
:func:`grpo_jax.tasks.rewards.math_reward` (last ``\\boxed{}``, normalised, bounded equivalence).

Prompt::

    Problem: <problem>
    Reason step by step, and put the final answer inside \\boxed{}.
    Solution:
    <- the model writes here

``Example.answer`` is MATH's full solution; ``meta`` holds ``level``, ``type``, ``id`` and
the canonical final answer.
"""
from __future__ import annotations

from typing import Any

from grpo_jax.tasks import rewards
from grpo_jax.tasks import Example
from grpo_jax.tasks.dataset_task import DatasetTask

PROMPT = (
    "Problem: {problem}\n"
    "Reason step by step, and put the final answer inside \\boxed{{}}.\n"
    "Solution:\n"
)


class MathTask(DatasetTask):
    name = "math"
    dataset = "math"
    prompt_style = "math"

    def to_example(self, record: dict) -> Example:
        boxed = rewards.last_boxed(record["solution"])
        return Example(
            prompt=PROMPT.format(problem=record["problem"].strip()),
            answer=record["solution"],
            meta={
                "id": record.get("id", ""),
                "level": record.get("level", ""),
                "type": record.get("type", ""),
                "final_answer": None if boxed is None else rewards.canonical_math_answer(boxed),
                "question": record["problem"].strip(),
            },
        )

    def reward(self, completion: str, example: Example) -> float:
        return rewards.math_reward(completion, example.answer)

    def extract_answer(self, completion: str) -> str | None:
        """Canonical form of the last ``\\boxed{}`` (equal strings = same vote), or None."""
        try:
            if not isinstance(completion, str) or len(completion) > rewards.MAX_COMPLETION_CHARS:
                return None
            boxed = rewards.last_boxed(completion)
            return None if boxed is None else rewards.canonical_math_answer(boxed) or None
        except Exception:  # noqa: BLE001
            return None

    def is_correct(self, answer: str | None, example: Example) -> bool:
        final = example.meta["final_answer"]
        return answer is not None and final is not None and rewards.math_equivalent(answer, final)

    def sft_text(self, example: Example, rng: Any = 0, wrong_step_prob: float = 0.0) -> str:
        """The reference solution (``wrong_step_prob`` must be 0)."""
        if wrong_step_prob:
            raise ValueError("math has no synthetic wrong steps; use wrong_step_prob=0")
        return example.answer.strip() + "\n"
