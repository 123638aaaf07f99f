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

* **prefill**: the static sampler's own, each prompt once (``prefill.prefill``), its cache in
  Tp slots; a question's G rows are all inserted from that one cache;
* **insert**: prompts' caches copied into free slots (a row-wise scatter) and their rows'
  state reset;
* **decode**: a ``lax.while_loop`` of draws and steps over all S slots, each slot writing at
  its own cache index (``model.write_at``), that goes back to the host once ``refill`` slots
  are free, a row paused on a pause token (a tool's closing fence), or no slot runs;
* **append**: tokens written into some slots' caches at their own positions (a tool's
  output), their next logits from the last of them: a row that called a tool goes on without
  its context prefilled again (``sampler.turns``).

The host loop (`SlotDecoder`) keeps the queue, the rows' results and the slots' owners; the
rows come back in row order. Its schedule (which slot takes which row when) is `schedule`'s,
which the benchmark runs on drawn lengths too (``benchmarks/bench_slots.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from grpo_jax import loops
from grpo_jax.config import ModelConfig
from grpo_jax.model import transformer as model_lib
from grpo_jax.parallel.sharding import batch_degree, batch_sharding, on_mesh, replicated, to_global, to_host
from grpo_jax.sampler import cache as cache_lib
from grpo_jax.sampler.calls import place_key
from grpo_jax.sampler.draw import Drawing, next_token, uniforms
from grpo_jax.sampler.engines import ENGINES, DecodeEngine
from grpo_jax.sampler.layouts import round_up
from grpo_jax.sampler.prefill import TRACE_COUNTS, prefill
from grpo_jax.sampler.settings import SamplingParams
from grpo_jax.shapes import bucket_length


@flax.struct.dataclass
class SlotState:
    """S decode slots between two visits of the host; N = Tp + Tc cache slots per row."""

    cache: model_lib.KVCache  # per layer (``cache.per_layer``): k [S,K,D,N], v [S,K,N,D]; mask [S,N]; index [S]
    logits: jax.Array  # [V, S] float32: what each slot's next draw reads
    row: jax.Array  # [S] int32: the slot's row (its randomness index)
    col: jax.Array  # [S] int32: the column the slot draws next
    prompt_len: jax.Array  # [S] int32: real prompt tokens (position of column 0)
    budget: jax.Array  # [S] int32: the column the row ends at (its max_new_tokens)
    active: jax.Array  # [S] bool: the slot decodes
    paused: jax.Array  # [S] bool: stopped on a pause token, waiting for the host
    pausable: jax.Array  # [S] bool: a pause token pauses this row (a tool call left)
    finished: jax.Array  # [S] bool: stopped on a stop token
    tokens: jax.Array  # [S, Tc] int32: the slot's draws by column
    logps: jax.Array  # [S, Tc] float32
    draws: jax.Array  # [] int32: decode steps run (each over all S slots)


@flax.struct.dataclass
class Lanes:
    """M rows entering slots (insert): lane m puts row ``row[m]`` of prompt ``prompt[m]`` (its
    index in the prefill's batch) into slot ``slot[m]``; slot = S drops the lane."""

    slot: jax.Array  # [M] int32
    prompt: jax.Array  # [M] int32
    row: jax.Array  # [M] int32
    prompt_len: jax.Array  # [M] int32
    budget: jax.Array  # [M] int32
    pausable: jax.Array  # [M] bool


def _rows(x):
    return cache_lib.constrain_rows(x)


def init_state(cfg: ModelConfig, kv_dtype: str, *, slots: int, prompt_bucket: int, num_cols: int) -> SlotState:
    """S free slots with an empty cache of Tp + Tc slots each."""
    cache = model_lib.init_cache(cfg, slots, prompt_bucket + num_cols, cache_lib.dtype(cfg, kv_dtype))
    cache = cache_lib.per_layer(cache_lib.constrain_cache(cache.replace(index=jnp.zeros((slots,), jnp.int32))))
    zeros = lambda dtype, *shape: _rows(jnp.zeros((slots,) + shape, dtype))
    return SlotState(cache=cache, logits=jnp.zeros((cfg.vocab_size, slots), jnp.float32),
                     row=zeros(jnp.int32), col=zeros(jnp.int32), prompt_len=zeros(jnp.int32),
                     budget=zeros(jnp.int32), active=zeros(bool), paused=zeros(bool), pausable=zeros(bool),
                     finished=zeros(bool), tokens=zeros(jnp.int32, num_cols), logps=zeros(jnp.float32, num_cols),
                     draws=jnp.zeros((), jnp.int32))


def insert(state: SlotState, prompt_cache: model_lib.KVCache, logits0, lanes: Lanes, pad_id) -> SlotState:
    """``lanes``' rows into their slots: each slot's first Tp cache slots become its prompt's
    (``prompt_cache``, stacked [L, Q, ...] of Tp slots), the rest masked out; its next draw
    reads its prompt's logits0 [Q, V]; its columns are emptied."""
    tp = prompt_cache.mask.shape[1]
    slot, prompt = lanes.slot, lanes.prompt

    def put(buf, src, axis):  # buf [S, ..., N, ...], src [Q, ..., Tp, ...]: the first Tp along axis
        index = [slot] + [slice(None)] * (buf.ndim - 1)
        index[axis] = slice(0, tp)
        return buf.at[tuple(index)].set(jnp.take(src, prompt, axis=0), mode="drop")

    c = state.cache
    parts = {}
    for name, layers in cache_lib.arrays(c).items():
        if name in cache_lib.LAYERED:
            axis = cache_lib._SLOT_AXIS[name]
            parts[name] = [put(buf, getattr(prompt_cache, name)[i], axis) for i, buf in enumerate(layers)]
    n = c.mask.shape[1]
    rows_mask = jnp.pad(jnp.take(prompt_cache.mask, prompt, axis=0), ((0, 0), (0, n - tp)))
    parts["mask"] = c.mask.at[slot].set(rows_mask, mode="drop")
    set_ = lambda buf, val: buf.at[slot].set(val, mode="drop")
    return state.replace(
        cache=c.replace(**parts), logits=state.logits.at[:, slot].set(jnp.take(logits0, prompt, axis=0).T, mode="drop"),
        row=set_(state.row, lanes.row), col=set_(state.col, 0), prompt_len=set_(state.prompt_len, lanes.prompt_len),
        budget=set_(state.budget, lanes.budget), active=set_(state.active, True), paused=set_(state.paused, False),
        pausable=set_(state.pausable, lanes.pausable), finished=set_(state.finished, False),
        tokens=set_(state.tokens, pad_id), logps=set_(state.logps, 0.0))


def _rope_rows(cfg: ModelConfig, slots: int):
    """(cos, sin) of every position a cache of ``slots`` slots can hold: [slots, D/2] each,
    the values ``model.rope_tables`` gives each position."""
    cos, sin = model_lib.rope_tables(jnp.arange(slots)[None], cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor)
    return cos[0, :, 0], sin[0, :, 0]


def decode(cfg: ModelConfig, engine: DecodeEngine, weights, state: SlotState, key, drawing: Drawing, pause_mask,
           refill, max_draws) -> SlotState:
    """Draw and step every running slot until ``refill`` slots are neither running nor
    paused (the host counts in it the rows it holds while their tools run), a row pauses,
    no slot runs, or ``max_draws`` draws have run.

    A draw of slot s: column col[s] of row row[s] from its pending logits with
    uniforms(key, col, row); a stop token ends the row (``finished``), so does its budget; a
    pause token (``pause_mask`` [V]) of a pausable row pauses it. Then one step of the model
    for every slot, each feeding its token at cache slot Tp + col and position
    prompt_len + col (the static decode's), which makes the pending logits of the rows
    still running or paused; it is skipped when none is."""
    TRACE_COUNTS["slot_decode"] += 1
    step_fn = engine.per_layer_step(cfg, weights)
    num_cols = state.tokens.shape[1]
    n = state.cache.mask.shape[1]
    tp = n - num_cols
    cos, sin = _rope_rows(cfg, n)
    pad_id = drawing.pad_id

    stop_at = state.draws + max_draws

    def cond(s: SlotState):
        free = jnp.sum(~s.active & ~s.paused)
        return jnp.any(s.active) & ~jnp.any(s.paused) & (free < refill) & (s.draws < stop_at)

    def body(s: SlotState) -> SlotState:
        run = s.active
        with jax.named_scope("sample"):
            token, logp = next_token(s.logits, uniforms(key, s.col, s.row), drawing)
        token = jnp.where(run, token, pad_id)
        col = jnp.minimum(s.col, num_cols - 1)  # a slot that is not running writes nowhere it reads
        put = lambda buf, x: jnp.where(run[:, None], model_lib.write_at(buf, x[:, None], col, axis=1), buf)
        stop = run & drawing.stop_mask[token]
        new_col = s.col + run
        ended = run & (stop | (new_col >= s.budget))
        pause = run & ~ended & s.pausable & pause_mask[token]
        s = s.replace(col=new_col, active=run & ~ended & ~pause, paused=s.paused | pause,
                      finished=s.finished | stop, tokens=put(s.tokens, token),
                      logps=put(s.logps, jnp.where(run, logp, 0.0)), draws=s.draws + 1)

        def step(s: SlotState) -> SlotState:
            positions = (s.prompt_len + col)[:, None]
            rope_cs = (cos[positions][:, :, None], sin[positions][:, :, None])
            logits, cache = step_fn(s.cache.replace(index=tp + col), token, run, positions, rope_cs)
            return s.replace(cache=cache, logits=logits)

        return jax.lax.cond(jnp.any(run & ~ended), step, lambda s: s, s)

    return loops.while_loop(cond, body, state)


def append(cfg: ModelConfig, state: SlotState, params, slot, tokens, real, pausable) -> SlotState:
    """Tokens [M, T] (real [M, T]: a prefix of each row) written into slots ``slot`` [M]
    (S drops a lane) from their next column on, through the model's own forward over those
    slots' caches; each slot's pending logits become those after its last real token, its
    column moves past them, and it runs again, pausable as ``pausable`` [M] says. Columns
    the tokens fill keep pad in ``tokens`` (the host records what it appended)."""
    TRACE_COUNTS["slot_append"] += 1
    num_cols = state.tokens.shape[1]
    n = state.cache.mask.shape[1]
    tp = n - num_cols
    take = lambda x: jnp.take(x, slot, axis=0, mode="clip")
    c = state.cache
    layered = {name: xs for name, xs in cache_lib.arrays(c).items() if name in cache_lib.LAYERED}
    # Only the M slots' caches are stacked for the model's forward, never the whole cache.
    sub = model_lib.KVCache(mask=take(c.mask), index=tp + take(state.col),
                            **{name: jnp.stack([take(x) for x in xs]) for name, xs in layered.items()})
    positions = take(state.prompt_len + state.col)[:, None] + jnp.arange(tokens.shape[1])
    hidden, sub = model_lib.forward_hidden(cfg, params, tokens, real, positions, cache=sub, unroll=False)
    last = jnp.maximum(jnp.sum(real, axis=1) - 1, 0)
    logits = model_lib.logits_from_hidden(cfg, params, jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
    back = {name: [x.at[slot].set(getattr(sub, name)[i], mode="drop") for i, x in enumerate(xs)]
            for name, xs in layered.items()}
    cache = c.replace(mask=c.mask.at[slot].set(sub.mask, mode="drop"), **back)
    set_ = lambda buf, val: buf.at[slot].set(val, mode="drop")
    return state.replace(cache=cache, logits=state.logits.at[:, slot].set(logits.T, mode="drop"),
                         col=set_(state.col, take(state.col) + jnp.sum(real, axis=1)),
                         active=set_(state.active, True), paused=set_(state.paused, False),
                         pausable=set_(state.pausable, pausable))


def mark(state: SlotState, run, unpause) -> SlotState:
    """Slots ``run`` [S] decode again; slots ``unpause`` [S] leave their pause (a row the
    host holds while its tool runs: neither running nor free)."""
    return state.replace(active=state.active | run, paused=state.paused & ~(run | unpause))


class _Program:
    """``fn`` jitted and run on its mesh (``sharding.on_mesh``), as ``calls.OnMesh``."""

    def __init__(self, fn, mesh: Mesh | None, static_argnames: tuple[str, ...] = (),
                 donate_argnums: tuple[int, ...] = ()):
        self.fn, self.mesh = fn, mesh
        self.jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnums=donate_argnums)

    def __call__(self, *args, **kwargs):
        with on_mesh(self.mesh):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with on_mesh(self.mesh):
            return self.jitted.lower(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class SlotPrograms:
    """The slot engine's programs for one model, mesh, step engine and cache dtype."""

    init: _Program
    prefill: _Program
    insert: _Program
    decode: _Program
    append: _Program
    mark: _Program


@functools.lru_cache(maxsize=16)
def programs(cfg: ModelConfig, mesh: Mesh | None, engine: DecodeEngine, kv_dtype: str) -> SlotPrograms:
    """The programs of ``engine`` (an ``engines.Slots``), forward only as the static
    sampler's (``calls.programs``); the slot state is donated to every program that
    updates it, so a rollout holds one copy of its cache."""
    cfg = dataclasses.replace(cfg, remat="none", attention="xla")
    return SlotPrograms(
        init=_Program(functools.partial(init_state, cfg, kv_dtype), mesh, ("slots", "prompt_bucket", "num_cols")),
        prefill=_Program(functools.partial(prefill, cfg, mesh, ENGINES["scan"], kv_dtype), mesh, ("cache_len",)),
        insert=_Program(insert, mesh, donate_argnums=(0,)),
        decode=_Program(functools.partial(decode, cfg, engine.step), mesh, donate_argnums=(1,)),
        append=_Program(functools.partial(append, cfg), mesh, donate_argnums=(0,)),
        mark=_Program(mark, mesh, donate_argnums=(0,)))


def default_slots(rows: int, rows_per_call: int, degree: int = 1) -> int:
    """Slots when ``SamplingParams.slots`` is 0: the rows one static call holds
    (``rows_per_call``; 0: all ``rows``), so the cache is the static sampler's; a multiple
    of the batch-sharding ``degree``."""
    return round_up(min(rows, rows_per_call or rows), degree)


def refill_slots(slots: int) -> int:
    """Free slots that send the decode back to the host while rows wait: one in 32 (at
    least one), so a visit's inserts amortise its host round trip on many slots without
    leaving more than a few percent of them idle."""
    return max(1, slots // 32)


def schedule(lengths: Sequence[int], slots: int, refill: int | None = None) -> tuple[int, int]:
    """(decode steps, tokens) of the slot engine's schedule for rows of ``lengths`` tokens
    (queued in order) on ``slots`` slots: the loop `SlotDecoder` runs, without a model.
    Utilization is tokens / (slots x steps)."""
    refill = refill_slots(slots) if refill is None else refill
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
        want = min(refill, len(queue)) if queue else slots + 1
        while left.any() and np.sum(left == 0) < want:
            left = np.maximum(left - 1, 0)
            steps += 1


def static_steps(lengths: Sequence[int], rows_per_call: int) -> int:
    """Decode steps of the static engine for the same rows: each call of ``rows_per_call``
    rows runs until its longest row ends."""
    lengths = list(lengths)
    return sum(max(lengths[i:i + rows_per_call]) for i in range(0, len(lengths), rows_per_call))


@dataclasses.dataclass
class _Row:
    """One row as the host assembles it: its tokens, which are the model's, their log-probs."""

    ids: list[int] = dataclasses.field(default_factory=list)
    own: list[bool] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    finished: bool = False

    def extend(self, ids, logps, own: bool) -> None:
        self.ids += [int(i) for i in ids]
        self.logps += [float(x) for x in logps]
        self.own += [own] * len(ids)


# Draws a visit runs at most while a held row's tool may finish: its output waits no longer.
HELD_DRAWS = 8


class SlotDecoder:
    """One rollout of the slot engine (module docstring): ``prompts`` (validated token lists)
    x ``group_size`` rows, row r of prompt r // G drawing as row ``row_offset + r``.

    ``on_pause(r, row)`` is asked when row r pauses on a pause token (``pause_tokens``):
    None resumes it at once; a future resolving to (tokens, pausable) holds it while the
    future runs, then appends the tokens to it (``append``) and resumes it, pausable again
    or not; tokens that fill its budget end it."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, settings: SamplingParams, engine: DecodeEngine,
                 params, prompts: list[list[int]], group_size: int, *, key, slots: int = 0,
                 rows_per_call: int = 0, row_offset: int = 0, pause_tokens: Sequence[int] = (),
                 pausable: bool = False, on_pause: Callable | None = None,
                 between_calls: Callable[[], None] | None = None):
        self.cfg, self.mesh, self.settings, self.engine = cfg, mesh, settings, engine
        self.params, self.prompts, self.group_size, self.key = params, prompts, group_size, key
        self.rows = len(prompts) * group_size
        degree = batch_degree(mesh)
        self.slots = round_up(slots, degree) if slots else default_slots(self.rows, rows_per_call, degree)
        self.row_offset, self.pausable, self.on_pause = row_offset, pausable, on_pause
        self.between_calls = between_calls
        self.prompt_bucket = bucket_length(max(len(p) for p in prompts))
        self.num_cols = bucket_length(settings.max_new_tokens)
        self.programs = programs(cfg, mesh, engine, settings.kv_dtype)
        drawing = Drawing.host(settings, cfg.vocab_size)
        pause_mask = np.zeros((cfg.vocab_size,), bool)
        pause_mask[list(pause_tokens)] = True
        self.drawing = jax.tree.map(self._replicated, drawing)
        self.pause_mask = self._replicated(pause_mask)
        self.weights = engine.step.weights(cfg, params)
        # Prompts prefilled per chunk: enough questions for the slots, a multiple of the degree.
        self.chunk_prompts = round_up(max(1, -(-self.slots // group_size)), degree)
        self.visits = 0

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

    def run(self) -> tuple[list[_Row], int]:
        """Every row, in row order, and the decode steps run."""
        progs, s_count = self.programs, self.slots
        key = place_key(self.key, self.mesh)
        tokens_all, mask_all = self.host_prompts()
        state = progs.init(slots=s_count, prompt_bucket=self.prompt_bucket, num_cols=self.num_cols)
        results = [_Row() for _ in range(self.rows)]
        owner = np.full(s_count, -1)  # row each slot holds
        recorded = np.zeros(s_count, np.int64)  # columns of the slot's row already in its result
        held: dict[int, object] = {}  # slot -> the future of a held row
        chunk = None  # (first prompt, prompt cache, logits0)
        next_row = 0
        while True:
            free = np.flatnonzero(owner < 0)
            while len(free) and next_row < self.rows:
                prompt = next_row // self.group_size
                if chunk is None or prompt >= chunk[0] + self.chunk_prompts:
                    if chunk is not None and self.between_calls is not None:
                        self.between_calls()
                    chunk = self._prefill(prompt, tokens_all, mask_all)
                last = min(self.rows, (chunk[0] + self.chunk_prompts) * self.group_size, next_row + len(free))
                rows = np.arange(next_row, last)
                state = self._insert(state, chunk, free[:len(rows)], rows)
                owner[free[:len(rows)]], recorded[free[:len(rows)]] = rows, 0
                free, next_row = free[len(rows):], last
            for s in [s for s, f in held.items() if f.done()]:
                state = self._append(state, s, held.pop(s).result(), results[owner[s]], owner, recorded)
            if not (owner >= 0).any():
                break
            running = (owner >= 0) & ~np.isin(np.arange(s_count), list(held))
            if not running.any():
                next(iter(held.values())).result()  # only held rows: wait for one
                continue
            waiting = self.rows - next_row
            refill = len(held) + (min(refill_slots(s_count), waiting) if waiting else s_count + 1)
            limit = HELD_DRAWS if held else np.iinfo(np.int32).max // 2
            state = progs.decode(self.weights, state, key, self.drawing, self.pause_mask,
                                 self._replicated(np.int32(refill)), self._replicated(np.int32(limit)))
            self.visits += 1
            active, paused, col, finished = (to_host(x) for x in (state.active, state.paused, state.col, state.finished))
            done_or_paused = running & (~active | paused)
            if not done_or_paused.any():
                continue
            toks, lps = to_host(state.tokens), to_host(state.logps)
            for s in np.flatnonzero(done_or_paused):
                row = results[owner[s]]
                row.extend(toks[s, recorded[s]:col[s]], lps[s, recorded[s]:col[s]], own=True)
                recorded[s] = col[s]
                if not paused[s]:  # ended: a stop token or its budget
                    row.finished = bool(finished[s])
                    owner[s] = -1
            pauses = np.flatnonzero(running & paused)
            run = np.zeros(s_count, bool)
            hold = np.zeros(s_count, bool)
            for s in pauses:
                future = self.on_pause(int(owner[s]), results[owner[s]]) if self.on_pause else None
                if future is None:
                    run[s] = True
                else:
                    held[int(s)], hold[s] = future, True
            if pauses.size:
                state = progs.mark(state, self._rows(run), self._rows(hold))
        return results, int(to_host(state.draws))

    def _prefill(self, first: int, tokens_all, mask_all):
        """The prompt cache and logits0 of the chunk of prompts from ``first``."""
        tokens, mask = tokens_all[first:first + self.chunk_prompts], mask_all[first:first + self.chunk_prompts]
        pad = self.chunk_prompts - len(tokens)
        tokens = np.pad(tokens, ((0, pad), (0, 0)), constant_values=self.settings.pad_id)
        mask = np.pad(mask, ((0, pad), (0, 0)))
        cache, logits0 = self.programs.prefill(self.params, self._rows(tokens), self._rows(mask), None,
                                               cache_len=self.prompt_bucket)
        return first, cache, logits0

    def _insert(self, state, chunk, slots, rows):
        """Rows ``rows`` of the chunk's prompts into ``slots``, lanes padded to a power of two."""
        m = 1 << (len(rows) - 1).bit_length()
        lane = lambda x, fill: np.concatenate([x, np.full(m - len(x), fill, np.asarray(x).dtype)])
        prompts = rows // self.group_size
        lens = np.array([len(self.prompts[p]) for p in prompts], np.int32)
        lanes = Lanes(slot=lane(slots.astype(np.int32), self.slots), prompt=lane((prompts - chunk[0]).astype(np.int32), 0),
                      row=lane((rows + self.row_offset).astype(np.int32), 0), prompt_len=lane(lens, 0),
                      budget=lane(np.full(len(rows), self.settings.max_new_tokens, np.int32), 0),
                      pausable=lane(np.full(len(rows), self.pausable), False))
        return self.programs.insert(state, chunk[1], chunk[2], jax.tree.map(self._replicated, lanes),
                                    self._replicated(np.int32(self.settings.pad_id)))

    def _append(self, state, s: int, result, row: _Row, owner, recorded):
        """A held row's tool output (tokens, pausable) appended to slot ``s``; a row whose
        budget it fills ends there."""
        tokens, pausable = result
        tokens = list(tokens)[: self.settings.max_new_tokens - len(row.ids)]
        row.extend(tokens, [0.0] * len(tokens), own=False)
        if len(row.ids) >= self.settings.max_new_tokens:
            owner[s] = -1  # held, so neither running nor paused: free for the next row
            return state
        recorded[s] += len(tokens)
        t = bucket_length(max(1, len(tokens)))
        ids = np.full((1, t), self.settings.pad_id, np.int32)
        real = np.zeros((1, t), bool)
        ids[0, :len(tokens)], real[0, :len(tokens)] = tokens, True
        return self.programs.append(state, self.params, self._replicated(np.array([s], np.int32)),
                                    self._replicated(ids), self._replicated(real),
                                    self._replicated(np.array([pausable])))
