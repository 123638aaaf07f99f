"""The device programs a run executes, built in one place.

The trainer, evaluation and the ahead-of-time check (``grpo_jax.aot``, ``launch/compile.py``)
take their sampler and train step from these functions with the same static arguments, so
the check compiles the programs a run executes (``tests/test_programs.py`` lowers both and
compares the HLO). Which decode runs is ``rl.decode``, resolved once here
(``decode_engine``) and printed by the trainer at start-up.
"""

from __future__ import annotations

from typing import Any, Callable

import optax
from jax.sharding import Mesh

from grpo_jax import sampling
from grpo_jax.algorithms import get_algorithm
from grpo_jax.config import Config
from grpo_jax.optimizer import make_optimizer, value_optimizer_config
from grpo_jax.sharding import make_sample_mesh
from grpo_jax.train_step import TrainStep, make_train_step


def optimizers(cfg: Config) -> tuple[optax.GradientTransformation, Any, Callable]:
    """(policy tx, value-model tx or None, the policy's lr schedule). A non-finite gradient
    skips the update (``optax.apply_if_finite``) instead of corrupting the params; the
    trainer stops after ``run.max_bad_steps`` of them in a row."""
    base, schedule = make_optimizer(cfg.optimizer, cfg.run.steps, updates_per_step=cfg.rl.num_updates)
    tx = optax.apply_if_finite(base, max_consecutive_errors=10**9)
    value_tx = None
    if get_algorithm(cfg.rl.algorithm).needs_value_model:
        value_base, _ = make_optimizer(value_optimizer_config(cfg.optimizer), cfg.run.steps,
                                       updates_per_step=cfg.rl.num_updates)
        value_tx = optax.apply_if_finite(value_base, max_consecutive_errors=10**9)
    return tx, value_tx, schedule


def group_size(cfg: Config) -> int:
    """Rows per question in a train batch: G, 2 for DPO's preference pairs, 1 for SFT."""
    source = get_algorithm(cfg.rl.algorithm).data_source
    return 2 if source == "sft_policy_pairs" else 1 if source == "dataset" else cfg.rl.group_size


def train_step(cfg: Config, mesh: Mesh) -> TrainStep:
    """The run's train step on its train mesh."""
    tx, value_tx, _ = optimizers(cfg)
    return make_train_step(cfg, tx, mesh, value_tx=value_tx, group_size=group_size(cfg))


def sample_mesh(cfg: Config, train: Mesh) -> Mesh:
    """The sampler's mesh: replicas x tensor (``mesh.sample_tensor``, else the slice
    preset's) when ``mesh.slice`` or ``mesh.sample_tensor`` is set, else the train mesh."""
    if cfg.mesh.slice or cfg.mesh.sample_tensor:
        return make_sample_mesh(cfg.mesh, list(train.devices.flat))
    return train


def sampler_mesh(mesh: Mesh | None) -> Mesh | None:
    """The mesh the sampler's programs are built for: None for one device (nothing to
    shard; the unsharded programs are shared)."""
    return None if mesh is not None and mesh.size == 1 else mesh


def decode_engine(cfg: Config, mesh: Mesh | None) -> str:
    """``rl.decode`` resolved for the sampling mesh (``sampling.resolve_engine``)."""
    return sampling.resolve_engine(cfg.rl.decode, sampler_mesh(mesh), cfg.rl.kv_dtype)


def sampler(cfg: Config, mesh: Mesh | None, *, unrolled: bool = False):
    """(prefill, decode) as the run's sampler calls them on ``mesh`` (``unrolled``: the cost
    twin of ``grpo_jax.aot``)."""
    mesh = sampler_mesh(mesh)
    return sampling.programs(cfg.model, mesh, engine=decode_engine(cfg, mesh),
                             filtered=cfg.rl.top_k > 0 or cfg.rl.top_p < 1.0, kv_dtype=cfg.rl.kv_dtype,
                             unrolled=unrolled)
