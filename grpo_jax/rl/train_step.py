"""One jitted, sharded train step for every algorithm of the unified paradigm.

    step(state, batch) -> (state, metrics)

What happens inside, in order (``make_train_step``):

1. ``algorithm.prepare`` — once per batch, no gradients, micro-batch by micro-batch:
   the log-probs and values that the μ updates share (π_θold when μ > 1 or PPO, π_ref
   when the algorithm needs it, the PPO value model), then advantages (GRPO group-
   relative / process, PPO's KL-shaped rewards + GAE + whitening) and the loss mask.
2. μ = rl.num_updates optimiser updates on the same batch (``lax.scan``). Each splits
   the batch into rl.num_micro_batches micro-batches (``lax.scan``), sums the gradient of
   the loss *numerator* and the denominators (``losses.aggregate_parts``), and divides
   once: 1 or 4 micro-batches give the same gradient up to float rounding, for every
   aggregation mode. PPO's value model is updated in the same step by its own optimiser.
   An update whose denominator is 0 (no valid token) leaves params and optimiser state
   unchanged.
3. Metrics: every loss-side metric is a ratio of sums accumulated over micro-batches,
   averaged over the μ updates; ``logprob_mismatch_max`` and ``ratio_deviation_max`` are
   taken at the first update, where π_θ is still the policy the batch was sampled for.

Hyperparameters: the numeric rl.* values (β, ε, γ, λ, value clip range, DPO β,
temperature, TIS cap) are an ``algorithms.RLHParams`` argument, so one compiled program
serves all their values; modes are compiled in (``RLConfig.modes()``, the cache key).

Sharding: ``jax.jit`` with explicit in/out shardings — params (policy, reference, value
model, optimiser moments) per the logical-axis rules (``model.param_shardings``), batch
rows over ('data', 'fsdp'), metrics replicated — and the state donated. One compiled
program per batch shape.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from grpo_jax.model import fused_attention, lora, packing, splash
from grpo_jax import loops
from grpo_jax.rl import losses
from grpo_jax.model import transformer as model_lib
from grpo_jax.rl.algorithms import (MAX_METRICS, Algorithm, RLHParams, algorithm_of, own_tokens,
                                 split_micro_batches)
from grpo_jax.rl.batching import Batch
from grpo_jax.config import Config, ModelConfig
from grpo_jax.parallel.sharding import batch_degree, batch_sharding, mesh_of, on_mesh, replicated

__all__ = ["TrainState", "TrainStep", "METRIC_NAMES", "init_train_state", "keeps_reference_copy", "make_train_step", "reset_reference",
           "opt_state_shardings", "static_config_key"]

# Always present in the metrics dict (0 where the algorithm has no such quantity,
# groups_kept_fraction 1). Algorithms may add more (e.g. PPO's return_mean, DPO's dpo_accuracy).
METRIC_NAMES = ("loss", "pg_loss", "kl", "clip_fraction", "entropy", "adv_mean", "adv_std",
                "grad_norm", "tokens", "logprob_mismatch_max", "value_loss",
                "groups_kept_fraction", "reward_mean")


@flax.struct.dataclass
class TrainState:
    """Everything the step updates (all device arrays; None fields hold nothing)."""

    step: Any  # int32 scalar: train steps taken
    params: Any  # what the optimiser trains: the policy's weights, or its LoRA adapters
    opt_state: Any
    ref_params: Any = None  # frozen π_ref; None unless the algorithm needs one (β > 0, DPO)
    value_params: Any = None  # PPO's value model V_ψ (a trunk + value head)
    value_opt_state: Any = None
    # LoRA (model.lora_rank > 0): the frozen base weights, which are π_ref as well
    # (ref_params stays None); grpo_jax.model.lora.model_view shows the state as full weights.
    base_params: Any = None


# ============================================================================ state

def opt_state_shardings(tx: optax.GradientTransformation, param_shapes: Any,
                        param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings of ``tx.init(params)``: every sub-tree shaped like the params (Adam's
    moments, accumulated gradients) is sharded like the params; anything else (counts)
    is replicated."""
    abstract = jax.eval_shape(tx.init, param_shapes)
    pdef = jax.tree.structure(param_shapes)

    def like_params(x):
        return jax.tree.structure(x) == pdef

    return jax.tree.map(lambda x: param_shardings if like_params(x) else replicated(mesh),
                        abstract, is_leaf=like_params)


def _shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _copy(tree):
    """A fresh copy with its own buffers and the same shardings (eager per-leaf copies):
    the reference must survive the donation of the policy."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _init_opt(tx, params):
    mesh = mesh_of(params)
    if mesh is None:
        return tx.init(params)
    shardings = opt_state_shardings(tx, _shapes(params), jax.tree.map(lambda x: x.sharding, params), mesh)
    return jax.jit(tx.init, out_shardings=shardings)(params)


def keeps_reference_copy(cfg: Config) -> bool:
    """Whether the state holds π_ref as its own weights: the algorithm needs a reference
    and the policy is not LoRA (whose reference is its base)."""
    return algorithm_of(cfg).needs_reference(cfg) and not lora.enabled(cfg.model)


def init_train_state(cfg: Config, params, tx: optax.GradientTransformation, *,
                     value_params=None, value_tx: optax.GradientTransformation | None = None
                     ) -> TrainState:
    """The state for ``cfg.rl.algorithm``: optimiser state(s), and a copy of ``params`` as
    the frozen reference only when the algorithm needs one (GRPO/PPO with β > 0, DPO);
    β = 0 and SFT/RFT keep no reference at all. With LoRA, ``params`` become the frozen
    base (and the reference) and fresh adapters (seeded by run.seed) are what the
    optimiser trains. PPO needs ``value_params`` (e.g.
    ``model.add_value_head(cfg.model, params, key, mesh)``) and ``value_tx``.
    ``params`` and ``value_params`` are copied (the step donates the state's buffers, so
    the caller's arrays, e.g. a frozen π_sft used for sampling, stay valid)."""
    algo = algorithm_of(cfg)
    params = _copy(jax.tree.map(jnp.asarray, params))
    mesh = mesh_of(params)
    step = jnp.zeros((), jnp.int32)
    if mesh is not None:
        step = jax.device_put(step, replicated(mesh))
    base = None
    if lora.enabled(cfg.model):
        base, params = params, lora.init_adapters(cfg.model, jax.random.key(cfg.run.seed), mesh)
    ref = _copy(params) if keeps_reference_copy(cfg) else None
    value_opt_state = None
    if algo.needs_value_model:
        if value_params is None or value_tx is None:
            raise ValueError(f"{algo.name} trains a value model: pass value_params "
                             "(model.add_value_head) and value_tx")
        # Own buffers: add_value_head shares the trunk arrays with the policy.
        value_params = _copy(jax.tree.map(jnp.asarray, value_params))
        value_opt_state = _init_opt(value_tx, value_params)
    else:
        value_params = None
    return TrainState(step=step, params=params, opt_state=_init_opt(tx, params), ref_params=ref,
                      value_params=value_params, value_opt_state=value_opt_state, base_params=base)


def reset_reference(state: TrainState, model_cfg: ModelConfig | None = None) -> TrainState:
    """π_ref ← π_θ (iterative GRPO, Algorithm 1 line 3). No-op when no reference is kept.
    Under LoRA (``model_cfg`` needed) the reference is the base: the adapters are merged
    into it and B set to 0, so the policy does not change, and A and the optimizer state
    carry on as a full fine-tune's optimizer state does across the reset."""
    if state.base_params is not None:
        if model_cfg is None:
            raise ValueError("reset_reference of a LoRA state needs its model config (lora_alpha, lora_targets)")
        return state.replace(base_params=lora.merged(model_cfg, state.base_params, state.params),
                             params=lora.zero_b(state.params))
    if state.ref_params is None:
        return state
    return state.replace(ref_params=_copy(state.params))


# ============================================================================ device side

def _combine(acc: dict, new: dict) -> dict:
    out = {}
    for name, (value, count) in new.items():
        a_value, a_count = acc[name]
        combined = jnp.maximum(a_value, value) if name in MAX_METRICS else a_value + value
        out[name] = (combined, a_count + count)
    return out


def _finish(parts: dict) -> dict:
    out = {}
    for name, (value, count) in parts.items():
        if name in MAX_METRICS:
            out[name] = jnp.asarray(value, jnp.float32)
        else:
            out[name] = losses.safe_divide(value, count)
    return out


def _f32_parts(metrics: dict) -> dict:
    return {k: (jnp.asarray(v, jnp.float32), jnp.asarray(c, jnp.float32)) for k, (v, c) in metrics.items()}


def _build_step(cfg: Config, algo: Algorithm, tx, value_tx, group_size: int) -> Callable:
    rl = cfg.rl
    num_micro = rl.num_micro_batches

    def loss_fn(params, value_params, micro_batch, extras, hp, base):
        policy = params if base is None else lora.policy_params(base, params)
        num, den, metrics = algo.loss_parts(policy, micro_batch, extras, cfg, hp,
                                            value_params=value_params)
        return num, (jnp.asarray(den, jnp.float32), _f32_parts(metrics))

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def one_micro_batch(params, value_params, micro, hp, base):
        (num, (den, metrics)), grads = grad_fn(params, value_params, *micro, hp, base)
        return grads, num, den, metrics

    def gradients(params, value_params, batch, extras, hp, base):
        """Σ over micro-batches of grad(numerator), numerator, denominator, metric parts."""
        if num_micro == 1:
            return one_micro_batch(params, value_params, (batch, extras), hp, base)
        micro = split_micro_batches((batch, extras), num_micro, algo.micro_batch_unit)
        first = jax.tree.map(lambda x: x[0], micro)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                             jax.eval_shape(one_micro_batch, params, value_params, first, hp, base))

        def body(acc, mb):
            grads, num, den, metrics = one_micro_batch(params, value_params, mb, hp, base)
            a_grads, a_num, a_den, a_metrics = acc
            return (jax.tree.map(jnp.add, a_grads, grads), a_num + num, a_den + den,
                    _combine(a_metrics, metrics)), None

        acc, _ = loops.scan(body, zeros, micro)
        return acc

    def apply(tx_, params, opt_state, grads, ok):
        updates, new_opt_state = tx_.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jnp.where(ok, new, old)
        return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt_state, opt_state)

    def update(carry, batch, extras, hp, base):
        params, opt_state, value_params, value_opt_state = carry
        grads, num, den, metric_parts = gradients(params, value_params, batch, extras, hp, base)
        ok = den > 0
        scale = 1.0 / jnp.where(ok, den, 1.0)
        policy_grads, value_grads = jax.tree.map(lambda g: g * scale, grads)
        metrics = _finish(metric_parts)
        metrics["grad_norm"] = optax.global_norm(policy_grads)
        params, opt_state = apply(tx, params, opt_state, policy_grads, ok)
        if value_params is not None:
            metrics["value_grad_norm"] = optax.global_norm(value_grads)
            value_params, value_opt_state = apply(value_tx, value_params, value_opt_state,
                                                  value_grads, ok)
        return (params, opt_state, value_params, value_opt_state), metrics

    def step(state: TrainState, batch: Batch, hp: RLHParams):
        extras, prep_metrics = algo.prepare(lora.model_view(state), batch, cfg, hp, group_size=group_size)
        if batch.packing is not None:
            # The μ updates split a packed batch in its packing's row order (which rows share
            # a micro-batch); every loss part is a sum over rows, so nothing else changes.
            batch, extras = packing.in_order(batch, batch.packing), packing.in_order(extras, batch.packing)
        carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
        base = state.base_params
        if rl.num_updates == 1:
            carry, metrics = update(carry, batch, extras, hp, base)
        else:
            carry, per_update = loops.scan(lambda c, _: update(c, batch, extras, hp, base), carry,
                                             None, length=rl.num_updates)
            metrics = {k: v[0] if k in MAX_METRICS else jnp.mean(v) for k, v in per_update.items()}
        params, opt_state, value_params, value_opt_state = carry
        out = {name: jnp.zeros((), jnp.float32) for name in METRIC_NAMES}
        out["groups_kept_fraction"] = jnp.ones((), jnp.float32)
        out.update({k: jnp.asarray(v, jnp.float32) for k, v in prep_metrics.items()})
        out.update(metrics)
        out["tokens"] = jnp.sum(own_tokens(batch).astype(jnp.float32))
        out["reward_mean"] = jnp.mean(batch.rewards.astype(jnp.float32))
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  value_params=value_params, value_opt_state=value_opt_state)
        return new_state, out

    return step


def static_config_key(cfg: Config, group_size: int | None = None) -> tuple:
    """What a compiled step depends on: the model and the modes of cfg.rl
    (``RLConfig.modes``; the numbers are ``RLHParams`` data)."""
    return cfg.model, cfg.rl.modes(group_size)


@dataclasses.dataclass
class TrainStep:
    """``step(state, batch) -> (state, metrics)``; compiled once per batch shape (AOT), the
    rl.* values of ``cfg`` passed as data (``RLHParams``).

    ``fn(state, batch, hp)`` is the unjitted step (for ``jax.make_jaxpr``);
    ``compiled(state, batch)`` the executable for that batch shape (``.memory_analysis()``);
    ``with_config(cfg)`` a step for another config that reuses the compiled programs when
    only RLHParams values differ. ``hp`` is ``cfg``'s RLHParams (host scalars).
    """

    cfg: Config
    algorithm: Algorithm
    mesh: Mesh
    tx: Any
    value_tx: Any
    group_size: int
    fn: Callable
    state_shardings: TrainState
    hp: RLHParams
    _cache: dict = dataclasses.field(default_factory=dict)

    def batch_shardings(self, batch: Batch) -> Batch:
        return jax.tree.map(lambda x: batch_sharding(self.mesh, np.ndim(x), np.shape(x)[0]), batch)

    @functools.cached_property
    def _hp_on_mesh(self) -> RLHParams:
        return jax.device_put(self.hp, replicated(self.mesh))

    def hparams(self) -> RLHParams:
        """``hp`` on the mesh (put there once)."""
        return self._hp_on_mesh

    def _place(self, state: TrainState, batch: Batch):
        return (jax.device_put(state, self.state_shardings),
                jax.device_put(batch, self.batch_shardings(batch)))

    def hparams_shapes(self) -> RLHParams:
        """``hparams()`` as ShapeDtypeStructs, for lowering without devices."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated(self.mesh)),
                            self.hp)

    def lower(self, state: TrainState, batch: Batch):
        """The step lowered for this state and batch (arrays, or ShapeDtypeStructs with
        shardings: ``grpo_jax.aot`` lowers the same program without devices)."""
        jitted = jax.jit(
            self.fn, in_shardings=(self.state_shardings, self.batch_shardings(batch), replicated(self.mesh)),
            out_shardings=(self.state_shardings, replicated(self.mesh)), donate_argnums=(0,))
        with on_mesh(self.mesh):  # the model's activation constraints (sharding.constrain)
            return jitted.lower(state, batch, self.hparams_shapes())

    def compiled(self, state: TrainState, batch: Batch):
        """The compiled executable for this batch's shapes (compiling it the first time)."""
        key = tuple((np.shape(x), jnp.result_type(x).name) for x in jax.tree.leaves(batch))
        if key not in self._cache:
            self._cache[key] = self.lower(*self._place(state, batch)).compile()
        return self._cache[key]

    def with_config(self, cfg: Config) -> "TrainStep":
        """The step for ``cfg``: shares compiled programs with this one when
        ``static_config_key`` agrees, else builds (and will compile) a new one."""
        if static_config_key(cfg, self.group_size) == static_config_key(self.cfg, self.group_size):
            return dataclasses.replace(self, cfg=cfg, hp=RLHParams.from_config(cfg.rl))
        return make_train_step(cfg, self.tx, self.mesh, value_tx=self.value_tx,
                               group_size=self.group_size)

    def _check(self, state: TrainState) -> None:
        wants_ref = keeps_reference_copy(self.cfg)
        if (state.ref_params is not None) != wants_ref:
            raise ValueError(
                f"state.ref_params is {'set' if state.ref_params is not None else 'None'} but "
                f"{self.algorithm.name} with rl.beta={self.cfg.rl.beta} "
                f"{'needs' if wants_ref else 'keeps no'} reference; build the state with "
                "init_train_state(cfg, ...) for the same config")

    def packed(self, batch: Batch) -> Batch:
        """``batch`` (host arrays) with its sequences packed when rl.pack is on
        (``packing.pack``: per micro-batch and device block of this step's mesh); as it
        is otherwise, or when it is packed already."""
        if not self.cfg.rl.pack or batch.packing is not None:
            return batch
        return packing.pack(jax.tree.map(np.asarray, batch), self.cfg.rl.num_micro_batches,
                            self.algorithm.micro_batch_unit, batch_degree(self.mesh))

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        self._check(state)
        batch = self.packed(batch)
        compiled = self.compiled(state, batch)
        state, batch = self._place(state, batch)
        return compiled(state, batch, self.hparams())


def make_train_step(cfg: Config, tx: optax.GradientTransformation, mesh: Mesh, *,
                    value_tx: optax.GradientTransformation | None = None,
                    group_size: int | None = None) -> TrainStep:
    """The train step for ``cfg.rl.algorithm`` on ``mesh`` (see the module docstring).

    ``tx`` updates the policy, ``value_tx`` the PPO value model (required for PPO).
    ``group_size`` G defaults to cfg.rl.group_size (GRPO: rows = questions × G). Only
    ``static_config_key(cfg)`` is compiled in; the other rl.* values are passed as data on
    every call (``step.with_config(new_cfg)`` reuses the compiled programs).
    """
    algo = algorithm_of(cfg)
    if cfg.model.attention == "splash":  # refused at start-up, not at the first step's trace
        splash.require_tpu(mesh.devices.flat[0].platform)
    if cfg.model.attention == "cudnn":
        fused_attention.require_gpu(mesh.devices.flat[0].platform)
    if algo.needs_value_model and value_tx is None:
        raise ValueError(f"{algo.name} trains a value model: pass value_tx")
    group_size = cfg.rl.group_size if group_size is None else int(group_size)
    param_sh = model_lib.param_shardings(cfg.model, mesh)
    trained_sh, trained_shapes = param_sh, model_lib.param_shapes(cfg.model)
    if lora.enabled(cfg.model):
        trained_sh = lora.adapter_shardings(cfg.model, mesh)
        trained_shapes = lora.adapter_shapes(cfg.model)
    state_sh = TrainState(
        step=replicated(mesh), params=trained_sh,
        opt_state=opt_state_shardings(tx, trained_shapes, trained_sh, mesh),
        ref_params=param_sh if keeps_reference_copy(cfg) else None,
        base_params=param_sh if lora.enabled(cfg.model) else None)
    if algo.needs_value_model:
        value_sh = model_lib.param_shardings(cfg.model, mesh, value_head=True)
        value_shapes = model_lib.param_shapes(cfg.model, value_head=True)
        state_sh = state_sh.replace(
            value_params=value_sh,
            value_opt_state=opt_state_shardings(value_tx, value_shapes, value_sh, mesh))
    fn = _build_step(cfg, algo, tx, value_tx, group_size)
    return TrainStep(cfg=cfg, algorithm=algo, mesh=mesh, tx=tx, value_tx=value_tx,
                     group_size=group_size, fn=fn, state_shardings=state_sh,
                     hp=RLHParams.from_config(cfg.rl))
