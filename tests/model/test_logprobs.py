"""Chunked log-probs: equal to the direct log_softmax (values, grads, entropy), never a
[B, T, V] float32 array in the loss path, and the completion alignment of the model."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.model import logprobs, transformer as model
from grpo_jax.rl import losses
from grpo_jax.config import ModelConfig
from grpo_jax.rl.batching import make_batch

TINY = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64, max_seq_len=64)


def _direct(hidden, unembed, targets, temperature):
    t = temperature if temperature > 0 else 1.0
    logits = hidden.astype(jnp.float32) @ unembed.astype(jnp.float32) / t
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
    return logp, losses.entropy_from_logits(logits)


def _inputs(b=3, t=11, e=16, v=40, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, (b, t, e)), jax.random.normal(k2, (e, v)) * 0.5,
            jax.random.randint(k3, (b, t), 0, v))


@pytest.mark.parametrize("chunk_size,temperature,keep_probs",
                         [(4, 1.0, False), (1, 0.7, False), (64, 0.0, False), (5, 1.3, False),
                          (4, 0.7, True), (64, 1.0, True)])
def test_chunked_equals_direct_values_grads_entropy(chunk_size, temperature, keep_probs):
    hidden, unembed, targets = _inputs()
    w = jax.random.normal(jax.random.key(9), targets.shape)  # arbitrary cotangent

    def chunked(h, u):
        logp, ent = logprobs.token_logprobs(h, u, targets, temperature=temperature,
                                            chunk_size=chunk_size, with_entropy=True,
                                            keep_probs=keep_probs)
        return jnp.sum(w * logp), (logp, ent)

    def direct(h, u):
        logp, ent = _direct(h, u, targets, temperature)
        return jnp.sum(w * logp), (logp, ent)

    (_, (lp1, e1)), g1 = jax.jit(jax.value_and_grad(chunked, (0, 1), has_aux=True))(hidden, unembed)
    (_, (lp2, e2)), g2 = jax.jit(jax.value_and_grad(direct, (0, 1), has_aux=True))(hidden, unembed)
    np.testing.assert_allclose(lp1, lp2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(e1, e2, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bfloat16_inputs_get_bfloat16_gradients_close_to_float32():
    """Logits are computed in float32 whatever the inputs' dtype; the gradients come back in
    the inputs' dtype, equal to the float32 gradients up to bfloat16 rounding."""
    hidden, unembed, targets = _inputs()
    loss = lambda h, u: jnp.sum(logprobs.token_logprobs(h, u, targets, chunk_size=4))
    g32 = jax.grad(loss, (0, 1))(hidden, unembed)
    g16 = jax.grad(loss, (0, 1))(hidden.astype(jnp.bfloat16), unembed.astype(jnp.bfloat16))
    for a, b in zip(g16, g32):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=3e-2, atol=3e-2 * float(jnp.max(jnp.abs(b))))


def test_vocab_major_unembedding_gives_the_same_values_and_transposed_gradient():
    hidden, unembed, targets = _inputs()
    w = jax.random.normal(jax.random.key(3), targets.shape)

    def loss(h, u, vocab_major):
        logp, ent = logprobs.token_logprobs(h, u, targets, chunk_size=4, with_entropy=True,
                                            vocab_major=vocab_major, temperature=0.8)
        return jnp.sum(w * logp), (logp, ent)

    (_, out_ev), (gh_ev, gu_ev) = jax.value_and_grad(loss, (0, 1), has_aux=True)(hidden, unembed, False)
    (_, out_ve), (gh_ve, gu_ve) = jax.value_and_grad(loss, (0, 1), has_aux=True)(hidden, unembed.T, True)
    for a, b in zip(out_ev, out_ve):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gh_ev, gh_ve, rtol=1e-5, atol=1e-6)
    assert gu_ve.shape == unembed.T.shape
    np.testing.assert_allclose(gu_ev, gu_ve.T, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[V, E\]"):
        logprobs.token_logprobs(hidden, unembed, targets, vocab_major=True)


def test_entropy_is_not_differentiated():
    hidden, unembed, targets = _inputs()
    ent = lambda h, u: jnp.sum(logprobs.token_logprobs(h, u, targets, chunk_size=4, with_entropy=True)[1])
    for g in jax.grad(ent, (0, 1))(hidden, unembed):
        np.testing.assert_array_equal(g, 0.0)


def test_temperature_zero_is_one_and_traced_temperature_matches():
    hidden, unembed, targets = _inputs()
    at0 = logprobs.token_logprobs(hidden, unembed, targets, temperature=0.0)
    at1 = logprobs.token_logprobs(hidden, unembed, targets, temperature=1.0)
    np.testing.assert_array_equal(at0, at1)
    traced = jax.jit(lambda t: logprobs.token_logprobs(hidden, unembed, targets, temperature=t))
    np.testing.assert_allclose(traced(jnp.float32(0.0)), at1, atol=1e-6)
    np.testing.assert_allclose(traced(jnp.float32(0.7)),
                               logprobs.token_logprobs(hidden, unembed, targets, temperature=0.7),
                               atol=1e-6)


@pytest.mark.parametrize("mesh_shape,vocab_major,rows", [((2, 2, 2), True, 8), ((2, 4, 1), False, 2)])
def test_on_a_mesh_the_sharded_chunks_equal_the_unsharded_ones(mesh_shape, vocab_major, rows):
    """Traced on a mesh, the chunk loop runs in shard_map: rows over (data, fsdp), the
    unembedding gathered over its embed shards, the vocabulary over tensor (its max, sum,
    target logit and ∂h reduced across shards); and with fewer rows than devices. Same
    log-probs, entropy and gradients as without a mesh; ∂W comes back sharded like W."""
    from grpo_jax.parallel import sharding

    hidden, unembed, targets = _inputs(b=rows, t=11, e=16, v=40)
    if vocab_major:
        unembed = unembed.T
    cot = jax.random.normal(jax.random.key(9), targets.shape)

    def loss(h, u):
        logp, ent = logprobs.token_logprobs(h, u, targets, temperature=0.7, chunk_size=4,
                                            with_entropy=True, vocab_major=vocab_major)
        return jnp.sum(cot * logp), (logp, ent)

    grad = jax.value_and_grad(loss, (0, 1), has_aux=True)
    want = jax.jit(grad)(hidden, unembed)
    mesh = sharding.mesh_from_shape(mesh_shape)
    names = ("vocab", "embed") if vocab_major else ("embed", "vocab")
    w_sharding = sharding.logical_to_sharding(names, unembed.shape, mesh)
    placed = (jax.device_put(hidden, sharding.batch_sharding(mesh, 3, rows)), jax.device_put(unembed, w_sharding))
    with sharding.on_mesh(mesh):
        got = jax.jit(grad)(*placed)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert got[1][1].sharding.is_equivalent_to(w_sharding, 2)


def _vocab_arrays(jaxpr, vocab):
    """Shapes of every intermediate (at any nesting depth) with a trailing vocab axis,
    other than the [E, V] matrix itself."""
    found = []

    def walk(jx):
        for eqn in jx.eqns:
            for var in eqn.outvars:
                shape = getattr(var.aval, "shape", ())
                if len(shape) >= 3 and shape[-1] == vocab:
                    found.append(shape)
            for sub in _subjaxprs(eqn):
                walk(sub)

    walk(jaxpr.jaxpr)
    return found


def _subjaxprs(eqn):
    for p in eqn.params.values():
        for q in (p if isinstance(p, (list, tuple)) else [p]):
            if isinstance(q, jax.extend.core.ClosedJaxpr):
                yield q.jaxpr
            elif isinstance(q, jax.extend.core.Jaxpr):
                yield q


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn):
            yield from _all_eqns(sub)


def test_loss_path_never_materialises_full_logits():
    """Forward and backward of the chunked path hold at most [B, chunk, V] logits
    (the direct path shows [B, T, V], so the check can see it)."""
    b, t, e, v, chunk = 2, 32, 16, 512, 8
    hidden, unembed, targets = _inputs(b, t, e, v)
    loss = lambda h, u: jnp.sum(logprobs.token_logprobs(h, u, targets, chunk_size=chunk,
                                                        with_entropy=True)[0])
    shapes = _vocab_arrays(jax.make_jaxpr(jax.grad(loss, (0, 1)))(hidden, unembed), v)
    assert shapes, "expected per-chunk logits in the jaxpr"
    assert max(int(np.prod(s)) for s in shapes) <= b * chunk * v, shapes
    direct = lambda h, u: jnp.sum(_direct(h, u, targets, 1.0)[0])
    shapes = _vocab_arrays(jax.make_jaxpr(jax.grad(direct, (0, 1)))(hidden, unembed), v)
    assert max(int(np.prod(s)) for s in shapes) >= b * t * v


def test_keep_probs_drops_the_recomputed_unembedding_matmul():
    """keep_probs does what it says: the backward pass reuses the forward's softmax, so the
    gradient has one [B, chunk, V] matmul fewer per chunk (the logits are not recomputed)."""
    hidden, unembed, targets = _inputs(t=12)

    def logit_dots(keep):
        loss = lambda h, u: jnp.sum(logprobs.token_logprobs(h, u, targets, chunk_size=4, keep_probs=keep))
        jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(hidden, unembed)
        return sum(1 for eqn in _all_eqns(jaxpr.jaxpr) if eqn.primitive.name == "dot_general"
                   and eqn.outvars[0].aval.shape[1:] == (4, unembed.shape[1]))  # [B, chunk, V]

    # recompute: forward logits, recomputed logits; keep: forward logits only (inside the scan)
    assert (logit_dots(False), logit_dots(True)) == (2, 1)


def test_compiled_memory_is_bounded_by_the_chunk():
    """Large vocab: the chunked gradient's temporaries stay well below one [B,T,V] f32."""
    b, t, e, v, chunk = 2, 512, 32, 8192, 16
    hidden, unembed, targets = _inputs(b, t, e, v)
    full_bytes = b * t * v * 4  # 32 MiB; one chunk is 1 MiB, and so is the [E, V] matrix

    def temp_bytes(fn):
        grad = jax.jit(jax.grad(fn, (0, 1)))
        return grad.lower(hidden, unembed).compile().memory_analysis().temp_size_in_bytes

    chunked = temp_bytes(lambda h, u: jnp.sum(logprobs.token_logprobs(h, u, targets, chunk_size=chunk)))
    direct = temp_bytes(lambda h, u: jnp.sum(_direct(h, u, targets, 1.0)[0]))
    print(f"grad temp bytes: chunked {chunked}, direct {direct}, one [B,T,V] f32 {full_bytes}")
    assert direct >= full_bytes
    assert chunked < full_bytes / 4


# ----------------------------------------------------------------- model alignment

@pytest.fixture(scope="module")
def params():
    """A policy with a value head: N(0, 0.02) weights shaped by model.param_shapes (as
    model.init_params draws them, without compiling the model's init)."""
    rng = np.random.default_rng(0)

    def fill(path, s):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "norm" in name:
            return jnp.ones(s.shape, jnp.float32)
        return jnp.asarray(0.02 * rng.standard_normal(s.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(fill, model.param_shapes(TINY, value_head=True))


def _ragged_batch(seed=0, b=4, tp=6, tc=5):
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, tp + 1, b)
    pmask = np.arange(tp)[None] >= (tp - plen)[:, None]  # left-padded
    clen = rng.integers(1, tc + 1, b)
    cmask = np.arange(tc)[None] < clen[:, None]  # right-padded
    ptok = np.where(pmask, rng.integers(1, TINY.vocab_size, (b, tp)), 0)
    ctok = np.where(cmask, rng.integers(1, TINY.vocab_size, (b, tc)), 0)
    return make_batch(ptok, pmask, ctok, cmask), plen, clen


def _right_padded_rows(batch, plen, clen):
    """Each row as prompt + completion starting at column 0 (no left padding), right-padded."""
    tp = batch.prompt_tokens.shape[1]
    length = tp + batch.tokens.shape[1]
    tokens = np.zeros((len(plen), length), np.int32)
    for i in range(len(plen)):
        row = np.concatenate([batch.prompt_tokens[i, tp - plen[i]:], batch.tokens[i, : clen[i]]])
        tokens[i, : len(row)] = row
    return tokens, np.arange(length)[None] < (plen + clen)[:, None]


def test_sequence_logprobs_match_an_independent_layout(params):
    """log_softmax(logits / T) of the same rows laid out without left padding: position
    plen-1+t predicts completion token t; padded entries are 0; entropy likewise."""
    batch, plen, clen = _ragged_batch()
    tokens, mask = _right_padded_rows(batch, plen, clen)
    logits_all = jax.jit(lambda p: model.forward_logits(TINY, p, tokens, mask))(params)
    ours = jax.jit(lambda p, t: logprobs.sequence_logprobs(
        TINY, p, batch, temperature=t, chunk_size=2, with_entropy=True))
    for temperature in (1.0, 0.6):
        logp, ent = ours(params, jnp.float32(temperature))
        for i in range(len(plen)):
            logits = logits_all[i, plen[i] - 1: plen[i] - 1 + clen[i]] / temperature
            comp = batch.tokens[i, : clen[i]]
            want = jax.nn.log_softmax(logits)[np.arange(clen[i]), comp]
            np.testing.assert_allclose(logp[i, : clen[i]], want, atol=2e-5)
            np.testing.assert_allclose(ent[i, : clen[i]], losses.entropy_from_logits(logits), atol=2e-5)
            np.testing.assert_array_equal(logp[i, clen[i]:], 0.0)


def test_sequence_values_read_the_predicting_positions(params):
    """V(t) comes from the hidden state that predicts token t (the state before o_t)."""
    batch, plen, clen = _ragged_batch(1)
    tokens, mask = _right_padded_rows(batch, plen, clen)

    def both(p):
        hidden, _ = model.forward_hidden(TINY, p, jnp.asarray(tokens), jnp.asarray(mask))
        return logprobs.sequence_values(TINY, p, batch), model.value_outputs(p, hidden)


    values, per_position = jax.jit(both)(params)
    for i in range(len(plen)):
        np.testing.assert_allclose(values[i, : clen[i]],
                                   per_position[i, plen[i] - 1: plen[i] - 1 + clen[i]], atol=1e-5)
        np.testing.assert_array_equal(values[i, clen[i]:], 0.0)
    with pytest.raises(ValueError, match="value head"):
        policy_only = {k: v for k, v in params.items() if k not in ("value_head", "value_bias")}
        logprobs.sequence_values(TINY, policy_only, batch)


# bf16 keeps 8 significant bits: rounding to nearest, the relative error of an operand is at
# most 2^-9.
BF16_U = 2.0 ** -9


def _bf16_logp_bound(hidden, unembed, temperature=1.0):
    """A bound on |Δ log π| from rounding h and W to bf16, per position: every logit moves by
    at most (2u + u²) Σ_e |h_e W_ev| / T, and log π = z[o] − logsumexp(z) by at most twice the
    largest such move (logsumexp is 1-Lipschitz in the max norm). float32 summation adds ~1e-6."""
    scale = jnp.abs(hidden.astype(jnp.float32)) @ jnp.abs(unembed.astype(jnp.float32))
    return 2 * (2 * BF16_U + BF16_U ** 2) * jnp.max(scale, axis=-1) / temperature + 1e-5


@pytest.mark.parametrize("vocab_major,keep_probs", [(False, False), (True, True)])
def test_bfloat16_operands_stay_within_the_rounding_bound(vocab_major, keep_probs):
    """model.unembed_dtype=bfloat16 (operand_dtype): log-probs within the bound of bf16
    rounding, not equal to float32 (the option does something), gradients close; the same
    with the softmax kept (keep_probs) and a vocab-major W."""
    hidden, unembed, targets = _inputs(b=4, t=9, e=64, v=200)
    w_in = unembed.T if vocab_major else unembed
    cot = jax.random.normal(jax.random.key(3), targets.shape)

    def loss(h, u, dtype):
        logp = logprobs.token_logprobs(h, u, targets, temperature=0.8, chunk_size=4, vocab_major=vocab_major,
                                       keep_probs=keep_probs, operand_dtype=dtype)
        return jnp.sum(cot * logp), logp

    grad = lambda dtype: jax.jit(jax.value_and_grad(lambda h, u: loss(h, u, dtype), (0, 1), has_aux=True))
    (_, lp32), g32 = grad("float32")(hidden, w_in)
    (_, lp16), g16 = grad("bfloat16")(hidden, w_in)
    delta = np.abs(np.asarray(lp16) - np.asarray(lp32))
    bound = np.asarray(_bf16_logp_bound(hidden, unembed, 0.8))
    assert (delta <= bound).all(), (delta.max(), bound.min())
    assert delta.max() > 0
    for a, b in zip(g16, g32):
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.02 * float(np.abs(b).max()))
    with pytest.raises(ValueError, match="operand_dtype"):
        logprobs.token_logprobs(hidden, unembed, targets, operand_dtype="float16")


def test_unembed_dtype_reaches_the_log_probs_and_the_decode_logits(params):
    """The config option on the tiny model: sequence_logprobs within the rounding bound of
    its float32 self; the decode's logits (model.logits_from_hidden) equal those of a bf16
    copy of the unembedding under float32 compute, which is what a bfloat16 sampling copy
    already computed."""
    import dataclasses

    bf = dataclasses.replace(TINY, unembed_dtype="bfloat16")
    batch, plen, clen = _ragged_batch()
    score = lambda cfg: jax.jit(lambda p: logprobs.sequence_logprobs(cfg, p, batch, temperature=1.0,
                                                                     chunk_size=2))(params)
    delta = np.abs(np.asarray(score(bf)) - np.asarray(score(TINY)))
    hidden = logprobs.completion_hidden(TINY, params, batch)
    bound = np.asarray(_bf16_logp_bound(hidden, params["embedding"].T))
    assert (delta <= bound).all() and delta.max() > 0
    h = jax.random.normal(jax.random.key(1), (3, TINY.embed_dim))
    copy = {**params, "embedding": params["embedding"].astype(jnp.bfloat16)}
    np.testing.assert_array_equal(model.logits_from_hidden(bf, params, h), model.logits_from_hidden(TINY, copy, h))
    assert not np.array_equal(model.logits_from_hidden(bf, params, h), model.logits_from_hidden(TINY, params, h))
