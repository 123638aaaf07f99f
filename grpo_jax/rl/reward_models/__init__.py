"""Reward models: an outcome reward model (ORM) and a process reward model (PRM).

Both are the policy's transformer trunk with the scalar value head (`model.value_outputs`),
read at different tokens of the sequence ``[bos] prompt completion [eos]``:

- ORM: one score per output, the head at the appended ``eos`` (the last real token),
  r_φ(q, o) = v_φ(q, o)_{|q|+|o|}. Trained with either
    pairwise Bradley-Terry    L = −log σ( r_φ(q, o⁺) − r_φ(q, o⁻) )      (o⁺ correct, o⁻ not)
    pointwise (sigmoid BCE)   L = −[ y log σ(r_φ) + (1 − y) log(1 − σ(r_φ)) ],  y = 1[o correct]
- PRM: one score per step, the head at the token where step j ends, r_φ^index(j); trained
  with the pointwise BCE per step against the step labels, averaged over every step of
  the batch. Step ends are character offsets into the completion (the format of
  ``Task.step_rewards``) mapped to token indices with ``token_end_offsets`` +
  ``char_to_token_index``: a step ends on the token covering its last character.

These are the reward models of DeepSeekMath §4.1 (r_φ of PPO's Eq. 3/4 and of GRPO with
outcome / process supervision). The paper trains them from the base model at lr 2e-5;
here `train_reward_model` starts from random, from a policy (a fresh value head is
added) or from an earlier reward model (continued training).

Iterative RL (Algorithm 1): after each iteration the reward model continues training on
new samples labelled by the rule, with a `ReplayBuffer` of historical samples making up
`replay_fraction` (10%) of every batch.

Host/device boundary: tokenising, batching, pairing and replay mixing are host-side
numpy; the forward, loss and AdamW update are one jitted function per training run
(fixed bucketed shapes, so it compiles once).

The package by role:
  data      labelled samples, rule labelling, their JSON-lines files, the replay buffer
            (host-side Python)
  scorer    `RewardModel`: what the trainer scores completions with; save / load
  training  the reward-model losses, `train_reward_model` and its accuracy metrics
  pretrain  `pretrain_trunk`: next-token training of the trunk a reward model starts from
  checks    the warnings: a model that ranks near chance, a score that rises as accuracy falls
  answer_check  the answer check: the trunk answers each question greedily, and completions
            that agree with it rank first (`add_answer_check`, `train_reward_model`'s answer_task)
"""
from grpo_jax.rl.reward_models.answer_check import AnswerCheck
from grpo_jax.rl.reward_models.data import (LabelledSample, ReplayBuffer, has_same_prompt_pair, label_completions,
                                         labelled_samples, line_step_ends, read_samples, replay_count,
                                         split_by_prompt, write_samples)
from grpo_jax.rl.reward_models.pretrain import pretrain_trunk
from grpo_jax.rl.reward_models.scorer import KINDS, LOSSES, READS, RewardModel
from grpo_jax.rl.reward_models.training import (add_answer_check, bradley_terry_loss, outcome_accuracy, pairwise_accuracy,
                                             pairwise_from_scores, pairwise_interval,
                                             pointwise_loss, step_accuracy, train_reward_model)

__all__ = [
    "AnswerCheck",
    "KINDS",
    "LOSSES",
    "READS",
    "LabelledSample",
    "ReplayBuffer",
    "RewardModel",
    "add_answer_check",
    "bradley_terry_loss",
    "pointwise_loss",
    "pretrain_trunk",
    "replay_count",
    "split_by_prompt",
    "has_same_prompt_pair",
    "label_completions",
    "labelled_samples",
    "line_step_ends",
    "pairwise_accuracy",
    "pairwise_from_scores",
    "pairwise_interval",
    "read_samples",
    "outcome_accuracy",
    "step_accuracy",
    "train_reward_model",
    "write_samples",
]
