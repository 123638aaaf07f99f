"""Host-side batch building: from sampled rollouts or texts to the device ``Batch``.

Everything here runs in Python/numpy between the jitted sampler and the jitted train step
(the boundary of ``trainer.Trainer.make_batch``):

    rollout (sampler) ─ Rollout.completion_ids / decode ─ score_rollout ─▶ Scores (host, untrusted text)
    rollout + Scores ─ batch_from_rollout / preference_pairs ─▶ Batch ─▶ train step
    (prompt, completion) texts ─ texts_to_batch ─▶ Batch (SFT)

``make_batch`` is the one place the defaults of a ``Batch`` (no rewards, no steps) live.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.struct
import jax
import numpy as np

from grpo_jax import shapes
from grpo_jax.tasks import Example, Task
from grpo_jax.text.tokenizer import Tokenizer, char_to_token_index, encode_prompt

__all__ = ["Batch", "Scores", "make_batch", "batch_from_rollout", "score_rollout", "texts_to_batch",
           "preference_pairs"]



@flax.struct.dataclass
class Batch:
    """One batch of B rows. Row p·G + g is output g for question p (DPO: row 2p chosen,
    2p+1 rejected). Completion token t of a row is predicted from its prompt and tokens <t."""

    prompt_tokens: Any  # [B, Tp] int32, left-padded
    prompt_mask: Any  # [B, Tp] bool
    tokens: Any  # [B, Tc] int32, completion, right-padded
    mask: Any  # [B, Tc] bool, real completion tokens incl. the stop token
    sample_logprobs: Any  # [B, Tc] f32, the sampler's log-probs (0 if not sampled)
    rewards: Any  # [B] f32, outcome reward / score per output
    correct: Any  # [B] bool, rule correctness (RFT / Online RFT)
    truncated: Any  # [B] bool, hit max_new_tokens without a stop token
    step_rewards: Any  # [B, S] f32, process-supervision reward per step
    step_end: Any  # [B, S] int32, completion token index where each step ends
    step_mask: Any  # [B, S] bool, real steps
    # [B, Tc] bool, the tokens a tool wrote (multi-turn rollouts, ``sampler.turns``): in the
    # context (``mask`` holds them), out of the loss (``algorithms.own_tokens``); None: no tool.
    tool_mask: Any = None
    # The rows' sequences packed for the forward passes (rl.pack; ``packing.pack``), or None.
    packing: Any = None


def make_batch(prompt_tokens, prompt_mask, tokens, mask, *, sample_logprobs=None, rewards=None,
               correct=None, truncated=None, step_rewards=None, step_end=None,
               step_mask=None, tool_mask=None) -> Batch:
    """A Batch with defaults for what is not given: zero log-probs and rewards, not
    correct, not truncated, and one empty step slot (S = 1, step_mask False). The one place
    these defaults live (``batch_from_rollout`` and ``texts_to_batch`` come through here)."""
    tokens = _host(tokens, np.int32)
    rows, tc = tokens.shape
    zeros = lambda shape, dtype: np.zeros(shape, dtype)
    step_rewards = zeros((rows, 1), np.float32) if step_rewards is None else _host(step_rewards, np.float32)
    s = step_rewards.shape[1]
    return Batch(
        prompt_tokens=_host(prompt_tokens, np.int32), prompt_mask=_host(prompt_mask, bool),
        tokens=tokens, mask=_host(mask, bool),
        sample_logprobs=zeros((rows, tc), np.float32) if sample_logprobs is None else _host(sample_logprobs, np.float32),
        rewards=zeros((rows,), np.float32) if rewards is None else _host(rewards, np.float32),
        correct=zeros((rows,), bool) if correct is None else _host(correct, bool),
        truncated=zeros((rows,), bool) if truncated is None else _host(truncated, bool),
        step_rewards=step_rewards,
        step_end=zeros((rows, s), np.int32) if step_end is None else _host(step_end, np.int32),
        step_mask=zeros((rows, s), bool) if step_mask is None else _host(step_mask, bool),
        tool_mask=None if tool_mask is None else _host(tool_mask, bool))


def batch_from_rollout(rollout, rewards, correct, step_rewards=None, step_end=None,
                       step_mask=None) -> Batch:
    """Host-side: a sampler ``Rollout`` plus host-computed rewards -> ``Batch``.

    ``truncated`` = not ``rollout.finished`` (cut at max_new_tokens); the sampler's arrays
    are kept as they are (``make_batch`` keeps arrays of the right dtype); rewards etc. are numpy.
    """
    rows = rollout.tokens.shape[0]
    return make_batch(rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens, rollout.mask,
                      sample_logprobs=rollout.logprobs, rewards=np.asarray(rewards).reshape(rows),
                      correct=np.asarray(correct).reshape(rows), truncated=~_host(rollout.finished, bool),
                      step_rewards=step_rewards, step_end=step_end, step_mask=step_mask,
                      tool_mask=rollout.tool_mask)


def _host(x, dtype):
    """``x`` as ``dtype``: a device array that already has it stays where it is (a sampler's
    rollout on the mesh); anything else becomes numpy."""
    if isinstance(x, jax.Array) and x.dtype == dtype:
        return x
    return np.asarray(x).astype(dtype, copy=False)


@dataclasses.dataclass
class Scores:
    """Host-side judgement of B completions (row p*G+g)."""

    texts: list[str]
    rewards: np.ndarray  # [B] float32
    correct: np.ndarray  # [B] bool
    step_rewards: np.ndarray  # [B,S] float32
    step_end: np.ndarray  # [B,S] int32, completion token index where the step ends
    step_mask: np.ndarray  # [B,S] bool


def score_rollout(task: Task, tokenizer: Tokenizer, examples: Sequence[Example], rollout,
                  group_size: int, *, reward_model=None, process: bool = False) -> Scores:
    """Decode each completion and score it with the task's rules (or a reward model).

    Model text is untrusted: it only ever reaches the task's reward functions, which parse
    it with bounded whitelisted evaluators and never eval it. In a rollout with tools the
    answer is read from the model's own text (`evaluation.own_text`, as the evaluation's
    `final_answer`): a \\boxed{} or an answer line the code printed is never the answer.
    """
    from grpo_jax.eval.evaluation import own_text

    tokens = np.asarray(rollout.tokens)
    b = tokens.shape[0]
    stop_ids = list(tokenizer.stop_ids)
    ids_per_row = [rollout.completion_ids(r, stop_ids) for r in range(b)]
    texts = [tokenizer.decode(ids) for ids in ids_per_row]
    row_examples = [examples[r // group_size] for r in range(b)]
    answered = texts if rollout.tool_mask is None else [own_text(rollout, r, tokenizer) for r in range(b)]
    correct = np.array([task.is_correct(task.extract_answer(t), ex) for t, ex in zip(answered, row_examples)], bool)
    prompts = [ex.prompt for ex in row_examples]
    # A reward model of either kind serves both supervisions (RewardModel.score: an ORM's
    # final value or a PRM's reduced step scores; step_scores: a PRM's steps or an ORM's
    # score as one step), so it is never silently bypassed.
    if reward_model is not None:
        rewards = np.asarray(reward_model.score(prompts, texts), np.float32)
    else:
        rewards = np.array([task.reward(t, ex) for t, ex in zip(texts, row_examples)], np.float32)
    steps_per_row = [[] for _ in range(b)]
    if process:
        if reward_model is not None:
            steps_per_row = reward_model.step_scores(prompts, texts)
        else:
            steps_per_row = [task.step_rewards(t, ex) for t, ex in zip(texts, row_examples)]
        steps_per_row = [list(steps) if ids else [] for ids, steps in zip(ids_per_row, steps_per_row)]
    # Every step is kept: the step axis grows to the batch's most steps, rounded up to a
    # power of two so the train step compiles for few shapes.
    s = shapes.bucket_length(max(len(x) for x in steps_per_row), minimum=1) if process else 1
    step_rewards = np.zeros((b, s), np.float32)
    step_end = np.zeros((b, s), np.int32)
    step_mask = np.zeros((b, s), bool)
    for r, (ids, steps) in enumerate(zip(ids_per_row, steps_per_row)):
        if not steps:
            continue
        ends = tokenizer.token_end_offsets(ids)
        for j, (char_end, value) in enumerate(steps):
            step_rewards[r, j] = value
            step_end[r, j] = char_to_token_index(ends, char_end)
            step_mask[r, j] = True
    return Scores(texts, rewards, correct, step_rewards, step_end, step_mask)


def texts_to_batch(tokenizer: Tokenizer, prompts: Sequence[str], completions: Sequence[str], *,
                   max_new_tokens: int, prompt_bucket: int | None = None) -> Batch:
    """Teacher-forced batch (SFT data): left-padded prompts, right-padded completions + eos."""
    p_ids = [encode_prompt(tokenizer, p) for p in prompts]
    c_ids = [(tokenizer.encode(c) + [tokenizer.eos_id])[:max_new_tokens] for c in completions]
    tp = prompt_bucket or shapes.bucket_length(max(len(x) for x in p_ids))
    if max(len(x) for x in p_ids) > tp:
        raise ValueError(f"a prompt has {max(len(x) for x in p_ids)} tokens, more than the bucket {tp}")
    b = len(prompts)
    pt = np.full((b, tp), tokenizer.pad_id, np.int32)
    pm = np.zeros((b, tp), bool)
    ct = np.full((b, max_new_tokens), tokenizer.pad_id, np.int32)
    cm = np.zeros((b, max_new_tokens), bool)
    for i, (p, c) in enumerate(zip(p_ids, c_ids)):
        pt[i, tp - len(p):] = p
        pm[i, tp - len(p):] = True
        ct[i, : len(c)] = c
        cm[i, : len(c)] = True
    return make_batch(pt, pm, ct, cm, rewards=np.ones((b,), np.float32), correct=np.ones((b,), bool))


def preference_pairs(rollout, scores: Scores, group_size: int, num_pairs: int) -> tuple[Any, np.ndarray]:
    """DPO data from G samples per question: rows (chosen, rejected) = (first correct, first
    incorrect) per question that has both, padded to `num_pairs` pairs with fully masked rows
    (zero gradient) so the compiled shape never changes. Returns (row arrays, pair mask)."""
    rows, valid = [], []
    for p in range(len(scores.correct) // group_size):
        group = range(p * group_size, (p + 1) * group_size)
        good = [r for r in group if scores.correct[r]]
        bad = [r for r in group if not scores.correct[r]]
        if good and bad and len(rows) < 2 * num_pairs:
            rows += [good[0], bad[0]]
            valid += [True, True]
    while len(rows) < 2 * num_pairs:
        rows += [0, 0]
        valid += [False, False]
    return np.array(rows), np.array(valid)
