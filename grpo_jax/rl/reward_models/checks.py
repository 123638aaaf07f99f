"""Warnings that keep a run from optimising a reward model that does not measure the task.

Two failures were measured on the testbed (docs/studies/figure5_testbed_rm/results.md):
reward models that ranked a right answer above a wrong one at chance, and GRPO runs scored by
them whose reward-model score rose while held-out accuracy fell below the SFT start. Both
were silent. `ranking_warning` speaks after a reward model is trained and evaluated, on the
score RL reads; `own_score_warning` on the model's own score (without its answer check), which
the check can hide: a checked score ranks by the trunk's answers, so a head at chance behind
a trunk that answers well passes `ranking_warning`, and a PRM's step scores, which process
supervision rewards, never see the check. `answer_check_warning` speaks when the check ranks
worse than the own score (its trunk answers the task's questions too badly to check them);
`hacking_warning` speaks during RL, from the trainer's evaluations.
"""
from __future__ import annotations

import math
from typing import Sequence

# Below this held-out pairwise accuracy (chance 0.5) a reward model is not worth training on.
RANKS_AT = 0.7
# Consecutive evaluation intervals over which the score rose and the accuracy fell.
HACKING_INTERVALS = 2


def ranking_warning(pairwise: float, *, threshold: float = RANKS_AT) -> str | None:
    """One line when a reward model's held-out pairwise accuracy (same-question right output
    ranked above wrong, `pairwise_accuracy`) is below ``threshold`` or unknown; else None."""
    if math.isnan(pairwise):
        return ("warning: the reward model's held-out pairwise accuracy is unknown (no question with a "
                "right and a wrong sample); check it before RL trains on it")
    if pairwise < threshold:
        return (f"warning: the reward model ranks a right answer above a wrong one on {pairwise:.3f} of "
                f"held-out pairs (chance 0.5, threshold {threshold}); RL scored by it optimises the "
                "model, not the task")
    return None


def own_score_warning(own: float, *, checked: float | None = None, threshold: float = RANKS_AT) -> str | None:
    """One line when a reward model's own score (the ORM's head, a PRM's minimum over its step
    scores; no answer check) ranks held-out pairs below ``threshold`` or unknown, whether or
    not an answer check lifts the score RL reads (``checked``, its pairwise); else None."""
    if math.isnan(own):
        return ("warning: the reward model's own score (without the answer check) has an unknown held-out "
                "pairwise accuracy (no question with a right and a wrong sample); check it before RL trains on it")
    if own >= threshold:
        return None
    lifted = ("" if checked is None or math.isnan(checked) else
              f"; the answer check's {checked:.3f} is its trunk's answers, not this score")
    return (f"warning: the reward model's own score (without the answer check; a PRM's minimum over steps, what "
            f"process supervision rewards) ranks a right answer above a wrong one on {own:.3f} of held-out pairs "
            f"(chance 0.5, threshold {threshold}){lifted}")


def answer_check_warning(with_check: float, without: float, trunk_accuracy: float) -> str | None:
    """One line when a reward model's held-out pairwise accuracy with its answer check is
    below that of its own score alone; else None (also when either is unknown)."""
    if math.isnan(with_check) or math.isnan(without) or with_check >= without:
        return None
    return (f"warning: the answer check lowers held-out pairwise accuracy from {without:.3f} to {with_check:.3f} "
            f"(the trunk answers {trunk_accuracy:.3f} of the questions right); train with --no-answer-check")


def hacking_warning(evaluations: Sequence[tuple[int, float, float]], *,
                    intervals: int = HACKING_INTERVALS) -> str | None:
    """One line when, over the last ``intervals`` consecutive evaluation intervals, the reward
    model's mean score on the greedy outputs rose every time while the rule's held-out accuracy
    fell every time; else None. ``evaluations``: (step, reward-model score, accuracy), in order."""
    if intervals < 1:
        raise ValueError(f"intervals must be >= 1, got {intervals}")
    last = list(evaluations)[-(intervals + 1):]
    if len(last) < intervals + 1:
        return None
    pairs = list(zip(last, last[1:]))
    if all(b[1] > a[1] and b[2] < a[2] for a, b in pairs):
        (s0, r0, a0), (s1, r1, a1) = last[0], last[-1]
        return (f"warning: reward hacking? from step {s0} to {s1} the reward model's score rose "
                f"{r0:.3f} -> {r1:.3f} while held-out accuracy fell {a0:.3f} -> {a1:.3f}, at each of "
                f"{intervals} evaluations")
    return None
