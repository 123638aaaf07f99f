"""Train any algorithm on any task from a preset: the generic CLI, on one host or a pod slice.

    grpo-train --preset cpu-tiny rl.algorithm=sft run.steps=200 run.run_dir=runs/sft
    grpo-train --preset smollm2-135m run.run_dir=runs/smollm2-grpo
    grpo-train --preset deepseekmath-rl-7b run.pretrained=/ckpt/hf-folder \\
        run.run_dir=gs://BUCKET/grpo_jax/ds7b mesh.slice=v5p-128

(`grpo-train` is installed with the package; `python experiments/train.py` is the same.)

Run it the same way on every host of a pod slice (`launch/run.py train ...` does): it joins
the multi-process runtime first (`grpo_jax.parallel.distributed.initialize`: TPU auto-detect, or
GRPO_JAX_COORDINATOR / GRPO_JAX_NUM_PROCESSES / GRPO_JAX_PROCESS_ID), and only process 0
logs, shows the progress bar and writes metrics.

What it builds from the config:
* the task `data.task` (arithmetic / countdown knobs from `data.*`; GSM8K / MATH read the
  official files from `data.data_dir`), or your own as `data.task=module:name`, a Task class
  or a function returning one, imported from the Python path (`PYTHONPATH=. grpo-train
  data.task=mytask:task ...`; docs/walkthrough.md);
* the model: `run.pretrained` set → `grpo_jax.model.pretrained.load` (GGUF, HF folder, or
  `smollm2-135m`) with its own tokenizer; empty → random init of `model.*` with a
  sentencepiece tokenizer trained on the task's text. That tokenizer is trained once, on
  process 0, saved as `<run.run_dir>/tokenizer.model` and sent to the other processes, so
  all processes (and every relaunch of the run) use the same one;
* `rl.algorithm=sft` trains on the task's worked solutions; the others sample.

Preemption: a SIGTERM (a Spot VM's notice) or Ctrl-C saves the step the run stands at, on
every process, logs one line and exits 75 (`grpo_jax.parallel.preemption`; docs/tpu.md#preemption).

Resume: a run whose `run.run_dir` holds checkpoints continues from the newest readable one
(same step, optimizer state and RNG), so re-running the same command after a crash or a
Spot-VM preemption picks up where it stopped; a finished run exits at once. Keep
`run.run_dir` on storage that outlives the VM (gs://...) for that. Unreadable steps newer
than the one resumed (a full disk, a copy cut short) are moved into
`<run.run_dir>/checkpoints/unreadable/`, never deleted, so the run saves those steps again.
If no checkpoint is readable, the run stops with an error naming them;
`run.restart_unreadable=true` moves them there too and trains from step 0. A checkpoint
that cannot be saved stops the run. A resume that changes what the run trains (rl.group_size,
the learning rate, ...; not its length, evaluation, logging or layout) is refused in one line
naming the keys; `run.allow_config_changes=true` trains on with them and records each change
in `<run.run_dir>/config_changes.jsonl` (`grpo_jax.checkpoints.resume_changes`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from grpo_jax import cli
from grpo_jax.cli import runs
from grpo_jax import config as config_lib  # no jax import: --help stays instant

log = logging.getLogger("train")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
    config_lib.add_config_args(p)
    p.add_argument("--tokenizer-vocab", type=int, default=64,
                   help="sentencepiece vocabulary size for a randomly initialised model (default 64)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


# ============================================================================ pieces

def asked_as_before(cfg: config_lib.Config, task, tokenizer):
    """`task` as the run dir's checkpoints were trained on it: a run that asked it in a chat
    prompt style (task.json, e.g. experiments/smollm2_grpo.py's) resumes in that style."""
    from grpo_jax.checkpoints import run_files
    from grpo_jax.tasks.chat import chat_task

    asked = run_files.read_task(cfg.run.run_dir, cfg)
    if asked["task"] == task.name and asked["prompt"] != "task" and task.prompt_form == "task":
        return chat_task(task, tokenizer, asked["prompt"])
    return task


def sft_data_fn(cfg: config_lib.Config, task):
    """`rl.algorithm=sft`: step -> (prompts, worked solutions), a function of (seed, step)
    only, so a resumed run sees the data an uninterrupted one would have."""
    d = cfg.data

    def sft_data(step: int):
        pairs = task.sft_examples("train", d.batch_size, d.seed * 1_000_003 + step,
                                  wrong_step_prob=d.wrong_step_prob)
        return [ex.prompt for ex, _ in pairs], [solution for _, solution in pairs]

    return sft_data


# ============================================================================ main

def train(cfg: config_lib.Config, *, task=None, tokenizer_vocab: int = 64, progress: bool = True):
    """Build everything for `cfg`, resume from `cfg.run.run_dir` if it holds a checkpoint,
    train to `cfg.run.steps`. Returns the Trainer (closed); `trainer.history` has the
    metrics of the steps run now. `task` overrides `data.task` (tests pass their own)."""
    from grpo_jax.checkpoints import checkpointing, resume_changes, run_files
    from grpo_jax.parallel import distributed
    from grpo_jax.parallel.sharding import make_mesh
    from grpo_jax.rl.trainer import Trainer

    run_files.check_writable(cfg.run.run_dir)
    # Before anything is written to the run dir: a mismatching resume must leave it untouched.
    # model.vocab_size comes from the tokenizer, set below; the Trainer checks it again.
    saved = checkpointing.check_run_dir(os.path.join(cfg.run.run_dir, "checkpoints"), cfg.to_dict(),
                                        ignore=("model.vocab_size",))
    changes = [] if saved is None else resume_changes.training_changes(saved[1], cfg.to_dict(), step=saved[0])
    if changes and not cfg.run.allow_config_changes:
        raise config_lib.ConfigError(resume_changes.refusal(cfg.run.run_dir, saved[0], changes))
    if cfg.rl.reward_model:  # its folder and metadata; the Trainer loads the weights
        from grpo_jax.rl.reward_models.scorer import RewardModel

        RewardModel.read_meta(cfg.rl.reward_model)
    with run_files.removed_if_start_fails(cfg.run.run_dir, distributed.is_main_process()):
        task = runs.make_task(cfg.data.task, cfg.data) if task is None else task
        mesh = make_mesh(cfg.mesh)
        cfg, params, tokenizer = runs.model_and_tokenizer(cfg, task, mesh, tokenizer_vocab=tokenizer_vocab)
        task = asked_as_before(cfg, task, tokenizer)
        sft_data = sft_data_fn(cfg, task) if cfg.rl.algorithm == "sft" else None
        # The Trainer scores the task's shortcut rules first: a broken reward stops the run here.
        trainer = Trainer(cfg, task=task, tokenizer=tokenizer, params=params, mesh=mesh,
                          sft_data=sft_data, progress=progress, resume=True)
    try:
        if changes and distributed.is_main_process():
            resume_changes.record(cfg.run.run_dir, trainer.start_step, changes)
        if trainer.start_step >= cfg.run.steps:
            log.info("%s already holds step %d of %d: nothing to do", cfg.run.run_dir,
                     trainer.start_step, cfg.run.steps)
        else:
            trainer.train()  # the Trainer logs "resumed from step N" when it restored one
    finally:
        trainer.close()
    return trainer


def sft_then_rl(task, argv=(), *, sft_steps: int = 300, sft_lr: float = 2e-3, tokenizer_vocab: int = 64,
                progress: bool = True) -> dict:
    """A task from scratch: a tokenizer trained on its text, `sft_steps` of SFT of a randomly
    initialised model on its worked solutions, then `rl.algorithm` from that SFT model.

    ``argv`` configures the RL run: `--preset NAME` (default cpu-tiny) and `section.field=value`
    overrides (`config_lib.config_from_argv`); the SFT run shares them except for its
    algorithm, length, learning rate and folder. Both runs keep checkpoints under
    `run.run_dir` (`sft/`, `rl/`) and resume from them, so a second call only redoes what did
    not finish. Returns held-out greedy `accuracy` and mean `reward` (`evaluate` on
    `data.eval_size` test questions) `before` and `after` RL, the RL `history`, and the
    held-out set's `shortcuts` (`grpo_jax.tasks.shortcuts.Baselines.to_dict`).
    A pretrained model (`run.pretrained`) is refused: this recipe makes its own tokenizer and
    model; `train(cfg, task=...)` (or `grpo-train data.task=module:name`) trains one."""
    import jax

    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.model.transformer import init_params
    from grpo_jax.sampler import Sampler
    from grpo_jax.parallel.sharding import make_mesh
    from grpo_jax.rl.trainer import Trainer

    cfg = config_lib.config_from_argv(argv)
    if cfg.run.pretrained:
        raise config_lib.ConfigError(
            f"run.pretrained={cfg.run.pretrained}: sft_then_rl trains a model from scratch with its own "
            "tokenizer; train a pretrained model on your task with grpo-train data.task=module:name "
            "run.pretrained=... (docs/walkthrough.md)")
    root = cfg.run.run_dir
    tokenizer = runs.shared_tokenizer(task, root, vocab_size=tokenizer_vocab, seed=cfg.data.seed)
    cfg = config_lib.apply_overrides(cfg, [f"model.vocab_size={tokenizer.vocab_size}",
                                           f"run.run_dir={root}/rl"]).validate()
    sft_cfg = config_lib.apply_overrides(cfg, [
        "rl.algorithm=sft", f"run.run_dir={root}/sft", f"run.steps={sft_steps}", "run.eval_every=0",
        f"run.checkpoint_every={sft_steps}", f"optimizer.peak_lr={sft_lr}", "optimizer.schedule=multistep",
        f"optimizer.warmup_steps={min(20, sft_steps // 10)}"]).validate()
    mesh = make_mesh(cfg.mesh)
    eval_examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    params = init_params(cfg.model, jax.random.key(cfg.run.seed), mesh)
    sft = Trainer(sft_cfg, task=task, tokenizer=tokenizer, params=params, mesh=mesh,
                  sft_data=sft_data_fn(sft_cfg, task), eval_examples=[], progress=progress)
    sft.train()  # like rl.train(): a no-op when the run dir already holds the last step
    sft.close()
    sampler = Sampler.for_run(cfg, mesh, tokenizer)
    before = evaluate(sampler, sft.params, task, tokenizer, eval_examples, key=jax.random.key(1))
    rl = Trainer(cfg, task=task, tokenizer=tokenizer, params=sft.params, mesh=mesh, eval_examples=eval_examples,
                 progress=progress)
    rl.train()
    rl.close()
    after = evaluate(sampler, rl.params, task, tokenizer, eval_examples, key=jax.random.key(1))
    return {"before": before, "after": after, "history": rl.history,
            "shortcuts": None if rl.shortcuts is None else rl.shortcuts.to_dict()}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # options and overrides in any order
    try:
        cfg = config_lib.config_from_args(args)  # bad overrides fail here, before any device work
    except config_lib.ConfigError as e:
        parser.error(str(e))
    if args.print_config:
        print(cfg.to_json())
        return 0

    from grpo_jax.parallel import distributed

    distributed.initialize()  # before anything touches a device
    import jax

    main_process = distributed.is_main_process()
    # Warnings from every process; progress messages (ours, not Orbax's) from process 0 only.
    cli.configure_logging(f"[%(asctime)s p{jax.process_index()}] %(message)s", datefmt="%H:%M:%S")
    for name in ("train", "grpo_jax"):
        logging.getLogger(name).setLevel(logging.INFO if main_process else logging.WARNING)
    log.info("%d process(es), %d devices (%s); run dir %s", jax.process_count(), jax.device_count(),
             jax.devices()[0].platform, cfg.run.run_dir)
    t0 = time.perf_counter()
    trainer = train(cfg, tokenizer_vocab=args.tokenizer_vocab, progress=not args.no_progress)
    if main_process and trainer.history:
        last = trainer.history[-1]
        shown = {k: round(v, 4) for k, v in last.items() if k in ("loss", "reward_mean", "kl", "eval_accuracy")}
        log.info("step %d/%d in %.0f s: %s", last["step"], cfg.run.steps, time.perf_counter() - t0,
                 json.dumps(shown))
    return 0


def console_main() -> None:
    """The `grpo-train` entry point: library errors as one line, exit 2 (grpo_jax.cli)."""
    cli.run(main, prog="grpo-train")
