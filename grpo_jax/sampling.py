"""Sampler (rollout engine): G completions per prompt, with the log-probs the trainer needs.

`sample(cfg, params, prompts, key=..., group_size=G, max_new_tokens=...)` returns a
`Rollout` whose row `prompt_index * G + g` is the g-th completion of prompt `prompt_index`.

The module has three parts, kept apart on purpose:

1. **Host side** (plain Python / numpy, never traced): input validation, bucketing of the
   static shapes, left padding of the prompts, padding of the batch with dummy rows,
   stripping them again.
2. **Device side** (jitted): `_prefill` runs the prompt batch once through the model,
   filling the KV cache, and copies each prompt's cache rows to its G samples (the prefill
   is shared by the group); `_decode` samples the first token from the prefill logits and
   then runs a `lax.while_loop`, one token per iteration, that stops as soon as every row
   has hit a stop token (or after `max_new_tokens`). A step is one of three decode
   engines, chosen by `rl.decode` and resolved once (`resolve_engine`): the model's own
   forward with its layers scanned (`scan`, the accelerator default) or written out
   (`unrolled`, the CPU-mesh default), whose cache is donated to `_decode` and returned by
   it so the loop updates it in place; or, on one CPU device, `feature_major.step` (the
   same layer, in the orientation XLA's CPU dots run fastest), whose loop runs in phases
   over a cache that holds only the slots filled by the phase's end (`decode_windows`),
   since attention's cost grows with the slots it reads.
   Every engine hands the token draw vocab-major logits, [V, B].
3. **Glue**: `sample` / `sample_with_info` call 1, then 2, then 1 again; `sample_to_host`
   does that for a few prompts at a time and concatenates the results on the host, so a
   step's KV cache holds one call's rows, not the whole batch's.

Conventions (the train step recomputes log-probs with the same ones)
--------------------------------------------------------------------
* **Left padding.** Prompts are left-padded to the prompt bucket `Tp`, so every row's last
  prompt token sits in cache slot `Tp - 1` and decode step t writes the same slot
  `Tp + t - 1` for every row: one scalar write index, one `dynamic_update_slice` per layer,
  and the prefill logits of every row are at the same column. (Right padding would need
  a different slot per row, i.e. a scatter per step, and a gather for the prefill logits.)
* **Positions.** RoPE positions are those of `grpo_jax.model.default_positions` applied
  to `[prompt_mask, mask]`: prompt tokens get 0..n-1, completion token t of a prompt with
  n real tokens gets n + t. Pad slots are masked out of attention.
* **Temperature.** `logprobs = log_softmax(logits / T)` at the sampled token for T > 0.
  T = 0 is greedy decoding (argmax of the logits) and reports `log_softmax(logits)`,
  i.e. the T = 1 log-probs. With top-k / top-p the log-probs are those of the
  distribution actually sampled: the tempered one renormalised over the kept tokens
  (log_softmax(logits / T) − log Σ_kept p). Without truncation this is exactly what a full
  forward pass recomputes (`log_softmax(forward_logits / T)`); with it, the trainer's
  ratio against these log-probs is the true importance ratio π_θ / π_sampler (see
  `algorithms`: GRPO uses them as π_θold at μ = 1 when truncation is on).
* **Top-k, then top-p** (the order transformers uses): top-k keeps the k largest logits
  (ties at the k-th value are kept); top-p then keeps the smallest prefix of the remaining
  tokens, by decreasing probability renormalised over them, whose mass is >= top_p.
* **Randomness.** Row r (= prompt_index * G + g) draws its token at step t with one
  uniform from `fold_in(fold_in(key, t), r)` and inverse-CDF sampling. A row's result
  depends only on (key, r, its prompt, params, settings): it does not depend on the batch
  padding, the mesh, or on whether the prefill is shared, so `sample(prompts, G)` equals
  `sample([p for p in prompts for _ in range(G)], group_size=1)` row by row, and
  `sample_to_host` in several calls equals one call (each call's rows keep their index in
  the whole batch).
* **Stop tokens.** The stop token is part of the completion (`mask` True, counted in
  `lengths`); everything after it is `pad_id`, masked, with log-prob 0. `finished` is True
  for rows that hit a stop token ("eos"), False for rows cut at `max_new_tokens` ("length").

Static shapes and compilation
-----------------------------
Compiled shapes are: the number of prompts (padded to a multiple of the batch-sharding
degree) and G, the prompt bucket and the completion bucket (powers of two, at least 16),
plus three compile-time switches: the decode engine (`rl.decode`, resolved once by
`resolve_engine`), its phases (`rl.decode_phases`, `cache_plan`), and whether top-k/top-p
filtering is on at all
(a sort over the vocabulary each step, skipped when top_k = 0 and top_p = 1). Everything
else — temperature, the values of top_k and top_p, max_new_tokens within its bucket, the
stop tokens, pad_id, the key — is traced, so a run compiles `_prefill` and `_decode` once
per (batch, prompt bucket). `TRACE_COUNTS` counts the traces. The returned arrays have
exactly `max_new_tokens` completion columns; the cache is `Tp + Tc` slots (Tc the
completion bucket), which may exceed `cfg.max_seq_len` — only real tokens' positions
(< `cfg.max_seq_len`) reach RoPE.

Sharding
--------
Under a mesh (`mesh=` or, when omitted, the mesh the params live on) the batch and the KV
cache are sharded over ('data', 'fsdp') and the cache's kv heads over 'tensor' (the rules
table in `grpo_jax.sharding`); the params are used as they are sharded for training (no
gather of the whole model anywhere). The sample batch is padded to a multiple of the
batch-sharding degree with dummy rows that start out finished (they never delay the early
stop) and are stripped from the result. The prompt batch is laid out shard by shard: each
shard's block holds the prompts of that shard's sample rows (a prompt whose group spans
two shards is prefilled on both), so copying a prompt's cache to its G rows is a local
copy on every device — a gather across shards would move the whole cache between chips
(on a 7B model, tens of GB per chip per call). Inputs become global arrays
(`sharding.to_global`: every process passes the same prompts and key), so the sampler
also runs on several processes; there the returned arrays are global too, and host code
reads them through `sharding.to_host`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import weakref
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from grpo_jax import feature_major as feature_major_lib
from grpo_jax import loops
from grpo_jax import model as model_lib
from grpo_jax.config import DECODE_ENGINES, KV_DTYPES, ConfigError, ModelConfig
from grpo_jax.shapes import bucket_length
from grpo_jax.sharding import (DTYPES, batch_degree, batch_sharding, constrain, logical_to_sharding, mesh_of, on_mesh, replicated,
                               to_global, to_host)

TRACE_COUNTS: collections.Counter = collections.Counter()  # "prefill" / "decode" -> traces


@flax.struct.dataclass
class Rollout:
    """B = num_prompts * G rows, row = prompt_index * G + g."""

    prompt_tokens: jax.Array  # [B, Tp] int32, LEFT-padded with pad_id (Tp = prompt bucket)
    prompt_mask: jax.Array  # [B, Tp] bool
    tokens: jax.Array  # [B, Tc] int32, Tc = max_new_tokens; pad_id after the stop token
    mask: jax.Array  # [B, Tc] bool, real completion tokens including the stop token
    logprobs: jax.Array  # [B, Tc] float32, log-prob of the token under the distribution sampled (top-k/p renormalised); 0 where ~mask
    lengths: jax.Array  # [B] int32 = mask.sum(1)
    finished: jax.Array  # [B] bool: True = stop token ("eos"), False = max_new_tokens ("length")


@dataclasses.dataclass(frozen=True)
class SampleInfo:
    """What one `sample_with_info` call did (for benchmarks and tests)."""

    num_prompts: int
    group_size: int
    prompt_bucket: int  # Tp
    completion_bucket: int  # internal completion columns (>= max_new_tokens)
    prompt_rows: int  # prefill batch after padding to the sharding degree
    sample_rows: int  # decode batch after padding
    decode_steps: int  # tokens generated per row before the loop stopped (<= max_new_tokens)


# ============================================================================ host side

def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_rows(num_prompts: int, group_size: int, mesh: Mesh | None, engine: str = "scan") -> tuple[int, int]:
    """(prefill rows, decode rows) of one call: the num_prompts x group_size samples padded
    with dummy rows to a multiple of the batch-sharding degree D, and the prefill batch of
    the engine's layout (`_layout`)."""
    slots, src = _layout(engine, num_prompts, group_size, batch_degree(mesh))
    return len(slots), len(src)


def _layout(engine: str, num_prompts: int, group_size: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot_prompt, src) of `shared_layout` for the shared engine, else `prefill_layout`."""
    return (shared_layout if engine == "shared" else prefill_layout)(num_prompts, group_size, degree)


def shared_layout(num_prompts: int, group_size: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """`prefill_layout`'s (slot_prompt, src) for the shared engine, whose rows read their
    prompt's cache in place (``model.PrefixCache``): every slot serves r consecutive rows,
    r = gcd(rows per shard, group_size), so a shard's rows are whole runs of one slot and a
    question's G rows use G / r copies of its prompt (one per shard they span when G
    exceeds a shard). Dummy rows get dummy slots."""
    rows = num_prompts * group_size
    bp = _round_up(rows, degree)
    r = math.gcd(bp // degree, group_size)
    first_row = np.arange(bp // r) * r
    slot_prompt = np.where(first_row < rows, first_row // group_size, -1).astype(np.int32)
    return slot_prompt, (np.arange(bp) // r).astype(np.int32)


def prefill_layout(num_prompts: int, group_size: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot_prompt [D*k], src [Bp]): prefill slot j holds prompt slot_prompt[j] (-1: a
    dummy prompt); sample row r copies the cache of slot src[r]. Rows and slots are split
    into D equal contiguous blocks (the batch sharding), and every row's slot lies in its
    own shard's block; k is the most prompts any shard's rows need. Dummy rows copy their
    block's first slot."""
    rows = num_prompts * group_size
    per_shard = _round_up(rows, degree) // degree
    shard = np.arange(degree)
    first = shard * per_shard // group_size  # first prompt of each shard's rows
    last = (np.minimum((shard + 1) * per_shard, rows) - 1) // group_size
    count = np.where(shard * per_shard < rows, last - first + 1, 0)
    k = max(1, int(count.max()))
    j = np.arange(k)
    slot_prompt = np.where(j < count[:, None], first[:, None] + j, -1).reshape(-1).astype(np.int32)
    r = np.arange(degree * per_shard)
    local = np.where(r < rows, r // group_size - first[r // per_shard], 0)
    return slot_prompt, (r // per_shard * k + local).astype(np.int32)


def _global_key(key, mesh: Mesh):
    """The key replicated on `mesh`, from the same key value on every process (typed or raw)."""
    if isinstance(key, jax.Array) and not key.is_fully_addressable:
        return key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = to_global(jax.random.key_data(key), replicated(mesh))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
    return to_global(key, replicated(mesh))


def _validate(cfg: ModelConfig, prompts, *, group_size, max_new_tokens, temperature, top_k,
              top_p, stop_tokens, pad_id, decode_phases) -> list[list[int]]:
    """Check every argument on the host; return the prompts as lists of ints."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not isinstance(prompts, np.ndarray):
        raise TypeError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    if not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if not isinstance(decode_phases, (int, np.integer)) or decode_phases < 1:
        raise ValueError(f"decode_phases must be an int >= 1, got {decode_phases!r}")
    vocab = cfg.vocab_size
    for name, ids in (("stop_tokens", list(stop_tokens)), ("pad_id", [pad_id])):
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"{name} {bad} outside the vocabulary [0, {vocab})")
    room = cfg.max_seq_len - max_new_tokens
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise TypeError(f"prompt {i} is a string: tokenize it first")
        p = [int(t) for t in np.asarray(p).reshape(-1)]
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if len(p) > room:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} the "
                f"sequence can hold at most cfg.max_seq_len - max_new_tokens = {room} prompt tokens")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        out.append(p)
    return out


@dataclasses.dataclass
class HostBatch:
    """One call's inputs as the host lays them out (`host_batch`): Pp prefill slots of Tp
    tokens, Bp sample rows."""

    prompt_tokens: np.ndarray  # [Pp, Tp] left-padded, in `prefill_layout` order
    prompt_mask: np.ndarray  # [Pp, Tp]
    src_rows: np.ndarray  # [Bp] prefill slot each sample row copies its cache from
    row_ids: np.ndarray  # [Bp] = 0..Bp-1 (the randomness index)
    row_valid: np.ndarray  # [Bp] False for dummy rows
    prompt_lens: np.ndarray  # [Bp] real prompt tokens of each sample row
    completion_bucket: int


def host_batch(prompts: list[list[int]], group_size: int, max_new_tokens: int, pad_id: int,
               mesh: Mesh | None, prompt_bucket: int, row_offset: int = 0, engine: str = "scan") -> HostBatch:
    """Left-pad the prompts into `prompt_bucket`, lay them out for the prefill
    (the engine's `_layout`) and lay out the (padded) sample rows, whose randomness indices start
    at `row_offset` (the call's first row in the whole batch)."""
    slot_prompt, src = _layout(engine, len(prompts), group_size, batch_degree(mesh))
    # Row -1 (the dummy slots' prompt) stays all pad and fully masked.
    tokens = np.full((len(prompts) + 1, prompt_bucket), pad_id, np.int32)
    mask = np.zeros((len(prompts) + 1, prompt_bucket), bool)
    for i, p in enumerate(prompts):
        tokens[i, prompt_bucket - len(p):] = p
        mask[i, prompt_bucket - len(p):] = True
    tokens, mask = tokens[slot_prompt], mask[slot_prompt]
    bp = len(src)
    valid = np.arange(bp) < len(prompts) * group_size
    lens = mask.sum(1).astype(np.int32)[src]
    return HostBatch(tokens, mask, src, row_offset + np.arange(bp, dtype=np.int32), valid, lens,
                     bucket_length(max_new_tokens))


# ============================================================================ device side

DRAW_BLOCK = 1024  # vocabulary entries per block of the two-level inverse-CDF draw


def first_max(x):
    """argmax over the vocabulary (first index of the maximum) of x [V,B] -> [B] int32.

    `jnp.argmax` lowers to a variadic (value, index) reduce that XLA's CPU backend does not
    vectorise, where a max followed by a min over the indices that reach it is two
    vectorised reductions (benchmarks/NOTES.md, "Figures behind code comments"). NaN
    columns give index 0."""
    m = jnp.max(x, axis=0, keepdims=True)
    first = jnp.min(jnp.where(x == m, jnp.arange(x.shape[0], dtype=jnp.int32)[:, None], x.shape[0]), axis=0)
    return jnp.where(first < x.shape[0], first, 0).astype(jnp.int32)


def inverse_cdf(weights, u):
    """Draw one index per column with probability proportional to weights [V,B] >= 0 (each
    column with some positive weight): the first index whose cumulative weight reaches
    u * total, u [B] in (0, 1].

    Two levels, so that no cumulative sum runs over the whole vocabulary (a sequential scan
    per row on CPU; benchmarks/NOTES.md, "Figures behind code comments"): the block whose
    running total first reaches the target, then the index inside that block. Along a
    non-decreasing cumulative sum the first index at or past the target is the count of
    entries below it, and it always has positive weight (a zero-weight entry repeats its
    predecessor's sum). If rounding leaves the target above every sum inside the block, the
    block's last index with positive weight is taken."""
    vocab, bsz = weights.shape
    blocks = -(-vocab // DRAW_BLOCK)
    w = jnp.pad(weights, ((0, blocks * DRAW_BLOCK - vocab), (0, 0))).reshape(blocks, DRAW_BLOCK, bsz)
    block_sum = jnp.sum(w, axis=1)  # [blocks, B]
    block_cum = jnp.cumsum(block_sum, axis=0)
    target = u * block_cum[-1]  # [B], <= the total, so some block reaches it
    j = jnp.sum(block_cum < target, axis=0)  # [B]
    before = jnp.take_along_axis(block_cum - block_sum, j[None, :], axis=0)  # [1, B]
    inner = jnp.take_along_axis(w, j[None, None, :], axis=0)[0]  # [block, B]
    i = jnp.sum(before + jnp.cumsum(inner, axis=0) < target, axis=0)
    last = jnp.max(jnp.where(inner > 0, jnp.arange(DRAW_BLOCK)[:, None], -1), axis=0)
    return (j * DRAW_BLOCK + jnp.minimum(i, last)).astype(jnp.int32)


def _next_token(logits, u, temperature, top_k, top_p, *, filtered: bool):
    """One sampling step for a batch. logits [V,B] f32 (vocab-major: the decode step's
    layout, see `feature_major`), u [B] in (0,1].

    Returns (token [B] int32, its log-prob [B] f32 under the distribution drawn from:
    log_softmax(logits / T), renormalised over the kept tokens when `filtered`); T = 0 is
    greedy and its log-probs are those of T = 1 (see the module docstring). `filtered` (static) turns
    on top-k (top_k > 0) and top-p (top_p < 1), whose values are traced.
    """
    vocab = logits.shape[0]
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    top = jnp.max(scaled, axis=0, keepdims=True)
    weights = jnp.exp(scaled - top)  # softmax(scaled) up to the column's normaliser
    log_norm = jnp.log(jnp.sum(weights, axis=0))
    if filtered:
        desc = -jnp.sort(-scaled.T, axis=-1)  # [B,V], decreasing
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        in_k = jnp.arange(vocab) < k  # the top-k prefix of `desc`
        # Top-p over the top-k tokens, probabilities renormalised over them.
        p_desc = jnp.where(in_k, jnp.exp(desc - desc[:, :1]), 0.0)
        mass = jnp.cumsum(p_desc, axis=-1) / jnp.sum(p_desc, axis=-1, keepdims=True)
        n_keep = jnp.minimum(1 + jnp.sum((mass < top_p) & in_k, axis=-1), k)
        n_keep = jnp.where(top_p >= 1.0, k, n_keep)
        threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)[:, 0]  # [B]
        weights = jnp.where(scaled >= threshold, weights, 0.0)  # ties at the threshold are kept
        # The distribution actually drawn from is the tempered one renormalised over the
        # kept tokens (so π_old in the ratio is the sampler's, not the untruncated
        # policy's). Greedy keeps the T = 1 convention.
        log_norm = jnp.where(greedy, log_norm, jnp.log(jnp.sum(weights, axis=0)))
    # Greedy is one setting for the whole batch: only the branch it needs runs.
    token = jax.lax.cond(greedy, lambda: first_max(scaled), lambda: inverse_cdf(weights, u))
    logp = jnp.take_along_axis(scaled - top, token[None, :], axis=0)[0] - log_norm
    return token, logp


def _uniforms(key, step, row_ids):
    """u in (0, 1] for every row, from fold_in(fold_in(key, step), row)."""
    step_key = jax.random.fold_in(key, step)
    draw = lambda r: jax.random.uniform(jax.random.fold_in(step_key, r), (), jnp.float32)
    return 1.0 - jax.vmap(draw)(row_ids)


# The logical axes of a stacked ``model.KVCache``'s arrays (its index is a scalar).
_CACHE_AXES = {"k": ("layers", "batch", "kv_heads", "head_dim", "seq"),
               "v": ("layers", "batch", "kv_heads", "seq", "head_dim"),
               "mask": ("batch", "seq"),
               "k_scale": ("layers", "batch", "kv_heads", "seq"),
               "v_scale": ("layers", "batch", "kv_heads", "seq")}
# The arrays of a cache with a leading layers axis (per-layer lists in some engines).
_LAYERED = ("k", "v", "k_scale", "v_scale")


def _cache_arrays(cache: model_lib.KVCache) -> dict:
    """{name: array} of a cache's arrays other than its index (no scales unless int8)."""
    return {name: getattr(cache, name) for name in _CACHE_AXES if getattr(cache, name) is not None}


def cache_sharding(mesh: Mesh, cache: model_lib.KVCache) -> model_lib.KVCache:
    """The shardings of a stacked cache on ``mesh``, by the rules table: rows over
    ('data', 'fsdp'), kv heads over 'tensor', the index replicated."""
    return cache.replace(index=replicated(mesh), **{
        name: logical_to_sharding(_CACHE_AXES[name], x.shape, mesh) for name, x in _cache_arrays(cache).items()})


def constrain_cache(cache: model_lib.KVCache) -> model_lib.KVCache:
    """A stacked cache constrained to `cache_sharding` on the mesh being traced under
    (``sharding.constrain``); unchanged without one (the per-layer cache of the
    feature-major engine only exists there)."""
    return cache.replace(index=constrain(cache.index, ()), **{
        name: constrain(x, _CACHE_AXES[name]) for name, x in _cache_arrays(cache).items()})


def kv_cache_dtype(cfg: ModelConfig, kv_dtype: str):
    """The sampler's cache dtype for ``rl.kv_dtype`` (checked by `resolve_engine`): auto is
    the model's compute dtype."""
    return jnp.dtype(DTYPES[cfg.dtype] if kv_dtype == "auto" else kv_dtype)


def _constrain_rows(x):
    """x [B, ...] with its rows sharded like the batch (``sharding.constrain``)."""
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def _prefill(cfg: ModelConfig, mesh: Mesh | None, engine: str, kv_dtype: str, params, prompt_tokens,
             prompt_mask, src_rows, *, cache_len: int, chunk_tokens: int | None = None):
    """Prompts [Pp,Tp] -> (cache with Bp rows, logits [Bp,V] for the first new token).

    The Pp prompts go through the model once; sample row r then gets a copy of prompt row
    src_rows[r]'s cache and logits (group sampling shares the prefill). The layers run as a
    `lax.scan`: with Tp tokens per row, slicing each layer's weights out of the stacked
    arrays once is negligible, and unrolling measured no faster but compiles slower.

    The prompts run against a cache of their own Tp slots, padded to `cache_len` afterwards:
    attending over the empty completion slots too would make the prefill attention
    (Tp + new tokens) / Tp times larger for nothing (they are masked out). A long prefill
    runs in row chunks with the feature-major engine, one after the other (`prefill_chunks`; `chunk_tokens` overrides
    PREFILL_CHUNK_TOKENS, for benchmarks).

    For the feature-major engine (whose decode carries a buffer per layer) the
    cache's k and v are lists of per-layer arrays ([Bp, K, D, S] / [Bp, K, S, D]): the pad
    writes each layer's buffer directly, where slicing a stacked cache apart at the start of
    decode (and stacking it again at its end) copies the whole cache twice per call.

    The cache is stored in ``kv_dtype`` (``rl.kv_dtype``, `kv_cache_dtype`)."""
    TRACE_COUNTS["prefill"] += 1
    num_prompts, tp = prompt_tokens.shape
    chunks = prefill_chunks(num_prompts, tp, engine, chunk_tokens)
    dtype = kv_cache_dtype(cfg, kv_dtype)
    if chunks == 1:
        last, cache = _prompt_forward(cfg, params, prompt_tokens, prompt_mask, dtype)
    else:
        rows = -(-num_prompts // chunks)
        split = lambda x: jnp.pad(x, ((0, chunks * rows - num_prompts), (0, 0))).reshape(chunks, rows, tp)
        last, cache = loops.map(lambda a: _prompt_forward(cfg, params, *a, dtype),
                                  (split(prompt_tokens), split(prompt_mask)))
        # [chunks, layers, rows, ...] -> [layers, chunks * rows, ...], without the padding rows
        join = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], chunks * rows, *x.shape[3:])[:, :num_prompts]
        cache = model_lib.KVCache(k=join(cache.k), v=join(cache.v),
                                  mask=cache.mask.reshape(chunks * rows, tp)[:num_prompts], index=cache.index[0])
        last = last.reshape(chunks * rows, -1)[:num_prompts]

    def pad(x, axis):  # the slot axis, from tp to cache_len
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, cache_len - tp)
        return jnp.pad(x, widths)

    if engine == "feature_major":
        layers = range(cfg.num_layers)
        k, v = [pad(cache.k[i], -1) for i in layers], [pad(cache.v[i], -2) for i in layers]
        cache = cache.replace(k=k, v=v, mask=pad(cache.mask, -1))
    else:
        slot_axis = {"k": -1, "v": -2, "mask": -1, "k_scale": -1, "v_scale": -1}
        cache = cache.replace(**{name: pad(x, slot_axis[name]) for name, x in _cache_arrays(cache).items()})
    logits = model_lib.logits_from_hidden(cfg, params, last)
    if src_rows is not None:  # None: one sample per prompt, rows already in place
        cache, logits = _copy_to_rows(cache, logits, src_rows, mesh)
    return constrain_cache(cache), _constrain_rows(logits)


# Prefill chunk size of the feature-major engine (one CPU device): XLA's CPU backend ran a
# long prefill slower in one pass than in row chunks of this many tokens (benchmarks/NOTES.md,
# "Prefill at batch 64 per token"; `python benchmarks/bench_layouts.py` times both).
PREFILL_CHUNK_TOKENS = 2048


def prefill_chunks(num_prompts: int, tp: int, engine: str, chunk_tokens: int | None = None) -> int:
    """How many row chunks the prefill of num_prompts x tp tokens runs in, one after the other:
    one except for the feature-major engine (one CPU device), where a chunk holds at most
    chunk_tokens (default PREFILL_CHUNK_TOKENS) tokens, or one row; meshes and accelerators
    gain from large matmuls."""
    if engine != "feature_major":
        return 1
    rows = max(1, (PREFILL_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens) // tp)
    return -(-num_prompts // rows)


def _prompt_forward(cfg: ModelConfig, params, prompt_tokens, prompt_mask, dtype):
    """Prompts [P, Tp] through the model against a cache of their own Tp slots, stored in
    ``dtype`` -> (the last column's hidden state [P, E], the cache)."""
    cache = constrain_cache(model_lib.init_cache(cfg, prompt_tokens.shape[0], prompt_tokens.shape[1], dtype))
    positions = model_lib.default_positions(prompt_mask)
    hidden, cache = model_lib.forward_hidden(cfg, params, prompt_tokens, prompt_mask, positions,
                                             cache=cache, unroll=False)
    # Left padding: every row's last prompt token is in the last column.
    return hidden[:, -1], cache


def _copy_to_rows(cache: model_lib.KVCache, logits, src_rows, mesh: Mesh | None):
    """Sample row r gets prefill slot src_rows[r]'s cache and logits. `prefill_layout`
    puts every row's slot in the row's own shard, so under a mesh each device copies from
    its own block (a shard_map with block-local indices): no cache bytes cross devices.
    A per-layer cache (lists, see `_prefill`) is only made without a mesh."""
    def take(arrays, logits, src):
        return ({name: jnp.take(x, src, axis=1 if name in _LAYERED else 0) for name, x in arrays.items()},
                jnp.take(logits, src, axis=0))

    if isinstance(cache.k, list):
        k, v = ([jnp.take(x, src_rows, axis=0) for x in xs] for xs in (cache.k, cache.v))
        mask, logits = jnp.take(cache.mask, src_rows, axis=0), jnp.take(logits, src_rows, axis=0)
        return cache.replace(k=k, v=v, mask=mask), logits
    arrays = _cache_arrays(cache)
    if mesh is None:
        arrays, logits = take(arrays, logits, src_rows)
    else:
        cs = _cache_arrays(cache_sharding(mesh, cache))
        rows = batch_sharding(mesh, 1, src_rows.shape[0]).spec
        specs = ({name: x.spec for name, x in cs.items()}, batch_sharding(mesh, 2, logits.shape[0]).spec)
        # Slot indices are global; each block starts at shard * (slots per shard).
        per_shard = cache.mask.shape[0] // batch_degree(mesh)
        local = lambda a, lg, src: take(a, lg, src - per_shard * _block_index(mesh, rows[0]))
        arrays, logits = jax.shard_map(local, mesh=mesh, in_specs=specs + (rows,),
                                       out_specs=specs)(arrays, logits, src_rows)
    return cache.replace(**arrays), logits


def _block_index(mesh: Mesh, axes) -> jax.Array:
    """Inside shard_map: this device's block of a dimension sharded over ``axes`` (a mesh
    axis name, a tuple of them, major first, or None)."""
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    index = jnp.int32(0)
    for axis in axes:
        index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
    return index


def _unstack(tree, n: int) -> list:
    return [jax.tree.map(lambda x: x[i], tree) for i in range(n)]


def _stack(parts: list):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *parts)


# Decode phases (feature-major and shared decode): attention reads every cache slot at every
# step, though at step t only the prompt's and t completion slots are filled. So the loop
# runs in up to `rl.decode_phases` phases, each over a cache that ends one phase's share of
# the completion bucket further on. Each phase is one more traced and compiled copy of the
# step. On one CPU more than 4 phases gained nothing measurable (benchmarks/NOTES.md,
# "Figures behind code comments"); on TPU a step is bound by the slots it reads, and more
# phases read fewer empty ones (docs/tpu.md, "Decode phases"). Short completions, where
# attention is a small share, keep one phase.
DECODE_PHASES = 4  # rl.decode_phases' default
_MIN_PHASE_SLOTS = 32


def decode_windows(prompt_slots: int, num_cols: int, phases: int = DECODE_PHASES) -> tuple[int, ...]:
    """The cache windows of up to ``phases`` decode phases for a prompt bucket and a
    completion bucket: increasing slot counts, the last one the whole cache
    (prompt_slots + num_cols), each phase at least _MIN_PHASE_SLOTS long."""
    phases = max(1, min(phases, num_cols // _MIN_PHASE_SLOTS))
    return tuple(prompt_slots + num_cols * (i + 1) // phases for i in range(phases))


def cache_plan(engine: str, prompt_slots: int, num_cols: int,
               phases: int = DECODE_PHASES) -> tuple[int, tuple[int, ...]]:
    """(the prefill's cache slots, the decode's windows) of one call: `feature_major` decodes
    in up to ``phases`` phases over a cache that grows (`decode_windows`); `shared` keeps the
    prompts' cache as the prefill made it and decodes into completion slots that grow by
    phase; the others run one loop over the whole prompt + completion cache."""
    if engine == "feature_major":
        windows = decode_windows(prompt_slots, num_cols, phases)
        return windows[0], windows
    if engine == "shared":
        return prompt_slots, decode_windows(0, num_cols, phases)
    return prompt_slots + num_cols, (prompt_slots + num_cols,)


def phase_steps(windows: tuple[int, ...], num_cols: int, steps: int) -> list[int]:
    """Decode steps each phase runs when none stops early: step s (1..steps) writes slot
    windows[-1] - num_cols + s - 1 and runs in the first phase whose window holds it (the
    loop condition of `_decode`)."""
    tp = windows[-1] - num_cols
    edges = [0] + [min(w - tp, steps) for w in windows]
    return [max(0, b - a) for a, b in zip(edges[:-1], edges[1:])]


def _resize_slots(cache: model_lib.KVCache, slots: int) -> model_lib.KVCache:
    """A per-layer decode cache (k [B,K,D,S], v [B,K,S,D] per layer, an int8 cache's scales
    [B,K,S] per layer, mask [B,S]) with S padded by empty slots to `slots`."""
    grow = lambda x, axis: jnp.pad(x, [(0, slots - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])
    scales = {name: [grow(s, 2) for s in getattr(cache, name)] for name in ("k_scale", "v_scale")
              if getattr(cache, name) is not None}
    return cache.replace(k=[grow(k, 3) for k in cache.k], v=[grow(v, 2) for v in cache.v],
                         mask=grow(cache.mask, 1), **scales)


@flax.struct.dataclass
class _DecodeState:
    """The decode loop's carry: B rows, Tc = num_cols completion columns."""

    step: jax.Array  # [] int32: the column the next iteration samples
    cache: model_lib.KVCache  # the engine's cache (`_engine_cache`)
    last: jax.Array  # [B] int32: the token sampled last (the next step's input)
    last_real: jax.Array  # [B] bool: that token is a real one (not a done row's pad)
    done: jax.Array  # [B] bool: stop token seen (or a dummy row)
    tokens: jax.Array  # [B, Tc] int32
    mask: jax.Array  # [B, Tc] bool
    logps: jax.Array  # [B, Tc] float32
    finished: jax.Array  # [B] bool: stopped on a stop token


def _engine_cache(engine: str, cache: model_lib.KVCache, num_layers: int) -> model_lib.KVCache:
    """The decode's cache as the engine carries it: per-layer lists of k and v (and an
    int8 cache's scales) for `unrolled` and `shared` (so a step writes one slot of one
    layer's buffer, never the stack) and `feature_major` (the prefill makes them per layer
    already), stacked for `scan`."""
    if engine in ("unrolled", "shared"):
        return cache.replace(**{name: _unstack(x, num_layers) for name, x in _cache_arrays(cache).items()
                                if name in _LAYERED})
    return cache


def _stacked(cache: model_lib.KVCache) -> model_lib.KVCache:
    """A per-layer cache (`_engine_cache`) stacked again."""
    return cache.replace(**{name: _stack(x) for name, x in _cache_arrays(cache).items() if name in _LAYERED})


def _decode(cfg: ModelConfig, engine: str, filtered: bool,
            params, cache, logits0, prompt_lens, row_ids, row_valid, key, temperature, top_k,
            top_p, max_new_tokens, stop_mask, pad_id, *, num_cols: int,
            windows: tuple[int, ...] | None = None, cost_steps: int | None = None):
    """Sample up to max_new_tokens (<= num_cols) tokens per row; stop when all rows are done.

    One step per loop iteration, by `engine` (`resolve_engine`):
    * `scan`: the model's forward (`forward_hidden`), its layers a `lax.scan` over the
      stacked weights and cache;
    * `unrolled`: the same forward with the layers written out, the weights and cache
      carried per layer and restacked inside the step: XLA folds each layer's
      slice(stack(...)) back to the buffer itself, so a step neither copies a layer's
      weights out of the stack nor rewrites the whole cache (one in-place slot write per
      layer). The optimization barrier keeps XLA from hoisting the loop-invariant weight
      stack out of the loop, which would bring the copies back;
    * `feature_major` (one CPU device): `feature_major.step`, with `params` from
      `feature_major_weights(cfg, params)` and the cache per layer from the prefill;
    * `shared`: the unrolled forward over a cache of completion slots only, made here,
      each row attending to its prompt slot's keys in `cache` (the prefill's, P slots of r
      rows each, `shared_layout`; ``model.PrefixCache``) instead of a copy of them, and
      logits0 per slot. The completion cache grows by phase (`windows`), so a step reads
      the filled slots and at most one phase's share of empty ones.

    `windows` (`cache_plan`): the cache slots of each decode phase (feature_major: the
    cache coming from the prefill with the first window's slots; shared: completion slots);
    None: one phase over the cache as it comes. `cost_steps` (static; the cost count of `grpo_jax.aot` only): run
    exactly that many steps, written out, in place of the loop.

    Returns (tokens, mask, logprobs [Bp,num_cols], finished [Bp], steps, cache): the
    donated cache, updated in place (`scan`, `unrolled`); None for the engines that make
    their own (`shared`, `feature_major`): an output would hold it, and the shared engine's
    restacked copy of it, past the loop. The cost twin returns it for every engine: a dead
    cache would let XLA fuse its last steps' writes away, which the loop, carrying it, does
    not.
    """
    TRACE_COUNTS["decode"] += 1
    bsz = row_ids.shape[0]
    num_layers = cfg.num_layers
    windows = windows or (cache.mask.shape[1],)
    prefix = None
    if engine == "shared":
        prefix = model_lib.PrefixCache(k=cache.k, v=cache.v, mask=cache.mask, k_scale=cache.k_scale,
                                       v_scale=cache.v_scale)
        logits0 = _constrain_rows(jnp.repeat(logits0, bsz // logits0.shape[0], axis=0))
        cache = constrain_cache(model_lib.init_cache(cfg, bsz, windows[0], cache.k.dtype))
    pick = functools.partial(_next_token, temperature=temperature, top_k=top_k, top_p=top_p,
                             filtered=filtered)

    def emit(state: _DecodeState, logits) -> _DecodeState:
        """Sample column `state.step` for the rows still running (done rows emit pad)."""
        step = state.step
        token, logp = pick(logits, _uniforms(key, step, row_ids))
        active = ~state.done
        token = jnp.where(active, token, pad_id)
        logp = jnp.where(active, logp, 0.0)
        stop = active & stop_mask[token]
        put = lambda buf, col: jax.lax.dynamic_update_slice(buf, col[:, None], (0, step))
        return state.replace(step=step + 1, last=token, last_real=active, done=state.done | stop,
                             tokens=put(state.tokens, token), mask=put(state.mask, active),
                             logps=put(state.logps, logp), finished=state.finished | stop)

    if engine in ("unrolled", "shared"):
        layer_params = _unstack(params["layers"], num_layers)
        step_params = lambda: dict(params, layers=_stack(jax.lax.optimization_barrier(layer_params)))
    else:
        step_params = lambda: params

    # RoPE tables of every step's position, made once ([Bp, num_cols, 1, D/2] each).
    tables = model_lib.rope_tables(prompt_lens[:, None] + jnp.arange(num_cols), cfg.head_dim,
                                   cfg.rope_theta, cfg.rope_scaling_factor)
    state = _DecodeState(
        step=jnp.zeros((), jnp.int32), cache=_engine_cache(engine, cache, num_layers),
        last=jnp.zeros((bsz,), jnp.int32), last_real=jnp.zeros((bsz,), bool), done=~row_valid,
        tokens=_constrain_rows(jnp.full((bsz, num_cols), pad_id, jnp.int32)),
        mask=_constrain_rows(jnp.zeros((bsz, num_cols), bool)),
        logps=_constrain_rows(jnp.zeros((bsz, num_cols), jnp.float32)),
        finished=jnp.zeros((bsz,), bool))
    state = emit(state, logits0.T)
    tp = windows[-1] - num_cols

    def cond(window, s: _DecodeState):
        # Step `step` writes slot tp + step - 1, which must lie inside the phase's window.
        return (s.step < max_new_tokens) & ~jnp.all(s.done) & (s.step < window - tp + 1)

    def body(s: _DecodeState) -> _DecodeState:
        rope_cs = tuple(jax.lax.dynamic_slice_in_dim(t, s.step - 1, 1, axis=1) for t in tables)
        c = s.cache
        if engine == "feature_major":
            logits, ks, vs, cache_mask = feature_major_lib.step(cfg, params, c.k, c.v, c.mask, c.index,
                                                                s.last, s.last_real, rope_cs)
            c = model_lib.KVCache(k=ks, v=vs, mask=cache_mask, index=c.index + 1)
        else:
            if engine != "scan":
                c = _stacked(c)
            # Token `step-1` (slot Tp+step-1) sits at position n + step - 1 (default_positions).
            positions = (prompt_lens + s.step - 1)[:, None]
            hidden, c = model_lib.forward_hidden(cfg, step_params(), s.last[:, None], s.last_real[:, None],
                                                 positions, cache=c, unroll=engine != "scan",
                                                 rope_cs=rope_cs, prefix=prefix)
            c = _engine_cache(engine, constrain_cache(c), num_layers)
            logits = model_lib.logits_from_hidden(cfg, params, hidden[:, 0]).T  # [V, B]
        return emit(s.replace(cache=c), logits)

    if cost_steps is not None:
        for _ in range(cost_steps):
            state = body(state)
    else:
        for window in windows:
            if engine in ("feature_major", "shared"):
                # The cache grows to the phase's window between phases (one copy each), never
                # inside one: XLA copies a slice of it that a step reads, at every step.
                state = state.replace(cache=_resize_slots(state.cache, window))
            state = jax.lax.while_loop(functools.partial(cond, window), body, state)
    if engine in ("feature_major", "shared") and cost_steps is None:
        cache = None
    else:
        cache = _stacked(state.cache) if engine in ("unrolled", "shared") else state.cache
    return state.tokens, state.mask, state.logps, state.finished, state.step, cache


class OnMesh:
    """A jitted program that is traced, lowered and run on its mesh (``sharding.on_mesh``), so
    its activation constraints apply (``sharding.constrain``, the model's and the sampler's);
    the mesh is entered outside the trace, as jax requires. ``unrolled``: traced inside
    ``loops.unrolled()`` (the cost twin of ``aot``). ``programs`` returns these."""

    def __init__(self, jitted: Any, mesh: Mesh | None, unrolled: bool = False):
        self.jitted, self.mesh, self.unrolled = jitted, mesh, unrolled

    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(on_mesh(self.mesh))
        if self.unrolled:
            stack.enter_context(loops.unrolled())
        return stack

    def __call__(self, *args, **kwargs):
        with self._context():
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with self._context():
            return self.jitted.lower(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        with self._context():
            return jax.eval_shape(functools.partial(self.jitted, **kwargs), *args)


@functools.lru_cache(maxsize=32)
def _jitted(kind: str, cfg: ModelConfig, mesh: Mesh | None, engine: str, *static, unrolled: bool = False) -> OnMesh:
    """One jit object per (kind, model shape, mesh, engine, compile-time settings); jax's own
    cache then keys on array shapes. ``unrolled`` programs are separate jit objects, so their
    traces never mix with the run's."""
    if kind == "prefill":
        jitted = jax.jit(functools.partial(_prefill, cfg, mesh, engine, *static),
                         static_argnames=("cache_len", "chunk_tokens"))
    else:
        # The cache is donated so that the loop updates it in place; the feature-major decode
        # grows it between phases instead, so its output cache is not the input's shape, and
        # the shared decode only reads it (its completion cache is its own).
        jitted = jax.jit(functools.partial(_decode, cfg, engine, *static),
                         static_argnames=("num_cols", "windows", "cost_steps"),
                         donate_argnums=() if engine in ("feature_major", "shared") else (1,))
    return OnMesh(jitted, mesh, unrolled)


def resolve_engine(engine: str, mesh: Mesh | None, kv_dtype: str = "auto") -> str:
    """The decode engine that runs for ``rl.decode = engine`` on the sampling ``mesh`` (None:
    one device) with a ``kv_dtype`` cache. ``auto``: ``feature_major`` on one CPU device (the
    layouts XLA's CPU dots are fastest in; ``unrolled`` for an int8 cache, which it does not
    hold), ``unrolled`` on a CPU mesh, ``shared`` on accelerators (decode there
    is bound by HBM bandwidth, and the shared engine reads a prompt's cache once per slot
    and only the completion slots filled so far; docs/tpu.md compares the engines).
    ConfigError for ``feature_major`` on a mesh or an accelerator, where it has no sharding,
    or with an int8 cache."""
    if engine not in DECODE_ENGINES:
        raise ConfigError(f"rl.decode={engine!r} is not one of {list(DECODE_ENGINES)}")
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"rl.kv_dtype={kv_dtype!r} is not one of {list(KV_DTYPES)}")
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    if engine == "auto":
        if platform != "cpu":
            return "shared"
        return "feature_major" if mesh is None and kv_dtype != "int8" else "unrolled"
    if engine == "feature_major" and (mesh is not None or platform != "cpu"):
        where = f"a mesh of {mesh.size} devices" if mesh is not None else f"a {platform} device"
        raise ConfigError(f"rl.decode=feature_major runs on one CPU device; this sampler has {where}: "
                         "use rl.decode=scan or unrolled")
    if engine == "feature_major" and kv_dtype == "int8":
        raise ConfigError("rl.kv_dtype=int8 needs the scan, unrolled or shared decode engine; "
                          "rl.decode=feature_major keeps its cache in the compute dtype")
    return engine


def programs(cfg: ModelConfig, mesh: Mesh | None, *, engine: str, filtered: bool,
             kv_dtype: str = "auto", unrolled: bool = False) -> tuple[OnMesh, OnMesh]:
    """(prefill, decode): the sampler's two jitted programs for a model on a mesh with a
    resolved decode ``engine`` (``resolve_engine``), ``filtered``: top-k / top-p on, the
    KV cache stored in ``kv_dtype`` (``rl.kv_dtype``; the decode takes it from the cache). The
    sampler runs these; ``grpo_jax.aot`` lowers the same ones (``unrolled``: its cost twin).
    Forward only, over a KV cache: remat and model.attention (the cache-free forward's
    kernel) change training, not sampling, so every remat policy and attention share them.
    The feature-major decode takes `feature_major_weights(cfg, params)` instead of the
    params and a per-layer cache from the prefill."""
    if engine not in DECODE_ENGINES[1:]:
        raise ValueError(f"programs needs a resolved decode engine (resolve_engine), got {engine!r}")
    if engine == "feature_major" and kv_dtype == "int8":
        raise ValueError("the feature-major engine holds no int8 cache (resolve_engine)")
    forward_cfg = dataclasses.replace(cfg, remat="none", attention="xla")
    return (_jitted("prefill", forward_cfg, mesh, engine, kv_dtype, unrolled=unrolled),
            _jitted("decode", forward_cfg, mesh, engine, bool(filtered), unrolled=unrolled))


class _HeldWeights:
    """One policy's feature-major decode weights, kept while every array of its params lives."""

    def __init__(self, key: tuple, leaves: list, weights, table: dict):
        # The table is held here because the module's globals are already None when the
        # last arrays die at interpreter exit, and their callbacks still run then.
        self.key, self.weights, self.table = key, weights, table
        self.refs = [weakref.ref(x, self._drop) for x in leaves]

    def holds(self, leaves: list) -> bool:
        return len(leaves) == len(self.refs) and all(r() is x for r, x in zip(self.refs, leaves))

    def _drop(self, _):
        if self.table.get(self.key) is self:
            del self.table[self.key]


_HELD_WEIGHTS: dict[tuple, _HeldWeights] = {}  # (cfg, dtype of the params) -> copy


def feature_major_weights(cfg: ModelConfig, params):
    """`feature_major.decode_weights(cfg, params)`, made once per policy: the copy (a pass over
    every weight) is reused while `params` holds the same array objects
    (evaluation samples each batch twice, `sample_to_host` calls once per chunk) and
    freed with the first of them: a new policy's params are new arrays, so never a stale
    copy, and one copy per model and dtype at most (a float32 policy and its bfloat16
    sampling copy, alternating, keep one each)."""
    leaves = jax.tree.leaves(params)
    key = (cfg, params["embedding"].dtype.name)
    held = _HELD_WEIGHTS.get(key)
    if held is None or not held.holds(leaves):
        held = _HELD_WEIGHTS[key] = _HeldWeights(key, leaves, _weights_program(cfg)(params),
                                                  _HELD_WEIGHTS)
    return held.weights


@functools.lru_cache(maxsize=8)
def _weights_program(cfg: ModelConfig):
    return jax.jit(functools.partial(feature_major_lib.decode_weights, cfg))


def sampling_copy(cfg: ModelConfig, params, dtype: str, mesh: Mesh | None = None):
    """The policy the sampler reads: float32 leaves cast to ``dtype``, placed on ``mesh``
    (the sampler's mesh, ``sharding.make_sample_mesh``) or, when None, where they are.
    float32 on the params' own placement returns ``params`` itself. A bfloat16 copy halves
    the weights' memory and the bytes each decode step reads, and under float32 compute its
    matmuls round their activations to bf16 and sum in float32 (``model.product``), so its
    log-probs differ slightly from the float32 trainer's (logged as logprob_mismatch_*;
    ``benchmarks/bench_rollout.py --bf16`` measures it)."""
    if dtype == "float32" and (mesh is None or mesh == mesh_of(params)):
        return params
    return _copier(cfg, mesh, dtype)(params)


@functools.lru_cache(maxsize=8)
def _copier(cfg: ModelConfig, mesh: Mesh | None, dtype: str):
    """One jitted cast (and reshard onto ``mesh``) per model, mesh and dtype."""
    out = None if mesh is None else model_lib.param_shardings(cfg, mesh)
    cast = lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x
    return jax.jit(lambda params: jax.tree.map(cast, params), out_shardings=out)


# ============================================================================ glue

def sample(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], *, key, group_size: int = 1,
           max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           stop_tokens: Sequence[int] = (), pad_id: int = 0, mesh: Mesh | None = None,
           engine: str = "auto", kv_dtype: str = "auto", decode_phases: int = DECODE_PHASES) -> Rollout:
    """G = group_size completions for each prompt (token-id lists of any lengths).

    key: a jax PRNG key (typed or raw); temperature 0 = greedy; top_k 0 = off; top_p 1 = off;
    stop_tokens: ids that end a completion (kept in it); pad_id fills prompts and completions;
    mesh: shard over this mesh (default: the params' mesh, if they live on one);
    engine: the decode engine (`rl.decode`: auto, scan, unrolled, feature_major, shared; see
    `resolve_engine`, which turns auto into one of the others for the sampling mesh);
    kv_dtype: the KV cache's dtype (`rl.kv_dtype`: auto = the model's compute dtype,
    bfloat16, or int8 with a scale per slot and head, `model.quantize_kv`);
    decode_phases: the most phases the feature-major and shared engines decode in
    (`rl.decode_phases`, `cache_plan`); it changes what a step reads, not what it draws.
    Conventions (positions, temperature, randomness, padding): see the module docstring.
    """
    return sample_with_info(cfg, params, prompts, key=key, group_size=group_size,
                            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, stop_tokens=stop_tokens, pad_id=pad_id, mesh=mesh,
                            engine=engine, kv_dtype=kv_dtype, decode_phases=decode_phases)[0]


def sample_with_info(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], *, key,
                     group_size: int = 1, max_new_tokens: int, temperature: float = 1.0,
                     top_k: int = 0, top_p: float = 1.0, stop_tokens: Sequence[int] = (),
                     pad_id: int = 0, mesh: Mesh | None = None, engine: str = "auto",
                     kv_dtype: str = "auto", decode_phases: int = DECODE_PHASES) -> tuple[Rollout, SampleInfo]:
    """`sample`, plus a `SampleInfo` describing the shapes used and the decode steps run."""
    prompts = _validate(cfg, prompts, group_size=group_size, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p,
                        stop_tokens=stop_tokens, pad_id=pad_id, decode_phases=decode_phases)
    mesh = _sampling_mesh(params, mesh)
    return _sample_call(cfg, params, prompts, key=key, group_size=group_size,
                        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, stop_tokens=stop_tokens, pad_id=pad_id, mesh=mesh,
                        engine=resolve_engine(engine, mesh, kv_dtype), kv_dtype=kv_dtype,
                        decode_phases=decode_phases, prompt_bucket=bucket_length(max(len(p) for p in prompts)))


def sample_to_host(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], *, key,
                   prompts_per_call: int = 0, group_size: int = 1, max_new_tokens: int,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   stop_tokens: Sequence[int] = (), pad_id: int = 0, mesh: Mesh | None = None,
                   engine: str = "auto", kv_dtype: str = "auto", decode_phases: int = DECODE_PHASES) -> Rollout:
    """`sample`'s Rollout as host numpy arrays (on every process), sampled
    `prompts_per_call` prompts at a time (0 = all in one call).

    Each call's results go to the host before the next call starts, so the device holds
    one call's KV cache ([layers, prompts_per_call * G, ...]) instead of the whole batch's.
    Every call uses the prompt bucket of the whole batch and its rows keep their index
    in it (the randomness index), so the tokens, masks and lengths equal those of one call;
    log-probs may differ in the last bits (other batch shapes), as between meshes.
    """
    prompts = _validate(cfg, prompts, group_size=group_size, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p,
                        stop_tokens=stop_tokens, pad_id=pad_id, decode_phases=decode_phases)
    if not isinstance(prompts_per_call, (int, np.integer)) or prompts_per_call < 0:
        raise ValueError(f"prompts_per_call must be an int >= 0 (0 = one call), got {prompts_per_call!r}")
    mesh = _sampling_mesh(params, mesh)
    engine = resolve_engine(engine, mesh, kv_dtype)
    per_call = prompts_per_call or len(prompts)
    tp = bucket_length(max(len(p) for p in prompts))
    parts = []
    for start in range(0, len(prompts), per_call):
        rollout, _ = _sample_call(cfg, params, prompts[start:start + per_call], key=key,
                                  group_size=group_size, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_k=top_k, top_p=top_p,
                                  stop_tokens=stop_tokens, pad_id=pad_id, mesh=mesh, engine=engine,
                                  kv_dtype=kv_dtype, decode_phases=decode_phases, prompt_bucket=tp,
                                  row_offset=start * group_size)
        parts.append(jax.tree.map(to_host, rollout))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def _sampling_mesh(params, mesh: Mesh | None) -> Mesh | None:
    mesh = mesh_of(params) if mesh is None else mesh
    # One device: nothing to shard, and the unsharded programs are reused.
    return None if mesh is not None and mesh.size == 1 else mesh


def _sample_call(cfg: ModelConfig, params, prompts: list[list[int]], *, key, group_size: int,
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 stop_tokens: Sequence[int], pad_id: int, mesh: Mesh | None, engine: str,
                 kv_dtype: str, decode_phases: int, prompt_bucket: int,
                 row_offset: int = 0) -> tuple[Rollout, SampleInfo]:
    """One prefill + decode for validated prompts, left-padded to `prompt_bucket`; sample
    row r draws its randomness as row `row_offset + r`."""
    # -- host: pad
    host = host_batch(prompts, group_size, max_new_tokens, pad_id, mesh, prompt_bucket, row_offset, engine)
    stop_mask = np.zeros((cfg.vocab_size,), bool)
    stop_mask[list(stop_tokens)] = True
    prompt_arrays = (host.prompt_tokens, host.prompt_mask)
    row_arrays = (host.src_rows, host.prompt_lens, host.row_ids, host.row_valid)
    if mesh is not None:
        # Global arrays built from the host copy every process holds (works multi-host).
        prompt_arrays = tuple(to_global(x, batch_sharding(mesh, x.ndim, x.shape[0])) for x in prompt_arrays)
        row_arrays = tuple(to_global(x, batch_sharding(mesh, 1, x.shape[0])) for x in row_arrays)
        stop_mask = to_global(stop_mask, replicated(mesh))
        key = _global_key(key, mesh)
    src_rows, prompt_lens, row_ids, row_valid = row_arrays

    # -- device: prefill once per prompt, then the decode loop
    tp, tc = host.prompt_tokens.shape[1], host.completion_bucket
    prefill, decode = programs(cfg, mesh, engine=engine, filtered=top_k > 0 or top_p < 1.0, kv_dtype=kv_dtype)
    copy_to = src_rows if group_size > 1 and engine != "shared" else None
    cache_len, windows = cache_plan(engine, tp, tc, decode_phases)
    cache, logits0 = prefill(params, *prompt_arrays, copy_to, cache_len=cache_len)
    decode_params = feature_major_weights(cfg, params) if engine == "feature_major" else params
    tokens, mask, logps, finished, steps, _ = decode(
        decode_params, cache, logits0, prompt_lens, row_ids, row_valid, key,
        np.float32(temperature), np.int32(top_k), np.float32(top_p), np.int32(max_new_tokens), stop_mask,
        np.int32(pad_id), num_cols=tc, windows=windows)

    # -- host: strip dummy rows and the unused columns of the completion bucket
    rows = len(prompts) * group_size
    if tokens.shape != (rows, max_new_tokens):
        tokens, mask, logps = (x[:rows, :max_new_tokens] for x in (tokens, mask, logps))
        finished = finished[:rows]
    # Each sample row's prompt is its prefill slot's.
    prompt_tokens, prompt_mask = (x[host.src_rows[:rows]] for x in (host.prompt_tokens, host.prompt_mask))
    if mesh is None:
        prompt_tokens, prompt_mask = jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask)
    else:
        prompt_tokens, prompt_mask = (to_global(x, batch_sharding(mesh, 2, rows))
                                      for x in (prompt_tokens, prompt_mask))
    rollout = Rollout(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens, mask=mask,
                      logprobs=logps, lengths=mask.sum(axis=1, dtype=jnp.int32), finished=finished)
    info = SampleInfo(num_prompts=len(prompts), group_size=group_size, prompt_bucket=tp,
                      completion_bucket=tc, prompt_rows=host.prompt_tokens.shape[0],
                      sample_rows=host.src_rows.shape[0], decode_steps=int(steps))
    return rollout, info
