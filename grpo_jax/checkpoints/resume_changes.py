"""What a resume may change of a run's config, and the record of what it changed.

A run resumed with other training settings trains its later steps differently from its first
ones, and the run's config.json is rewritten with the new values. `grpo-train` therefore refuses
such a resume in one line naming the keys (`refusal`), unless `run.allow_config_changes=true`:
then each change is appended to ``<run_dir>/config_changes.jsonl`` (`record`: the step it took
effect after, old and new values), which `grpo-evaluate` prints and writes into the summary of
every checkpoint it shaped (`before_step`, `describe`).

Keys that change how, how far or how often the same run is computed pass silently (`QUIET`):
the loop's length and bookkeeping, held-out evaluation, where files are, the device layout, and
the implementation choices that compute the same numbers. The loop's length (run.steps) counts
when it moves the multistep schedule's rate drops for a step still to train. The restore-relevant keys (model
shape, algorithm) are `checkpointing.config_differences`' and refused before these.

Paths go through epath: a run dir may be gs:// on a pod slice.
"""

from __future__ import annotations

import json
from typing import Any

from etils import epath

from grpo_jax.config import multistep_drops

CHANGES_FILE = "config_changes.jsonl"
ALLOW = "run.allow_config_changes"
QUIET_SECTIONS = ("mesh",)  # the same computation laid out on other devices
QUIET = (
    "run.run_dir", "run.steps", "run.checkpoint_every", "run.keep_checkpoints", "run.eval_every", "run.log_every",
    "run.max_bad_steps", "run.restart_unreadable", ALLOW,
    "data.eval_size", "data.data_dir",
    "model.remat", "model.attention", "model.vocab_size",  # vocab_size: the tokenizer's, checked on restore
    "rl.num_micro_batches", "rl.logprob_chunk_size", "rl.decode", "rl.decode_phases", "rl.sample_prompts",
    "rl.decode_slots", "rl.tool_workers", "rl.tool_backend_stop_share", "rl.tool_backend_stop_steps",
)

Change = tuple[str, Any, Any]  # (dotted key, saved value, requested value)


def training_changes(saved: dict, requested: dict, *, step: int) -> list[Change]:
    """The keys, sorted, whose value in the ``requested`` Config dict differs from the ``saved``
    one and changes what the run trains after ``step``, the step it resumes from. A key the
    saved config lacks (a field newer than the checkpoint) is not compared: its value then is
    unknown. run.steps counts when it moves the multistep schedule's rate for a later step."""
    out = []
    for section in sorted(set(saved) & set(requested) - set(QUIET_SECTIONS)):
        old, new = saved[section], requested[section]
        for name in sorted(set(old) & set(new)):
            key = f"{section}.{name}"
            if key not in QUIET and old[name] != new[name]:
                out.append((key, old[name], new[name]))
    if _moves_the_schedule(saved, requested, step):
        out.append(("run.steps", saved["run"]["steps"], requested["run"]["steps"]))
    return sorted(out)


def _moves_the_schedule(saved: dict, requested: dict, step: int) -> bool:
    """Whether, under the multistep schedule in both configs, some step from ``step`` on lies
    before, between or after the rate drops (`config.multistep_drops`) otherwise with the
    requested run.steps than with the saved one. (A changed schedule is a change of its own.)"""
    try:
        totals = saved["run"]["steps"], requested["run"]["steps"]
        schedules = saved["optimizer"]["schedule"], requested["optimizer"]["schedule"]
    except KeyError:  # a checkpoint older than these fields
        return False
    if totals[0] == totals[1] or schedules != ("multistep", "multistep"):
        return False
    (old_first, old_second), (new_first, new_second) = map(multistep_drops, totals)
    phase = lambda s, first, second: (s >= first) + (s >= second)
    return any(phase(s, old_first, old_second) != phase(s, new_first, new_second) for s in range(step, totals[1]))


def _listed(changes: list[Change]) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes)


def refusal(run_dir: str, step: int, changes: list[Change]) -> str:
    """The one-line error of a resume that would change ``changes`` after ``step``."""
    why = (" (run.steps places the multistep schedule's rate drops, at 80% and 90% of it: the later steps would "
           "train at other rates; optimizer.schedule=constant does not depend on it)"
           if any(key == "run.steps" for key, _, _ in changes) else "")
    return (f"{run_dir} trained to step {step} with other settings: {_listed(changes)}{why}. Resume with the saved "
            f"values, add {ALLOW}=true to train on with the new ones from step {step} (recorded in "
            f"{CHANGES_FILE}, shown by grpo-evaluate), or start over in a new run.run_dir")


def record(run_dir: str, step: int, changes: list[Change]) -> None:
    """Append one line to the run's history: the new values hold for the steps after ``step``."""
    line = {"step": step, "changes": {key: [old, new] for key, old, new in changes}}
    path = epath.Path(run_dir) / CHANGES_FILE
    history = path.read_text() if path.exists() else ""
    path.write_text(history + json.dumps(line) + "\n")  # gs:// objects cannot be appended to


def read(run_dir: str) -> list[dict]:
    """The run's history of changes, oldest first; [] for a run never changed on resume."""
    path = epath.Path(run_dir) / CHANGES_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def before_step(history: list[dict], step: int) -> list[dict]:
    """The changes that shaped the checkpoint of ``step``: those made before it was trained."""
    return [entry for entry in history if entry["step"] < step]


def describe(history: list[dict]) -> str:
    """One line: "config changed on resume: after step 2: rl.group_size 8 -> 4; ..."."""
    return "config changed on resume: " + "; ".join(
        f"after step {e['step']}: " + _listed([(k, old, new) for k, (old, new) in e["changes"].items()])
        for e in history)
