"""experiments/figure5_premise.py: the premise's figures from a regime's rewards."""
import numpy as np

from test_evaluate_cli import script

premise = script("figure5_premise").premise


def test_premise_figures_by_hand():
    outcomes = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], float)
    steps = [[[1, 1], [1, 0], [0], [1, 1]],  # varies
             [[1, 0]] * 4,  # every sample the same steps: no process-supervision signal
             [[1, 1]] * 4]
    got = premise(outcomes, steps)
    assert got == {"questions": 3, "group_size": 4, "right_fraction": 5 / 12,
                   "outcome_varying_fraction": 1 / 3, "step_right_fraction": 17 / 23,
                   "step_varying_fraction": 1 / 3}
