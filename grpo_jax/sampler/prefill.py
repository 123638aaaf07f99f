"""The prefill program: the prompts once through the model, filling the KV cache, then each
prompt's cache and first-token logits given to its rows (group sampling shares the prefill).
"""

from __future__ import annotations

import collections

import jax.numpy as jnp
from jax.sharding import Mesh

from grpo_jax import loops
from grpo_jax.model import transformer as model_lib
from grpo_jax.config import ModelConfig
from grpo_jax.sampler import cache as cache_lib
from grpo_jax.sampler.engines import DecodeEngine

TRACE_COUNTS: collections.Counter = collections.Counter()  # "prefill" / "decode" -> traces


def prefill(cfg: ModelConfig, mesh: Mesh | None, engine: DecodeEngine, kv_dtype: str, params, prompt_tokens,
            prompt_mask, src_rows, *, cache_len: int, chunk_tokens: int | None = None):
    """Prompts [Pp,Tp] -> (cache with Bp rows, logits [Bp,V] for the first new token).

    The Pp prompts go through the model once; sample row r then gets a copy of prompt row
    src_rows[r]'s cache and logits (None: the rows are the prompts, or the engine reads the
    prompts' cache in place). The layers run as a `lax.scan`: with Tp tokens per row,
    slicing each layer's weights out of the stacked arrays once is negligible, and
    unrolling measured no faster but compiles slower.

    The prompts run against a cache of their own Tp slots, handed on `cache_len` long in
    the engine's form (``DecodeEngine.prefill_cache``): attending over the empty completion
    slots too would make the prefill attention (Tp + new tokens) / Tp times larger for
    nothing (they are masked out). The prefill runs in the engine's row chunks, one after
    the other (``DecodeEngine.prefill_chunks``; `chunk_tokens` overrides its chunk size,
    for benchmarks). The cache is stored in ``kv_dtype`` (``rl.kv_dtype``, ``cache.dtype``)."""
    TRACE_COUNTS["prefill"] += 1
    num_prompts, tp = prompt_tokens.shape
    chunks = engine.prefill_chunks(num_prompts, tp, chunk_tokens)
    dtype = cache_lib.dtype(cfg, kv_dtype)
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
    cache = engine.prefill_cache(cache, cache_len)
    logits = model_lib.logits_from_hidden(cfg, params, last)
    if src_rows is not None:
        cache, logits = cache_lib.copy_to_rows(cache, logits, src_rows, mesh)
    return cache_lib.constrain_cache(cache), cache_lib.constrain_rows(logits)


def _prompt_forward(cfg: ModelConfig, params, prompt_tokens, prompt_mask, dtype):
    """Prompts [P, Tp] through the model against a cache of their own Tp slots, stored in
    ``dtype`` -> (the last column's hidden state [P, E], the cache)."""
    cache = cache_lib.constrain_cache(model_lib.init_cache(cfg, prompt_tokens.shape[0], prompt_tokens.shape[1], dtype))
    positions = model_lib.default_positions(prompt_mask)
    hidden, cache = model_lib.forward_hidden(cfg, params, prompt_tokens, prompt_mask, positions,
                                             cache=cache, unroll=False)
    # Left padding: every row's last prompt token is in the last column.
    return hidden[:, -1], cache
