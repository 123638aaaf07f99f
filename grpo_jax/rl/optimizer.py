"""AdamW with the DeepSeekMath multi-step learning-rate schedule.

Schedule (paper §2.2.1 / §3.1): linear warmup to the peak over `warmup_steps`, the peak
until 80% of training, 31.6% of the peak until 90%, then 10% of the peak.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from grpo_jax.config import OptimizerConfig, multistep_drops


def multistep_schedule(peak_lr: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """lr(step) = peak·min(1, (step+1)/warmup) before 0.8·total, then ×0.316, then ×0.1 from 0.9·total.

    `step` counts optimizer updates from 0; warmup reaches the peak on update `warmup_steps − 1`.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    first, second = multistep_drops(total_steps)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (step + 1.0) / max(warmup_steps, 1)) if warmup_steps > 0 else 1.0
        factor = jnp.where(step < first, 1.0, jnp.where(step < second, 0.316, 0.1))
        return peak_lr * warm * factor

    return schedule


def constant_schedule(peak_lr: float, warmup_steps: int) -> optax.Schedule:
    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        return peak_lr * (jnp.minimum(1.0, (step + 1.0) / warmup_steps) if warmup_steps > 0 else 1.0)

    return schedule


def decay_mask(params: Any) -> Any:
    """True for parameters that get weight decay: matrices (embeddings, projections), never
    norms, biases or the scalar value bias. Stacked layers add a leading axis, so decide by
    name rather than by rank."""

    def keep(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return not ("norm" in name or "bias" in name)

    return jax.tree_util.tree_map_with_path(keep, params)


def updates_applied(cfg: OptimizerConfig, train_steps: int, updates_per_step: int = 1) -> int:
    """AdamW updates applied after ``train_steps`` train steps of ``updates_per_step`` (μ)
    optimiser calls each, ``cfg.grad_accum_steps`` calls accumulating into one update."""
    return (train_steps * updates_per_step) // cfg.grad_accum_steps


def value_optimizer_config(cfg: OptimizerConfig) -> OptimizerConfig:
    """The PPO value model's optimiser: the policy's, at peak_lr × value_lr_scale."""
    return dataclasses.replace(cfg, peak_lr=cfg.peak_lr * cfg.value_lr_scale)


def make_optimizer(cfg: OptimizerConfig, total_steps: int, *, updates_per_step: int = 1
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (b1, b2, eps, decoupled weight decay on `decay_mask`) after global-norm clipping,
    optionally accumulating `grad_accum_steps` calls into one update (optax.MultiSteps).

    The schedule is written in train steps (`warmup_steps`, and 80% / 90% of `total_steps`,
    i.e. run.steps) but optax advances it once per applied AdamW update, of which a train
    step makes `updates_per_step / grad_accum_steps` (μ = rl.num_updates calls, k of them
    per update). So the returned schedule maps an update count n to the train step
    ⌊n·k/μ⌋ it belongs to: warmup and the drops land on the train steps they name for
    any μ and k. It is the rate AdamW applies at update n (see `updates_applied`).
    """
    if updates_per_step < 1:
        raise ValueError(f"updates_per_step must be >= 1, got {updates_per_step}")
    if cfg.schedule == "multistep":
        by_step = multistep_schedule(cfg.peak_lr, cfg.warmup_steps, total_steps)
    else:
        by_step = constant_schedule(cfg.peak_lr, cfg.warmup_steps)
    k = cfg.grad_accum_steps

    def lr(update):
        return by_step(jnp.floor_divide(jnp.asarray(update, jnp.int32) * k, updates_per_step))

    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             mask=decay_mask))
    tx = optax.chain(*parts)
    if k > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=k)
    return tx, lr
