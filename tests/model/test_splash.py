"""model.attention=splash: jax's Pallas splash kernel (grpo_jax.model.splash) against the model's
own attention, in Pallas' interpreter on a CPU mesh; its refusal off TPU; the train step
with it compiled for a TPU ahead of time."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from grpo_jax import aot
from grpo_jax.model import transformer as model, splash
from grpo_jax.rl import programs
from grpo_jax.config import ConfigError, apply_overrides, get_preset
from grpo_jax.sampler import Sampler
from grpo_jax.parallel.sharding import mesh_from_shape, on_mesh

B, T, H, K, D = 2, 100, 4, 2, 32  # T: not a multiple of 128, so the kernel pads the end


def _cache_layout_attention(q, k, v, allowed):
    """model.attend_many on [B,T,H,D] / [B,T,K,D] inputs -> [B,T,H,D]."""
    out = model.attend_many(q.reshape(B, T, K, H // K, D), jnp.transpose(k, (0, 2, 3, 1)),
                            jnp.swapaxes(v, 1, 2), allowed)
    return out.reshape(B, T, H, D)


def test_splash_equals_the_models_attention_with_left_padding_and_gqa():
    """On a (data 2, tensor 2) mesh: at every real query the kernel's output and the
    gradients of a loss that ignores pad queries (dq, dk, dv) are `_attend_many`'s; a pad
    query attends to the pads at or before it (itself at least), finite."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, D)), jnp.float32) for n in (H, K, K))
    # Row 0: 10 left pads (prompt) and 5 right pads (after the completion); row 1: 40 left pads.
    real = np.ones((B, T), bool)
    real[0, :10] = real[0, -5:] = False
    real[1, :40] = False
    mask = jnp.asarray(real)
    causal = np.tril(np.ones((T, T), bool))[None]
    allowed = jnp.asarray(causal & real[:, None, :])  # the model's mask
    same_segment = jnp.asarray(causal & (real[:, :, None] == real[:, None, :]))
    w = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32) * mask[:, :, None, None]

    def with_grads(f):
        return jax.jit(lambda *x: (f(*x), jax.grad(lambda *y: jnp.sum(f(*y) * w), argnums=(0, 1, 2))(*x)))

    mesh = mesh_from_shape((2, 1, 2))
    assert splash.specs(mesh, q.shape, k.shape)[:2] == (P("data", None, "tensor", None),) * 2
    with on_mesh(mesh):
        out, grads = with_grads(lambda *x: splash.attention(*x, mask, interpret=True))(q, k, v)
    ref, ref_grads = with_grads(lambda *x: _cache_layout_attention(*x, allowed))(q, k, v)
    np.testing.assert_allclose(np.where(real[:, :, None, None], out, 0),
                               np.where(real[:, :, None, None], ref, 0), atol=2e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-6)
    np.testing.assert_allclose(out, _cache_layout_attention(q, k, v, same_segment), atol=2e-6)


def test_splash_keeps_packed_sequences_apart():
    """Row 0 packs two sequences (positions 0-39 and 40-89, then 10 pads), row 1 one of 100
    tokens (rl.pack, grpo_jax.model.packing): with their segment ids the kernel's output and
    gradients at every real query are the model's attention with its segment mask."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, D)), jnp.float32) for n in (H, K, K))
    segments = np.ones((B, T), np.int32)
    segments[0, 40:90], segments[0, 90:] = 2, 0
    real = segments > 0
    causal = np.tril(np.ones((T, T), bool))[None]
    allowed = jnp.asarray(causal & real[:, None, :] & (segments[:, :, None] == segments[:, None, :]))
    w = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32) * jnp.asarray(real)[:, :, None, None]

    def with_grads(f):
        return jax.jit(lambda *x: (f(*x), jax.grad(lambda *y: jnp.sum(f(*y) * w), argnums=(0, 1, 2))(*x)))

    out, grads = with_grads(lambda *x: splash.attention(*x, jnp.asarray(real), segments=jnp.asarray(segments),
                                                        interpret=True))(q, k, v)
    ref, ref_grads = with_grads(lambda *x: _cache_layout_attention(*x, allowed))(q, k, v)
    np.testing.assert_allclose(np.where(real[:, :, None, None], out, 0), np.where(real[:, :, None, None], ref, 0),
                               atol=2e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-6)


def test_heads_stay_whole_when_the_kv_heads_do_not_divide_over_tensor():
    mesh = mesh_from_shape((2, 1, 2))
    assert splash.specs(mesh, (B, T, H, D), (B, T, 1, D)) == (
        P("data", None, None, None), P("data", None, None, None), P("data", None))


def test_block_sizes_divide_the_padded_sequence():
    assert [splash.padded_length(t) for t in (1, 128, 129, 1279)] == [128, 128, 256, 1280]
    assert [splash.block_sizes(n).block_q for n in (128, 256, 384, 1280, 2048)] == [128, 256, 128, 256, 512]
    with pytest.raises(ValueError, match="multiples of 128"):
        splash.block_sizes(100)


def test_splash_off_tpu_is_refused():
    cfg = apply_overrides(get_preset("cpu-tiny"), ["model.attention=splash"])
    tokens = jnp.ones((1, 8), jnp.int32)
    params = model.init_params(cfg.model, jax.random.key(0))
    with pytest.raises(ConfigError, match="model.attention=splash runs on TPU only; .* compiled for cpu"):
        model.forward_logits(cfg.model, params, tokens)
    with pytest.raises(ConfigError, match="model.attention=splash runs on TPU only"):
        programs.train_step(cfg, mesh_from_shape((1, 2, 1)))
    with pytest.raises(ConfigError, match="model.attention='flash' is not one of"):
        apply_overrides(cfg, ["model.attention=flash"]).validate()
    # The sampler runs over a KV cache, where attention is the model's own: shared programs.
    xla = dataclasses.replace(cfg.model, attention="xla")
    splash_call = Sampler.for_run(cfg).call(2, 2, 16)
    xla_call = Sampler.for_run(dataclasses.replace(cfg, model=xla)).call(2, 2, 16)
    assert splash_call.prefill is xla_call.prefill and splash_call.decode is xla_call.decode


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu not installed (pip install -r requirements-tpu.txt)")
def test_train_step_with_splash_compiles_for_a_tpu():
    """cpu-tiny (head_dim 32, 32 + 64 - 1 tokens padded to 128) on v5e:2x2: the splash
    kernels (forward, dq, dkv) are in the compiled step; the default step has none."""
    cfg = apply_overrides(get_preset("cpu-tiny"), ["data.batch_size=2"])  # 4 rows per chip
    mesh, _ = aot.topology_mesh(cfg, "v5e:2x2")
    rows = cfg.data.batch_size * cfg.rl.group_size
    assert "tpu_custom_call" not in aot.lower_train_step(cfg, mesh, rows, 32).as_text()
    compiled, _ = aot.compile_train_step(apply_overrides(cfg, ["model.attention=splash"]), mesh, rows, 32)
    text = compiled.as_text()
    for kernel in ("splash_mha_fwd_segmented", "splash_mha_dq_segmented", "splash_mha_dkv_segmented"):
        assert kernel in text, kernel
