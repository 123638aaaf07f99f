"""One process of the multi-process test (tests/parallel/test_multihost.py).

    GRPO_JAX_COORDINATOR=localhost:PORT GRPO_JAX_NUM_PROCESSES=2 GRPO_JAX_PROCESS_ID=i \\
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/parallel/multihost_worker.py RUN_DIR [--preempt]

Every process runs the same program, as on the workers of a TPU pod slice: it joins the
multi-process runtime (`grpo_jax.parallel.distributed.initialize`, configured by the environment)
and runs `grpo_jax.cli.train.train()` (what `grpo-train` and experiments/train.py run) — tokenizer trained on process 0 and shared,
random init, `grpo_jax.rl.trainer.Trainer` with GRPO (sampler → host scoring → train step)
on one global mesh of both processes' devices, checkpoints from all processes into
RUN_DIR. Each process then writes `RUN_DIR/result_<process>.json` (its metrics per step),
and process 0 writes the final params, gathered to the host, to `RUN_DIR/params.npz`.

The test runs the same `run()` in its own process for the 1-process reference.
"""

from __future__ import annotations

import json
import os
import sys

MESH = (1, 4, 2)  # (data, fsdp, tensor): fsdp spans both processes, tensor stays within one
STEPS = 3
OVERRIDES = [
    "rl.algorithm=grpo", "model.embed_dim=64", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=128", "model.max_seq_len=64",
    f"mesh.ici_data={MESH[0]}", f"mesh.ici_fsdp={MESH[1]}", f"mesh.ici_tensor={MESH[2]}",
    "rl.group_size=4", "rl.max_new_tokens=16", "rl.beta=0.04", "rl.temperature=1.0",
    "data.batch_size=4", "data.eval_size=8", "data.num_operands=2", "data.max_digits=1",
    "optimizer.peak_lr=1e-2", "optimizer.warmup_steps=0", "optimizer.schedule=constant",
    f"run.steps={STEPS}", f"run.eval_every={STEPS}", "run.checkpoint_every=2", "run.keep_checkpoints=3",
]
# `--preempt`: a run far longer than the test waits, with no save or evaluation on the way,
# which the test stops with a SIGTERM to one process (test_multihost.py).
PREEMPT_STEPS = 1000
PREEMPT_OVERRIDES = ["run.eval_every=0", f"run.checkpoint_every={PREEMPT_STEPS}"]
TOKENIZER_VOCAB = 40
# Compared between runs (timings are not).
METRICS = ("loss", "pg_loss", "kl", "grad_norm", "entropy", "tokens", "reward_mean", "adv_std",
           "completion_length", "eval_accuracy", "step")


def make_task():
    """Arithmetic questions, scored by the share of digits in the completion: a random
    model's samples already differ in that reward, so GRPO advantages and gradients are
    non-zero from the first step."""
    from grpo_jax.tasks import get_task

    task = get_task("arithmetic", num_operands=2, max_digits=1)
    task.reward = lambda completion, example: sum(c.isdigit() for c in completion) / max(len(completion), 1)
    return task


def make_config(run_dir: str, steps: int = STEPS, extra=()):
    from grpo_jax import config as config_lib

    return config_lib.load_config("cpu-tiny", OVERRIDES + [f"run.run_dir={run_dir}", f"run.steps={steps}", *extra])


def run(run_dir: str, steps: int = STEPS, extra=()):
    """Train (or resume) the test's GRPO run in RUN_DIR; returns the (closed) Trainer."""
    from grpo_jax.cli import train as train_cli

    return train_cli.train(make_config(run_dir, steps, extra), task=make_task(),
                             tokenizer_vocab=TOKENIZER_VOCAB, progress=False)


def metrics_of(history) -> list[dict]:
    return [{k: h[k] for k in METRICS if k in h} for h in history]


def param_arrays(params) -> dict:
    """{path: numpy array} of a params pytree, gathered from every process (a collective)."""
    import jax

    from grpo_jax.parallel.sharding import to_host

    return {jax.tree_util.keystr(path): to_host(x)
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def main(argv=None) -> None:
    run_dir, *mode = sys.argv[1:] if argv is None else argv
    from grpo_jax.parallel import distributed

    if not distributed.initialize():
        raise SystemExit("multihost_worker: set GRPO_JAX_COORDINATOR, GRPO_JAX_NUM_PROCESSES "
                         "and GRPO_JAX_PROCESS_ID")
    import jax
    import numpy as np

    if mode == ["--preempt"]:
        from grpo_jax.parallel.preemption import Preempted

        try:
            run(run_dir, PREEMPT_STEPS, PREEMPT_OVERRIDES)
        except Preempted as stop:  # the step this process saved; the exception sets the exit code
            with open(os.path.join(run_dir, f"result_{jax.process_index()}.json"), "w") as f:
                json.dump({"process_index": jax.process_index(), "preempted_at": stop.step}, f)
            raise
        raise SystemExit("multihost_worker --preempt: the run was not stopped")
    trainer = run(run_dir)
    arrays = param_arrays(trainer.params)
    if jax.process_index() == 0:
        np.savez(os.path.join(run_dir, "params.npz"), **arrays)
    result = {"process_index": jax.process_index(), "process_count": jax.process_count(),
              "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
              "mesh": dict(trainer.mesh.shape), "history": metrics_of(trainer.history)}
    with open(os.path.join(run_dir, f"result_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f, indent=1)
    distributed.barrier("multihost_worker_done")


if __name__ == "__main__":
    main()
