"""The data sources D of the unified paradigm (DeepSeekMath §5.2.1, Eq. 5): where a step's
(q, o) come from, as objects the algorithms name (``Algorithm.data_source``).

    | source           | q        | o                               | rows per question |
    | dataset          | P_sft    | the SFT data's own solutions    | 1                 |
    | sft_policy       | P_sft    | G sampled offline from π_sft    | G                 |
    | policy           | P_sft    | G sampled online from π_θ       | G                 |
    | sft_policy_pairs | P_sft    | (o+, o−) of G drawn from π_sft  | 2                 |

Each source builds the step's host `Batch` (`DataSource.batch`) from what the run it is
given offers, so the trainer names no source:

* ``run.cfg``, ``run.tokenizer``;
* ``run.sft_data(step) -> (prompts, completions)`` (the dataset source only);
* ``run.questions(step) -> [Example]``, the step's P questions;
* ``run.rollout(examples, key, offline) -> (Rollout, Scores, info)``: G completions per
  question drawn from π_θ (or, ``offline``, from π_sft) and scored on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from grpo_jax.rl.batching import Batch, batch_from_rollout, preference_pairs, texts_to_batch


@dataclasses.dataclass(frozen=True)
class DataSource:
    """One data source: its ``name`` (the table above), whether its completions are
    ``sampled`` (False: the SFT data's own), and whether they come from the frozen π_sft
    (``offline``: the run keeps a copy of the starting weights to sample)."""

    name: str
    sampled: bool = True
    offline: bool = False

    def rows_per_question(self, group_size: int) -> int:
        """Rows a question takes in a train batch: G sampled, 1 from the dataset."""
        return group_size if self.sampled else 1

    def batch(self, run, step: int, key) -> tuple[Batch, dict]:
        """The step's host batch of data.batch_size x `rows_per_question` rows, and its info
        (rollout metrics), from ``run``."""
        raise NotImplementedError


class Dataset(DataSource):
    """(q, o) from the SFT data: teacher-forced, nothing sampled."""

    def batch(self, run, step, key):
        prompts, completions = run.sft_data(step)
        return texts_to_batch(run.tokenizer, prompts, completions, max_new_tokens=run.cfg.rl.max_new_tokens), {}


class Sampled(DataSource):
    """G completions per question, every row kept: row p·G + g is output g of question p."""

    def batch(self, run, step, key):
        rollout, scores, info = run.rollout(run.questions(step), key, self.offline)
        return batch_from_rollout(rollout, scores.rewards, scores.correct, scores.step_rewards, scores.step_end,
                                  scores.step_mask), info


class Pairs(DataSource):
    """G completions per question drawn from π_sft, kept as one (chosen, rejected) pair per
    question that has both (rows 2p, 2p + 1; ``batching.preference_pairs``), padded with
    fully masked pairs to data.batch_size pairs so the compiled shape never changes."""

    def rows_per_question(self, group_size):
        return 2

    def batch(self, run, step, key):
        rollout, scores, info = run.rollout(run.questions(step), key, self.offline)
        rows, valid = preference_pairs(rollout, scores, run.cfg.rl.group_size, run.cfg.data.batch_size)
        pick = lambda x: np.asarray(x)[rows]
        pairs = jax.tree.map(pick, rollout)
        pairs = pairs.replace(mask=np.asarray(pairs.mask) & valid[:, None])
        return batch_from_rollout(pairs, pick(scores.rewards), pick(scores.correct)), {
            **info, "pairs_fraction": float(valid.mean())}


DATASET = Dataset("dataset", sampled=False)
SFT_POLICY = Sampled("sft_policy", offline=True)
POLICY = Sampled("policy")
SFT_POLICY_PAIRS = Pairs("sft_policy_pairs", offline=True)
DATA_SOURCES = (DATASET, SFT_POLICY, POLICY, SFT_POLICY_PAIRS)
