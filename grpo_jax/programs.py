"""The device programs a run executes, built in one place.

The trainer, evaluation and the ahead-of-time check (``grpo_jax.aot``, ``launch/compile.py``)
take their sampler calls (``sampler.sampler_call``) and train step from these functions with
the same static arguments, so the check compiles the programs a run executes
(``tests/test_programs.py`` lowers both and compares the HLO). Which decode runs is
``rl.decode``, resolved by ``sampler.resolve`` and printed by the trainer at start-up.
"""

from __future__ import annotations

from typing import Any, Callable

import optax
from jax.sharding import Mesh

from grpo_jax import sampler as sampler_lib
from grpo_jax.algorithms import algorithm_of
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
    if algorithm_of(cfg).needs_value_model:
        value_base, _ = make_optimizer(value_optimizer_config(cfg.optimizer), cfg.run.steps,
                                       updates_per_step=cfg.rl.num_updates)
        value_tx = optax.apply_if_finite(value_base, max_consecutive_errors=10**9)
    return tx, value_tx, schedule


def group_size(cfg: Config) -> int:
    """Rows per question in a train batch: G, 2 for DPO's preference pairs, 1 for SFT."""
    source = algorithm_of(cfg).data_source
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


def decode_engine(cfg: Config, mesh: Mesh | None) -> str:
    """The name of the engine ``rl.decode`` resolves to on the sampling mesh
    (``sampler.resolve``)."""
    return sampler_lib.resolve(cfg.rl.decode, sampler_lib.sampling_mesh(mesh), cfg.rl.kv_dtype).name


def sampler(cfg: Config, mesh: Mesh | None, prompts: int, group_size: int, prompt_len: int, *,
            evaluation: bool = False, **twin) -> sampler_lib.SamplerCall:
    """The sampler call a run makes on its sampling ``mesh`` for ``prompts`` x
    ``group_size`` rows with prompts in a bucket of ``prompt_len``: the rollout's
    (``SamplingParams.from_rl``), or with ``evaluation`` the in-run evaluation's
    (``SamplingParams.evaluation``: greedy, one row per question). ``twin``: the cost twin
    of ``grpo_jax.aot`` (``sampler.sampler_call``)."""
    settings = sampler_lib.SamplingParams.from_rl(cfg.rl)
    if evaluation:
        settings = settings.evaluation()
    return sampler_lib.sampler_call(cfg.model, mesh, settings, prompts, group_size, prompt_len, **twin)
