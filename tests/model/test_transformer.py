"""Model: shapes, causality, padding, GQA, KV cache, scan/remat equivalence."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.model import transformer as model
from grpo_jax.config import ModelConfig

TINY = ModelConfig(vocab_size=97, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64, max_seq_len=64)


# Jitted once per config: op-by-op dispatch of the layer scan costs seconds per call.
_logits = jax.jit(model.forward_logits, static_argnums=0)


def _params(cfg, seed=0, **kw):
    return model.init_params(cfg, jax.random.key(seed), **kw)


@pytest.mark.parametrize("cfg", [
    TINY,
    dataclasses.replace(TINY, num_kv_heads=4),  # multi-head
    dataclasses.replace(TINY, num_kv_heads=1),  # multi-query
    dataclasses.replace(TINY, tie_embeddings=False, attention_bias=True, num_layers=3),
])
def test_output_shapes(cfg):
    params = _params(cfg)
    tokens = jax.random.randint(jax.random.key(1), (3, 7), 0, cfg.vocab_size)
    logits = _logits(cfg, params, tokens)
    assert logits.shape == (3, 7, cfg.vocab_size) and logits.dtype == jnp.float32
    assert params["layers"]["attn"]["k"].shape == (cfg.num_layers, cfg.embed_dim, cfg.num_kv_heads, cfg.head_dim)
    assert ("lm_head" in params) == (not cfg.tie_embeddings)


def test_causal_mask():
    params = _params(TINY)
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, TINY.vocab_size)
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % TINY.vocab_size)
    a = _logits(TINY, params, tokens)
    b = _logits(TINY, params, changed)
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-4


def test_padding_invariance_left_and_right():
    params = _params(TINY)
    seq = jax.random.randint(jax.random.key(2), (1, 6), 1, TINY.vocab_size)
    ref = _logits(TINY, params, seq)[0]
    pad = jnp.full((1, 3), 5, jnp.int32)  # pad tokens with arbitrary ids
    left = jnp.concatenate([pad, seq], 1)
    left_mask = jnp.concatenate([jnp.zeros((1, 3), bool), jnp.ones((1, 6), bool)], 1)
    right = jnp.concatenate([seq, pad], 1)
    right_mask = left_mask[:, ::-1]
    np.testing.assert_allclose(_logits(TINY, params, left, left_mask)[0, 3:], ref, atol=1e-5)
    np.testing.assert_allclose(_logits(TINY, params, right, right_mask)[0, :6], ref, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """GQA with kv_heads < heads is MHA whose k/v heads are repeated per group."""
    gqa = TINY
    mha = dataclasses.replace(TINY, num_kv_heads=TINY.num_heads)
    p = _params(gqa)
    groups = gqa.num_heads // gqa.num_kv_heads
    p_mha = jax.tree.map(lambda x: x, p)
    p_mha["layers"]["attn"]["k"] = jnp.repeat(p["layers"]["attn"]["k"], groups, axis=2)
    p_mha["layers"]["attn"]["v"] = jnp.repeat(p["layers"]["attn"]["v"], groups, axis=2)
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, TINY.vocab_size)
    np.testing.assert_allclose(_logits(gqa, p, tokens), _logits(mha, p_mha, tokens), atol=1e-5)


def _cached_decode(unroll: bool, cache_dtype=None):
    """Two rows (row 0 left-padded by 3) decoded through a cache: a 5-token prefill, then
    one token at a time -> (the cached logits, the full forward's, the final cache)."""
    params = _params(TINY)
    b, t, prefix = 2, 12, 5
    tokens = jax.random.randint(jax.random.key(4), (b, t), 0, TINY.vocab_size)
    mask = jnp.ones((b, t), bool).at[0, :3].set(False)
    full = _logits(TINY, params, tokens, mask)
    cache = model.init_cache(TINY, b, 16, cache_dtype)
    positions = model.default_positions(mask)
    # Jitted: the one-token steps share one compile instead of dispatching op by op.
    step = jax.jit(lambda *a: model.forward_hidden(TINY, *a, unroll=unroll))
    hidden, cache = step(params, tokens[:, :prefix], mask[:, :prefix], positions[:, :prefix], cache)
    outs = [hidden]
    for i in range(prefix, t):
        h, cache = step(params, tokens[:, i:i + 1], mask[:, i:i + 1], positions[:, i:i + 1], cache)
        outs.append(h)
    return model.logits_from_hidden(TINY, params, jnp.concatenate(outs, 1)), full, cache


@pytest.mark.parametrize("unroll", [False, True])
def test_cached_decoding_matches_full_forward(unroll):
    logits, full, cache = _cached_decode(unroll)
    np.testing.assert_allclose(logits[0, 3:], full[0, 3:], atol=1e-5)
    np.testing.assert_allclose(logits[1], full[1], atol=1e-5)
    assert int(cache.index) == 12


def test_quantize_kv_keeps_every_entry_within_half_a_step():
    x = jax.random.normal(jax.random.key(3), (3, 4, 16, 5)) * jnp.arange(1, 6)  # vectors along axis 2
    x = x.at[0, 0, :, 0].set(0.0)
    q, scale = model.quantize_kv(x, 2)
    assert q.dtype == jnp.int8 and scale.shape == (3, 4, 5)
    back = model.dequantize_kv(q, scale, 2, jnp.float32)
    assert (np.abs(np.asarray(back - x)) <= np.asarray(scale)[:, :, None, :] / 2 + 1e-6).all()
    np.testing.assert_allclose(np.abs(np.asarray(q)).max(axis=2)[scale > 0], 127)  # each vector's largest entry
    assert float(scale[0, 0, 0]) == 0 and not np.asarray(q[0, 0, :, 0]).any()


@pytest.mark.parametrize("unroll", [False, True])
def test_decoding_over_an_int8_cache_stays_near_the_full_forward(unroll):
    """The cached decode of test_cached_decoding_matches_full_forward over an int8 cache
    (keys and values quantised per slot and head): logits within 0.02 of the full forward,
    not equal to them (the cache is int8), the keys stored int8 with their scales."""
    logits, full, cache = _cached_decode(unroll, jnp.int8)
    assert cache.k.dtype == jnp.int8 and bool((cache.k_scale[:, :, :, :12] > 0).all())
    gap = np.abs(np.asarray(logits[1] - full[1]))
    assert 0 < gap.max() < 0.02
    np.testing.assert_allclose(logits[0, 3:], full[0, 3:], atol=0.02)


@pytest.mark.parametrize("unroll", [False, True])
def test_decoding_over_a_shared_prompt_matches_full_forward(unroll):
    """Rows that share a prompt slot (PrefixCache, r = 3 rows per slot) and decode their
    own tokens into a cache of completion slots give each row's logits of the whole
    sequence run at once; the prompts are left-padded by different amounts."""
    cfg = dataclasses.replace(TINY, attention_bias=True)
    params = _params(cfg)
    p, r, tp, steps = 2, 3, 6, 5
    prompts = jax.random.randint(jax.random.key(5), (p, tp), 0, cfg.vocab_size)
    prompt_mask = jnp.ones((p, tp), bool).at[0, :2].set(False)
    hidden, pcache = jax.jit(lambda *a: model.forward_hidden(cfg, *a))(
        params, prompts, prompt_mask, model.default_positions(prompt_mask), model.init_cache(cfg, p, tp))
    prefix = model.PrefixCache(k=pcache.k, v=pcache.v, mask=prompt_mask)
    b = p * r
    own = jax.random.randint(jax.random.key(6), (b, steps), 0, cfg.vocab_size)
    lens = jnp.repeat(prompt_mask.sum(1), r)
    cache = model.init_cache(cfg, b, 8)
    step = jax.jit(lambda *a: model.forward_hidden(cfg, *a, unroll=unroll, prefix=prefix))
    outs = []
    for i in range(steps):
        h, cache = step(params, own[:, i:i + 1], jnp.ones((b, 1), bool), (lens + i)[:, None], cache)
        outs.append(h)
    got = model.logits_from_hidden(cfg, params, jnp.concatenate(outs, 1))
    tokens = jnp.concatenate([jnp.repeat(prompts, r, axis=0), own], axis=1)
    mask = jnp.concatenate([jnp.repeat(prompt_mask, r, axis=0), jnp.ones((b, steps), bool)], axis=1)
    want = _logits(cfg, params, tokens, mask)[:, tp:]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_attention_with_a_prefix_equals_attention_over_the_joined_cache():
    """attend_with_prefix is _attend over [the slot's prompt keys, the row's own keys] with
    the two masks joined, including a row whose own cache is empty."""
    keys = jax.random.split(jax.random.key(7), 5)
    p, r, kh, g, d, tp, s = 2, 2, 2, 3, 8, 5, 4
    b = p * r
    q = jax.random.normal(keys[0], (b, 1, kh, g, d))
    k, pk = jax.random.normal(keys[1], (b, kh, d, s)), jax.random.normal(keys[2], (p, kh, d, tp))
    v, pv = jax.random.normal(keys[3], (b, kh, s, d)), jax.random.normal(keys[4], (p, kh, tp, d))
    prefix_mask = jnp.array([[False, True, True, True, True], [True] * 5])
    allowed = jnp.array([[True, True, False, False], [False] * 4, [True, False, True, False], [True] * 4])[:, None]
    got = model.attend_with_prefix(q, k, v, allowed, pk, pv, prefix_mask)
    joined_k = jnp.concatenate([jnp.repeat(pk, r, axis=0), k], axis=-1)
    joined_v = jnp.concatenate([jnp.repeat(pv, r, axis=0), v], axis=-2)
    joined = jnp.concatenate([jnp.repeat(prefix_mask, r, axis=0)[:, None], allowed], axis=-1)
    np.testing.assert_allclose(got, model.attend(q, joined_k, joined_v, joined), atol=1e-5)


def _loss_and_grads(cfg, params, tokens):
    def loss(p):
        logits = model.forward_logits(cfg, p, tokens[:, :-1])
        lp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("variant", [dict(scan_layers=False), dict(remat="full"), dict(remat="dots")])
def test_scan_and_remat_do_not_change_loss_or_grads(variant):
    params = _params(TINY)
    tokens = jax.random.randint(jax.random.key(5), (2, 10), 0, TINY.vocab_size)
    l0, g0 = _loss_and_grads(TINY, params, tokens)
    l1, g1 = _loss_and_grads(dataclasses.replace(TINY, **variant), params, tokens)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g0, g1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_backward_equals_autodiff_of_its_formula(dtype):
    """The written-out SwiGLU backward gives autodiff's gradients of
    (silu(x·gate) ⊙ (x·up))·down, in the inputs' dtype."""
    ks = jax.random.split(jax.random.key(11), 5)
    x = jax.random.normal(ks[0], (2, 7, 16)).astype(dtype)
    gate, up = (jax.random.normal(k, (16, 24)).astype(dtype) * 0.5 for k in ks[1:3])
    down = (jax.random.normal(ks[3], (24, 16)) * 0.5).astype(dtype)
    cot = jax.random.normal(ks[4], (2, 7, 16))
    reference = lambda x, g, u, d: (jax.nn.silu(x @ g) * (x @ u)) @ d
    grads = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot),
                                argnums=(0, 1, 2, 3))(x, gate, up, down)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(model.swiglu(x, gate, up, down), np.float32),
                               np.asarray(reference(x, gate, up, down), np.float32), rtol=tol, atol=tol)
    for ours, ref in zip(grads(model.swiglu), grads(reference)):
        assert ours.dtype == dtype and ours.shape == ref.shape
        scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(ours, np.float32) / scale,
                                   np.asarray(ref, np.float32) / scale, atol=tol)


def test_swiglu_with_bf16_weights_under_float32_compute():
    """A bf16 weight meets float32 activations as a bf16 product summed in float32 (the
    sampler's bf16 copy; `model.product`): the output equals the float64 formula on
    bf16-rounded operands, and the gradients come back in each input's dtype, equal to
    autodiff of that same rounded formula."""
    ks = jax.random.split(jax.random.key(13), 5)
    x = jax.random.normal(ks[0], (2, 5, 16))
    gate, up = (jax.random.normal(k, (16, 24)).astype(jnp.bfloat16) for k in ks[1:3])
    down = (jax.random.normal(ks[3], (24, 16)) * 0.5).astype(jnp.bfloat16)
    r = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    a, b = r(x) @ r(gate), r(x) @ r(up)
    want = r(a / (1 + np.exp(-a)) * b) @ r(down)
    np.testing.assert_allclose(np.asarray(model.swiglu(x, gate, up, down)), want, rtol=1e-5, atol=1e-5)
    rounded = lambda x, g, u, d: model.swiglu(x, g.astype(jnp.float32), u.astype(jnp.float32),
                                              d.astype(jnp.float32))
    cot = jax.random.normal(ks[4], (2, 5, 16))
    grads = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2, 3))(x, gate, up, down)
    for ours, ref, primal in zip(grads(model.swiglu), grads(rounded), (x, gate, up, down)):
        assert ours.dtype == primal.dtype
        scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(ours, np.float32) / scale, np.asarray(ref, np.float32) / scale,
                                   atol=2e-2)


def test_attention_backward_equals_autodiff_including_fully_masked_rows():
    """The recomputing attention backward gives autodiff's gradients of masked softmax
    attention, also for a query with no allowed key (a left pad: uniform weights)."""
    b, t, kh, g, d, s = 2, 5, 2, 3, 4, 5
    ks = jax.random.split(jax.random.key(12), 4)
    q = jax.random.normal(ks[0], (b, t, kh, g, d))
    k = jax.random.normal(ks[1], (b, kh, d, s))
    v = jax.random.normal(ks[2], (b, kh, s, d))
    real = jnp.array([[False, True, True, True, True], [True] * 5])  # row 0: query 0 sees nothing
    allowed = (jnp.arange(s)[None, None, :] <= jnp.arange(t)[None, :, None]) & real[:, None, :]
    cot = jax.random.normal(ks[3], (b, t, kh, g, d))

    def reference(q, k, v):
        scores = jnp.einsum("btkgd,bkds->bkgts", q, k) / np.sqrt(d)
        scores = jnp.where(allowed[:, None, None], scores, model.NEG)
        return jnp.einsum("bkgts,bksd->btkgd", jax.nn.softmax(scores, -1), v)

    ours = lambda q, k, v: model.attend_many(q, k, v, allowed)
    np.testing.assert_allclose(ours(q, k, v), reference(q, k, v), atol=1e-6)
    np.testing.assert_allclose(ours(q, k, v)[0, 0], jnp.broadcast_to(v[0].mean(1), (g, kh, d)).swapaxes(0, 1),
                               atol=1e-6)  # uniform over the 5 slots
    grads = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a) * cot), (0, 1, 2))(q, k, v)
    for a, r in zip(grads(ours), grads(reference)):
        np.testing.assert_allclose(a, r, atol=2e-6 * float(jnp.max(jnp.abs(r))))


def test_causal_blocks_equal_one_pass_for_every_real_query():
    """Query blocks over the keys up to their last row (a forward without a cache) give the
    one-pass attention and its gradients for real queries; a left pad query averages its
    block's values. T = 10 in 3 uneven blocks (rows 0-2, 3-6, 7-9)."""
    b, t, kh, g, d = 2, 10, 2, 2, 4
    ks = jax.random.split(jax.random.key(13), 4)
    q = jax.random.normal(ks[0], (b, t, kh, g, d))
    k = jax.random.normal(ks[1], (b, kh, d, t))
    v = jax.random.normal(ks[2], (b, kh, t, d))
    real = jnp.arange(t)[None, :] >= jnp.array([[2], [0]])  # row 0: two left pads
    allowed = (jnp.arange(t)[None, None, :] <= jnp.arange(t)[None, :, None]) & real[:, None, :]
    cot = jax.random.normal(ks[3], (b, t, kh, g, d)) * real[:, :, None, None, None]
    one = lambda q, k, v: model.attend_many(q, k, v, allowed)
    blocks = lambda q, k, v: model.attend_causal(q, k, v, allowed, 3)
    got, want = blocks(q, k, v), one(q, k, v)
    np.testing.assert_allclose(got[0, 2:], want[0, 2:], atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], atol=1e-6)
    np.testing.assert_allclose(got[0, 0], jnp.broadcast_to(v[0, :, :3].mean(1), (g, kh, d)).swapaxes(0, 1),
                               atol=1e-6)  # uniform over block 0's three slots
    grads = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a) * cot), (0, 1, 2))(q, k, v)
    for a, r in zip(grads(blocks), grads(one)):
        np.testing.assert_allclose(a, r, atol=2e-6 * float(jnp.max(jnp.abs(r))))
    assert [model.causal_blocks(n) for n in (1, 63, 64, 100, 255, 4096)] == [1, 1, 2, 3, 4, 4]


def test_cache_free_forward_in_blocks_equals_the_cached_forward():
    """A 70-token forward without a cache takes the query blocks (2 of 35 rows); with a
    cache (the prefill) it attends in one pass: the real tokens' hidden states agree."""
    cfg = dataclasses.replace(TINY, max_seq_len=96)
    params = _params(cfg)
    tokens = jax.random.randint(jax.random.key(14), (2, 70), 0, cfg.vocab_size)
    mask = jnp.arange(70)[None, :] >= jnp.array([[5], [0]])
    assert model.causal_blocks(70) == 2
    blocks, _ = model.forward_hidden(cfg, params, tokens, mask)
    cached, _ = model.forward_hidden(cfg, params, tokens, mask, cache=model.init_cache(cfg, 2, 80))
    np.testing.assert_allclose(blocks[0, 5:], cached[0, 5:], atol=2e-5)
    np.testing.assert_allclose(blocks[1], cached[1], atol=2e-5)


def test_value_head_and_bfloat16_compute():
    cfg = dataclasses.replace(TINY, dtype="bfloat16")
    params = _params(cfg, value_head=True)
    assert params["value_head"].shape == (cfg.embed_dim,) and params["embedding"].dtype == jnp.float32
    tokens = jax.random.randint(jax.random.key(6), (2, 5), 0, cfg.vocab_size)
    hidden, _ = model.forward_hidden(cfg, params, tokens)
    assert hidden.dtype == jnp.bfloat16
    values = model.value_outputs(params, hidden)
    assert values.shape == (2, 5) and values.dtype == jnp.float32
    f32 = _logits(TINY, params, tokens)
    bf16 = _logits(cfg, params, tokens)
    assert np.abs(np.asarray(f32) - np.asarray(bf16)).max() < 0.05  # same model, lower precision


def test_rope_is_relative():
    """Shifting every position by a constant leaves attention (hence logits) unchanged."""
    params = _params(TINY)
    tokens = jax.random.randint(jax.random.key(7), (1, 8), 0, TINY.vocab_size)
    mask = jnp.ones_like(tokens, bool)
    pos = jnp.arange(8)[None]
    h0, _ = model.forward_hidden(TINY, params, tokens, mask, pos)
    h1, _ = model.forward_hidden(TINY, params, tokens, mask, pos + 17)
    np.testing.assert_allclose(h0, h1, atol=1e-4)
