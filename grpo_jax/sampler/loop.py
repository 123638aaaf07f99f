"""The decode program: a ``lax.while_loop``, one token per row per iteration, that stops as
soon as every row has hit a stop token (or after max_new_tokens), whatever the engine: the
loop calls only the ``engines.DecodeEngine`` interface and ``draw``.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from grpo_jax import loops
from grpo_jax.model import transformer as model_lib
from grpo_jax.config import ModelConfig
from grpo_jax.sampler import cache as cache_lib
from grpo_jax.sampler.draw import Drawing, next_token, uniforms
from grpo_jax.sampler.engines import DecodeEngine
from grpo_jax.sampler.prefill import TRACE_COUNTS


@flax.struct.dataclass
class Rows:
    """Per sample row [B]: what the decode needs to know of it."""

    prompt_lens: jax.Array  # [B] int32: real prompt tokens (the first completion position)
    row_ids: jax.Array  # [B] int32: the randomness index (the row's index in the whole batch)
    valid: jax.Array  # [B] bool: False for dummy rows (they start out finished)
    first_cols: jax.Array  # [B] int32: the row's column at the decode's first draw (a resumed row's)


@flax.struct.dataclass
class DecodeState:
    """The decode loop's carry: B rows, Tc = num_cols completion columns."""

    step: jax.Array  # [] int32: the column the next iteration samples
    cache: model_lib.KVCache  # the engine's cache (`DecodeEngine.start`)
    last: jax.Array  # [B] int32: the token sampled last (the next step's input)
    last_real: jax.Array  # [B] bool: that token is a real one (not a done row's pad)
    done: jax.Array  # [B] bool: stop token seen (or a dummy row)
    tokens: jax.Array  # [B, Tc] int32
    mask: jax.Array  # [B, Tc] bool
    logps: jax.Array  # [B, Tc] float32
    finished: jax.Array  # [B] bool: stopped on a stop token


def decode(cfg: ModelConfig, engine: DecodeEngine, params, cache, logits0, rows: Rows, key, drawing: Drawing, *,
           num_cols: int, windows: tuple[int, ...] | None = None):
    """Sample up to drawing.max_new_tokens (<= num_cols) tokens per row; stop when all rows
    are done. The first token is drawn from the prefill's logits0, each next one by a step
    of the ``engine`` over its cache, with ``params`` in its weights form
    (``DecodeEngine.weights``).

    `windows` (``DecodeEngine.cache_plan``): the cache slots of each decode phase; None: one
    phase over the cache as it comes. Each phase is a ``loops.while_loop`` (written out by
    the cost count of ``grpo_jax.aot``).

    Returns (tokens, mask, logprobs [Bp,num_cols], finished [Bp], steps, cache): the cache
    ``DecodeEngine.finish`` gives.
    """
    TRACE_COUNTS["decode"] += 1
    bsz = rows.row_ids.shape[0]
    windows = windows or (cache.mask.shape[1],)
    step_fn, cache, logits0 = engine.start(cfg, params, cache, logits0, bsz, windows)
    pad_id = drawing.pad_id

    def emit(state: DecodeState, logits) -> DecodeState:
        """Sample column `state.step` for the rows still running (done rows emit pad)."""
        step = state.step
        # Named scopes split a decode step's profile into parts (benchmarks/profile_ops.py).
        with jax.named_scope("sample"):
            token, logp = next_token(logits, uniforms(key, step + rows.first_cols, rows.row_ids), drawing)
        active = ~state.done
        token = jnp.where(active, token, pad_id)
        logp = jnp.where(active, logp, 0.0)
        stop = active & drawing.stop_mask[token]
        put = lambda buf, col: jax.lax.dynamic_update_slice(buf, col[:, None], (0, step))
        return state.replace(step=step + 1, last=token, last_real=active, done=state.done | stop,
                             tokens=put(state.tokens, token), mask=put(state.mask, active),
                             logps=put(state.logps, logp), finished=state.finished | stop)

    # RoPE tables of every step's position, made once ([Bp, num_cols, 1, D/2] each).
    tables = model_lib.rope_tables(rows.prompt_lens[:, None] + jnp.arange(num_cols), cfg.head_dim,
                                   cfg.rope_theta, cfg.rope_scaling_factor)
    state = DecodeState(
        step=jnp.zeros((), jnp.int32), cache=cache,
        last=jnp.zeros((bsz,), jnp.int32), last_real=jnp.zeros((bsz,), bool), done=~rows.valid,
        tokens=cache_lib.constrain_rows(jnp.full((bsz, num_cols), pad_id, jnp.int32)),
        mask=cache_lib.constrain_rows(jnp.zeros((bsz, num_cols), bool)),
        logps=cache_lib.constrain_rows(jnp.zeros((bsz, num_cols), jnp.float32)),
        finished=jnp.zeros((bsz,), bool))
    state = emit(state, logits0.T)
    tp = windows[-1] - num_cols

    def cond(window, s: DecodeState):
        # Step `step` writes slot tp + step - 1, which must lie inside the phase's window.
        return (s.step < drawing.max_new_tokens) & ~jnp.all(s.done) & (s.step < window - tp + 1)

    def body(s: DecodeState) -> DecodeState:
        rope_cs = tuple(jax.lax.dynamic_slice_in_dim(t, s.step - 1, 1, axis=1) for t in tables)
        # Token `step-1` (slot Tp+step-1) sits at position n + step - 1 (default_positions).
        positions = (rows.prompt_lens + s.step - 1)[:, None]
        logits, c = step_fn(s.cache, s.last, s.last_real, positions, rope_cs)
        return emit(s.replace(cache=c), logits)

    for window in windows:
        with jax.named_scope("cache_update"):
            state = state.replace(cache=engine.grow(state.cache, window))
        state = loops.while_loop(functools.partial(cond, window), body, state)
    return state.tokens, state.mask, state.logps, state.finished, state.step, engine.finish(state.cache)
