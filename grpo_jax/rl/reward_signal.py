"""Whether GRPO has anything to learn from: a group whose rewards are all equal gives every one of
its completions advantage 0, so a run in which no group varies (a randomly initialised model that
never earns a reward) updates nothing, and its losses read 0. The Trainer says so once it has
gone `NO_SIGNAL_STEPS` steps in a row that way."""

from __future__ import annotations

from typing import Mapping

# Long enough that a few unlucky batches of a run that learns do not trip it.
NO_SIGNAL_STEPS = 10
NO_SIGNAL = "no group has varying rewards: GRPO has no signal; start from SFT (sft_then_rl) or a pretrained model"


def flat_steps(streak: int, metrics: Mapping[str, float]) -> int:
    """The steps in a row, up to this one, in which no group's rewards varied, from the streak
    before it; 0 when the step's metrics have no groups (algorithms without them)."""
    return streak + 1 if metrics.get("groups_varying_fraction", 1.0) == 0.0 else 0


def warning(streak: int, done: int) -> str | None:
    """The warning to log after step ``done``, once per streak of `NO_SIGNAL_STEPS` flat steps."""
    if streak != NO_SIGNAL_STEPS:
        return None
    return f"steps {done - streak + 1}-{done}: {NO_SIGNAL}"
