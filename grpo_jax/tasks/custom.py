"""Your own task: prompts with reference answers and a Python reward function.

    task = CustomTask(prompts, reward)

``prompts`` is either a list of ``(prompt, answer)`` string pairs or a function
``question(rng: random.Random) -> (prompt, answer)`` that draws one; the trainer seeds the
``rng`` from ``(data.seed, step)``, so a resumed run sees the questions an uninterrupted one
would have. ``reward(prompt, completion, answer) -> float`` scores a completion (the
generated text only). That is the whole contract; everything else is optional:

- ``step_reward(prompt, completion, answer) -> list[float]``: process supervision
  (``rl.supervision=process``), one reward per line of the completion, in order (a step is
  a line, including its newline).
- ``solution(prompt, answer, rng) -> str``: the worked solution SFT trains on (and the
  tokenizer is trained on); default: the answer itself.
- ``correct_reward``: a completion counts as correct (RFT's and DPO's 𝕀(o), accuracy) when
  its reward is at least this (default 1.0).
- ``eval_prompts``: held-out ``(prompt, answer)`` pairs; default: the list itself, or
  distinct draws of ``question`` whose prompt falls in the held-out split (a stable hash of
  the prompt text, `grpo_jax.tasks.split_of`): training then never draws those prompts.
- ``tool``: a `grpo_jax.tools.PythonTool` the policy may call (rl.max_tool_calls > 0): its
  code blocks run in a sandbox and their outputs join the completion the reward reads.
- ``shortcuts(train_examples) -> {name: guess(example) -> answer}``: rules that answer
  without the skill, reported beside every held-out accuracy (`grpo_jax.tasks.shortcuts`; the
  commonest answer is always reported).

The reward function runs on untrusted model text: it must not ``eval`` it. A ``bool`` it
returns counts as 0 or 1. A reward that raises, or returns anything but a finite real number,
stops the run with a :class:`RewardFunctionError` naming the prompt and the completion; the
trainer calls it at start-up (scoring the shortcut rules' answers), so a broken one stops the
run before its first step.
"""

from __future__ import annotations

import math
import numbers
import random
from typing import Callable, Sequence, Union

from grpo_jax.errors import GrpoJaxError
from grpo_jax.tasks import Example, Task, draw_distinct, split_of

Pair = tuple[str, str]
Question = Callable[[random.Random], Pair]
Reward = Callable[[str, str, str], float]


class RewardFunctionError(GrpoJaxError):
    """A user reward (or prompt) function broke its contract; the message names the prompt."""


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


class CustomTask(Task):
    """A :class:`Task` from prompts and reward functions (see the module docstring)."""

    def __init__(self, prompts: Union[Sequence[Pair], Question], reward: Reward, *,
                 step_reward: Callable[[str, str, str], Sequence[float]] | None = None,
                 solution: Callable[[str, str, random.Random], str] | None = None,
                 correct_reward: float = 1.0, eval_prompts: Sequence[Pair] | None = None,
                 shortcuts: Callable[[list[Example]], dict] | None = None, name: str = "custom",
                 tool=None):
        if callable(prompts):
            self._question, self._pairs = prompts, None
        else:
            self._question, self._pairs = None, [self._checked_pair(p, f"prompts[{i}]")
                                                 for i, p in enumerate(prompts)]
            if not self._pairs:
                raise ValueError("CustomTask: the prompt list is empty")
        self._eval_pairs = None if eval_prompts is None else [
            self._checked_pair(p, f"eval_prompts[{i}]") for i, p in enumerate(eval_prompts)]
        self._reward, self._step_reward, self._solution = reward, step_reward, solution
        self.correct_reward, self.name, self._shortcuts = correct_reward, name, shortcuts
        self.tool = tool

    @staticmethod
    def _checked_pair(pair, where: str) -> Pair:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise RewardFunctionError(f"{where} must be a (prompt, answer) pair of strings, got {pair!r}")
        return pair[0], pair[1]

    # ------------------------------------------------------------------ questions
    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """Train: ``n`` questions drawn with a ``random.Random`` seeded by (split, seed); held
        out: the first ``n`` held-out pairs, or ``n`` distinct drawn questions of the split
        (fixed, so every evaluation sees the same ones). Drawn training questions skip the
        held-out prompts."""
        rng = random.Random(f"{self.name}/{split}/{seed}")
        if split != "train" and self._eval_pairs is not None:
            pairs = self._eval_pairs[:n]
        elif self._pairs is not None:
            pairs = self._pairs[:n] if split != "train" else [rng.choice(self._pairs) for _ in range(n)]
        elif split == "train":
            pairs = []
            for _ in range(200 * n + 1000):
                if len(pairs) == n:
                    break
                pair = self._draw(rng, split, seed)
                if split_of(pair[0]) == "train":
                    pairs.append(pair)
            if len(pairs) != n:
                raise RewardFunctionError(f"question(rng) gave too few training prompts ({len(pairs)} of {n})")
        else:
            try:
                pairs = draw_distinct(lambda: self._draw(rng, split, seed), lambda p: p[0], split, n,
                                      tries=200 * n + 1000)
            except ValueError as e:
                raise RewardFunctionError(f"{e}: question(rng) has too few distinct {split} prompts for "
                                          f"{n} held-out questions; draw from a larger space, ask for "
                                          "fewer (data.eval_size) or pass eval_prompts") from None
        return [Example(prompt, answer) for prompt, answer in pairs]

    def _draw(self, rng: random.Random, split: str, seed: int) -> Pair:
        return self._checked_pair(self._question(rng), f"question(rng) for {split} seed {seed}")

    def shortcuts(self, train: list[Example]) -> dict:
        return {} if self._shortcuts is None else dict(self._shortcuts(train))

    def sft_text(self, example: Example, rng=0, wrong_step_prob: float = 0.0) -> str:
        if self._solution is None:
            return example.answer
        text = self._solution(example.prompt, example.answer, rng if isinstance(rng, random.Random)
                              else random.Random(rng))
        if not isinstance(text, str):
            raise RewardFunctionError(f"solution() must return a str, got {type(text).__name__} "
                                      f"for prompt {_short(example.prompt)}")
        return text

    # ------------------------------------------------------------------ scoring (host side)
    def _call(self, fn, what: str, completion: str, example: Example):
        try:
            return fn(example.prompt, completion, example.answer)
        except Exception as e:
            raise RewardFunctionError(
                f"{what} raised {type(e).__name__}: {e} — for prompt {_short(example.prompt)}, "
                f"completion {_short(completion)}, answer {_short(example.answer)}") from e

    def _number(self, value, what: str, completion: str, example: Example) -> float:
        # A bool is a Real: `return completion.strip() == answer` scores 0 or 1, as people mean it.
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardFunctionError(
                f"{what} must return a finite float (or a bool: 0/1), got {value!r} ({type(value).__name__}) for "
                f"prompt {_short(example.prompt)}, completion {_short(completion)}")
        return float(value)

    def reward(self, completion: str, example: Example) -> float:
        value = self._call(self._reward, "reward()", completion, example)
        return self._number(value, "reward()", completion, example)

    def step_rewards(self, completion: str, example: Example) -> list[tuple[int, float]]:
        """One (character end, reward) per line, from ``step_reward``; without one, the
        outcome reward as a single step."""
        if self._step_reward is None:
            return super().step_rewards(completion, example)
        values = self._call(self._step_reward, "step_reward()", completion, example)
        lines = completion.splitlines(keepends=True)
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != len(lines):
            raise RewardFunctionError(
                f"step_reward() must return one float per line ({len(lines)} lines), got {values!r} "
                f"for prompt {_short(example.prompt)}, completion {_short(completion)}")
        ends, end = [], 0
        for line in lines:
            end += len(line)
            ends.append(end)
        return [(e, self._number(v, "step_reward()", completion, example)) for e, v in zip(ends, values)]

    def extract_answer(self, completion: str) -> str | None:
        """The completion without surrounding white space: majority voting compares whole
        completions, which suits short answers."""
        return completion.strip()

    def is_correct(self, answer: str | None, example: Example) -> bool:
        return answer is not None and self.reward(answer, example) >= self.correct_reward


__all__ = ["CustomTask", "RewardFunctionError"]
