"""The sampler's KV cache: its layouts (stacked, or a buffer per layer), its sharding, its
dtype (int8 with scales: ``model.quantize_kv``), the copy of a prompt's cache to its rows,
and the windows a phased decode grows it through.

A stacked cache is ``model.KVCache`` (k [L, B, K, D, S], v [L, B, K, S, D], mask [B, S], an
int8 cache's scales [L, B, K, S], a scalar index); a per-layer cache holds lists of L arrays
in place of k, v and the scales, so that a decode step writes one slot of one layer's
buffer, never the stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from grpo_jax.model import transformer as model_lib
from grpo_jax.config import ModelConfig
from grpo_jax.sampler.settings import DECODE_PHASES
from grpo_jax.parallel.sharding import DTYPES, batch_degree, batch_sharding, constrain, logical_to_sharding, replicated

# The logical axes of a stacked cache's arrays (its index is a scalar).
AXES = {"k": ("layers", "batch", "kv_heads", "head_dim", "seq"),
        "v": ("layers", "batch", "kv_heads", "seq", "head_dim"),
        "mask": ("batch", "seq"),
        "k_scale": ("layers", "batch", "kv_heads", "seq"),
        "v_scale": ("layers", "batch", "kv_heads", "seq")}
LAYERED = ("k", "v", "k_scale", "v_scale")  # the arrays with a leading layers axis
SLOT_AXIS = {"k": -1, "v": -2, "mask": -1, "k_scale": -1, "v_scale": -1}


def arrays(cache: model_lib.KVCache) -> dict:
    """{name: array} of a cache's arrays other than its index (no scales unless int8)."""
    return {name: getattr(cache, name) for name in AXES if getattr(cache, name) is not None}


def sharding(mesh: Mesh, cache: model_lib.KVCache) -> model_lib.KVCache:
    """The shardings of a stacked cache on ``mesh``, by the rules table: rows over
    ('data', 'fsdp'), kv heads over 'tensor', a scalar index replicated (a per-row one
    like the rows)."""
    index = replicated(mesh) if jnp.ndim(cache.index) == 0 else logical_to_sharding(("batch",), cache.index.shape, mesh)
    return cache.replace(index=index, **{
        name: logical_to_sharding(AXES[name], x.shape, mesh) for name, x in arrays(cache).items()})


def constrain_cache(cache: model_lib.KVCache) -> model_lib.KVCache:
    """A stacked cache constrained to `sharding` on the mesh being traced under
    (``sharding.constrain``); unchanged without one (a per-layer cache of the feature-major
    engine only exists there)."""
    return cache.replace(index=constrain(cache.index, ("batch",) * jnp.ndim(cache.index)), **{
        name: constrain(x, AXES[name]) for name, x in arrays(cache).items()})


def constrain_rows(x):
    """x [B, ...] with its rows sharded like the batch (``sharding.constrain``)."""
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def dtype(cfg: ModelConfig, kv_dtype: str):
    """The cache dtype for ``rl.kv_dtype`` (checked by ``engines.resolve``): auto is the
    model's compute dtype."""
    return jnp.dtype(DTYPES[cfg.dtype] if kv_dtype == "auto" else kv_dtype)


def _pad(x, axis: int, slots: int):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, slots - x.shape[axis])
    return jnp.pad(x, widths)


def pad_slots(cache: model_lib.KVCache, slots: int) -> model_lib.KVCache:
    """A stacked cache with S padded by empty slots to ``slots``."""
    return cache.replace(**{name: _pad(x, SLOT_AXIS[name], slots) for name, x in arrays(cache).items()})


def per_layer(cache: model_lib.KVCache) -> model_lib.KVCache:
    """A stacked cache as a per-layer one."""
    return cache.replace(**{name: [x[i] for i in range(x.shape[0])]
                            for name, x in arrays(cache).items() if name in LAYERED})


def stacked(cache: model_lib.KVCache) -> model_lib.KVCache:
    """A per-layer cache stacked again."""
    return cache.replace(**{name: jnp.stack(x) for name, x in arrays(cache).items() if name in LAYERED})


def resize_slots(cache: model_lib.KVCache, slots: int) -> model_lib.KVCache:
    """A per-layer cache (k [B,K,D,S], v [B,K,S,D] per layer, an int8 cache's scales
    [B,K,S] per layer, mask [B,S]) with S padded by empty slots to ``slots``."""
    return cache.replace(mask=_pad(cache.mask, -1, slots), **{
        name: [_pad(x, SLOT_AXIS[name], slots) for x in xs] for name, xs in arrays(cache).items() if name in LAYERED})


def copy_to_rows(cache: model_lib.KVCache, logits, src_rows, mesh: Mesh | None):
    """Sample row r gets prefill slot src_rows[r]'s cache and logits. The prompt layouts
    (``layouts``) put every row's slot in the row's own shard, so under a mesh each device
    copies from its own block (a shard_map with block-local indices): no cache bytes cross
    devices. A per-layer cache is only made without a mesh."""
    def take(parts, logits, src):
        return ({name: jnp.take(x, src, axis=1 if name in LAYERED else 0) for name, x in parts.items()},
                jnp.take(logits, src, axis=0))

    if isinstance(cache.k, list):
        k, v = ([jnp.take(x, src_rows, axis=0) for x in xs] for xs in (cache.k, cache.v))
        mask, logits = jnp.take(cache.mask, src_rows, axis=0), jnp.take(logits, src_rows, axis=0)
        return cache.replace(k=k, v=v, mask=mask), logits
    parts = arrays(cache)
    if mesh is None:
        parts, logits = take(parts, logits, src_rows)
    else:
        cs = arrays(sharding(mesh, cache))
        rows = batch_sharding(mesh, 1, src_rows.shape[0]).spec
        specs = ({name: x.spec for name, x in cs.items()}, batch_sharding(mesh, 2, logits.shape[0]).spec)
        # Slot indices are global; each block starts at shard * (slots per shard).
        per_shard = cache.mask.shape[0] // batch_degree(mesh)
        local = lambda a, lg, src: take(a, lg, src - per_shard * _block_index(mesh, rows[0]))
        parts, logits = jax.shard_map(local, mesh=mesh, in_specs=specs + (rows,),
                                      out_specs=specs)(parts, logits, src_rows)
    return cache.replace(**parts), logits


def _block_index(mesh: Mesh, axes) -> jax.Array:
    """Inside shard_map: this device's block of a dimension sharded over ``axes`` (a mesh
    axis name, a tuple of them, major first, or None)."""
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    index = jnp.int32(0)
    for axis in axes:
        index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
    return index


# Decode phases (feature-major and shared decode): attention reads every cache slot at every
# step, though at step t only the prompt's and t completion slots are filled. So the loop
# runs in up to `rl.decode_phases` phases, each over a cache that ends one phase's share of
# the completion bucket further on. Each phase is one more traced and compiled copy of the
# step. On one CPU more than 4 phases gained nothing measurable (benchmarks/NOTES.md,
# "Figures behind code comments"); on TPU a step is bound by the slots it reads, and more
# phases read fewer empty ones (docs/tpu.md, "Decode phases"). Short completions, where
# attention is a small share, keep one phase.
_MIN_PHASE_SLOTS = 32


def decode_windows(prompt_slots: int, num_cols: int, phases: int = DECODE_PHASES) -> tuple[int, ...]:
    """The cache windows of up to ``phases`` decode phases for a prompt bucket and a
    completion bucket: increasing slot counts, the last one the whole cache
    (prompt_slots + num_cols), each phase at least _MIN_PHASE_SLOTS long."""
    phases = max(1, min(phases, num_cols // _MIN_PHASE_SLOTS))
    return tuple(prompt_slots + num_cols * (i + 1) // phases for i in range(phases))


def phase_steps(windows: tuple[int, ...], num_cols: int, steps: int) -> list[int]:
    """Decode steps each phase runs when none stops early: step s (1..steps) writes slot
    windows[-1] - num_cols + s - 1 and runs in the first phase whose window holds it (the
    loop condition of ``loop.decode``)."""
    tp = windows[-1] - num_cols
    edges = [0] + [min(w - tp, steps) for w in windows]
    return [max(0, b - a) for a, b in zip(edges[:-1], edges[1:])]
