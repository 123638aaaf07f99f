"""experiments/figure5_premise.py: the premise's figures from a regime's rewards."""
import math

import numpy as np
import pytest

from tests.cli.test_evaluate import script

premise = script("figure5_premise").premise


def test_premise_figures_by_hand():
    outcomes = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], float)
    steps = [[[1, 1], [1, 0], [0], [1, 1]],  # varies
             [[1, 0]] * 4,  # every sample the same steps: no process-supervision signal
             [[1, 1]] * 4]
    got = premise(outcomes, steps)
    assert got == pytest.approx({"questions": 3, "group_size": 4, "right_fraction": 5 / 12,
                   "outcome_varying_fraction": 1 / 3, "step_right_fraction": 17 / 23,
                   "step_varying_fraction": 1 / 3,
                   # summed steps x = 2 1 0 2 | 1 1 1 1 | 2 2 2 2 against y: cov 35/144, var x 59/144, var y 35/144
                   "step_outcome_correlation": math.sqrt(35 / 59)}, rel=1e-12)


def test_a_label_that_pays_for_leaving_the_chain_shows_as_a_negative_correlation():
    """The old line-local label in the sparse regime: wrong samples carried their slip on and
    scored more steps than the right ones; the correlation is what the design must check."""
    outcomes = np.array([[1, 0, 0, 0]], float)
    steps = [[[1, 0, 0, 1], [0, 1, 1, 1], [0, 1, 1, 1], [1, 0, 1, 1]]]
    assert premise(outcomes, steps)["step_outcome_correlation"] < 0
    assert premise(outcomes, [[[1] * 4, [0] * 4, [0] * 4, [1, 0, 0, 0]]])["step_outcome_correlation"] > 0
    assert premise(np.zeros((1, 4)), steps)["step_outcome_correlation"] == 0.0  # constant outcome: no relation
