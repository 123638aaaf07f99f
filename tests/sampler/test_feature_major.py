"""The feature-major decode step against the model's own cached forward, step by step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.model import transformer as model
from grpo_jax import sampler
from grpo_jax.sampler import cache as cache_lib
from grpo_jax.sampler import feature_major
from grpo_jax.sampler.engines import ENGINES
from tests.sampler.test_sampling import flat

FM = ENGINES["feature_major"]
from grpo_jax.config import ModelConfig

TINY = ModelConfig(vocab_size=97, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64, max_seq_len=64)


@pytest.mark.parametrize("cfg,atol", [
    (TINY, 1e-5),
    (dataclasses.replace(TINY, num_kv_heads=1, num_layers=3), 1e-5),  # multi-query
    (dataclasses.replace(TINY, tie_embeddings=False, attention_bias=True), 1e-5),
    (dataclasses.replace(TINY, dtype="bfloat16"), 0.1),
])
def test_step_equals_the_models_cached_forward(cfg, atol):
    """A 5-token prefill by the model, then 6 one-token steps by both: the same logits (vocab-
    major here) and the same cache, with a left-padded row and a padding token mid-way
    (real=False: its slot must stay masked for later steps)."""
    params = model.init_params(cfg, jax.random.key(1))
    if cfg.attention_bias:  # zero-initialised: give them values so that they are checked
        leaves = {"q_bias", "k_bias", "v_bias"}
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.3 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
            if p[-1].key in leaves else x, params)
    b, prefix, steps, slots = 3, 5, 6, 16
    tokens = jax.random.randint(jax.random.key(2), (b, prefix + steps), 0, cfg.vocab_size)
    mask = jnp.ones(tokens.shape, bool).at[0, :2].set(False).at[2, prefix + 2].set(False)
    positions = model.default_positions(mask)
    cache = model.init_cache(cfg, b, slots)
    run = jax.jit(lambda p, t, m, pos, c: model.forward_hidden(cfg, p, t, m, pos, c, unroll=True))
    _, cache = run(params, tokens[:, :prefix], mask[:, :prefix], positions[:, :prefix], cache)
    weights = jax.jit(feature_major.decode_weights, static_argnums=0)(cfg, params)
    ks, vs = list(cache.k), list(cache.v)
    cache_mask = cache.mask

    @jax.jit
    def fm_step(ks, vs, cache_mask, index, tok, real, pos):
        rope_cs = model.rope_tables(pos[:, None], cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor)
        return feature_major.step(cfg, weights, ks, vs, cache_mask, index, tok, real, rope_cs)

    for i in range(prefix, prefix + steps):
        hidden, cache = run(params, tokens[:, i:i + 1], mask[:, i:i + 1], positions[:, i:i + 1], cache)
        want = model.logits_from_hidden(cfg, params, hidden[:, 0])
        logits, ks, vs, cache_mask = fm_step(ks, vs, cache_mask, jnp.int32(i), tokens[:, i], mask[:, i],
                                             positions[:, i])
        assert logits.shape == (cfg.vocab_size, b) and logits.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(logits).T, np.asarray(want), atol=atol, rtol=atol)
        np.testing.assert_array_equal(np.asarray(cache_mask), np.asarray(cache.mask))
        for got, ref in zip(ks + vs, list(cache.k) + list(cache.v)):
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                                       atol=atol, rtol=atol)


@pytest.mark.parametrize("b", [3, feature_major.SUMMED_SCORES_FROM])
def test_attention_of_one_token_equals_the_models_in_both_forms(b):
    """Below _SUMMED_SCORES_FROM rows the step uses the model's attention (two dots); from
    there on its scores are a summed product (one dot left): the same output either way,
    masked slots included."""
    kh, g, d, s = 2, 3, 8, 12
    keys = jax.random.split(jax.random.key(4), 4)
    q = jax.random.normal(keys[0], (b, kh, g, d))
    k = jax.random.normal(keys[1], (b, kh, d, s))
    v = jax.random.normal(keys[2], (b, kh, s, d))
    allowed = (jax.random.uniform(keys[3], (b, 1, s)) < 0.6).at[:, :, 0].set(True)
    got = feature_major.attend(q, k, v, allowed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(model.attend(q[:, None], k, v, allowed)),
                               atol=1e-5, rtol=1e-5)
    dots = str(jax.make_jaxpr(feature_major.attend)(q, k, v, allowed)).count("dot_general")
    assert dots == (2 if b < feature_major.SUMMED_SCORES_FROM else 1)


def test_decode_weights_are_the_parameters_transposed():
    """[out, in] copies: q of layer 1 is its [E, H, D] kernel as [H·D, E]; an untied
    unembedding is lm_head [E, V] as [V, E]; a tied one is the embedding itself."""
    cfg = dataclasses.replace(TINY, tie_embeddings=False)
    params = model.init_params(cfg, jax.random.key(3))
    w = feature_major.decode_weights(cfg, params)
    q = np.asarray(params["layers"]["attn"]["q"][1])  # [E, H, D]
    np.testing.assert_array_equal(np.asarray(w["layers"][1]["q"]), q.reshape(32, 32).T)
    np.testing.assert_array_equal(np.asarray(w["layers"][0]["down"]),
                                  np.asarray(params["layers"]["mlp"]["down"][0]).T)
    np.testing.assert_array_equal(np.asarray(w["unembedding"]), np.asarray(params["lm_head"]).T)
    tied = model.init_params(TINY, jax.random.key(3))
    assert feature_major.decode_weights(TINY, tied)["unembedding"] is tied["embedding"]


def test_sampler_uses_it_only_as_the_feature_major_engine(monkeypatch):
    """Traced by the feature_major engine (what auto resolves to on one CPU device), not by
    the scan engine, which runs the model's own forward; both draw the same tokens."""
    cfg = dataclasses.replace(TINY, vocab_size=89)  # a config no other test has compiled
    calls = []
    real_step = feature_major.step
    monkeypatch.setattr(feature_major, "step", lambda *a: calls.append(1) or real_step(*a))
    params = model.init_params(cfg, jax.random.key(4))
    kw = dict(key=jax.random.key(5), group_size=2, max_new_tokens=5, temperature=1.0)
    rolled = flat(sampler.sample, cfg, params, [[3, 4, 5]], engine="scan", **kw)
    assert not calls
    unrolled = flat(sampler.sample, cfg, params, [[3, 4, 5]], engine="auto", **kw)
    assert calls
    np.testing.assert_array_equal(np.asarray(rolled.tokens), np.asarray(unrolled.tokens))


def test_decode_windows_split_the_completion_into_equal_phases():
    """Up to four phases, each a share of the completion bucket, the last the whole cache;
    a phase never shorter than 32 slots."""
    assert cache_lib.decode_windows(64, 128) == (96, 128, 160, 192)
    assert cache_lib.decode_windows(16, 64) == (48, 80)
    assert cache_lib.decode_windows(256, 512) == (384, 512, 640, 768)
    assert cache_lib.decode_windows(32, 16) == (48,)
    assert cache_lib.decode_windows(32, 32) == (64,)


@pytest.mark.parametrize("stops", [(), tuple(range(20, 30))])
def test_phased_decode_draws_what_one_phase_over_the_whole_cache_draws(stops):
    """Prompts of different lengths, 100 new tokens (a 128-column bucket: four phases of 32
    slots): the same tokens, log-probs and steps as the rolled sampler, whose model forward
    attends over all slots in one loop. A step that wrote past its phase's cache would have
    its slot clamped onto the last one, and the draws would part. Without stop tokens every
    row runs through every phase; with ten of them, every row stops before the third phase,
    whose loop then runs no step."""
    cfg = dataclasses.replace(TINY, vocab_size=83, max_seq_len=256)  # compiled by no other test
    params = model.init_params(cfg, jax.random.key(6))
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16]]
    kw = dict(key=jax.random.key(7), group_size=2, max_new_tokens=100, temperature=1.0, stop_tokens=stops)
    rolled, info = flat(sampler.sample_with_info, cfg, params, prompts, engine="scan", **kw)
    phased, phased_info = flat(sampler.sample_with_info, cfg, params, prompts, engine="feature_major", **kw)
    assert info.completion_bucket == 128
    windows = cache_lib.decode_windows(info.prompt_bucket, info.completion_bucket)
    assert len(windows) == 4
    np.testing.assert_array_equal(np.asarray(rolled.tokens), np.asarray(phased.tokens))
    np.testing.assert_array_equal(np.asarray(rolled.mask), np.asarray(phased.mask))
    np.testing.assert_allclose(np.asarray(phased.logprobs), np.asarray(rolled.logprobs), atol=2e-5)
    assert phased_info.decode_steps == info.decode_steps
    if stops:
        assert info.decode_steps < windows[2] - info.prompt_bucket and bool(phased.finished.all())
    else:
        assert info.decode_steps == 100 and int(phased.lengths.min()) == 100


def test_decode_weights_are_made_once_per_policy_and_freed_with_it():
    """The sampler reuses one policy's copy while its params are the same arrays, makes a new
    one for new params (never a stale copy), and drops it when the params are freed."""
    import gc
    import weakref

    cfg = dataclasses.replace(TINY, vocab_size=83)
    old = model.init_params(cfg, jax.random.key(6))
    first = FM.weights(cfg, old)
    assert FM.weights(cfg, old) is first
    new = jax.tree.map(lambda x: x + 1.0, old)
    second = FM.weights(cfg, new)
    assert second is not first
    np.testing.assert_array_equal(np.asarray(second["layers"][0]["up"]),
                                  np.asarray(new["layers"]["mlp"]["up"][0]).T)
    low = sampler.sampling_copy(cfg, new, "bfloat16")  # another dtype: held beside it
    third = FM.weights(cfg, low)
    assert FM.weights(cfg, new) is second
    assert FM.weights(cfg, low) is third
    assert third["layers"][0]["up"].dtype == jnp.bfloat16
    copies = [weakref.ref(w["layers"][0]["up"]) for w in (second, third)]
    del new, low, second, third
    gc.collect()
    assert [c() for c in copies] == [None, None]  # the sampler holds no copy of freed params


def test_a_sampler_held_copy_dies_quietly_at_interpreter_exit(tmp_path):
    """The copy's weakref callbacks run while Python tears the module down, when its globals
    are already None: they must not print 'Exception ignored' tracebacks after every script
    that sampled."""
    import subprocess
    import sys

    script = ("import jax; from grpo_jax import sampler; from grpo_jax.model import transformer as model; from grpo_jax.config import ModelConfig\n"
              "cfg = ModelConfig(vocab_size=31, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, "
              "head_dim=8, mlp_dim=32, max_seq_len=32)\n"
              "p = model.init_params(cfg, jax.random.key(0))\n"
              "r = sampler.sample(cfg, p, [[1, 2]], sampler.SamplingParams(3), key=jax.random.key(1))\n"
              "print(r.tokens.shape)\n")
    env = {**__import__("os").environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "(1, 3)" in out.stdout
    assert "Exception ignored" not in out.stderr, out.stderr


def _bf16_round(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)


def test_bf16_weights_multiply_bf16_inputs_in_float32():
    """A bfloat16 weight meets its activations rounded to bfloat16, sums in float32: equal to
    the float64 product of the rounded operands; float32 weights are a plain float32 dot."""
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((48, 40)), rng.standard_normal((40, 8))
    got = feature_major.dense(jnp.asarray(w, jnp.bfloat16), jnp.asarray(x, jnp.float32), jnp.float32)
    assert got.dtype == jnp.float32
    want = _bf16_round(w) @ _bf16_round(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - w @ x).max() > 1e-3  # the rounding of x is visible, so it is checked
    got32 = feature_major.dense(jnp.asarray(w, jnp.float32), jnp.asarray(x, jnp.float32), jnp.float32)
    np.testing.assert_allclose(np.asarray(got32), w @ x, rtol=1e-5, atol=1e-5)


def test_bf16_transpose_and_row_gather_are_exact():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, 40)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(feature_major.to_features, static_argnums=1)(x, True)),
                                  np.asarray(x).T)
    table = jnp.asarray(rng.standard_normal((97, 40)), jnp.bfloat16)
    tokens = jnp.asarray([5, 0, 96, 5])
    got = jax.jit(feature_major.embed)(table, tokens)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(table, np.float32)[[5, 0, 96, 5]])


def test_bf16_step_keeps_every_weight_in_bf16_and_tracks_the_model():
    """With a bfloat16 sampling copy, the compiled step holds no float32 copy of any weight
    matrix (XLA upcasts a bf16 dot whose right operand is not row-major [in, B], and converts
    a table it gathers from in bf16: either doubles the step's time), and its logits equal the
    model's forward on the same bf16 weights, which rounds the same operands to bf16
    (`model.product`): far closer than the bf16 rounding itself (checked against an upcast
    forward)."""
    import re

    cfg = dataclasses.replace(TINY, embed_dim=40, mlp_dim=72, tie_embeddings=False)
    params = sampler.sampling_copy(cfg, model.init_params(cfg, jax.random.key(7)), "bfloat16")
    weights = feature_major.decode_weights(cfg, params)
    b, slots = 4, 16
    cache = model.init_cache(cfg, b, slots)
    tokens = jnp.asarray([3, 50, 7, 96])
    rope_cs = model.rope_tables(jnp.zeros((b, 1), jnp.int32), cfg.head_dim, cfg.rope_theta,
                                cfg.rope_scaling_factor)
    fn = jax.jit(lambda w, ks, vs, m: feature_major.step(cfg, w, ks, vs, m, jnp.int32(0), tokens,
                                                         jnp.ones(b, bool), rope_cs))
    args = (weights, list(cache.k), list(cache.v), cache.mask)
    hlo = fn.lower(*args).compile().as_text()
    shapes = {tuple(x.shape) for x in jax.tree.leaves(weights) if x.ndim == 2}
    assert {(72, 40), (40, 72), (97, 40)} <= shapes
    copies = {s for s in re.findall(r"f32\[(\d+),(\d+)\]", hlo)}
    assert not {(str(r), str(c)) for r, c in shapes} & copies, sorted(copies)
    logits = np.asarray(fn(*args)[0]).T
    hidden, _ = model.forward_hidden(cfg, params, tokens[:, None], jnp.ones((b, 1), bool),
                                     jnp.zeros((b, 1), jnp.int32), cache, unroll=True)
    want = np.asarray(model.logits_from_hidden(cfg, params, hidden[:, 0]))
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    upcast = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    hidden32, _ = model.forward_hidden(cfg, upcast, tokens[:, None], jnp.ones((b, 1), bool),
                                       jnp.zeros((b, 1), jnp.int32), cache, unroll=True)
    rounding = np.abs(np.asarray(model.logits_from_hidden(cfg, upcast, hidden32[:, 0])) - want).max()
    assert rounding > 1e-3, rounding  # the bf16 operands are visible, so the match above is real
