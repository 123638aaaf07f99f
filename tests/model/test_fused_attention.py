"""model.attention=cudnn: jax.nn.dot_product_attention (grpo_jax.model.fused_attention) against the
model's own attention, with jax's XLA implementation on CPU; its wiring into the model; its
refusal off GPU and with float32 compute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.model import fused_attention, transformer as model
from grpo_jax.rl import programs
from grpo_jax.config import ConfigError, apply_overrides, get_preset
from grpo_jax.sampler import Sampler
from grpo_jax.parallel.sharding import mesh_from_shape

B, T, H, K, D = 2, 48, 4, 2, 16


def _models_attention(q, k, v, allowed):
    """model.attend_causal (the model's no-cache attention) on [B,T,H,D] / [B,T,K,D] inputs."""
    out = model.attend_causal(q.reshape(B, T, K, H // K, D), jnp.transpose(k, (0, 2, 3, 1)),
                              jnp.swapaxes(v, 1, 2), allowed, model.causal_blocks(T))
    return out.reshape(B, T, H, D)


def _qkv(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(B, T, n, D)), dtype) for n in (H, K, K))


def _with_grads(f, w):
    return jax.jit(lambda *x: (f(*x), jax.grad(lambda *y: jnp.sum(f(*y) * w), argnums=(0, 1, 2))(*x)))


@pytest.mark.parametrize("packed", [False, True])
def test_equals_the_models_attention_with_padding_gqa_and_packing(packed):
    """Row 0: 6 left pads (its prompt's) and 5 right pads, or (packed) two sequences and pads;
    row 1: 20 left pads. At every real query the output and the gradients of a loss that
    ignores pad queries equal the model's; every output is finite."""
    q, k, v = _qkv(0)
    real = np.ones((B, T), bool)
    segments = None
    if packed:
        seg = np.ones((B, T), np.int32)
        seg[0, 20:40], seg[0, 40:] = 2, 0
        real = seg > 0
        segments = jnp.asarray(seg)
    else:
        real[0, :6] = real[0, -5:] = False
    real[1, :20] = False
    allowed = np.tril(np.ones((T, T), bool))[None] & real[:, None, :]
    if packed:
        allowed &= seg[:, :, None] == seg[:, None, :]
    w = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H, D)), jnp.float32) * real[:, :, None, None]
    out, grads = _with_grads(lambda *x: fused_attention.attention(*x, jnp.asarray(real), segments=segments,
                                                                  implementation="xla"), w)(q, k, v)
    ref, ref_grads = _with_grads(lambda *x: _models_attention(*x, jnp.asarray(allowed)), w)(q, k, v)
    keep = real[:, :, None, None]
    np.testing.assert_allclose(np.where(keep, out, 0), np.where(keep, ref, 0), atol=2e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-6)
    assert np.isfinite(np.asarray(out)).all()


def test_the_model_with_cudnn_attention_computes_the_models_logits(monkeypatch):
    """The cache-free forward with model.attention=cudnn goes through fused_attention (here
    with jax's XLA implementation, this being a CPU): the same logits at real tokens as the
    model's own attention, in bfloat16 compute; a forward with a cache keeps the model's."""
    calls, original = [], fused_attention.attention

    def on_cpu(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs, implementation="xla")

    monkeypatch.setattr(fused_attention, "attention", on_cpu)
    xla = dataclasses.replace(get_preset("cpu-tiny").model, dtype="bfloat16")
    cudnn = dataclasses.replace(xla, attention="cudnn")
    params = model.init_params(xla, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, xla.vocab_size, (2, 24)), jnp.int32)
    mask = jnp.ones(tokens.shape, bool).at[0, :5].set(False)
    got = model.forward_logits(cudnn, params, tokens, mask)
    want = model.forward_logits(xla, params, tokens, mask)
    assert calls
    real = np.asarray(mask)[:, :, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=0.05 * float(np.abs(want).max()))
    # The sampler runs over a KV cache, where attention is the model's own: shared programs.
    cfg = apply_overrides(get_preset("cpu-tiny"), ["model.dtype=bfloat16"])
    fused, plain = (Sampler.for_run(c).call(2, 4, 16) for c in (cfg.replace(model={"attention": "cudnn"}), cfg))
    assert (fused.prefill, fused.decode) == (plain.prefill, plain.decode)


def test_cudnn_is_refused_off_gpu_and_with_float32_compute():
    cfg = apply_overrides(get_preset("cpu-tiny"), ["model.attention=cudnn", "model.dtype=bfloat16"]).validate()
    params = model.init_params(cfg.model, jax.random.key(0))
    with pytest.raises(ConfigError, match="model.attention=cudnn runs on GPU only .* compiled for cpu"):
        model.forward_logits(cfg.model, params, jnp.ones((1, 8), jnp.int32))
    with pytest.raises(ConfigError, match="model.attention=cudnn runs on GPU only"):
        programs.train_step(cfg, mesh_from_shape((1, 2, 1)))
    with pytest.raises(ConfigError, match="needs model.dtype=bfloat16 or float16"):
        apply_overrides(get_preset("cpu-tiny"), ["model.attention=cudnn"]).validate()
