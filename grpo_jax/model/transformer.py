"""Llama-family decoder (Flax Linen): RMSNorm, RoPE, grouped-query attention, SwiGLU, KV cache.

Every parameter is declared once with its logical axes (`vocab, embed, heads, kv_heads,
head_dim, mlp, layers, norm`); `grpo_jax.parallel.sharding.LOGICAL_RULES` maps them to the mesh.
Layers are one `nn.scan` (parameters stacked on a leading `layers` axis) whether the loop
is rolled (training: compile time, memory) or fully unrolled (decoding on CPU, where the
step measured faster without the loop: benchmarks/NOTES.md, "Figures behind code
comments"); the parameter tree is the same either way.

Attention masking works on cache *slots*: a query in slot q attends to key slot k when
k <= q and slot k holds a real token. Without a cache the slots are the sequence
positions. RoPE uses explicit per-token positions, so left-padded prompts get position 0
at their first real token. With ``model.attention=splash`` a forward pass without a cache
(training, scoring) runs jax's Pallas TPU kernel instead (`grpo_jax.model.splash`), with
``model.attention=cudnn`` cuDNN's fused attention on GPU (`grpo_jax.model.fused_attention`); a real
token's output is the same.

Building blocks other modules compute with (the feature-major decode step, the splash
kernel's checks, benchmarks), so that every path computes what the model computes:
`product` / `operand` (a matmul with a weight as the layer holds it), `attend`,
`attend_scored`, `attend_many`, `attend_causal`, `attend_with_prefix` and `slot_attention`
(attention over cache slots), `rope_tables` / `rope`, and `NEG` (a masked key's score).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from grpo_jax.model import fused_attention, splash
from grpo_jax import loops
from grpo_jax.config import ModelConfig
from grpo_jax.parallel.sharding import DTYPES, constrain, logical_to_sharding

Params = Any
NEG = -1e30  # finite: a fully masked row (a pad query) must give a uniform softmax, not NaN


@flax.struct.dataclass
class KVCache:
    """Keys/values for every layer. k: [layers, batch, kv_heads, head_dim, max_len];
    v: [layers, batch, kv_heads, max_len, head_dim]; mask: [batch, max_len] (slot holds a real
    token); index: next slot to write: a scalar (every row writes the same slot), or [batch]
    (each row its own: the slot engine, ``grpo_jax.sampler.slots``; `write_at`).

    Heads come first so that each (row, kv head) is one contiguous block, and k is stored
    transposed, so that a decode step's two attention matmuls, q [G,D] x k [D,S] and
    probs [G,S] x v [S,D], read the cache as it lies. With [.., max_len, kv_heads, ..] XLA
    transposed the whole cache of every layer at every step (benchmarks/NOTES.md, "Figures
    behind code comments").

    An int8 cache (``init_cache(..., dtype=jnp.int8)``) also holds k_scale and v_scale
    [layers, batch, kv_heads, max_len] float32: each slot's key and value of a head are
    stored as int8 times that scale (``quantize_kv``), and every read dequantizes them."""

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    index: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dtype = jnp.dtype(DTYPES[cfg.dtype] if dtype is None else dtype)
    v_shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    k_shape = (cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, max_len)
    scales = {}
    if dtype == jnp.int8:
        scale_shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len)
        scales = {"k_scale": jnp.zeros(scale_shape, jnp.float32), "v_scale": jnp.zeros(scale_shape, jnp.float32)}
    # Separate buffers for k and v so both can be donated to the decode step.
    return KVCache(k=jnp.zeros(k_shape, dtype), v=jnp.zeros(v_shape, dtype),
                   mask=jnp.zeros((batch, max_len), bool), index=jnp.zeros((), jnp.int32), **scales)


def quantize_kv(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """x -> (int8 round(x / scale), scale float32) with one scale per vector along ``axis``
    (a head's key or value in one slot): max |x| / 127, so that vector's largest entry
    is exact and every entry is within scale / 2. An all-zero vector gets scale 0."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=axis) / 127.0
    safe = jnp.expand_dims(jnp.where(scale > 0, scale, 1.0), axis)
    return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale


def dequantize_kv(x: jax.Array, scale: jax.Array | None, axis: int, dt) -> jax.Array:
    """A cache read in the compute dtype dt: x itself, or int8 x times its ``scale``
    broadcast along ``axis`` (``quantize_kv``)."""
    if scale is None:
        return x.astype(dt)
    return (x.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dt)


@flax.struct.dataclass
class PrefixCache:
    """The keys/values of P prompts that the decode's B = P·r rows share, r consecutive rows
    per prompt slot (row b reads slot b // r): k [layers, P, kv_heads, head_dim, Tp],
    v [layers, P, kv_heads, Tp, head_dim] (``KVCache``'s layouts), mask [P, Tp]. Read-only
    while decoding; the rows' own tokens go to a ``KVCache`` of completion slots."""

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    k_scale: jax.Array | None = None  # [layers, P, kv_heads, Tp] of an int8 cache (``KVCache``)
    v_scale: jax.Array | None = None


def _param(module: nn.Module, name: str, shape, axes, init, cfg: ModelConfig):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape,
                        DTYPES[cfg.param_dtype])


def adapted_weight(w: jax.Array, a: jax.Array, b: jax.Array, alpha: float) -> jax.Array:
    """A weight with its LoRA adapter (Hu et al. 2021, Eq. 3, in the x·W convention):

        W' = W + (alpha / r)·A·B,   w [*in, *out], a [*in, r], b [r, *out] -> [*in, *out]

    summed in the wider of the two dtypes and rounded once to w's dtype (a bfloat16 base
    meets float32 adapters without rounding A·B first). B = 0 gives W exactly."""
    delta = (alpha / a.shape[-1]) * jnp.tensordot(a, b, axes=1)
    return (w + delta).astype(w.dtype)


def _adapter(module: nn.Module, name: str) -> tuple[jax.Array, jax.Array] | None:
    """The LoRA adapter (A, B) of the weight ``name`` when the params carry one
    (``{name}_lora_a`` / ``{name}_lora_b`` beside it, ``grpo_jax.model.lora.policy_params``)."""
    if not module.has_variable("params", f"{name}_lora_a"):
        return None
    return tuple(module.get_variable("params", f"{name}_lora_{part}") for part in "ab")


def adapted_product(spec: str, x: jax.Array, w: jax.Array, adapter, alpha: float, dt) -> jax.Array:
    """einsum(spec, x, W') for W' = W + (alpha / r)·A·B (`adapted_weight`), computed as

        x·W + (alpha / r)·(x·A)·B,   spec "x,w->y"; a [*in, r], b [r, *out] (w's axes split)

    so that the backward pass forms dx, dA and dB only: through a merged W' autodiff forms
    the full [in, out] gradient of every adapted weight (a third of a full fine-tune's
    matmul work) and the scan keeps each layer's merged copy for it. ``adapter`` None is
    the plain product."""
    y = product(spec, x, operand(w, dt))
    if adapter is None:
        return y
    a, b = adapter
    (x_axes, w_axes), y_axes = spec.split("->")[0].split(","), spec.split("->")[1]
    w_in, w_out = w_axes[:a.ndim - 1], w_axes[a.ndim - 1:]
    h_axes = "".join(c for c in x_axes if c not in w_in) + "z"
    h = product(f"{x_axes},{w_in}z->{h_axes}", x, operand(a, dt))
    return y + (alpha / a.shape[-1]) * product(f"{h_axes},z{w_out}->{y_axes}", h, operand(b, dt))


class RMSNorm(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        scale = _param(self, "scale", (x.shape[-1],), ("norm",), nn.initializers.ones, self.cfg)
        return rms_norm(x, scale, self.cfg.rms_eps)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """x / rms(x) * scale over the feature ``axis`` of x (-1: [..., E]; the feature-major
    decode's 0: [E, B]), computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    scale = scale.astype(jnp.float32)
    if axis % x.ndim != x.ndim - 1:
        scale = scale.reshape((-1,) + (1,) * (x.ndim - 1 - axis % x.ndim))
    return (y * scale).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, scaling: float) -> tuple[jax.Array, jax.Array]:
    """positions [B,T] -> (cos, sin), each [B,T,1,D/2] float32, shared by every layer."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = (positions.astype(jnp.float32) / scaling)[..., None] * inv_freq  # [B,T,D/2]
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rope(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary embedding, rotate-half convention (as HF Llama). x: [B,T,H,D], tables from
    `rope_tables`."""
    cos, sin = tables
    d = x.shape[-1]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attend(q, k, v, allowed):
    """Grouped-query attention. q [B,T,K,G,D] (G query heads per kv head), k [B,K,D,S],
    v [B,K,S,D] (the cache layouts), allowed [B,T,S] -> [B,T,K,G,D].

    A decode step (T = 1) folds the G query heads into the rows of one [G, D] x [D, S] matmul
    per (row, kv head), so both dots are plain row-major matmuls over the cache as it lies;
    written like the T > 1 case, XLA's CPU backend transposes the scores and falls back to a
    slow dot for probs x v. For long T (training, prefill) the general form below is the
    faster one, so it stays there (benchmarks/NOTES.md, "Figures behind code comments").
    """
    if q.shape[1] == 1:
        return attend_scored(jnp.einsum("bkgd,bkds->bkgs", q[:, 0], k).astype(jnp.float32), v, allowed)
    return attend_many(q, k, v, allowed)


def attend_scored(scores, v, allowed):
    """The rest of a decode step's attention: unscaled scores q·k [B,K,G,S] float32,
    v [B,K,S,D], allowed [B,1,S] -> [B,1,K,G,D] in v's dtype."""
    scores = scores / jnp.sqrt(v.shape[-1]).astype(jnp.float32)
    scores = jnp.where(allowed[:, :, None, :], scores, NEG)  # [B,1,1,S]: same keys for all heads
    # Softmax with the division after the second matmul: it divides [B,K,G,D] values instead
    # of [B,K,G,S], fewer whenever the cache has more slots than a head has dimensions.
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    out = jnp.einsum("bkgs,bksd->bkgd", weights.astype(v.dtype), v).astype(jnp.float32)
    return (out / jnp.sum(weights, axis=-1, keepdims=True)).astype(v.dtype)[:, None]


def attend_with_prefix(q, k, v, allowed, pk, pv, prefix_mask):
    """One new token's attention over its prompt slot's shared keys and its own cache, as
    one softmax: q [B,1,K,G,D], k [B,K,D,S], v [B,K,S,D], allowed [B,1,S], pk [P,K,D,Tp],
    pv [P,K,Tp,D], prefix_mask [P,Tp] with B = P·r (rows b·r .. b·r+r-1 share slot b)
    -> [B,1,K,G,D]. The r rows of a slot meet its keys in one [r·G, D] x [D, Tp] product,
    so the prompt's cache is read once per slot, not once per row."""
    b, _, kh, g, d = q.shape
    p, tp = prefix_mask.shape
    r = b // p
    scale = jnp.sqrt(d).astype(jnp.float32)
    qp = q[:, 0].reshape(p, r, kh, g, d)
    sp = jnp.einsum("prkgd,pkds->prkgs", qp, pk).astype(jnp.float32) / scale
    sp = jnp.where(prefix_mask[:, None, None, None, :], sp, NEG)
    sc = jnp.einsum("bkgd,bkds->bkgs", q[:, 0], k).astype(jnp.float32) / scale
    sc = jnp.where(allowed[:, :, None, :], sc, NEG)  # [B,1,1,S]: same keys for all heads
    top = jnp.maximum(jnp.max(sp, axis=-1).reshape(b, kh, g), jnp.max(sc, axis=-1))[..., None]
    ep = jnp.exp(sp - top.reshape(p, r, kh, g, 1))
    ec = jnp.exp(sc - top)
    out = (jnp.einsum("prkgs,pksd->prkgd", ep.astype(pv.dtype), pv,
                      preferred_element_type=jnp.float32).reshape(b, kh, g, d)
           + jnp.einsum("bkgs,bksd->bkgd", ec.astype(v.dtype), v, preferred_element_type=jnp.float32))
    total = jnp.sum(ep, axis=-1).reshape(b, kh, g, 1) + jnp.sum(ec, axis=-1, keepdims=True)
    return (out / total).astype(v.dtype)[:, None]


def _scores(q, k, allowed):
    """[B,K,G,T,S] float32 scaled scores, NEG where a key is not allowed."""
    scores = jnp.einsum("btkgd,bkds->bkgts", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1]).astype(jnp.float32)
    return jnp.where(allowed[:, None, None, :, :], scores, NEG)


def _softmax_parts(q, k, allowed):
    """exp(scores − max) [B,K,G,T,S], the max and the sum of that exp [B,K,G,T,1]."""
    scores = _scores(q, k, allowed)
    top = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - top)
    return e, top, jnp.sum(e, axis=-1, keepdims=True)


@jax.custom_vjp
def attend_many(q, k, v, allowed):
    """`attend` for T > 1 (training, prefill), with the backward pass written out: it
    keeps only each row's softmax max and sum and recomputes the probabilities, where
    autodiff kept two [B,K,G,T,S] float32 arrays per layer, zero-filled and copied at every
    step: quadratic in the sequence length, where the max and sum are linear."""
    return _attend_many_fwd(q, k, v, allowed)[0]


def _attend_many_fwd(q, k, v, allowed):
    e, top, total = _softmax_parts(q, k, allowed)
    out = jnp.einsum("bkgts,bksd->btkgd", (e / total).astype(q.dtype), v)
    return out, (q, k, v, allowed, out, top, total)


def _attend_many_bwd(res, d_out):
    q, k, v, allowed, out, top, total = res
    probs = jnp.exp(_scores(q, k, allowed) - top) / total
    d_v = jnp.einsum("bkgts,btkgd->bksd", probs.astype(q.dtype), d_out)
    d_probs = jnp.einsum("btkgd,bksd->bkgts", d_out, v).astype(jnp.float32)
    # softmax backward: p ⊙ (dp − Σ_s p dp), and Σ_s p dp = Σ_d out · d_out
    row = jnp.einsum("btkgd,btkgd->bkgt", out.astype(jnp.float32), d_out.astype(jnp.float32))
    d_scores = probs * (d_probs - row[..., None])
    d_scores = jnp.where(allowed[:, None, None, :, :], d_scores, 0.0)
    d_scores = (d_scores / jnp.sqrt(q.shape[-1]).astype(jnp.float32)).astype(q.dtype)
    d_q = jnp.einsum("bkgts,bkds->btkgd", d_scores, k)
    d_k = jnp.einsum("bkgts,btkgd->bkds", d_scores, q)
    return d_q, d_k, d_v, None


attend_many.defvjp(_attend_many_fwd, _attend_many_bwd)

# Query blocks of a forward pass without a cache (training, scoring): block i of n needs keys
# up to its own last row only, which skips (n - 1) / 2n of the score and softmax work.
_CAUSAL_BLOCKS = 4
_MIN_CAUSAL_BLOCK = 32


def causal_blocks(seq_len: int) -> int:
    """How many query blocks `attend_causal` splits a cache-free forward of seq_len into
    (1: it does not)."""
    return max(1, min(_CAUSAL_BLOCKS, seq_len // _MIN_CAUSAL_BLOCK))


def attend_causal(q, k, v, allowed, num_blocks: int):
    """`attend_many` where key slot s is allowed for query t only if s <= t (a forward
    pass without a cache, slots = token indices), with the queries in num_blocks row
    blocks, each over the keys up to its last row. q [B,T,K,G,D], k [B,K,D,T],
    v [B,K,T,D], allowed [B,T,T]. A real query's keys all lie in its block's range, so its
    output is `attend_many`'s up to rounding; a pad query (no allowed key) averages its
    block's values instead of all T."""
    t = q.shape[1]
    bounds = [round(i * t / num_blocks) for i in range(num_blocks + 1)]
    return jnp.concatenate([
        attend_many(q[:, lo:hi], k[..., :hi], v[:, :, :hi], allowed[:, lo:hi, :hi])
        for lo, hi in zip(bounds[:-1], bounds[1:])], axis=1)


def product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum(spec, a, b), one operand a weight as the layer holds it (see `operand`). A
    bfloat16 weight meeting float32 activations (the sampler's ``rl.sample_dtype=bfloat16``
    copy under float32 compute) is not upcast: the product rounds the activations to bf16
    and sums in float32, as a TPU's matmul unit does, which lets XLA's CPU dot run its bf16
    kernels. ``sampler.feature_major`` uses it too, so every sampling path computes the same thing."""
    if {a.dtype, b.dtype} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}:
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)
    return jnp.einsum(spec, a, b)


def operand(w: jax.Array, dt) -> jax.Array:
    """A weight as `product` takes it: cast to the compute dtype dt, except a bfloat16
    weight under float32 compute, which stays bf16."""
    return w if w.dtype == jnp.bfloat16 and dt == jnp.float32 else w.astype(dt)


def cache_layer(cache: KVCache, prefix: PrefixCache | None = None) -> dict:
    """The per-layer view `slot_attention` takes (stacked on a leading layers axis when
    the layers scan over it): {"k", "v", "k_scale", "v_scale"} of the rows' own cache,
    plus {"pk", "pv", "pk_scale", "pv_scale"} of a shared prompt cache."""
    kv = {"k": cache.k, "v": cache.v, "k_scale": cache.k_scale, "v_scale": cache.v_scale}
    if prefix is not None:
        kv.update(pk=prefix.k, pv=prefix.v, pk_scale=prefix.k_scale, pv_scale=prefix.v_scale)
    return kv


def write_at(buf: jax.Array, x: jax.Array, index: jax.Array, axis: int) -> jax.Array:
    """buf [B, ...] with x [B, ...] written along ``axis`` from slot ``index`` on: a scalar
    (one slice update for every row), or [B] (row b from index[b]: a row-wise scatter,
    what a slot engine's rows at different positions need)."""
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice_in_dim(buf, x, index, axis=axis)
    put = lambda b, xb, i: jax.lax.dynamic_update_slice_in_dim(b, xb, i, axis=axis - 1)
    return jax.vmap(put)(buf, x, index)


def query_slots(index: jax.Array, batch: int, t: int) -> jax.Array:
    """[B, T] cache slots of a call's T tokens written from ``index`` (`write_at`'s)."""
    return jnp.reshape(index, (-1, 1)) + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))


def _write_slots(kv: dict, k, v, write_index) -> dict:
    """This call's k [B,K,D,T] and v [B,K,T,D] written into the cache layer's slots
    write_index... (a scalar or per row, `write_at`; quantized first when the cache is
    int8) -> the layer's k, v and scales."""
    put = write_at
    if kv["k_scale"] is None:
        return {"k": put(kv["k"], k.astype(kv["k"].dtype), write_index, axis=3),
                "v": put(kv["v"], v.astype(kv["v"].dtype), write_index, axis=2), "k_scale": None, "v_scale": None}
    (k8, ks), (v8, vs) = quantize_kv(k, 2), quantize_kv(v, 3)
    return {"k": put(kv["k"], k8, write_index, axis=3), "v": put(kv["v"], v8, write_index, axis=2),
            "k_scale": put(kv["k_scale"], ks, write_index, axis=2),
            "v_scale": put(kv["v_scale"], vs, write_index, axis=2)}


def slot_attention(q, k, v, q_slot, key_mask, kv, write_index, dt, prefix_mask=None, segments=None):
    """The model's own attention over cache slots (module docstring). q [B,T,H,D], k/v
    [B,T,K,D] (this call's tokens, in slots write_index...), q_slot [B,T], key_mask [B,S],
    kv: one layer of `cache_layer` (with a shared prompt's keys for one token,
    `attend_with_prefix`, prefix_mask [P,Tp]), or None (then S = T); segments [B,T]
    (no cache only): a query sees only keys of its own segment (packed sequences,
    `grpo_jax.model.packing`)
    -> (out [B,T,H,D], the updated {"k", "v", "k_scale", "v_scale"} or None).
    Attention reads the cache as stored: an int8 cache's keys and values dequantized,
    this call's tokens included."""
    k, v = jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)  # the cache layouts
    new_kv = None
    if kv is not None:
        # Named scopes split a decode step's profile into parts (benchmarks/profile_ops.py).
        with jax.named_scope("cache_update"):
            new_kv = _write_slots(kv, k, v, write_index)
    with jax.named_scope("attend"):
        if kv is not None:
            k = dequantize_kv(new_kv["k"], new_kv["k_scale"], 2, dt)
            v = dequantize_kv(new_kv["v"], new_kv["v_scale"], 3, dt)
        else:
            k, v = k.astype(dt), v.astype(dt)
        b, t, h, d = q.shape
        s = k.shape[3]
        allowed = (jnp.arange(s)[None, None, :] <= q_slot[:, :, None]) & key_mask[:, None, :]  # [B,T,S]
        if segments is not None:
            allowed = allowed & (segments[:, :, None] == segments[:, None, :])
        q = q.reshape(b, t, k.shape[1], h // k.shape[1], d)
        blocks = causal_blocks(t) if kv is None else 1
        if kv is not None and kv.get("pk") is not None:
            chex.assert_axis_dimension(q, 1, 1)
            out = attend_with_prefix(q, k, v, allowed, dequantize_kv(kv["pk"], kv["pk_scale"], 2, dt),
                                     dequantize_kv(kv["pv"], kv["pv_scale"], 3, dt), prefix_mask)
        elif blocks > 1:
            out = attend_causal(q, k, v, allowed, blocks)
        else:
            out = attend(q, k, v, allowed)
    return out.reshape(b, t, h, d), new_kv


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, rope_cs, q_slot, key_mask, kv, write_index, prefix_mask=None, segments=None):
        """kv: None (no cache) or this layer's `cache_layer` (with a shared prompt's part
        for a one-token decode, ``PrefixCache``; prefix_mask [P, Tp]); segments [B, T]:
        packed sequences' ids (no cache only, `slot_attention`)."""
        cfg = self.cfg
        dt = DTYPES[cfg.dtype]
        init = nn.initializers.normal(0.02)
        wq = _param(self, "q", (cfg.embed_dim, cfg.num_heads, cfg.head_dim), ("embed", "heads", "head_dim"), init, cfg)
        wk = _param(self, "k", (cfg.embed_dim, cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"), init, cfg)
        wv = _param(self, "v", (cfg.embed_dim, cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"), init, cfg)
        wo = _param(self, "o", (cfg.num_heads, cfg.head_dim, cfg.embed_dim), ("heads", "head_dim", "embed"), init, cfg)
        alpha = cfg.lora_alpha
        q, k, v = (adapted_product("bte,ehd->bthd", x, w, _adapter(self, name), alpha, dt)
                   for name, w in zip("qkv", (wq, wk, wv)))
        if cfg.attention_bias:
            zeros = nn.initializers.zeros
            q = q + _param(self, "q_bias", (cfg.num_heads, cfg.head_dim), ("heads", "head_dim"), zeros, cfg).astype(dt)
            k = k + _param(self, "k_bias", (cfg.num_kv_heads, cfg.head_dim), ("kv_heads", "head_dim"), zeros, cfg).astype(dt)
            v = v + _param(self, "v_bias", (cfg.num_kv_heads, cfg.head_dim), ("kv_heads", "head_dim"), zeros, cfg).astype(dt)
        q = rope(q, rope_cs)
        k = rope(k, rope_cs)
        if kv is None and cfg.attention == "splash":
            out, new_kv = splash.attention(q, k, v, key_mask, segments=segments), None
        elif kv is None and cfg.attention == "cudnn":
            out, new_kv = fused_attention.attention(q, k, v, key_mask, segments=segments), None
        else:
            out, new_kv = slot_attention(q, k, v, q_slot, key_mask, kv, write_index, dt, prefix_mask, segments)
        b, t, h, d = q.shape
        # One contracting dim of h*d: with two (h, d) XLA transposed the weight at every call.
        adapter = _adapter(self, "o")
        if adapter is not None:
            adapter = (adapter[0].reshape(h * d, -1), adapter[1])
        return adapted_product("btf,fe->bte", out.reshape(b, t, h * d), wo.reshape(h * d, -1), adapter,
                               alpha, dt), new_kv


@jax.custom_vjp
def swiglu(x, gate, up, down):
    """SwiGLU feed-forward: x [..., E], gate/up [E, F], down [F, E] -> [..., E].

        y = (silu(x·gate) ⊙ (x·up)) · down

    The backward pass is written out (`_swiglu_bwd`) rather than left to autodiff: from
    autodiff, XLA's CPU backend writes the SiLU derivative in a transposed layout (a
    scalar, strided loop; benchmarks/NOTES.md, "Figures behind code comments") and keeps four
    [tokens, F] residuals per layer; written out, it keeps the two pre-activations and
    recomputes the SiLU from them next to six matmuls.
    """
    a, b = _swiglu_preactivations(x, gate, up)
    return product("...f,fe->...e", jax.nn.silu(a) * b, down)


def _swiglu_preactivations(x, gate, up):
    return product("...e,ef->...f", x, gate), product("...e,ef->...f", x, up)


def _swiglu_fwd(x, gate, up, down):
    a, b = _swiglu_preactivations(x, gate, up)
    return product("...f,fe->...e", jax.nn.silu(a) * b, down), (x, a, b, gate, up, down)


def _swiglu_bwd(res, dy):
    x, a, b, gate, up, down = res
    s = jax.nn.sigmoid(a)
    silu = a * s
    # [E,F] then transposed: as "...f,...e->fe", XLA's CPU backend computed silu·b (exp
    # included) in a transposed layout for the matmul, as a scalar loop (benchmarks/NOTES.md,
    # "Figures behind code comments").
    d_down = jnp.einsum("...e,...f->ef", dy, silu * b).T
    dh = jnp.einsum("...e,fe->...f", dy, down)
    db = dh * silu
    da = dh * b * s * (1 + a * (1 - s))  # d silu(a)/da = s (1 + a (1 − s))
    d_gate = jnp.einsum("...e,...f->ef", x, da)
    d_up = jnp.einsum("...e,...f->ef", x, db)
    dx = jnp.einsum("...f,ef->...e", da, gate) + jnp.einsum("...f,ef->...e", db, up)
    # bf16 weights under float32 compute get float32 gradients; cotangents keep the
    # primals' dtypes (a no-op otherwise).
    return (dx.astype(x.dtype), d_gate.astype(gate.dtype), d_up.astype(up.dtype),
            d_down.astype(down.dtype))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _thin(x, adapter):
    """x·A [..., r] of one adapter (A [in, r]), or None without one."""
    return None if adapter is None else product("...i,ir->...r", x, adapter[0])


def _lora_linear(x, w, h, adapter, scale):
    """x·W + scale·h·B for h = x·A (`adapted_product` for a 2-D weight)."""
    y = product("...i,io->...o", x, w)
    return y if adapter is None else y + scale * product("...r,ro->...o", h, adapter[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def swiglu_lora(scale, x, gate, up, down, adapters):
    """`swiglu` with LoRA on its weights: adapters is one (A [in, r], B [r, out]) or None
    per weight (gate, up, down), and each product is x·W + scale·(x·A)·B. The backward is
    written out, as `swiglu`'s is: it keeps x, the two pre-activations and the thin
    [..., r] products, and forms the adapters' gradients and dx, never a gradient of the
    frozen [E, F] weights (autodiff would keep a third [..., F] residual for B of down)."""
    return _swiglu_lora_fwd(scale, x, gate, up, down, adapters)[0]


def _swiglu_lora_fwd(scale, x, gate, up, down, adapters):
    lg, lu, ld = adapters
    hg, hu = _thin(x, lg), _thin(x, lu)
    a, b = _lora_linear(x, gate, hg, lg, scale), _lora_linear(x, up, hu, lu, scale)
    m = jax.nn.silu(a) * b
    y = _lora_linear(m, down, _thin(m, ld), ld, scale)
    return y, (x, a, b, hg, hu, gate, up, down, adapters)


def _swiglu_lora_bwd(scale, res, dy):
    x, a, b, hg, hu, gate, up, down, (lg, lu, ld) = res
    s = jax.nn.sigmoid(a)
    silu = a * s
    m = silu * b
    dm = jnp.einsum("...e,fe->...f", dy, down)
    d_ld = None
    if ld is not None:
        d_hd = scale * jnp.einsum("...e,re->...r", dy, ld[1])
        d_ld = (jnp.einsum("...f,...r->fr", m, d_hd), scale * jnp.einsum("...r,...e->re", _thin(m, ld), dy))
        dm = dm + jnp.einsum("...r,fr->...f", d_hd, ld[0])
    db = dm * silu
    da = dm * b * s * (1 + a * (1 - s))  # d silu(a)/da = s (1 + a (1 − s))
    dx = jnp.einsum("...f,ef->...e", da, gate) + jnp.einsum("...f,ef->...e", db, up)
    grads = []
    for d, h, adapter in ((da, hg, lg), (db, hu, lu)):
        if adapter is None:
            grads.append(None)
            continue
        dh = scale * jnp.einsum("...f,rf->...r", d, adapter[1])
        grads.append((jnp.einsum("...e,...r->er", x, dh), scale * jnp.einsum("...r,...f->rf", h, d)))
        dx = dx + jnp.einsum("...r,er->...e", dh, adapter[0])
    grads.append(d_ld)
    cast = tuple(None if g is None else (g[0].astype(p[0].dtype), g[1].astype(p[1].dtype))
                 for g, p in zip(grads, (lg, lu, ld)))
    # The frozen weights get no cotangent (None: zero), so nothing forms one.
    return dx.astype(x.dtype), None, None, None, cast


swiglu_lora.defvjp(_swiglu_lora_fwd, _swiglu_lora_bwd)


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dt = DTYPES[cfg.dtype]
        init = nn.initializers.normal(0.02)
        gate = _param(self, "gate", (cfg.embed_dim, cfg.mlp_dim), ("embed", "mlp"), init, cfg)
        up = _param(self, "up", (cfg.embed_dim, cfg.mlp_dim), ("embed", "mlp"), init, cfg)
        down = _param(self, "down", (cfg.mlp_dim, cfg.embed_dim), ("mlp", "embed"), init, cfg)
        weights = (operand(gate, dt), operand(up, dt), operand(down, dt))
        adapters = tuple(None if ab is None else (operand(ab[0], dt), operand(ab[1], dt))
                         for ab in (_adapter(self, name) for name in ("gate", "up", "down")))
        if all(ab is None for ab in adapters):
            return swiglu(x, *weights)
        return swiglu_lora(cfg.lora_alpha / cfg.lora_rank, x, *weights, adapters)


class Block(nn.Module):
    """One pre-norm decoder layer; the scan carry is the residual stream."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, kv, aux):
        rope_cs, q_slot, key_mask, write_index, prefix_mask, segments = aux
        h, new_kv = Attention(self.cfg, name="attn")(
            RMSNorm(self.cfg, name="attn_norm")(x), rope_cs, q_slot, key_mask, kv, write_index, prefix_mask,
            segments)
        x = x + h
        x = x + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, name="mlp_norm")(x))
        # The residual stream between layers: rows over ('data', 'fsdp'), per the rules table.
        return constrain(x, ("batch", "seq", "embed")), new_kv


_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Transformer(nn.Module):
    """Decoder trunk. `value_head` adds a scalar-per-token head (value / reward models).
    `unroll` (None: from cfg.scan_layers) fully unrolls the layer scan."""

    cfg: ModelConfig
    value_head: bool = False
    unroll: bool | None = None

    def setup(self):
        cfg = self.cfg
        self.embedding = self.param(
            "embedding", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
            (cfg.vocab_size, cfg.embed_dim), DTYPES[cfg.param_dtype])
        block = Block
        if cfg.remat != "none":
            block = nn.remat(Block, prevent_cse=False, policy=_REMAT_POLICIES[cfg.remat])
        unroll = ((not cfg.scan_layers) if self.unroll is None else self.unroll) or loops.unrolling()
        self.layers = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(0, nn.broadcast), length=cfg.num_layers,
            unroll=cfg.num_layers if unroll else 1,
            metadata_params={nn.PARTITION_NAME: "layers"})(cfg, name="layers")
        self.final_norm = RMSNorm(cfg, name="final_norm")
        if not cfg.tie_embeddings:
            self.lm_head = self.param(
                "lm_head", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "vocab")),
                (cfg.embed_dim, cfg.vocab_size), DTYPES[cfg.param_dtype])
        if self.value_head:
            self.value_kernel = self.param(
                "value_head", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed",)),
                (cfg.embed_dim,), DTYPES[cfg.param_dtype])
            self.value_bias = self.param(
                "value_bias", nn.with_logical_partitioning(nn.initializers.zeros, ()), (), DTYPES[cfg.param_dtype])

    def __call__(self, tokens, positions, mask, cache: KVCache | None = None, rope_cs=None,
                 prefix: PrefixCache | None = None, segments=None):
        """tokens, positions: [B,T] int32; mask: [B,T] bool (real tokens); rope_cs: the
        `rope_tables` of `positions` when the caller has them (else computed here); prefix:
        a shared prompt cache the rows attend to before their own ``cache`` (decode, T = 1);
        segments: [B,T] int32 ids of packed sequences (no cache), attention stays inside each.
        Returns (hidden [B,T,E] after the final norm, updated cache or None)."""
        if segments is not None and cache is not None:
            raise ValueError("segments are for a forward pass without a cache (packed sequences)")
        dt = DTYPES[self.cfg.dtype]
        with jax.named_scope("embed"):  # the profile's parts (benchmarks/profile_ops.py), as in slot_attention
            x = jnp.take(self.embedding, tokens, axis=0).astype(dt)
        b, t = tokens.shape
        if cache is None:
            write_index = jnp.zeros((), jnp.int32)
            key_mask = mask
            kv = None
        else:
            write_index = cache.index
            with jax.named_scope("cache_update"):
                key_mask = write_at(cache.mask, mask, write_index, axis=1)
            kv = cache_layer(cache, prefix)
        q_slot = query_slots(write_index, b, t)
        if rope_cs is None:
            cfg = self.cfg
            rope_cs = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor)
        prefix_mask = None if prefix is None else prefix.mask
        x, new_kv = self.layers(x, kv, (rope_cs, q_slot, key_mask, write_index, prefix_mask, segments))
        hidden = self.final_norm(x)
        new_cache = None
        if cache is not None:
            new_cache = KVCache(mask=key_mask, index=write_index + t, **new_kv)
        return hidden, new_cache


# ----------------------------------------------------------------------------- functional API

def _module(cfg: ModelConfig, value_head: bool = False, unroll: bool | None = None) -> Transformer:
    return Transformer(cfg, value_head=value_head, unroll=unroll)


def _init_boxed(cfg: ModelConfig, key: jax.Array, value_head: bool):
    """The boxed parameters, from a one-token forward. The parameters do not depend on the
    attention kernel, and this forward is traced wherever shapes are asked for (on the
    host, for an ahead-of-time TPU compile too), so it runs the model's own."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    cfg = dataclasses.replace(cfg, attention="xla")
    return _module(cfg, value_head).init(key, tokens, tokens, jnp.ones((1, 1), bool))["params"]


def param_logical_axes(cfg: ModelConfig, value_head: bool = False) -> Any:
    """Pytree (same structure as params) of logical-axis-name tuples."""
    boxed = jax.eval_shape(functools.partial(_init_boxed, cfg, value_head=value_head), jax.random.key(0))
    return jax.tree.map(lambda b: tuple(b.names), boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def param_shapes(cfg: ModelConfig, value_head: bool = False) -> Any:
    boxed = jax.eval_shape(functools.partial(_init_boxed, cfg, value_head=value_head), jax.random.key(0))
    return nn.meta.unbox(boxed)


def param_shardings(cfg: ModelConfig, mesh: Mesh, value_head: bool = False) -> Any:
    """NamedSharding for every parameter, derived from its logical axes and the rules table."""
    axes = param_logical_axes(cfg, value_head)
    shapes = param_shapes(cfg, value_head)
    return jax.tree.map(lambda a, s: logical_to_sharding(a, s.shape, mesh), axes, shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def init_params(cfg: ModelConfig, key: jax.Array, mesh: Mesh | None = None, *, value_head: bool = False) -> Params:
    """Random parameters, created directly in their shards when a mesh is given (the init
    runs under jit with out_shardings, so no device ever holds the whole model)."""
    return _initializer(cfg, mesh, value_head)(key)


@functools.lru_cache(maxsize=16)
def _initializer(cfg: ModelConfig, mesh: Mesh | None, value_head: bool):
    """One compiled init per (model, mesh, head): tracing the flax modules and compiling
    their initializers costs far more than running the compiled init on a fresh key."""
    fn = lambda k: nn.meta.unbox(_init_boxed(cfg, k, value_head))
    out = None if mesh is None else param_shardings(cfg, mesh, value_head)
    return jax.jit(fn, out_shardings=out)


def default_positions(mask: jax.Array) -> jax.Array:
    """RoPE positions that start at 0 on each row's first real token (left or right padding)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def forward_hidden(cfg: ModelConfig, params: Params, tokens: jax.Array, mask: jax.Array | None = None,
                   positions: jax.Array | None = None, cache: KVCache | None = None,
                   *, unroll: bool | None = None, rope_cs=None,
                   prefix: PrefixCache | None = None, segments: jax.Array | None = None
                   ) -> tuple[jax.Array, KVCache | None]:
    """tokens [B,T] int32 -> (hidden [B,T,E], cache). mask defaults to all real tokens;
    segments [B,T] int32: several sequences per row, each attending only to its own tokens
    (`grpo_jax.model.packing`; pass their positions too).

    rope_cs: `rope_tables(positions, ...)` computed by the caller. The decode loop passes
    them sliced from tables made once before the loop: computed inside the step, XLA's CPU
    backend fuses the sin and cos into every layer's rotation of q and k and evaluates them
    again there for every head at every step (benchmarks/NOTES.md, "Figures behind code comments")."""
    chex.assert_rank(tokens, 2)
    mask = jnp.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
    chex.assert_equal_shape([tokens, mask])
    positions = default_positions(mask) if positions is None else positions
    value_head = "value_head" in params
    return _module(cfg, value_head, unroll).apply({"params": params}, tokens, positions, mask, cache, rope_cs,
                                                  prefix, segments)


def unembedding(cfg: ModelConfig, params: Params) -> tuple[jax.Array, bool]:
    """The unembedding as stored and whether it is vocab-major: ``(embedding [V,E], True)``
    when tied, else ``(lm_head [E,V], False)`` (``logprobs.token_logprobs``'s arguments).
    Contracted as it lies: a transposed copy of a tied embedding would cost a [E,V] copy per
    call (the sampler paid it on every rollout) and its gradient a transpose per log-prob
    chunk."""
    if cfg.tie_embeddings:
        return params["embedding"], True
    return params["lm_head"], False


def logits_from_hidden(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> logits [..., vocab] float32 (the unembedding as `unembedding` gives it),
    from float32 operands, or with ``cfg.unembed_dtype`` bfloat16 from bf16-rounded ones summed
    in float32 (`product`'s rule, which a bfloat16 sampling copy takes anyway)."""
    w, vocab_major = unembedding(cfg, params)
    with jax.named_scope("unembed"):  # the profile's parts (benchmarks/profile_ops.py)
        if cfg.unembed_dtype == "bfloat16":
            w = w.astype(jnp.bfloat16)
        return product("...e,ve->...v" if vocab_major else "...e,ev->...v", hidden.astype(jnp.float32),
                       operand(w, jnp.float32))


def forward_logits(cfg: ModelConfig, params: Params, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Causal forward without cache: tokens [B,T] int32 -> logits [B,T,vocab] float32."""
    hidden, _ = forward_hidden(cfg, params, tokens, mask)
    logits = logits_from_hidden(cfg, params, hidden)
    chex.assert_shape(logits, tokens.shape + (cfg.vocab_size,))
    return logits


def value_outputs(params: Params, hidden: jax.Array) -> jax.Array:
    """Scalar head: hidden [B,T,E] -> [B,T] float32 (values or rewards per token)."""
    return hidden.astype(jnp.float32) @ params["value_head"].astype(jnp.float32) + params["value_bias"]


def add_value_head(cfg: ModelConfig, params: Params, key: jax.Array, mesh: Mesh | None = None) -> Params:
    """A copy of `params` with a freshly initialised value head (reward / value model from a policy)."""
    fresh = init_params(cfg, key, mesh, value_head=True)
    out = dict(params)
    out["value_head"] = fresh["value_head"]
    out["value_bias"] = fresh["value_bias"]
    return out


def count_params(params: Params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
