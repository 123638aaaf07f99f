"""The slot engine (continuous batching): a fixed number of decode slots fed from a queue of
rows, each slot taking the next row as soon as the one it holds stops, so that a rollout
costs the tokens it produces rather than its rows times its longest row.

Every row's tokens equal the static engine's (``rl.decode`` of the other engines): row r
draws its token at column t with ``draw.uniforms(key, t, r)``, from logits of its own prompt
and tokens so far, at the same RoPE positions, over a cache laid out as the static one (its
prompt left-padded into the prompt bucket Tp, then the completion bucket Tc). Only where a
row sits and when it runs differ, and neither enters its draws. Log-probs agree to float
rounding (other batch shapes, as between meshes).

The device programs (`programs`), each a pure function of the slot state (`SlotState`):

* **prefill**: the static sampler's own (``prefill.prefill``): a chunk of prompts once each,
  their caches in Tp slots; a question's G rows are all inserted from that one cache;
* **decode**: a ``lax.while_loop`` over all S slots. Each iteration inserts queued rows of the
  chunk into free slots (a row-wise scatter of their prompts' caches), draws a token for
  every running slot, writes each ended row to the output, and steps the model for the slots
  still running, each at its own cache index (``model.write_at``). It goes back to the host
  when the chunk's rows are all inserted and a slot is free (the host prefills the next
  chunk), a row pauses on a pause token (a tool's closing fence), or no slot runs;
* **append**: tokens written into some slots' caches at their own positions (a tool's
  output), their next logits from the last of them: a row that called a tool goes on without
  its context prefilled again (``sampler.turns``);
* **mark**: paused slots run on, or are held while the host runs their tools.

The host loop (`SlotDecoder`) prefills the chunks, answers pauses and reads the rows back in
row order. The steps it runs are `schedule`'s, which the benchmark also runs on drawn
lengths (``benchmarks/bench_slots.py``); the tests hold the two equal.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import time
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from grpo_jax import loops
from grpo_jax.config import ModelConfig
from grpo_jax.model import transformer as model_lib
from grpo_jax.parallel.sharding import batch_degree, batch_sharding, replicated, to_global, to_host
from grpo_jax.sampler import cache as cache_lib
from grpo_jax.sampler.calls import OnMesh, place_key
from grpo_jax.sampler.draw import Drawing, next_token, uniforms
from grpo_jax.sampler.engines import ENGINES, DecodeEngine
from grpo_jax.sampler.layouts import round_up
from grpo_jax.sampler.prefill import TRACE_COUNTS, prefill
from grpo_jax.sampler.settings import SamplingParams
from grpo_jax.shapes import bucket_length


@flax.struct.dataclass
class SlotState:
    """S decode slots, the queue and the output of B rows between two visits of the host;
    N = Tp + Tc cache slots per slot."""

    cache: model_lib.KVCache  # per layer (``cache.per_layer``): k [S,K,D,N], v [S,K,N,D]; mask [S,N]; index [S]
    logits: jax.Array  # [V, S] float32: what each slot's next draw reads
    row: jax.Array  # [S] int32: the slot's row (0..B-1)
    col: jax.Array  # [S] int32: the column the slot draws next
    prompt_len: jax.Array  # [S] int32: real prompt tokens of the row (the position of column 0)
    active: jax.Array  # [S] bool: the slot decodes
    paused: jax.Array  # [S] bool: stopped on a pause token, waiting for the host
    held: jax.Array  # [S] bool: the host holds the row while its tool runs
    pausable: jax.Array  # [S] bool: a pause token pauses this row (a tool call left)
    tokens: jax.Array  # [S, Tc] int32: the slot's row by column
    logps: jax.Array  # [S, Tc] float32
    next_row: jax.Array  # [] int32: the next queued row
    out_tokens: jax.Array  # [B, Tc] int32: ended rows
    out_logps: jax.Array  # [B, Tc] float32
    out_len: jax.Array  # [B] int32
    out_finished: jax.Array  # [B] bool: ended on a stop token
    draws: jax.Array  # [] int32: decode steps run (each over all S slots)

    def free(self) -> jax.Array:
        """[S] bool: slots that hold no row."""
        return ~self.active & ~self.paused & ~self.held


@flax.struct.dataclass
class Chunk:
    """The prompts the queue's rows next_row..end-1 come from: Q prompts' cache (stacked, Tp
    slots) and logits0 [Q, V]; row r is prompt (r - first_row) // G of them."""

    cache: model_lib.KVCache
    logits0: jax.Array  # [Q, V]
    prompt_len: jax.Array  # [Q] int32
    first_row: jax.Array  # [] int32
    end: jax.Array  # [] int32: the first row past the chunk
    group_size: jax.Array  # [] int32


def _rows(x):
    return cache_lib.constrain_rows(x)


def init_state(cfg: ModelConfig, kv_dtype: str, *, slots: int, prompt_bucket: int, num_cols: int, rows: int,
               pad_id) -> SlotState:
    """S free slots with an empty cache of Tp + Tc slots each, and B rows queued."""
    cache = model_lib.init_cache(cfg, slots, prompt_bucket + num_cols, cache_lib.dtype(cfg, kv_dtype))
    cache = cache_lib.per_layer(cache_lib.constrain_cache(cache.replace(index=jnp.zeros((slots,), jnp.int32))))
    full = lambda value, dtype, *shape: _rows(jnp.full(shape, value, dtype))
    return SlotState(cache=cache, logits=jnp.zeros((cfg.vocab_size, slots), jnp.float32),
                     row=full(0, jnp.int32, slots), col=full(0, jnp.int32, slots),
                     prompt_len=full(0, jnp.int32, slots), active=full(False, bool, slots),
                     paused=full(False, bool, slots), held=full(False, bool, slots),
                     pausable=full(False, bool, slots), tokens=full(pad_id, jnp.int32, slots, num_cols),
                     logps=full(0.0, jnp.float32, slots, num_cols), next_row=jnp.zeros((), jnp.int32),
                     out_tokens=full(pad_id, jnp.int32, rows, num_cols),
                     out_logps=full(0.0, jnp.float32, rows, num_cols), out_len=full(0, jnp.int32, rows),
                     out_finished=full(False, bool, rows), draws=jnp.zeros((), jnp.int32))


def _insert(state: SlotState, chunk: Chunk, pausable, pad_id) -> SlotState:
    """Queued rows of the chunk into the free slots, in slot order: each slot's first Tp cache
    slots become its prompt's, the rest masked out; its next draw reads its prompt's logits0;
    its columns are emptied."""
    free = state.free()
    row = state.next_row + jnp.cumsum(free) - 1
    take = free & (row < chunk.end)
    s_count = take.shape[0]
    slot = jnp.where(take, jnp.arange(s_count), s_count)  # s_count: dropped
    prompt = jnp.clip((row - chunk.first_row) // chunk.group_size, 0, chunk.logits0.shape[0] - 1)
    tp = chunk.cache.mask.shape[1]

    def put(buf, src, axis):  # buf [S, ..., N, ...] <- src [Q, ..., Tp, ...] along axis
        index = [slot] + [slice(None)] * (buf.ndim - 1)
        index[axis] = slice(0, tp)
        return buf.at[tuple(index)].set(jnp.take(src, prompt, axis=0), mode="drop")

    c = state.cache
    parts = {name: [put(buf, getattr(chunk.cache, name)[i], cache_lib.SLOT_AXIS[name]) for i, buf in enumerate(layers)]
             for name, layers in cache_lib.arrays(c).items() if name in cache_lib.LAYERED}
    n = c.mask.shape[1]
    parts["mask"] = c.mask.at[slot].set(jnp.pad(jnp.take(chunk.cache.mask, prompt, axis=0), ((0, 0), (0, n - tp))),
                                        mode="drop")
    set_ = lambda buf, val: buf.at[slot].set(val, mode="drop")
    return state.replace(
        cache=c.replace(**parts),
        logits=state.logits.at[:, slot].set(jnp.take(chunk.logits0, prompt, axis=0).T, mode="drop"),
        row=set_(state.row, row), col=set_(state.col, 0), prompt_len=set_(state.prompt_len, chunk.prompt_len[prompt]),
        active=state.active | take, pausable=set_(state.pausable, pausable), tokens=set_(state.tokens, pad_id),
        logps=set_(state.logps, 0.0), next_row=state.next_row + jnp.sum(take))


def _write_out(state: SlotState, ended, finished) -> SlotState:
    """The rows of slots ``ended`` [S] into the output (``finished``: ended on a stop token)."""
    row = jnp.where(ended, state.row, state.out_len.shape[0])  # B: dropped
    set_ = lambda buf, val: buf.at[row].set(val, mode="drop")
    return state.replace(out_tokens=set_(state.out_tokens, state.tokens), out_logps=set_(state.out_logps, state.logps),
                         out_len=set_(state.out_len, state.col), out_finished=set_(state.out_finished, finished))


def _rope_rows(cfg: ModelConfig, slots: int):
    """(cos, sin) of every position a cache of ``slots`` slots can hold: [slots, D/2] each,
    the values ``model.rope_tables`` gives each position."""
    cos, sin = model_lib.rope_tables(jnp.arange(slots)[None], cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor)
    return cos[0, :, 0], sin[0, :, 0]


def decode(cfg: ModelConfig, engine: DecodeEngine, weights, state: SlotState, chunk: Chunk, key, drawing: Drawing,
           row_offset, pause_mask, pausable, rows, max_draws) -> SlotState:
    """Insert, draw and step until the chunk's queued rows are fewer than the free slots
    while rows past the chunk wait (of ``rows``, B), a row pauses, no slot runs, or
    ``max_draws`` draws have run.

    A draw of slot s: column col[s] of its row from its pending logits, with
    uniforms(key, col, row_offset + row); a stop token ends the row (to the output, finished),
    so does its budget (drawing.max_new_tokens); a pause token (``pause_mask`` [V]) of a
    pausable row pauses it (rows enter ``pausable``). Then one step of the model for every
    slot, each feeding its token at cache slot Tp + col and position prompt_len + col (the
    static decode's), which makes the pending logits of the rows still running or paused;
    it is skipped when none is."""
    TRACE_COUNTS["slot_decode"] += 1
    step_fn = engine.per_layer_step(cfg, weights)
    num_cols = state.tokens.shape[1]
    tp = state.cache.mask.shape[1] - num_cols
    cos, sin = _rope_rows(cfg, tp + num_cols)
    pad_id = drawing.pad_id
    stop_at = state.draws + max_draws

    def cond(s: SlotState):
        free = jnp.sum(s.free())
        queued = chunk.end - s.next_row
        # Rows past the chunk wait, and the chunk cannot fill the free slots: back to the host
        # for the next chunk before a slot idles.
        short = (chunk.end < rows) & (queued < free)
        return (jnp.any(s.active) | ((queued > 0) & (free > 0))) & ~jnp.any(s.paused) & ~short & (s.draws < stop_at)

    def body(s: SlotState) -> SlotState:
        s = jax.lax.cond(jnp.any(s.free()) & (s.next_row < chunk.end),
                         lambda s: _insert(s, chunk, pausable, pad_id), lambda s: s, s)
        run = s.active
        with jax.named_scope("sample"):
            token, logp = next_token(s.logits, uniforms(key, s.col, row_offset + s.row), drawing)
        token = jnp.where(run, token, pad_id)
        col = jnp.minimum(s.col, num_cols - 1)  # a slot that is not running writes nowhere it reads
        put = lambda buf, x: jnp.where(run[:, None], model_lib.write_at(buf, x[:, None], col, axis=1), buf)
        stop = run & drawing.stop_mask[token]
        new_col = s.col + run
        ended = run & (stop | (new_col >= drawing.max_new_tokens))
        pause = run & ~ended & s.pausable & pause_mask[token]
        s = s.replace(col=new_col, active=run & ~ended & ~pause, paused=s.paused | pause,
                      tokens=put(s.tokens, token), logps=put(s.logps, jnp.where(run, logp, 0.0)), draws=s.draws + 1)
        s = jax.lax.cond(jnp.any(ended), lambda s: _write_out(s, ended, stop), lambda s: s, s)

        def step(s: SlotState) -> SlotState:
            positions = (s.prompt_len + col)[:, None]
            rope_cs = (cos[positions][:, :, None], sin[positions][:, :, None])
            logits, cache = step_fn(s.cache.replace(index=tp + col), token, run, positions, rope_cs)
            return s.replace(cache=cache, logits=logits)

        return jax.lax.cond(jnp.any(run & ~ended), step, lambda s: s, s)

    return loops.while_loop(cond, body, state)


def append(cfg: ModelConfig, state: SlotState, params, slot, tokens, real, pausable, max_new_tokens) -> SlotState:
    """Tokens [M, T] (real [M, T]: a prefix of each row) appended to the rows of slots
    ``slot`` [M] (S drops a lane) from their next column on: into their columns (log-prob 0)
    and, through the model's own forward over those slots' caches, into their caches at
    their own positions. Each slot's pending logits become those after its last real token
    and it runs again, pausable as ``pausable`` [M] says; a row the tokens bring to
    ``max_new_tokens`` ends there (to the output, not finished)."""
    TRACE_COUNTS["slot_append"] += 1
    num_cols = state.tokens.shape[1]
    tp = state.cache.mask.shape[1] - num_cols
    take = lambda x: jnp.take(x, slot, axis=0, mode="clip")
    c = state.cache
    layered = {name: xs for name, xs in cache_lib.arrays(c).items() if name in cache_lib.LAYERED}
    col = take(state.col)
    # Only the M slots' caches are stacked for the model's forward, never the whole cache.
    sub = model_lib.KVCache(mask=take(c.mask), index=tp + col,
                            **{name: jnp.stack([take(x) for x in xs]) for name, xs in layered.items()})
    positions = (take(state.prompt_len) + col)[:, None] + jnp.arange(tokens.shape[1])
    hidden, sub = model_lib.forward_hidden(cfg, params, tokens, real, positions, cache=sub, unroll=False)
    count = jnp.sum(real, axis=1)
    last = jnp.maximum(count - 1, 0)
    logits = model_lib.logits_from_hidden(cfg, params, jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
    back = {name: [x.at[slot].set(getattr(sub, name)[i], mode="drop") for i, x in enumerate(xs)]
            for name, xs in layered.items()}
    # The tokens into the rows' columns: where column j of a lane's row holds token j - col.
    j = jnp.arange(num_cols)[None, :] - col[:, None]
    inside = (j >= 0) & (j < count[:, None])
    row_tokens = jnp.where(inside, jnp.take_along_axis(tokens, jnp.clip(j, 0, tokens.shape[1] - 1), axis=1),
                           take(state.tokens))
    row_logps = jnp.where(inside, 0.0, take(state.logps))
    set_ = lambda buf, val: buf.at[slot].set(val, mode="drop")
    new_col = col + count
    ended = new_col >= max_new_tokens
    s = state.replace(cache=c.replace(mask=c.mask.at[slot].set(sub.mask, mode="drop"), **back),
                      logits=state.logits.at[:, slot].set(logits.T, mode="drop"), col=set_(state.col, new_col),
                      tokens=set_(state.tokens, row_tokens), logps=set_(state.logps, row_logps),
                      active=set_(state.active, ~ended), paused=set_(state.paused, False),
                      held=set_(state.held, False), pausable=set_(state.pausable, pausable))
    s_count = state.active.shape[0]
    ended_slots = jnp.zeros((s_count,), bool).at[slot].set(ended, mode="drop")
    return _write_out(s, ended_slots, jnp.zeros((s_count,), bool))


def mark(state: SlotState, run, hold) -> SlotState:
    """Paused slots ``run`` [S] decode again; paused slots ``hold`` [S] are held (neither
    running nor free) while the host runs their tools."""
    return state.replace(active=state.active | run, paused=state.paused & ~(run | hold), held=state.held | hold)


@dataclasses.dataclass(frozen=True)
class SlotPrograms:
    """The slot engine's programs for one model, mesh, step engine and cache dtype."""

    init: OnMesh
    prefill: OnMesh
    decode: OnMesh
    append: OnMesh
    mark: OnMesh


@functools.lru_cache(maxsize=16)
def programs(cfg: ModelConfig, mesh: Mesh | None, engine: DecodeEngine, kv_dtype: str) -> SlotPrograms:
    """The programs of ``engine`` (an ``engines.Slots``), forward only as the static
    sampler's (``calls.programs``); the slot state is donated to every program that
    updates it, so a rollout holds one copy of its cache."""
    cfg = dataclasses.replace(cfg, remat="none", attention="xla")
    return SlotPrograms(
        init=OnMesh(functools.partial(init_state, cfg, kv_dtype), mesh,
                      ("slots", "prompt_bucket", "num_cols", "rows")),
        prefill=OnMesh(functools.partial(prefill, cfg, mesh, ENGINES["scan"], kv_dtype), mesh, ("cache_len",)),
        decode=OnMesh(functools.partial(decode, cfg, engine.step), mesh, donate_argnums=(1,)),
        append=OnMesh(functools.partial(append, cfg), mesh, donate_argnums=(0,)),
        mark=OnMesh(mark, mesh, donate_argnums=(0,)))


def tool_processes(mesh: Mesh | None, slots: int) -> np.ndarray:
    """[slots] the process that runs the tools of each slot's rows: the lowest-numbered
    process whose devices hold the slot (the batch sharding); this process without a mesh."""
    if mesh is None:
        return np.full(slots, jax.process_index())
    out = np.full(slots, jax.process_count())
    for device, index in batch_sharding(mesh, 1, slots).devices_indices_map((slots,)).items():
        held = np.arange(slots)[index[0]]
        out[held] = np.minimum(out[held], device.process_index)
    return out


def default_slots(rows: int, rows_per_call: int, degree: int = 1) -> int:
    """Slots when ``SamplingParams.slots`` is 0: the rows one static call holds
    (``rows_per_call``; 0: all ``rows``), so the cache is the static sampler's; a multiple
    of the batch-sharding ``degree``."""
    return round_up(min(rows, rows_per_call or rows), degree)


def schedule(lengths: Sequence[int], slots: int) -> tuple[int, int]:
    """(decode steps, tokens) of the slot engine for rows of ``lengths`` tokens, queued in
    order, on ``slots`` slots: a slot whose row ends takes the next row at the next step.
    Utilization is tokens / (slots x steps)."""
    left = np.zeros(slots, np.int64)  # tokens still to draw per slot (0: free)
    queue = list(lengths)[::-1]
    steps = 0
    while True:
        for s in np.flatnonzero(left == 0):
            if not queue:
                break
            left[s] = queue.pop()
        if not left.any():
            return steps, int(np.sum(lengths))
        # run until a slot frees while rows wait (or to the end)
        run = int(left[left > 0].min()) if queue else int(left.max())
        left = np.maximum(left - run, 0)
        steps += run


def static_steps(lengths: Sequence[int], rows_per_call: int) -> int:
    """Decode steps of the static engine for the same rows: each call of ``rows_per_call``
    rows runs until its longest row ends."""
    lengths = list(lengths)
    return sum(max(lengths[i:i + rows_per_call]) for i in range(0, len(lengths), rows_per_call))


@dataclasses.dataclass
class SlotRows:
    """What `SlotDecoder.run` returns, host arrays of B rows in row order."""

    tokens: np.ndarray  # [B, max_new_tokens] int32
    logprobs: np.ndarray  # [B, max_new_tokens] float32
    lengths: np.ndarray  # [B] int32
    finished: np.ndarray  # [B] bool
    tool_mask: np.ndarray  # [B, max_new_tokens] bool: columns ``append`` wrote
    decode_steps: int
    visits: int  # the host's decode calls
    appended_tokens: int  # tokens `append` put through the model (tools' outputs)
    appends: int


# Draws a decode call runs at most while a held row's tool may finish: its output waits no longer.
HELD_DRAWS = 8
# What `SlotDecoder`'s ``on_pause`` answers for a row it holds on a process that does not run
# the row's tools: that process's output reaches the others gathered (`SlotDecoder._finished`).
REMOTE = object()
# Seconds a process that runs none of the held rows' tools waits before it asks the others again.
REMOTE_POLL_S = 0.01
# What every rollout's `append`s put through the model ("tokens", "appends"): a tool call
# costs its output's tokens, nothing of the context before it.
APPENDED: collections.Counter = collections.Counter()


class SlotDecoder:
    """One rollout of the slot engine (module docstring): ``prompts`` (validated token lists)
    x ``group_size`` rows, row r of prompt r // G drawing as row ``row_offset + r``.

    ``on_pause(r, ids, since, local)`` is asked on every process when row r pauses on one of
    ``pause_tokens`` (rows start ``pausable``): ids its columns so far, ``since`` the column
    after the tokens last appended to it (0: none). None resumes it at once, on every process
    alike. Otherwise the row is held: where ``local`` (the process that runs the row's tools,
    `tool_processes`) the answer is a future resolving to (tokens, pausable), elsewhere
    `REMOTE`. Once the future is done, every process appends its tokens to the row (`append`)
    and resumes it, pausable again or not; tokens that fill its budget end it.
    ``between_calls()`` runs before each chunk's prefill but the first."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, settings: SamplingParams, engine: DecodeEngine,
                 params, prompts: list[list[int]], group_size: int, *, key, slots: int = 0,
                 rows_per_call: int = 0, row_offset: int = 0, pause_tokens: Sequence[int] = (),
                 pausable: bool = False, on_pause: Callable | None = None,
                 between_calls: Callable[[], None] | None = None):
        self.cfg, self.mesh, self.settings = cfg, mesh, settings
        self.params, self.prompts, self.group_size, self.key = params, prompts, group_size, key
        self.rows = len(prompts) * group_size
        degree = batch_degree(mesh)
        self.slots = round_up(slots, degree) if slots else default_slots(self.rows, rows_per_call, degree)
        self.row_offset, self.pausable, self.on_pause = row_offset, pausable, on_pause
        self.between_calls = between_calls
        self.prompt_bucket = bucket_length(max(len(p) for p in prompts))
        self.num_cols = bucket_length(settings.max_new_tokens)
        self.programs = programs(cfg, mesh, engine, settings.kv_dtype)
        pause_mask = np.zeros((cfg.vocab_size,), bool)
        pause_mask[list(pause_tokens)] = True
        self.drawing = jax.tree.map(self._replicated, Drawing.host(settings, cfg.vocab_size))
        self.pause_mask = self._replicated(pause_mask)
        self.weights = engine.step.weights(cfg, params)
        self.runs_tools = tool_processes(mesh, self.slots) == jax.process_index()  # [S]
        # Prompts a chunk prefills: from the next row's question, enough rows to fill every
        # slot however many of that question's rows are in already; a multiple of the degree.
        self.chunk_prompts = round_up(-(-self.slots // group_size) + 1, degree)

    def _replicated(self, x):
        x = np.asarray(x)
        return x if self.mesh is None else to_global(x, replicated(self.mesh))

    def _rows(self, x):
        x = np.asarray(x)
        return x if self.mesh is None else to_global(x, batch_sharding(self.mesh, x.ndim, x.shape[0]))

    def host_prompts(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, mask) [P, Tp] of the prompts left-padded into the prompt bucket."""
        tokens = np.full((len(self.prompts), self.prompt_bucket), self.settings.pad_id, np.int32)
        mask = np.zeros(tokens.shape, bool)
        for i, p in enumerate(self.prompts):
            tokens[i, self.prompt_bucket - len(p):] = p
            mask[i, self.prompt_bucket - len(p):] = True
        return tokens, mask

    def _chunk(self, first: int, tokens_all, mask_all) -> tuple[Chunk, int]:
        """The chunk of prompts from prompt ``first``: its prefill and its queue's rows, and
        the first row past it."""
        q = self.chunk_prompts
        tokens, mask = tokens_all[first:first + q], mask_all[first:first + q]
        pad = q - len(tokens)
        tokens = np.pad(tokens, ((0, pad), (0, 0)), constant_values=self.settings.pad_id)
        mask = np.pad(mask, ((0, pad), (0, 0)))
        cache, logits0 = self.programs.prefill(self.params, self._rows(tokens), self._rows(mask), None,
                                               cache_len=self.prompt_bucket)
        g = self.group_size
        scalars = (first * g, min(self.rows, (first + q) * g), g)
        chunk = Chunk(cache=cache, logits0=logits0, prompt_len=self._rows(mask.sum(1).astype(np.int32)),
                      **{k: self._replicated(np.int32(v)) for k, v in zip(("first_row", "end", "group_size"), scalars)})
        return chunk, scalars[1]

    def run(self) -> SlotRows:
        """Every row, in row order."""
        progs, s_count, pad_id = self.programs, self.slots, self.settings.pad_id
        key = place_key(self.key, self.mesh)
        tokens_all, mask_all = self.host_prompts()
        state = progs.init(slots=s_count, prompt_bucket=self.prompt_bucket, num_cols=self.num_cols, rows=self.rows,
                           pad_id=self._replicated(np.int32(pad_id)))
        owner = np.full(s_count, -1)  # row each slot holds, as the host last saw it
        tool_cols: dict[int, list[tuple[int, int]]] = {}  # row -> [(first column, count)] appended
        held: dict[int, object] = {}  # slot -> its held row's future
        self.appended = []  # tokens of each append
        chunk, chunk_end = None, 0
        scalar = lambda v, dtype=np.int32: self._replicated(np.asarray(v, dtype))
        visits = 0
        while True:
            for s, result in self._finished(held):
                state = self._append(state, s, result, tool_cols.setdefault(int(owner[s]), []))
            next_row = int(to_host(state.next_row))
            active, held_now = to_host(state.active), to_host(state.held)
            free = int(np.sum(~active & ~held_now))  # paused slots were marked after the last decode
            if chunk is None or chunk_end < self.rows and chunk_end - next_row < free:
                if chunk is not None and self.between_calls is not None:
                    self.between_calls()
                chunk, chunk_end = self._chunk(next_row // self.group_size, tokens_all, mask_all)
            if not (active.any() or held_now.any()) and next_row >= self.rows:
                break
            if not active.any() and (next_row >= self.rows or held_now.all()):  # only held rows: wait for one
                self._wait(held)
                continue
            limit = HELD_DRAWS if held else np.iinfo(np.int32).max // 2
            state = progs.decode(self.weights, state, chunk, key, self.drawing, scalar(self.row_offset),
                                 self.pause_mask, scalar(self.pausable, bool), scalar(self.rows), scalar(limit))
            visits += 1
            paused = to_host(state.paused)
            if not paused.any():
                continue
            row_of, cols, toks = to_host(state.row), to_host(state.col), to_host(state.tokens)
            run, hold = np.zeros(s_count, bool), np.zeros(s_count, bool)
            for s in np.flatnonzero(paused):
                owner[s] = row_of[s]
                spans = tool_cols.get(int(row_of[s]))
                since = spans[-1][0] + spans[-1][1] if spans else 0
                future = (self.on_pause(int(row_of[s]), toks[s, :cols[s]].tolist(), since, bool(self.runs_tools[s]))
                          if self.on_pause else None)
                if future is None:
                    run[s] = True
                else:
                    held[int(s)], hold[s] = future, True
            state = progs.mark(state, self._rows(run), self._rows(hold))
        width = self.settings.max_new_tokens
        lengths = to_host(state.out_len)
        tool_mask = np.zeros((self.rows, width), bool)
        for r, spans in tool_cols.items():
            for first, count in spans:
                tool_mask[r, first:first + count] = True
        return SlotRows(tokens=to_host(state.out_tokens)[:, :width], logprobs=to_host(state.out_logps)[:, :width],
                        lengths=lengths, finished=to_host(state.out_finished), tool_mask=tool_mask,
                        decode_steps=int(to_host(state.draws)), visits=visits,
                        appended_tokens=sum(self.appended), appends=len(self.appended))

    def _finished(self, held: dict) -> list[tuple[int, tuple]]:
        """(slot, (tokens, pausable)) of the held rows whose tools are done, taken out of
        ``held``, in slot order and the same on every process: each process reports those
        it runs, and across processes the reports are gathered (a collective each visit),
        so every host loop appends the same rows at the same step."""
        if not held:  # the same on every process: no collective
            return []
        done = {s: f.result() for s, f in held.items() if self.runs_tools[s] and f.done()}
        if jax.process_count() > 1:
            done = self._gathered(done)
        for s in done:
            del held[s]
        return sorted(done.items())

    def _gathered(self, done: dict) -> dict:
        """Every process's ``done`` in one: a row's tools run on one process, whose entries
        the others' zeros leave as they are."""
        from jax.experimental import multihost_utils

        width = self.settings.max_new_tokens
        flag, count, pausable = np.zeros(self.slots, bool), np.zeros(self.slots, np.int32), np.zeros(self.slots, bool)
        tokens = np.zeros((self.slots, width), np.int32)
        for s, (toks, paus) in done.items():
            toks = list(toks)[:width]
            flag[s], count[s], pausable[s], tokens[s, :len(toks)] = True, len(toks), paus, toks
        # [processes, ...] each
        flag, count, pausable, tokens = map(np.asarray, multihost_utils.process_allgather((flag, count, pausable, tokens)))
        count, tokens = count.sum(0), tokens.sum(0)
        return {int(s): (tokens[s, :count[s]].tolist(), bool(pausable[:, s].any())) for s in np.flatnonzero(flag.any(0))}

    def _wait(self, held: dict) -> None:
        """Until one of the held rows this process runs has finished; where it runs none (or
        with other processes), a short wait, since the next `_finished` hears of theirs."""
        mine = [f for s, f in held.items() if self.runs_tools[s]]
        if jax.process_count() == 1:
            concurrent.futures.wait(mine, return_when=concurrent.futures.FIRST_COMPLETED)
        elif mine:
            concurrent.futures.wait(mine, timeout=REMOTE_POLL_S, return_when=concurrent.futures.FIRST_COMPLETED)
        else:
            time.sleep(REMOTE_POLL_S)

    def _append(self, state, s: int, result, spans: list):
        """A held row's tool output (tokens, pausable) appended to slot ``s`` (`append`),
        cut at the row's budget; ``spans`` records its columns."""
        tokens, pausable = result
        col = int(to_host(state.col)[s])
        tokens = list(tokens)[: self.settings.max_new_tokens - col]
        spans.append((col, len(tokens)))
        self.appended.append(len(tokens))
        APPENDED["tokens"] += len(tokens)
        APPENDED["appends"] += 1
        t = bucket_length(max(1, len(tokens)))
        ids = np.full((1, t), self.settings.pad_id, np.int32)
        real = np.zeros((1, t), bool)
        ids[0, :len(tokens)], real[0, :len(tokens)] = tokens, True
        return self.programs.append(state, self.params, self._replicated(np.array([s], np.int32)),
                                    self._replicated(ids), self._replicated(real),
                                    self._replicated(np.array([pausable])),
                                    self._replicated(np.int32(self.settings.max_new_tokens)))
