"""The feature-major engine's decode step: activations stored ``[E, B]``, for one CPU device.

The same layer as ``model.Block`` with a KV cache and one new token per row, written so
that every dense matmul is ``W [out, in] @ x [in, B] -> [out, B]``: the long weight
dimension becomes the kernel's row dimension and the few batch rows its columns. XLA's CPU
backend (YNNPACK dots, jax 0.10) ran that orientation faster than ``x [B, in] @
W [in, out]`` for B of 8-64 on every CPU measured, by a margin that depends on the CPU
(``python benchmarks/bench_layouts.py`` times both; benchmarks/NOTES.md, "Figures behind
code comments"). Asking for the transposed product of row-major activations is not enough:
XLA folds the transpose back into the dot, so the orientation is kept by storing the
activations transposed and by an optimization barrier at the two places they must be rows
(the per-head attention, which reads the cache in its ``model.KVCache`` layout).

Why this layer is not ``model.Block`` itself: the model's blocks are Linen modules whose
products are written for row-major activations ``[B, T, E]`` with ``[in, out]`` weights;
running them feature-major would mean a second orientation threaded through every module
of the model for one CPU engine, the fast path growing into a second model. So the layer is
written here from the model's own functions (``model.rms_norm``, ``model.rope``,
``model.attend`` / ``attend_scored``, ``model.product`` / ``operand``: its numerics), and
only its orientation and weight layout are its own; ``tests/sampler/test_feature_major.py`` holds it
equal to the model's forward.

Its weights are ``[out, in]`` copies of the parameters (``decode_weights``), which the
engine makes once per policy and reuses while the params are the same arrays
(``weights.HeldWeights``): one pass over the weights, against one per token for the steps.
On meshes and on TPU the sampler runs the model's own forward, whose layouts the TPU
compiler chooses itself and which keeps no second copy of the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.model import transformer as model_lib
from grpo_jax.config import ModelConfig
from grpo_jax.parallel.sharding import DTYPES


def decode_weights(cfg: ModelConfig, params) -> dict:
    """The decode step's weights from ``params`` (the model's tree): per layer, the q/k/v
    projections as ``[heads·head_dim, E]``, the output projection ``[E, heads·head_dim]``,
    gate and up ``[F, E]``, down ``[E, F]``, the norm scales and biases; the embedding
    ``[V, E]``, the final norm and the unembedding ``[V, E]`` (the embedding itself when
    tied). In the parameters' dtype: the step casts them to the compute dtype where it uses
    them, as the model does, so that a bfloat16 sampling copy stays half the bytes."""
    e = cfg.embed_dim

    def layer(i):
        p = jax.tree.map(lambda x: x[i], params["layers"])
        a, m = p["attn"], p["mlp"]
        w = {"q": a["q"].reshape(e, -1).T, "k": a["k"].reshape(e, -1).T, "v": a["v"].reshape(e, -1).T,
             "o": a["o"].reshape(-1, e).T, "gate": m["gate"].T, "up": m["up"].T, "down": m["down"].T}
        w["attn_norm"], w["mlp_norm"] = p["attn_norm"]["scale"], p["mlp_norm"]["scale"]
        if cfg.attention_bias:
            w.update({f"{k}_bias": a[f"{k}_bias"].reshape(-1, 1) for k in "qkv"})
        return w

    unembed, vocab_major = model_lib.unembedding(cfg, params)
    return {"layers": [layer(i) for i in range(cfg.num_layers)], "embedding": params["embedding"],
            "final_norm": params["final_norm"]["scale"],
            "unembedding": unembed if vocab_major else unembed.T}


def dense(w, x, dt):
    """w [out, in] @ x [in, B] -> [out, B], by the model's rule (``model.product``): a
    bfloat16 weight under float32 compute meets bf16-rounded activations and sums in float32."""
    return model_lib.product("oi,ib->ob", model_lib.operand(w, dt), x)


def embed(table, tokens):
    """table [V, E] rows at tokens [B]. A bfloat16 table is gathered as its 16-bit patterns:
    XLA's CPU backend has no bf16 gather and would convert the whole table to float32 (a
    [V, E] float32 temporary) in every decode call to take B rows of it."""
    if table.dtype != jnp.bfloat16:
        return jnp.take(table, tokens, axis=0)
    bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), tokens, axis=0)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def _to_rows(x):
    """[N, B] -> [B, N]; the barrier keeps XLA from turning the dot that made x back."""
    return jax.lax.optimization_barrier(x).T


def to_features(x, bf16: bool):
    """[B, N] -> [N, B] for the next dot.

    float32: a layout change only (XLA lowers a transpose to one), so the dot reads the
    rows as they lie: YNNPACK's float32 dot is fastest so. bfloat16: a real transpose,
    written as a product with the identity (exact, B² · N multiply-adds) because that is
    the one way to make XLA move the data: YNNPACK's bf16 dot needs its right operand
    row-major [N, B], and XLA's operand upcaster turns a bf16 dot without it into a
    float32 one over float32 copies of the weights (slower than float32 throughout:
    benchmarks/NOTES.md, "Figures behind code comments").
    """
    if bf16:
        return jnp.einsum("bn,bc->nc", x, jnp.eye(x.shape[0], dtype=x.dtype),
                          precision=jax.lax.Precision.HIGHEST)
    return jax.lax.optimization_barrier(x.T)


def step(cfg: ModelConfig, weights: dict, ks: list, vs: list, cache_mask, index, tokens, real,
         rope_cs) -> tuple[jax.Array, list, list, jax.Array]:
    """One decode step for B rows, each with one new token.

    ks / vs: per-layer cache buffers ([B, K, D, S] / [B, K, S, D], ``model.KVCache``'s
    layouts); cache_mask [B, S]; index: the slot the new token is written to (a scalar, or
    one per row [B]: ``model.write_at``);
    tokens, real: [B] (real: the token is not padding); rope_cs: ``model.rope_tables`` of
    the tokens' positions, each [B, 1, 1, D/2].
    Returns (logits [V, B] float32 — vocab-major —, ks, vs, the cache mask with the new slot).
    """
    s = ks[0].shape[-1]
    bf16 = weights["unembedding"].dtype == jnp.bfloat16
    # The named scopes are the model's (slot_attention, logits_from_hidden): a step's profile
    # splits into the same parts whichever engine ran it (benchmarks/profile_ops.py).
    with jax.named_scope("embed"):
        x = to_features(embed(weights["embedding"], tokens).astype(DTYPES[cfg.dtype]), bf16)  # [E, B]
    with jax.named_scope("cache_update"):
        key_mask = model_lib.write_at(cache_mask, real[:, None], index, axis=1)
    allowed = ((jnp.arange(s) <= model_lib.query_slots(index, tokens.shape[0], 1)) & key_mask)[:, None, :]  # [B, 1, S]
    new_ks, new_vs = [], []
    for w, k_cache, v_cache in zip(weights["layers"], ks, vs):
        x, k_cache, v_cache = _layer(cfg, w, x, k_cache, v_cache, index, allowed, rope_cs, bf16)
        new_ks.append(k_cache)
        new_vs.append(v_cache)
    with jax.named_scope("final_norm"):
        hidden = model_lib.rms_norm(x, weights["final_norm"], cfg.rms_eps, axis=0)
    with jax.named_scope("unembed"):
        unembed = weights["unembedding"]
        if cfg.unembed_dtype == "bfloat16":  # as model.logits_from_hidden
            unembed = unembed.astype(jnp.bfloat16)
        logits = dense(unembed, hidden.astype(jnp.float32), jnp.float32)
    return logits, new_ks, new_vs, key_mask


SUMMED_SCORES_FROM = 16


def attend(q, k, v, allowed):
    """``model.attend`` for one new token: q [B, K, G, D], caches as ``model.KVCache``,
    allowed [B, 1, S] -> [B, 1, K, G, D].

    From SUMMED_SCORES_FROM rows on, `attend_summed`; below, the model's two dots.
    """
    if q.shape[0] < SUMMED_SCORES_FROM:
        return model_lib.attend(q[:, None], k, v, allowed)
    return attend_summed(q, k, v, allowed)


def attend_summed(q, k, v, allowed):
    """`attend` (q [B, K, G, D], k [B, K, D, S], v [B, K, S, D], allowed [B, 1, S]
    -> [B, 1, K, G, D]) with the scores as a product summed over the head dimension instead of
    B·K small [G, D] x [D, S] dots: one fused loop over the cache as it lies, where the dot
    kernel spends its time per small product, which pays off only once there are enough
    rows. ``python benchmarks/bench_layouts.py`` times both forms (benchmarks/NOTES.md,
    "Figures behind code comments").
    """
    scores = jnp.sum(q[..., None].astype(jnp.float32) * k[:, :, None].astype(jnp.float32), axis=3)
    return model_lib.attend_scored(scores, v, allowed)


@jax.named_scope("layers")  # the model's op names, for benchmarks/profile_ops.py
def _layer(cfg: ModelConfig, w: dict, x, k_cache, v_cache, index, allowed, rope_cs, bf16: bool):
    """One pre-norm decoder layer on x [E, B]: (x, k_cache, v_cache) after it."""
    dt = DTYPES[cfg.dtype]
    b = x.shape[1]
    h, kh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    with jax.named_scope("attn"):
        y = model_lib.rms_norm(x, w["attn_norm"], cfg.rms_eps, axis=0)
        q, k, v = (dense(w[n], y, dt) for n in "qkv")  # [H·D, B], [K·D, B], [K·D, B]
        if cfg.attention_bias:
            q, k, v = (t + w[f"{n}_bias"].astype(dt) for t, n in zip((q, k, v), "qkv"))
        q = model_lib.rope(_to_rows(q).reshape(b, 1, h, d), rope_cs)
        k = model_lib.rope(_to_rows(k).reshape(b, 1, kh, d), rope_cs)[:, 0]  # [B, K, D]
        v = _to_rows(v).reshape(b, kh, 1, d)
        with jax.named_scope("cache_update"):
            k_cache = model_lib.write_at(k_cache, k[..., None].astype(k_cache.dtype), index, axis=3)
            v_cache = model_lib.write_at(v_cache, v.astype(v_cache.dtype), index, axis=2)
        with jax.named_scope("attend"):
            out = attend(q.reshape(b, kh, h // kh, d), k_cache.astype(dt), v_cache.astype(dt), allowed)
        x = x + dense(w["o"], to_features(out.reshape(b, h * d), bf16), dt)
    with jax.named_scope("mlp"):
        y = model_lib.rms_norm(x, w["mlp_norm"], cfg.rms_eps, axis=0)
        x = x + dense(w["down"], jax.nn.silu(dense(w["gate"], y, dt)) * dense(w["up"], y, dt), dt)
    return x, k_cache, v_cache
