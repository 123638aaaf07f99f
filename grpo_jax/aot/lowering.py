"""The run's own programs lowered on abstract, sharded arguments: the train step
(``programs.train_step``) on an abstract state and batch, the run's sampler calls
(``Sampler.for_run``, ``Sampler.abstract_call``) and, for a run that calls a tool, the
calls of its continuations (``sampler.turns.continuation_call``), so the check compiles
what a run executes."""


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
    sampler = Sampler.for_run(cfg, sample_mesh=mesh)  # its engine chosen for this mesh's devices
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


def slot_programs(cfg: Config, mesh, prompt_len: int, slots: int = 0) -> dict:
    """{"slot_prefill" | "slot_decode" | "slot_append": (program, abstract args, kwargs)}:
    the slot engine's programs (``sampler.slots``, rl.decode=slots) a run of ``cfg`` makes
    on the sampling ``mesh``: ``slots`` decode slots (0: rl.decode_slots, else one static
    call's rows, rl.sample_prompts x G), a prefill of a chunk of questions in a bucket of
    ``prompt_len``, the decode loop over the whole step's rows (data.batch_size x G), and
    the append of a tool's output (one row, a 64-token bucket). The state's and the chunk's
    shardings are those their own programs give them (each compiled here for ``mesh``)."""
    from grpo_jax.parallel.sharding import replicated
    from grpo_jax.sampler import slots as slots_lib
    from grpo_jax.sampler.calls import place_key, sampling_mesh
    from grpo_jax.sampler.draw import Drawing
    from grpo_jax.sampler.engines import resolve
    from grpo_jax.sampler.layouts import round_up
    from grpo_jax.sampler.weights import abstract_sampling_copy
    from grpo_jax.shapes import bucket_length

    sampler = run_sampler(cfg, mesh)
    settings = sampler.settings.replace(engine="slots")
    smesh = sampling_mesh(mesh)
    engine = resolve("slots", smesh, settings.kv_dtype)
    progs = slots_lib.programs(cfg.model, smesh, engine, settings.kv_dtype)
    g = cfg.rl.group_size
    degree = 1 if smesh is None else smesh.shape["data"] * smesh.shape["fsdp"]
    s = round_up(slots or cfg.rl.decode_slots or (cfg.rl.sample_prompts or cfg.data.batch_size) * g, degree)
    q = round_up(-(-s // g) + 1, degree)
    rows = cfg.data.batch_size * g
    rep = None if smesh is None else replicated(smesh)
    scalar = lambda dtype=jnp.int32: jax.ShapeDtypeStruct((), dtype, sharding=rep)
    rows_of = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=None if smesh is None else
                                                        batch_sharding(smesh, len(shape), shape[0]))
    outputs = lambda lowered: abstract_like(lowered.out_info, lowered.compile().output_shardings)
    weights = abstract_sampling_copy(cfg.model, sampler.weights_dtype, smesh)
    init_args = dict(slots=s, prompt_bucket=prompt_len, num_cols=bucket_length(settings.max_new_tokens), rows=rows,
                     pad_id=scalar())
    state = outputs(progs.init.lower(**init_args))
    pre_args = (weights, rows_of((q, prompt_len), jnp.int32), rows_of((q, prompt_len), bool), None)
    cache, logits0 = outputs(progs.prefill.lower(*pre_args, cache_len=prompt_len))
    chunk = slots_lib.Chunk(cache=cache, logits0=logits0, prompt_len=rows_of((q,), jnp.int32), first_row=scalar(),
                            end=scalar(), group_size=scalar())
    drawing = Drawing.host(settings, cfg.model.vocab_size)
    drawing = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), drawing)
    vocab_mask = jax.ShapeDtypeStruct((cfg.model.vocab_size,), bool, sharding=rep)
    decode_args = (engine.step.abstract_weights(cfg.model, weights), state, chunk, place_key(None, smesh, True),
                   drawing, scalar(), vocab_mask, scalar(bool), scalar(), scalar())
    lane = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
    append_args = (state, weights, lane((1,), jnp.int32), lane((1, 64), jnp.int32), lane((1, 64), bool),
                   lane((1,), bool), scalar())
    return {"slot_prefill": (progs.prefill, pre_args, {"cache_len": prompt_len}),
            "slot_decode": (progs.decode, decode_args, {}), "slot_append": (progs.append, append_args, {})}
