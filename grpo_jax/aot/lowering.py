"""The run's own programs lowered on abstract, sharded arguments: the train step
(``programs.train_step``) on an abstract state and batch, the run's sampler calls
(``Sampler.for_run``, ``Sampler.abstract_call``) and, for a run that calls a tool, the
calls of its continuations (``sampler.turns.continuation_call``), so the check compiles
what a run executes."""

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax.model import lora, packing
from grpo_jax.rl import programs
from grpo_jax.model import transformer as model_lib
from grpo_jax.rl import train_step as ts
from grpo_jax.aot.fit import compile_lowered
from grpo_jax.rl.batching import Batch
from grpo_jax.config import Config
from grpo_jax.sampler import Sampler, turns
from grpo_jax.shapes import abstract_like
from grpo_jax.parallel.sharding import batch_sharding


def abstract_batch(rows: int, prompt_len: int, completion_len: int, mesh, tools: bool = False) -> Batch:
    """A Batch of ShapeDtypeStructs: [rows, prompt_len] prompts, [rows, completion_len]
    completions, one step slot, with ``tools`` the [rows, completion_len] mask of the
    tokens a tool wrote (a tool rollout's, ``sampler.turns``); rows sharded over the batch
    axes."""
    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape), rows))

    tp, tc = (rows, prompt_len), (rows, completion_len)
    return Batch(prompt_tokens=arr(tp, jnp.int32), prompt_mask=arr(tp, bool),
                    tokens=arr(tc, jnp.int32), mask=arr(tc, bool),
                    sample_logprobs=arr(tc, jnp.float32), rewards=arr((rows,), jnp.float32),
                    correct=arr((rows,), bool), truncated=arr((rows,), bool),
                    step_rewards=arr((rows, 1), jnp.float32), step_end=arr((rows, 1), jnp.int32),
                    step_mask=arr((rows, 1), bool), tool_mask=arr(tc, bool) if tools else None)


def train_state(cfg: Config, mesh):
    """(TrainStep, abstract TrainState): the run's train step (``programs.train_step``) and
    its state as ShapeDtypeStructs sharded like a real run's (policy, optimizer, reference,
    value model; under LoRA the frozen base and the adapters)."""
    step = programs.train_step(cfg, mesh)
    params = model_lib.param_shapes(cfg.model)
    trained = lora.adapter_shapes(cfg.model) if lora.enabled(cfg.model) else params
    shapes = ts.TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32), params=trained,
        opt_state=jax.eval_shape(step.tx.init, trained),
        ref_params=params if step.state_shardings.ref_params is not None else None,
        base_params=params if step.state_shardings.base_params is not None else None)
    if step.value_tx is not None:
        vparams = model_lib.param_shapes(cfg.model, value_head=True)
        shapes = shapes.replace(value_params=vparams, value_opt_state=jax.eval_shape(step.value_tx.init, vparams))
    return step, abstract_like(shapes, step.state_shardings)


def lower_train_step(cfg: Config, mesh, rows: int, prompt_len: int):
    """The run's train step lowered for a batch of ``rows`` x (prompt_len +
    rl.max_new_tokens) tokens, on abstract state and batch sharded like a real run's (with
    rl.max_tool_calls > 0 the batch carries the tool's tokens' mask)."""
    step, state = train_state(cfg, mesh)
    batch = abstract_batch(rows, prompt_len, cfg.rl.max_new_tokens, mesh, tools=cfg.rl.max_tool_calls > 0)
    if cfg.rl.pack:  # the largest packing the batch can need (one sequence per row)
        batch = batch.replace(packing=packing.abstract(rows, prompt_len, cfg.rl.max_new_tokens, mesh))
    return step.lower(state, batch)


def compile_train_step(cfg: Config, mesh, rows: int, prompt_len: int):
    """(compiled train step, seconds); see ``lower_train_step``."""
    return compile_lowered("train_step", lower_train_step(cfg, mesh, rows, prompt_len))


def run_sampler(cfg: Config, mesh, evaluation: bool = False) -> Sampler:
    """The sampler a run of ``cfg`` builds (``Sampler.for_run``), on the sampling ``mesh``
    (None: one device); with ``evaluation`` the in-run evaluation's (``Sampler.evaluation``:
    greedy)."""
    sampler = dataclasses.replace(Sampler.for_run(cfg), mesh=mesh)
    return sampler.evaluation() if evaluation else sampler


def sampler_calls(cfg: Config, mesh, prompts: int, group_size: int, prompt_len: int, *,
                  evaluation: bool = False) -> dict:
    """{"prefill" | "decode": (program, args, kwargs)}: the sampler call a run makes
    (`run_sampler`: the rollout's, or with ``evaluation`` the in-run evaluation's) with
    abstract arguments over the abstract sampling copy (``Sampler.abstract_weights``), for
    one call of ``prompts`` x ``group_size`` rows, a prompt bucket of ``prompt_len`` and
    rl.max_new_tokens new tokens. ``mesh`` None: one device."""
    sampler = run_sampler(cfg, mesh, evaluation)
    call = sampler.call(prompts, group_size, prompt_len)
    return call.abstract(sampler.abstract_weights(call))


def lower_sampler(cfg: Config, mesh, prompts: int, group_size: int, prompt_len: int, **kwargs) -> dict:
    """{"prefill": lowered, "decode": lowered}; see ``sampler_calls``."""
    return {name: program.lower(*args, **static)
            for name, (program, args, static) in sampler_calls(cfg, mesh, prompts, group_size, prompt_len,
                                                               **kwargs).items()}


def compile_sampler(cfg: Config, mesh, prompts: int, group_size: int, prompt_len: int, *,
                    evaluation: bool = False) -> dict:
    """{"prefill": (compiled, s), "decode": (compiled, s)}: the run's sampler programs for
    one call (``sampler_calls``). FitError names the program the compiler finds too big."""
    prefix = "eval" if evaluation else "sample"
    return {name: compile_lowered(f"{prefix}_{name}", lowered)
            for name, lowered in lower_sampler(cfg, mesh, prompts, group_size, prompt_len,
                                               evaluation=evaluation).items()}


def tool_turn_calls(cfg: Config, mesh, rows: int, context_len: int, used: int) -> dict:
    """{"prefill" | "decode": (program, args, kwargs)}: the sampler call a tool rollout
    (rl.max_tool_calls > 0) makes to continue ``rows`` rows once the longest holds ``used``
    tokens and the longest context ``context_len`` (``turns.continuation_call`` of
    `run_sampler`: each row's context prefilled afresh, the rest of rl.max_new_tokens
    decoded), with abstract arguments as in `sampler_calls`."""
    sampler = run_sampler(cfg, mesh)
    call = turns.continuation_call(sampler, rows, context_len, used)
    return call.abstract(sampler.abstract_weights(call))


def lower_tool_turn(cfg: Config, mesh, rows: int, context_len: int, used: int) -> dict:
    """{"prefill": lowered, "decode": lowered}; see ``tool_turn_calls``."""
    return {name: program.lower(*args, **static)
            for name, (program, args, static) in tool_turn_calls(cfg, mesh, rows, context_len, used).items()}
