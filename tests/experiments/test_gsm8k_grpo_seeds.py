"""experiments/gsm8k_grpo.py --seeds: seeds finished in an earlier invocation (read back from
their summary.json) and a seed run now are plotted together."""
import json
import sys

from tests.cli.test_evaluate import script


def seed_summary(seed: int, accuracies: dict[int, float]) -> dict:
    return {"seed": seed, "task": "word_arithmetic", "config": {"rl": {"algorithm": "grpo"}},
            "eval_accuracy_at_step": accuracies}


def test_read_and_fresh_seeds_are_plotted_in_step_order(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "common", script("common"))  # the script's sibling
    grpo = script("gsm8k_grpo")
    plotted = {}
    monkeypatch.setattr("grpo_jax.eval.plots.plot_runs",
                        lambda curves, steps, path, **kw: plotted.update(curves=curves, steps=steps) or path)
    # One seed as read back from its file (string keys), one as run_seed returns it (int keys);
    # steps 5 and 10 sort the wrong way round as strings.
    read = json.loads(json.dumps(seed_summary(0, {0: 0.1, 5: 0.2, 10: 0.3})))
    fresh = seed_summary(2, {0: 0.1, 5: 0.25, 10: 0.4})
    grpo.plot_seeds([read, fresh], None, [0.2, 0.3], str(tmp_path))
    assert plotted["steps"] == [0, 5, 10]
    assert plotted["curves"] == {"seed 0": [[0.1, 0.2, 0.3]], "seed 2": [[0.1, 0.25, 0.4]]}
