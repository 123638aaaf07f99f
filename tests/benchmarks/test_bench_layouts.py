"""bench_layouts: its two orientations compute the same thing (so its timings compare like with like)."""

import jax.numpy as jnp
import numpy as np
import pytest


def test_row_and_feature_major_programs_agree_with_numpy(benchmark_module):
    bench_layouts = benchmark_module("bench_layouts")

    rng = np.random.default_rng(0)
    e, f, v, b = 16, 24, 40, 3
    x = rng.standard_normal((b, e)).astype(np.float32)
    layers = [tuple(rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((e, f), (e, f), (f, e)))
              for _ in range(2)]
    want = x.astype(np.float64)
    for gate, up, down in layers:
        a = want @ gate
        want = want + (a / (1 + np.exp(-a)) * (want @ up)) @ down
    rows, features, features_bf16 = bench_layouts.mlp_programs(2)
    np.testing.assert_allclose(np.asarray(rows(jnp.asarray(x), layers)), want, rtol=1e-5, atol=1e-5)
    transposed = [tuple(w.T.copy() for w in layer) for layer in layers]
    np.testing.assert_allclose(np.asarray(features(jnp.asarray(x.T), transposed)).T, want, rtol=1e-5, atol=1e-5)

    def bf16(a):  # numpy float64 of a rounded to bfloat16
        return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)

    want16 = x.astype(np.float64).T  # the bf16 column: every dot operand rounded, sums exact
    for gate, up, down in transposed:
        a = bf16(gate) @ bf16(want16)
        want16 = want16 + bf16(down) @ bf16(a / (1 + np.exp(-a)) * (bf16(up) @ bf16(want16)))
    low = [tuple(jnp.asarray(w, jnp.bfloat16) for w in layer) for layer in transposed]
    got16 = np.asarray(features_bf16(jnp.asarray(x.T), low))
    np.testing.assert_allclose(got16, want16, rtol=1e-4, atol=1e-4)
    assert np.abs(got16 - want.T).max() > 1e-3  # bf16 rounding is visible, so it is checked

    emb = rng.standard_normal((v, e)).astype(np.float32)
    logits = x.astype(np.float64) @ emb.T.astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
    un_rows, un_features = bench_layouts.unembed_programs()
    np.testing.assert_allclose(np.asarray(un_rows(jnp.asarray(x), jnp.asarray(emb))), lse, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(un_features(jnp.asarray(x.T), jnp.asarray(emb))), lse, rtol=1e-5)
    logits16 = bf16(x) @ bf16(emb).T
    lse16 = np.log(np.exp(logits16 - logits16.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(np.asarray(un_features(jnp.asarray(x.T), jnp.asarray(emb, jnp.bfloat16))), lse16,
                               rtol=1e-5)


def test_both_decode_attention_forms_agree_with_numpy(benchmark_module):
    bench_layouts = benchmark_module("bench_layouts")

    rng = np.random.default_rng(1)
    b, kh, g, d, s = 2, 2, 3, 4, 5
    q = rng.standard_normal((b, kh, g, d)).astype(np.float32)
    ks = [rng.standard_normal((b, kh, d, s)).astype(np.float32) for _ in range(2)]
    vs = [rng.standard_normal((b, kh, s, d)).astype(np.float32) for _ in range(2)]
    allowed = np.array([[[True, False, True, True, False]], [[True, True, False, False, False]]])
    want = q.astype(np.float64)
    for k, v in zip(ks, vs):
        scores = np.einsum("bkgd,bkds->bkgs", want, k) / np.sqrt(d)
        p = np.exp(np.where(allowed[:, :, None, :], scores, -np.inf))
        want = want + np.einsum("bkgs,bksd->bkgd", p / p.sum(-1, keepdims=True), v)
    for program in bench_layouts.attention_programs():
        got = program(jnp.asarray(q), [jnp.asarray(k) for k in ks], [jnp.asarray(v) for v in vs], jnp.asarray(allowed))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_prefill_in_one_pass_and_in_chunks_agree(benchmark_module):
    """The two programs the prefill table times: the same cache and logits (3 prompts, the
    chunked one in chunks of 2 rows, the second padded)."""
    bench_layouts = benchmark_module("bench_layouts")
    import jax

    from grpo_jax.model import transformer as model
    from grpo_jax.sampler.engines import ENGINES
    from grpo_jax.config import cpu_tiny

    cfg = cpu_tiny().model
    params = model.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (3, 8)), jnp.int32)
    mask = jnp.ones((3, 8), bool).at[0, :3].set(False)
    progs = bench_layouts.prefill_programs(cfg, params, tokens, mask, 12, chunk_tokens=16)
    (one_cache, one_logits), (chunk_cache, chunk_logits) = (p(params, tokens, mask, None) for p in progs.values())
    assert ENGINES["feature_major"].prefill_chunks(3, 8, 16) == 2 and len(one_cache.k) == cfg.num_layers
    for a, b in zip(jax.tree.leaves((one_cache, one_logits)), jax.tree.leaves((chunk_cache, chunk_logits))):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)


def test_read_split_attributes_the_extra_time_to_reading(benchmark_module):
    bench_layouts = benchmark_module("bench_layouts")

    # 0.020 s from memory, 0.012 s in cache: 8 ms extra for 400 MB -> 50 GB/s; 6 GFLOP / 0.012 s.
    r = bench_layouts.read_split(0.020, 0.012, weight_bytes=400_000_000, flops=6_000_000_000)
    assert r["extra_s"] == pytest.approx(0.008)
    assert r["read_bytes_per_s"] == pytest.approx(5e10)
    assert r["in_cache_flops_per_s"] == pytest.approx(5e11)
    # No extra time: nothing attributable to reading, and no rate is invented.
    assert bench_layouts.read_split(0.010, 0.011, weight_bytes=1, flops=1)["read_bytes_per_s"] is None
