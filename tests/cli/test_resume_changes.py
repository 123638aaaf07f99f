"""A resume with other training settings (issue 86): grpo-train refuses it in one line naming the
keys and the flag that allows it, lets bookkeeping keys through silently, and with
run.allow_config_changes=true records the change, which grpo-evaluate prints and writes into the
summary of every checkpoint trained after it."""
import json

import pytest

from grpo_jax.checkpoints import resume_changes
from grpo_jax.cli import evaluate as evaluate_cli, train as train_cli
from grpo_jax.errors import ConfigError

# One SFT step of a one-layer model: no sampler to compile; SFT reads optimizer.peak_lr.
TINY = ["--no-progress", "rl.algorithm=sft", "run.checkpoint_every=1", "run.eval_every=0", "model.num_layers=1",
        "data.batch_size=2", "data.eval_size=4"]


def test_only_training_keys_count_and_a_key_the_checkpoint_lacks_is_not_compared():
    saved = {"rl": {"group_size": 8, "num_micro_batches": 1}, "run": {"steps": 10, "seed": 0},
             "mesh": {"ici_fsdp": -1}, "data": {"eval_size": 64}}
    requested = {"rl": {"group_size": 4, "num_micro_batches": 4, "newer_field": 1}, "run": {"steps": 20, "seed": 1},
                 "mesh": {"ici_fsdp": 8}, "data": {"eval_size": 16}}
    assert resume_changes.training_changes(saved, requested, step=3) == [("rl.group_size", 8, 4), ("run.seed", 0, 1)]


@pytest.mark.parametrize("saved_steps, step, steps", [
    (20, 20, 40),   # a finished run extended: the rate would go back up to the peak
    (20, 5, 40),    # cut at step 5, resumed longer: the drops move from 16 and 18 to 32 and 36
    (20, 5, 21),    # drops at 16 and 18 either way
    (40, 40, 45),   # every later step past the second drop either way
    (40, 30, 45),   # step 32 is past the first drop of 40 steps, not of 45
    (10, 3, 8),     # shorter
    (1, 1, 2), (2, 2, 3),
])
@pytest.mark.parametrize("schedule", ["multistep", "constant"])
def test_run_steps_counts_exactly_when_a_later_step_would_train_at_another_rate(saved_steps, step, steps, schedule):
    from grpo_jax.rl.optimizer import multistep_schedule

    saved = {"run": {"steps": saved_steps}, "optimizer": {"schedule": schedule}}
    requested = {"run": {"steps": steps}, "optimizer": {"schedule": schedule}}
    # The optimizer's own schedules, step by step, over the steps still to train.
    moved = schedule == "multistep" and any(
        float(multistep_schedule(1.0, 0, saved_steps)(s)) != float(multistep_schedule(1.0, 0, steps)(s))
        for s in range(step, steps))
    changes = resume_changes.training_changes(saved, requested, step=step)
    assert changes == ([("run.steps", saved_steps, steps)] if moved else [])
    if moved:
        assert "run.steps places the multistep schedule's rate drops" in resume_changes.refusal("r", step, changes)


def test_a_changed_resume_is_refused_allowed_and_recorded_then_shown_by_grpo_evaluate(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train_cli.main([*TINY, "run.steps=1", f"run.run_dir={run_dir}"]) == 0
    config_json = (run_dir / "config.json").read_text()
    with pytest.raises(ConfigError) as err:
        train_cli.main([*TINY, "run.steps=2", "optimizer.peak_lr=0.0005", f"run.run_dir={run_dir}"])
    assert str(err.value) == (
        f"{run_dir} trained to step 1 with other settings: optimizer.peak_lr 0.001 -> 0.0005. Resume with the saved "
        "values, add run.allow_config_changes=true to train on with the new ones from step 1 (recorded in "
        "config_changes.jsonl, shown by grpo-evaluate), or start over in a new run.run_dir")
    assert (run_dir / "config.json").read_text() == config_json  # refused before anything was written
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1"]

    # Length, evaluation and logging keys pass silently and are not recorded.
    assert train_cli.main([*TINY, "run.steps=2", "data.eval_size=2", "run.log_every=2", f"run.run_dir={run_dir}"]) == 0
    assert not (run_dir / resume_changes.CHANGES_FILE).exists()

    assert train_cli.main([*TINY, "run.steps=3", "optimizer.peak_lr=0.0005", "run.allow_config_changes=true",
                           f"run.run_dir={run_dir}"]) == 0
    history = [{"step": 2, "changes": {"optimizer.peak_lr": [0.001, 0.0005]}}]
    assert resume_changes.read(str(run_dir)) == history
    assert json.loads((run_dir / "config.json").read_text())["optimizer"]["peak_lr"] == 0.0005

    capsys.readouterr()
    evaluate_cli.main(["--model", str(run_dir), "--limit", "2", "--k", "0", "--no-progress",
                       "--out", str(tmp_path / "eval")])
    out = capsys.readouterr().out
    line = "config changed on resume: after step 2: optimizer.peak_lr 0.001 -> 0.0005"
    assert f"{run_dir}: {line}" in out.splitlines()
    assert out.count(line) == 2  # the run's history, then the table of step 3, the one checkpoint it shaped
    settings = {s: json.loads((tmp_path / "eval" / f"step-{s}" / "summary.json").read_text())["settings"]
                for s in (2, 3)}
    assert "config_changes" not in settings[2] and settings[3]["config_changes"] == history
