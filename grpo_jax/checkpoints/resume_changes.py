"""What a resume may change of a run's config, and the record of what it changed.

A run resumed with other training settings trains its later steps differently from its first
ones, and the run's config.json is rewritten with the new values. `grpo-train` therefore refuses
such a resume in one line naming the keys (`refusal`), unless `run.allow_config_changes=true`:
then each change is appended to ``<run_dir>/config_changes.jsonl`` (`record`: the step it took
effect after, old and new values), which `grpo-evaluate` prints and writes into the summary of
every checkpoint it shaped (`before_step`, `describe`).

Keys that change how, how far or how often the same run is computed pass silently (`QUIET`):
the loop's length and bookkeeping, held-out evaluation, where files are, the device layout, and
the implementation choices that compute the same numbers. The restore-relevant keys (model
shape, algorithm) are `checkpointing.config_differences`' and refused before these.

Paths go through epath: a run dir may be gs:// on a pod slice.
"""

from __future__ import annotations

import json
from typing import Any

from etils import epath

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


def training_changes(saved: dict, requested: dict) -> list[Change]:
    """The keys, sorted, whose value in the ``requested`` Config dict differs from the ``saved``
    one and changes what the run trains. A key the saved config lacks (a field newer than the
    checkpoint) is not compared: its value then is unknown."""
    out = []
    for section in sorted(set(saved) & set(requested) - set(QUIET_SECTIONS)):
        old, new = saved[section], requested[section]
        for name in sorted(set(old) & set(new)):
            key = f"{section}.{name}"
            if key not in QUIET and old[name] != new[name]:
                out.append((key, old[name], new[name]))
    return out


def _listed(changes: list[Change]) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes)


def refusal(run_dir: str, step: int, changes: list[Change]) -> str:
    """The one-line error of a resume that would change ``changes`` after ``step``."""
    return (f"{run_dir} trained to step {step} with other settings: {_listed(changes)}. Resume with the saved "
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
