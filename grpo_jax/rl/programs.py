"""The train step a run executes and its optimizers, built in one place.

The trainer and the ahead-of-time check (``grpo_jax.aot``, ``launch/compile.py``) take the
train step from `train_step` with the same static arguments, as they take the sampler's
calls from the run's `sampler.Sampler` (``Sampler.for_run``), so the check compiles the
programs a run executes (``tests/rl/test_programs.py`` lowers both and compares the HLO).
"""

from __future__ import annotations

from typing import Any, Callable

import optax
from jax.sharding import Mesh

from grpo_jax.rl.algorithms import algorithm_of
from grpo_jax.config import Config, ConfigError
from grpo_jax.rl.optimizer import make_optimizer, value_optimizer_config
from grpo_jax.rl.train_step import TrainStep, make_train_step


def optimizers(cfg: Config) -> tuple[optax.GradientTransformation, Any, Callable]:
    """(policy tx, value-model tx or None, the policy's lr schedule). A non-finite gradient
    skips the update (``optax.apply_if_finite``) instead of corrupting the params; the
    trainer stops after ``run.max_bad_steps`` of them in a row."""
    base, schedule = make_optimizer(cfg.optimizer, cfg.run.steps, updates_per_step=cfg.rl.num_updates)
    tx = optax.apply_if_finite(base, max_consecutive_errors=10**9)
    value_tx = None
    if algorithm_of(cfg).needs_value_model:
        value_base, _ = make_optimizer(value_optimizer_config(cfg.optimizer), cfg.run.steps,
                                       updates_per_step=cfg.rl.num_updates)
        value_tx = optax.apply_if_finite(value_base, max_consecutive_errors=10**9)
    return tx, value_tx, schedule


def group_size(cfg: Config) -> int:
    """Rows per question in a train batch (``DataSource.rows_per_question``): G, 2 for
    DPO's preference pairs, 1 for SFT."""
    return algorithm_of(cfg).data_source.rows_per_question(cfg.rl.group_size)


def check_micro_batches(cfg: Config) -> None:
    """ConfigError at start-up, rather than at the first step's trace, when rl.num_micro_batches
    does not split a step's batch (data.batch_size x `group_size` rows) into equal micro-batches
    of whole units (DPO's pairs stay in one micro-batch)."""
    rows_per_question, unit = group_size(cfg), algorithm_of(cfg).micro_batch_unit
    rows, num = cfg.data.batch_size * rows_per_question, cfg.rl.num_micro_batches
    if rows % (num * unit):
        fits = [n for n in range(1, rows // unit + 1) if rows % (n * unit) == 0]
        raise ConfigError(
            f"rl.num_micro_batches={num} does not split a step's batch of {rows} rows (data.batch_size="
            f"{cfg.data.batch_size} x {rows_per_question} rows per question for rl.algorithm={cfg.rl.algorithm})"
            + (" into micro-batches of whole pairs" if unit == 2 else "")
            + f"; values that do: {', '.join(map(str, fits))}")


def train_step(cfg: Config, mesh: Mesh) -> TrainStep:
    """The run's train step on its train mesh."""
    check_micro_batches(cfg)
    tx, value_tx, _ = optimizers(cfg)
    return make_train_step(cfg, tx, mesh, value_tx=value_tx, group_size=group_size(cfg))
