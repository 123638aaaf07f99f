"""The answer check: a reward model whose trunk also answers the question.

A reward model's trunk, trained with the joint next-token loss, is a language model of right
solutions. Read as one, it answers each question greedily; a completion whose final answer
(the task's ``extract_answer``) agrees with that answer is ranked above every one that does
not, and the model's own score orders completions within each side:

    ORM / PRM, Bradley-Terry (identity) scores   r'(q, o) = r(q, o) + margin · a(q, o)
    sigmoid scores in (0, 1)                      r'(q, o) = (σ(r(q, o)) + a(q, o)) / 2

a(q, o) = 1[extract(o) = extract(greedy(q))], 0 when either has no answer. ``margin`` is the
spread of the model's own scores over its training samples, so agreement decides first on
every pair within that range; the sigmoid form stays in (0, 1), with agreement deciding at ½.
A PRM's step scores (`RewardModel.step_scores`) stay its own, judged on progress labels: the
check is about the answer, so it enters the outcome score alone.

Why: the score of a likelihood-aware ORM is, in effect, the trunk's likelihood of each line
(docs/reward_models.md, "What the ORMs rank by"), and no reduction of per-line likelihoods
sees two wrong lines that cancel. Solving the question does. The greedy answers are cached per
question: the trainer decodes each group's question once. Decoding, extraction and comparison
are host-side; the completion's text is untrusted and only ever reaches ``extract_answer``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

# The most questions whose greedy answers one model keeps; past it the cache starts afresh.
CACHE_QUESTIONS = 65536


@dataclasses.dataclass(frozen=True)
class AnswerCheck:
    """How a reward model checks answers: ``extract`` (the task's ``extract_answer``, untrusted
    text in, answer or None out), ``task`` (the task's name, to rebuild ``extract`` on load),
    ``margin`` (identity scores: what agreeing adds) and ``max_new_tokens`` (the greedy
    answer's length bound, at most the room the model's ``max_seq_len`` leaves)."""

    extract: Callable[[str], str | None]
    task: str
    margin: float
    max_new_tokens: int

    def __post_init__(self):
        if not np.isfinite(self.margin) or self.margin <= 0:
            raise ValueError(f"answer check margin must be a finite number > 0, got {self.margin}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"answer check max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")

    def meta(self) -> dict:
        """What `RewardModel.save` records (the extractor is rebuilt from ``task``)."""
        return {"task": self.task, "margin": float(self.margin), "max_new_tokens": self.max_new_tokens}


def combine(scores: np.ndarray, agree: np.ndarray, transform: str, margin: float) -> np.ndarray:
    """scores [B] (the model's own, after its transform), agree [B] in {0, 1} -> [B] float32:
    agreement first, the score within each side (module docstring)."""
    scores, agree = np.asarray(scores, np.float32), np.asarray(agree, np.float32)
    if transform == "sigmoid":
        return ((scores + agree) / 2).astype(np.float32)
    return (scores + np.float32(margin) * agree).astype(np.float32)


def spread_margin(scores: Sequence[float]) -> float:
    """The margin of identity scores: their spread (max - min) over the training samples, at
    least 1, so agreement decides first on every pair of scores in that range."""
    scores = np.asarray(scores, np.float64)
    if scores.size == 0 or not np.all(np.isfinite(scores)):
        raise ValueError("the answer check's margin needs finite scores of at least one training sample")
    return float(max(1.0, scores.max() - scores.min()))


class GreedyAnswers:
    """The trunk's greedy answer to each question, decoded on first sight and cached."""

    def __init__(self, cfg, params, tokenizer, check: AnswerCheck, *, prompts_per_call: int = 256):
        self.cfg, self.params, self.tokenizer, self.check = cfg, params, tokenizer, check
        self.prompts_per_call = prompts_per_call
        self._answers: dict[str, str | None] = {}
        self._weights = None

    def __call__(self, prompts: Sequence[str]) -> list[str | None]:
        """The greedy answer to each of ``prompts`` [B] (None: the trunk wrote none, or the
        question leaves no room to answer within ``max_seq_len``)."""
        todo = sorted({p for p in prompts if p not in self._answers})
        if todo:
            if len(self._answers) + len(todo) > CACHE_QUESTIONS:
                self._answers.clear()
            self._answers.update(zip(todo, self._decode(todo)))
        return [self._answers[p] for p in prompts]

    def _decode(self, prompts: list[str]) -> list[str | None]:
        from grpo_jax.sampler.host import Sampler
        from grpo_jax.sampler.settings import SamplingParams
        from grpo_jax.text.tokenizer import encode_prompt

        ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        room = [self.cfg.max_seq_len - len(x) for x in ids]
        fits = [i for i, r in enumerate(room) if r >= 1]
        out: list[str | None] = [None] * len(prompts)
        for lo in range(0, len(fits), self.prompts_per_call):
            rows = fits[lo:lo + self.prompts_per_call]
            new = min(self.check.max_new_tokens, min(room[i] for i in rows))
            sampler = Sampler(self.cfg, None, SamplingParams(new, temperature=0.0, stop_tokens=self.tokenizer.stop_ids,
                                                             pad_id=self.tokenizer.pad_id))
            if self._weights is None:
                self._weights = sampler.copy(self.params)
            rollout = sampler.generate(self._weights, [ids[i] for i in rows], key=jax.random.key(0))
            for r, i in enumerate(rows):
                text = self.tokenizer.decode(rollout.completion_ids(r, self.tokenizer.stop_ids))
                out[i] = self.check.extract(text)
        return out


def agreement(answers: Sequence[str | None], completions: Sequence[str],
              extract: Callable[[str], str | None]) -> np.ndarray:
    """[B] float32: 1 where completion b's answer is the (non-None) greedy answer to its question."""
    if len(answers) != len(completions):
        raise ValueError(f"{len(answers)} greedy answers for {len(completions)} completions")
    return np.asarray([float(a is not None and extract(c) == a) for a, c in zip(answers, completions)], np.float32)
