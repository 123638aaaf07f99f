"""The files beside a run's checkpoints from which `grpo-evaluate` and a resumed `grpo-train`
rebuild the run: the Trainer writes them, so every script's run dir carries them.

    <run_dir>/config.json       the Config, its model section the model actually trained
    <run_dir>/tokenizer.model   a randomly initialised model's sentencepiece tokenizer
                                (a pretrained model's comes with `run.pretrained`)
    <run_dir>/task.json         {"task": the task's name, "prompt": how its questions were
                                asked: "task" (the task's own text) or a prompts.STYLES key
                                (the bare question in the model's chat format)}

Paths go through epath: a run dir may be gs:// on a pod slice.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import pathlib
import socket

from etils import epath

from grpo_jax.config import Config
from grpo_jax.errors import CheckpointError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"
TASK_FILE = "task.json"


def path(run_dir: str, name: str) -> epath.Path:
    return epath.Path(run_dir) / name


def check_writable(run_dir: str) -> None:
    """Stop in one line, naming ``run_dir``, when this process cannot write there: a gs://
    folder without gcsfs (etils reaches GCS through it), a folder it may not create or write.
    Every process checks, since every host writes its shards of each checkpoint. Called at
    start-up, before the model loads, so a run cannot train for hours towards its first save."""
    if run_dir.startswith("gs://") and importlib.util.find_spec("gcsfs") is None:
        raise CheckpointError(f"run.run_dir={run_dir}: writing to gs:// needs the gcsfs package, which this "
                              "Python lacks: pip install gcsfs (launch/setup.py installs it on TPU VMs)")
    # A local run dir is probed in its deepest folder that exists, which can hold the folders
    # below it: made here, the run dir would outlive a start that fails later, and removing it
    # again would race the other processes of a run probing the same folder. gs:// has no folders.
    missing = [] if "://" in run_dir else missing_folders(run_dir)
    root = epath.Path(missing[-1].parent if missing else run_dir)
    probe = root / f".write-check-{socket.gethostname()}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except Exception as err:  # OSError locally; gcsfs raises its own HTTP and credential errors
        raise CheckpointError(f"run.run_dir={run_dir} cannot be written: {type(err).__name__}: {err}") from err


def missing_folders(run_dir: str) -> list[pathlib.Path]:
    """The folders of the local path ``run_dir`` that do not exist yet, deepest first."""
    path, out = pathlib.Path(run_dir).absolute(), []
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out


@contextlib.contextmanager
def removed_if_start_fails(run_dir: str, main_process: bool):
    """Remove the folders of ``run_dir`` that did not exist before the block when it raises, so
    a start that fails (a broken reward, a model that does not load) leaves no run dir of a run
    that never trained; only process 0 wrote in it (the tokenizer), so only it removes."""
    top = [run_dir] if "://" in run_dir else missing_folders(run_dir)[-1:]  # the outermost folder to make
    made = [epath.Path(p) for p in top if main_process and not epath.Path(p).exists()]
    try:
        yield
    except BaseException:
        for folder in made:
            if folder.exists():
                folder.rmtree()
        raise


def write(cfg: Config, task, tokenizer) -> None:
    """Write the run's files (call on process 0). Rewritten on every start, so they describe
    the model, tokenizer and prompts the checkpoints that follow are trained with."""
    root = epath.Path(cfg.run.run_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(cfg.to_json())
    (root / TASK_FILE).write_text(json.dumps({"task": task.name, "prompt": task.prompt_form}))
    if cfg.run.pretrained:
        return
    if hasattr(tokenizer, "model_proto"):
        (root / TOKENIZER_FILE).write_bytes(tokenizer.model_proto)
    else:
        log.warning("%s: the tokenizer (%s) cannot be saved, so grpo-evaluate cannot rebuild this run",
                    cfg.run.run_dir, type(tokenizer).__name__)


def read_config(run_dir: str) -> dict | None:
    """The Config dict of a run dir, or None when `run_dir` is not one. An HF folder also
    holds a config.json, so the file must have the Config's sections."""
    f = path(run_dir, CONFIG_FILE)
    if not f.is_file():
        return None
    saved = json.loads(f.read_text())
    return saved if isinstance(saved, dict) and {"model", "rl", "run"} <= set(saved) else None


def read_task(run_dir: str, cfg: Config) -> dict:
    """{"task", "prompt"} of a run dir. A run dir without task.json was written by
    `grpo-train` before the file existed: it trained `data.task` on the task's own text."""
    f = path(run_dir, TASK_FILE)
    if f.is_file():
        return json.loads(f.read_text())
    return {"task": cfg.data.task, "prompt": "task"}
