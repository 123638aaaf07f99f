"""A run as the command-line programs build and load it: its task (`make_task`), its model
and tokenizer (`model_and_tokenizer`), and a saved run's config, checkpoints and policy at
a step (`open_run`, `SavedRun`).

``grpo-train``, ``grpo-evaluate`` and ``grpo-export`` (and the experiments) import this
module, never each other, so a training run and every program that reads it back build the
task, tokenizer and model the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from grpo_jax import config as config_lib  # no jax import: the CLIs' --help stays instant
from grpo_jax.errors import CheckpointError, ConfigError, PretrainedError

log = logging.getLogger(__name__)
TOKENIZER_CORPUS = 2000  # documents of the task's text the tokenizer is trained on


def make_task(name: str, data: config_lib.DataConfig | None = None, *, data_dir: str | None = None,
              tfds_dir: str | None = None):
    """The task ``name``: a registered name, or your own as ``"module:name"``
    (`grpo_jax.tasks.user_task`). With ``data``, a run's data section: its knobs (the
    arithmetic task's difficulty, the GSM8K / MATH files in ``data.data_dir``), as the run
    trained it. Without: the task's own defaults, GSM8K / MATH from the official files in
    ``data_dir`` (grpo-evaluate's --data-dir, the same folder as data.data_dir), prepared
    into ``tfds_dir`` (TFDS's default when None)."""
    from grpo_jax.tasks import get_task

    if name in config_lib.FILE_TASKS:
        if data is not None:
            check_data_dir(name, data.data_dir, "data.data_dir")
            return get_task(name, manual_dir=data.data_dir, skip_bad_rows=data.skip_bad_rows)
        return get_task(name, data_dir=tfds_dir, manual_dir=data_dir)
    if name == "arithmetic" and data is not None:
        return get_task(name, num_operands=data.num_operands, max_digits=data.max_digits, slip=data.slip,
                        format_reward=data.format_reward, min_carries=data.min_carries)
    if name == "modular" and data is not None:
        return get_task(name, modulus=data.modulus, num_operands=data.num_operands,
                        num_subtractions=data.num_subtractions, format_reward=data.format_reward,
                        tool_prob=data.tool_prob)
    return get_task(name)


# What each file task reads, for the error that asks for its folder (docs/walkthrough.md has
# the formats).
_FILES = {"gsm8k": "GSM8K's official train.jsonl and test.jsonl",
          "math": "MATH's official train/<subject>/<id>.json and test/<subject>/<id>.json"}


def check_data_dir(task: str, folder: str, key: str) -> None:
    """A file task's folder is set and local: ConfigError naming ``key`` and what to do
    otherwise. Training reads the files from local disk on every host; a gs:// folder is
    copied there first (launch/stage.py)."""
    if not folder:
        raise ConfigError(f"{key} is empty: data.task={task} reads {_FILES[task]} from it. Set {key}=/path/to/"
                          f"{task} (formats: docs/walkthrough.md#the-data-files), or run "
                          "python experiments/gsm8k_grpo.py, which trains on generated GSM8K-format "
                          "problems when no folder is given")
    if "://" in folder:
        raise ConfigError(f"{key}={folder} is not a local folder: copy it to every host's disk first "
                          "(python launch/stage.py gs://..., or run.py --stage) and give that folder")


def shared_tokenizer(task, run_dir: str, *, vocab_size: int, seed: int = 0):
    """The run's sentencepiece tokenizer, identical on every process.

    Process 0 loads `<run_dir>/tokenizer.model` if it exists (a resumed run keeps its
    vocabulary), else trains one on the task's text and saves it there; the model bytes
    then go to every other process (`distributed.broadcast_bytes`)."""
    from grpo_jax.parallel import distributed
    from grpo_jax.checkpoints import run_files
    from grpo_jax.text.tokenizer import SentencePieceTokenizer, train_sentencepiece

    proto = None
    if distributed.is_main_process():
        path = run_files.path(run_dir, run_files.TOKENIZER_FILE)
        if path.exists():
            proto = path.read_bytes()
            log.info("tokenizer: %s", path)
        else:
            tokenizer = train_sentencepiece(task.text_corpus(TOKENIZER_CORPUS, seed=seed), vocab_size=vocab_size)
            proto = tokenizer.model_proto
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(proto)
            log.info("tokenizer: trained %d pieces on the %s text, saved to %s",
                     tokenizer.vocab_size, task.name, path)
    return SentencePieceTokenizer(distributed.broadcast_bytes(proto))


def model_and_tokenizer(cfg: config_lib.Config, task, mesh, *, tokenizer_vocab: int):
    """(cfg, params, tokenizer): cfg with the model actually used (a pretrained model's
    shape, or the tokenizer's vocabulary), validated again."""
    import jax

    from grpo_jax.model.transformer import init_params

    if cfg.run.pretrained:
        from grpo_jax.model import pretrained

        runtime = {k: getattr(cfg.model, k) for k in pretrained.RUNTIME_FIELDS}
        model_cfg, params, tokenizer = pretrained.load(cfg.run.pretrained, mesh=mesh, overrides=runtime)
        if tokenizer is None:
            raise PretrainedError(f"{cfg.run.pretrained} has no tokenizer (an HF folder needs tokenizer.json)")
        if cfg.run.chat_format:
            tokenizer = tokenizer.with_chat_format(cfg.run.chat_format)
        cfg = cfg.replace(model=model_cfg).validate()
    else:
        tokenizer = shared_tokenizer(task, cfg.run.run_dir, vocab_size=tokenizer_vocab, seed=cfg.data.seed)
        cfg = cfg.replace(model={"vocab_size": tokenizer.vocab_size}).validate()
        params = init_params(cfg.model, jax.random.key(cfg.run.seed), mesh)
    return cfg, params, tokenizer


def run_config(run_dir: str) -> config_lib.Config | None:
    """The Config a training run dir was trained with (its config.json), with ``run_dir``
    as its run dir (the folder may have been moved or copied since); None when ``run_dir``
    is not a training run dir."""
    from grpo_jax.checkpoints import run_files

    saved = run_files.read_config(run_dir)
    if saved is None:
        return None
    return config_lib.Config.from_dict(saved).replace(run={"run_dir": run_dir})


@dataclasses.dataclass
class SavedRun:
    """A training run's dir, opened for reading (`open_run`): its config (the model actually
    trained), tokenizer, checkpointer and saved steps; a LoRA run's ``base`` params and
    their ``lora.base_pointer`` (``pointer``, computed once: it hashes every base weight),
    None without LoRA. `params` gives π_θ at a step."""

    cfg: config_lib.Config
    tokenizer: Any
    checkpointer: Any
    steps: list[int]
    base: Any = None
    pointer: dict | None = None

    def params(self, step: int, mesh):
        """π_θ of checkpoint ``step`` as full weights on ``mesh``: its policy params, or for
        a LoRA run its adapters merged into the base (``base``, or the one a reference reset
        saved in the run, ``lora.resolve_base``); refused in one line when the checkpoint was
        saved over another base."""
        from grpo_jax.model import lora, transformer as model
        from grpo_jax.shapes import abstract_like

        cfg, ckpt = self.cfg, self.checkpointer
        if self.base is None:
            abstract = abstract_like(model.param_shapes(cfg.model), model.param_shardings(cfg.model, mesh))
            return ckpt.restore_params(abstract, step)
        base, _ = lora.resolve_base(ckpt.read_meta(step).get("base"), self.base, self.pointer, cfg.run.run_dir,
                                    f"checkpoint step {step} in {ckpt.directory}")
        abstract = abstract_like(lora.adapter_shapes(cfg.model), lora.adapter_shardings(cfg.model, mesh))
        return lora.merged(cfg.model, base, ckpt.restore_params(abstract, step))

    def close(self) -> None:
        self.checkpointer.close()


def open_run(cfg: config_lib.Config, task, mesh) -> SavedRun:
    """The training run of ``cfg`` (`run_config`) as train_cli built it: config.json's model
    section is the model actually trained, the tokenizer is the run's tokenizer.model (or
    the pretrained model's own), and a LoRA run's base is its initial (or pretrained)
    params. ``task`` only trains a tokenizer when the run has none, which is refused.
    CheckpointError for a run without checkpoints or without its tokenizer."""
    from etils import epath

    from grpo_jax.checkpoints import checkpointing, run_files
    from grpo_jax.model import lora

    run_dir = cfg.run.run_dir
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    # Checkpointer creates its folder: look before, so reading a run writes nothing into it.
    # epath, not os.path: a pod slice's run dir is on gs://.
    ckpt = checkpointing.Checkpointer(ckpt_dir) if epath.Path(ckpt_dir).is_dir() else None
    steps = ckpt.all_steps() if ckpt else []
    if not steps:
        raise CheckpointError(f"{run_dir} is a training run dir with no checkpoints under {ckpt_dir}")
    if not cfg.run.pretrained and not run_files.path(run_dir, run_files.TOKENIZER_FILE).is_file():
        # shared_tokenizer would train a new one, whose ids mean nothing to these weights.
        raise CheckpointError(f"{run_dir} has no {run_files.TOKENIZER_FILE}: its tokenizer is lost")
    # Without LoRA the initial (or pretrained) params are dropped: each step's come from its
    # checkpoint. A LoRA checkpoint holds adapters only: the initial params are their base.
    cfg, params, tokenizer = model_and_tokenizer(cfg, task, mesh, tokenizer_vocab=cfg.model.vocab_size)
    if not lora.enabled(cfg.model):
        return SavedRun(cfg, tokenizer, ckpt, steps)
    return SavedRun(cfg, tokenizer, ckpt, steps, base=params, pointer=lora.base_pointer(cfg, params))
