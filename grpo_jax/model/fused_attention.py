"""cuDNN's fused flash attention, as jax ships it (``jax.nn.dot_product_attention``), for the
forward passes without a KV cache (training, scoring), chosen by ``model.attention=cudnn``.

The model's own attention (``model.attend_causal``) writes each layer's [B, K, G, T, T] scores
to memory and reads them back for the softmax and the values; the fused kernel keeps a block of
scores on chip, skips the blocks above the causal diagonal, and saves only each row's
log-sum-exp for its backward pass. jax picks cuDNN only on a GPU, so the choice is refused
elsewhere at start-up (``require_gpu``, like ``splash`` off TPU); the same function with
``implementation="xla"`` is jax's reference computation, which the tests compare with the
model's attention on CPU.

Masking. ``is_causal`` gives the kernel the causal mask (the blocks it skips). The rest of the
model's ``allowed`` keys, real tokens only and, for packed rows (``rl.pack``), the query's own
sequence, reaches it as a boolean [B, 1, T, T] mask, which jax turns into an additive bias
(cuDNN's one way to take an arbitrary mask; its length-based padding masks assume every row's
tokens start at 0, and a row here starts with its prompt's left padding). A pad query sees no
allowed key: its output is finite and the loss masks it out.

Dtypes: cuDNN's kernels take bfloat16 or float16 (``ModelConfig.validate`` refuses
``model.dtype=float32`` with cudnn).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.errors import ConfigError


# Sequence lengths are padded to a multiple of this: cuDNN's training kernels with a mask (a
# bias) refuse odd lengths (a train step's 767 = prompt + completion - 1 positions), and its
# flash kernels work in tiles of 64 positions.
_TILE = 64


def require_gpu(platform: str) -> None:
    """ConfigError unless the program is compiled for a GPU (jax's cuDNN attention)."""
    if platform != "gpu":
        raise ConfigError(f"model.attention=cudnn runs on GPU only (cuDNN); this program is compiled for "
                          f"{platform}: use model.attention=xla")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array, *,
              segments: jax.Array | None = None, implementation: str = "cudnn") -> jax.Array:
    """Causal grouped-query attention by ``jax.nn.dot_product_attention``. q [B,T,H,D], k/v
    [B,T,K,D], key_mask [B,T] bool (real tokens), segments [B,T] int32 (packed sequences' ids,
    0 on padding) -> [B,T,H,D] in q's dtype:

        out_t = Σ_{s <= t, allowed} softmax_s(q_t·k_s / sqrt(D)) v_s

    ``implementation``: "cudnn" (refused off GPU, ``require_gpu``) or "xla"."""
    if implementation == "cudnn":
        mesh = jax.sharding.get_abstract_mesh()
        require_gpu(mesh.abstract_device.platform if not mesh.empty else jax.devices()[0].platform)
    b, t = key_mask.shape
    pad = -t % _TILE
    if pad:  # cuDNN refuses an odd length with a mask; padded keys are masked, padded queries cut off
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        segments = None if segments is None else jnp.pad(segments, ((0, 0), (0, pad)))
        key_mask = jnp.pad(key_mask, ((0, 0), (0, pad)))
    out = _masked_causal(q, k, v, key_mask, segments, implementation)
    return out[:, :t] if pad else out


def _masked_causal(q, k, v, key_mask, segments, implementation):
    b, t = key_mask.shape
    allowed = key_mask.astype(bool)[:, None, None, :]
    if segments is not None:
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    mask = jnp.broadcast_to(allowed, (b, 1, t, t))
    return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, is_causal=True,
                                        implementation=implementation)
