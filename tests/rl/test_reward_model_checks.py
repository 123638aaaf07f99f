"""The reward-model warnings: a model that ranks near chance (the score RL reads, or its own
score behind the answer check), an answer check that ranks worse than the model's own score,
and a score that rises while held-out accuracy falls (reward hacking), each said in one line,
the last by the trainer."""
import logging
import math

import numpy as np
import pytest

from grpo_jax.rl.reward_models.checks import (RANKS_AT, answer_check_warning, hacking_warning, own_score_warning,
                                           ranking_warning)
from tests.rl.test_trainer import tok  # noqa: F401  (the fixture)


@pytest.mark.parametrize("pairwise, warns", [(0.5, True), (0.699, True), (RANKS_AT, False), (0.95, False),
                                             (math.nan, True)])
def test_ranking_warning_below_the_threshold(pairwise, warns):
    line = ranking_warning(pairwise)
    assert (line is not None) is warns
    if warns:
        assert "\n" not in line and line.startswith("warning:")
        if not math.isnan(pairwise):
            assert f"{pairwise:.3f}" in line


@pytest.mark.parametrize("with_check, without, warns", [(0.80, 0.84, True), (0.84, 0.84, False), (0.96, 0.84, False),
                                                      (math.nan, 0.84, False), (0.9, math.nan, False)])
def test_answer_check_warning_when_the_check_ranks_worse(with_check, without, warns):
    line = answer_check_warning(with_check, without, 0.31)
    assert (line is not None) is warns
    if warns:
        assert "\n" not in line and line.startswith("warning:") and "--no-answer-check" in line
        assert "from 0.840 to 0.800" in line and "0.310 of the questions" in line


@pytest.mark.parametrize("evals, warns", [
    ([(10, 0.1, 0.5), (20, 0.2, 0.4), (30, 0.3, 0.3)], True),  # rose twice, fell twice
    ([(10, 0.1, 0.5), (20, 0.2, 0.4)], False),  # one interval only
    ([(10, 0.1, 0.5), (20, 0.2, 0.4), (30, 0.3, 0.4)], False),  # accuracy flat at the end
    ([(10, 0.1, 0.5), (20, 0.2, 0.6), (30, 0.3, 0.3)], False),  # accuracy rose once
    ([(10, 0.3, 0.5), (20, 0.2, 0.4), (30, 0.1, 0.3)], False),  # both fell: no hacking
    ([(0, 0.0, 0.9), (10, 0.3, 0.1), (20, 0.1, 0.5), (30, 0.2, 0.4), (40, 0.3, 0.3)], True),  # the last two
])
def test_hacking_warning_needs_consecutive_opposite_moves(evals, warns):
    assert (hacking_warning(evals) is not None) is warns


def test_hacking_warning_names_the_steps_and_values():
    line = hacking_warning([(10, 0.1, 0.5), (20, 0.2, 0.4), (30, 0.35, 0.25)])
    assert "step 10 to 30" in line and "0.100 -> 0.350" in line and "0.500 -> 0.250" in line


class _RisingRM:
    """Scores the evaluation's outputs ("held out") a little higher at each evaluation, and
    the rollouts' outputs 0."""

    kind = "outcome"

    def __init__(self):
        self.evaluations = 0

    def score(self, prompts, completions):
        if set(completions) != {"held out"}:
            return np.zeros(len(completions), np.float32)
        self.evaluations += 1
        return np.full(len(completions), 0.1 * self.evaluations, np.float32)


def test_the_trainer_logs_the_reward_models_score_and_warns_when_it_is_hacked(tmp_path, tok, monkeypatch, caplog):
    from grpo_jax.rl import trainer as trainer_lib
    from tests.rl.test_trainer import _cfg, _trainer

    accuracies = iter([0.75, 0.5, 0.25])

    def fake_evaluate(sampler, params, task, tokenizer, examples, *, key, texts=False, **kw):
        assert texts  # the reward model needs the greedy outputs
        return {"accuracy": next(accuracies), "reward": 0.0, "texts": ["held out"] * len(examples),
                "correct": [True] * len(examples)}

    monkeypatch.setattr(trainer_lib, "evaluate", fake_evaluate)
    cfg = _cfg(tmp_path, tok, "run.steps=3", "run.eval_every=1", "run.checkpoint_every=0")
    rm = _RisingRM()
    trainer = _trainer(cfg, tok, reward_model=rm)
    with caplog.at_level(logging.WARNING, logger=trainer_lib.__name__):
        history = trainer.train()
    trainer.close()
    scores = [h["eval_reward_model_score"] for h in history]
    np.testing.assert_allclose(scores, [0.1, 0.2, 0.3], rtol=1e-6)
    assert [h["eval_accuracy"] for h in history] == [0.75, 0.5, 0.25]
    hacked = [r.getMessage() for r in caplog.records if "reward hacking" in r.getMessage()]
    assert len(hacked) == 1 and "from step 1 to 3" in hacked[0]


@pytest.mark.parametrize("own, checked, warns", [(0.5, 0.99, True), (0.699, None, True), (RANKS_AT, 0.99, False),
                                                 (0.85, 0.5, False), (math.nan, 0.99, True)])
def test_own_score_warning_reads_the_score_without_the_check(own, checked, warns):
    line = own_score_warning(own, checked=checked)
    assert (line is not None) is warns
    if warns:
        assert "\n" not in line and line.startswith("warning:") and "without the answer check" in line
    if warns and not math.isnan(own):
        assert f"on {own:.3f} of held-out pairs" in line
        # The checked figure is named as the trunk's, where there is one.
        assert ("answer check's 0.990 is its trunk's answers" in line) is (checked is not None)
