"""Splash attention: jax's Pallas TPU flash-attention kernel
(``jax.experimental.pallas.ops.tpu.splash_attention``) for the forward passes without a KV
cache (training, scoring), chosen by ``model.attention=splash``.

The model's own attention (``model.attend_many``) writes the [B, K, G, T, T] scores to
memory; the kernel streams key blocks through on-chip memory with an online softmax, keeps
only each row's log-sum-exp for its backward kernels, and skips the key blocks the causal
mask hides.

Masking. The kernel takes a static mask (causal here) and'ed with segment ids: query t sees
key s only if s <= t and both carry the same id. The id is the padding mask (1: real token,
0: pad), so a real query sees exactly the model's ``allowed`` keys (the real ones at or
before it) and a pad query sees only pads at or before it -- itself at least, so no row is
fully masked: a pad query's output is the softmax-weighted average of those pads' values,
finite, and the loss masks it out. (The model's own attention gives a pad query an average
of the real values instead; real queries agree.) A packed row (``rl.pack``,
``grpo_jax.model.packing``) gives each of its sequences its own id, so each attends only to itself.

Shapes. Every block size must be a multiple of 128 (the TPU's lane width: the kernel tiles
segment ids and the key dimension in lanes) and divide the sequence; ``padded_length``
rounds the sequence up to a multiple of 128 with pad positions at the end (segment 0, after
every real query, so causally invisible to them), whose outputs are dropped. The blocks
span the whole head_dim, so any head_dim is served. GQA is the kernel's own: its
multi-head variant takes K kv heads for H query heads and gives query head h the kv head
h // (H / K), the model's grouping.

Sharding. The kernel sees one device's whole sequences: ``attention`` wraps it in
``jax.shard_map`` over the mesh being traced under, rows over the batch axes and heads over
'tensor' (when the kv heads divide over it; else every 'tensor' device computes all heads
of its rows), as ``sharding.LOGICAL_RULES`` lays out the activations around it.

Cost counts. The kernel gives its ``pallas_call`` no ``CostEstimate``, so XLA's
``cost_analysis()`` counts neither its FLOPs nor the bytes it reads and writes:
``aot.train_cost`` of a step with splash leaves attention's share out (benchmarks/NOTES.md,
"Splash attention in the train step (AOT)").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

from grpo_jax.errors import ConfigError
from grpo_jax.parallel.sharding import logical_to_spec

LANES = 128
# Largest first: bigger blocks mean fewer grid steps; 512 is the size MaxText defaults to.
_BLOCKS = (512, 256, 128)


def require_tpu(platform: str, *, interpret: bool = False) -> None:
    """ConfigError unless the program is compiled for TPU (the kernel is Mosaic code) or
    ``interpret`` (Pallas' interpreter, any backend: the tests' CPU runs)."""
    if platform != "tpu" and not interpret:
        raise ConfigError(f"model.attention=splash runs on TPU only; this program is compiled for "
                          f"{platform}: use model.attention=xla")


def padded_length(seq_len: int) -> int:
    """The sequence length the kernel runs on: seq_len rounded up to a multiple of 128."""
    return -(-seq_len // LANES) * LANES


def block_sizes(seq_len: int) -> sa.BlockSizes:
    """The largest block in _BLOCKS dividing ``seq_len`` (a multiple of 128), for the
    forward kernel and both backward kernels (dq, and dk/dv)."""
    if seq_len % LANES:
        raise ValueError(f"splash attention runs on multiples of {LANES} tokens, got {seq_len}")
    b = next(b for b in _BLOCKS if seq_len % b == 0)
    return sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                         block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)


def _kernel(num_heads: int, seq_len: int, interpret: bool):
    """The causal kernel for one row: q [H, S, D], k/v [K, S, D], SegmentIds([S], [S]) ->
    [H, S, D]. Built per trace: it holds its block masks as arrays of the trace (the
    kernel package caches the numpy work behind them per shape)."""
    mask = sa.MultiHeadMask([sa.CausalMask((seq_len, seq_len))] * num_heads)
    return sa.make_splash_mha(mask, block_sizes=block_sizes(seq_len), head_shards=1, q_seq_shards=1,
                              interpret=interpret)


def _rows_attention(q, k, v, segments, *, interpret: bool):
    """``attention`` on the rows and heads one device holds (no mesh); segments [B,T] int32."""
    _, t, h, d = q.shape
    n = padded_length(t)

    def heads_first(x):  # [B,T,N,D] -> [B,N,n,D], zero rows appended
        return jnp.swapaxes(jnp.pad(x, ((0, 0), (0, n - t), (0, 0), (0, 0))), 1, 2)

    ids = jnp.pad(segments, ((0, 0), (0, n - t)))  # appended: pads
    # The kernel does not scale the scores: q carries the 1/sqrt(D).
    q = q * jnp.asarray(1 / d ** 0.5, q.dtype)
    out = jax.vmap(_kernel(h, n, interpret))(heads_first(q), heads_first(k), heads_first(v),
                                             sa.SegmentIds(ids, ids))
    return jnp.swapaxes(out, 1, 2)[:, :t]


def specs(mesh, q_shape, kv_shape) -> tuple[P, P, P]:
    """shard_map specs (q and the output, k and v, key_mask): rows per the 'batch' rule,
    heads per 'heads' / 'kv_heads' only when both shard (a query head must find its kv head
    on its own device)."""
    q_spec = logical_to_spec(("batch", "seq", "heads", "head_dim"), q_shape, mesh)
    kv_spec = logical_to_spec(("batch", "seq", "kv_heads", "head_dim"), kv_shape, mesh)
    if q_spec[2] != kv_spec[2]:
        q_spec, kv_spec = P(q_spec[0], None, None, None), P(kv_spec[0], None, None, None)
    return q_spec, kv_spec, P(q_spec[0], None)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array, *,
              segments: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """Causal grouped-query attention by the splash kernel. q [B,T,H,D], k/v [B,T,K,D],
    key_mask [B,T] bool (real tokens) -> [B,T,H,D] in q's dtype:

        out_t = Σ_{s <= t, same segment} softmax_s(q_t·k_s / sqrt(D)) v_s

    The segments are the padding mask (1 real, 0 pad), or ``segments`` [B,T] int32 when
    a row packs several sequences (ids 1, 2, ... and 0 on padding, `grpo_jax.model.packing`).

    On the mesh being traced under (``sharding.on_mesh``), per device in a shard_map; with
    none, on the arrays as they are. ``interpret``: Pallas' interpreter instead of the TPU
    kernel (tests on CPU); without it, ConfigError unless the program is compiled for TPU."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    require_tpu(device.platform if device is not None else jax.devices()[0].platform, interpret=interpret)
    local = functools.partial(_rows_attention, interpret=interpret)
    segments = (key_mask if segments is None else segments).astype(jnp.int32)
    if mesh.empty:
        return local(q, k, v, segments)
    q_spec, kv_spec, mask_spec = specs(mesh, q.shape, k.shape)
    # check_vma=False: Pallas calls do not declare how their outputs vary over the mesh.
    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, mask_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v, segments)
