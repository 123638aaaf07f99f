"""Sampler: greedy = step-by-step argmax, frequencies = softmax(logits/T), top-k/top-p sets,
log-probs = a full forward pass, stop tokens, group sharing, meshes, compile counts, errors.

Every test uses the same tiny model and, where it can, the same static shapes (3 prompts
× G=2 in the 16-token buckets), so the whole file compiles only a handful of programs.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from grpo_jax.model import transformer as model
from grpo_jax import sampler, shapes
from grpo_jax.sampler import cache, calls, draw, engines, layouts
from grpo_jax.sampler.prefill import TRACE_COUNTS
from grpo_jax.config import cpu_tiny
from jax.sharding import PartitionSpec as P

from grpo_jax.config import ConfigError
from grpo_jax.parallel.sharding import batch_degree, batch_sharding, mesh_from_shape

# cpu-tiny with an untied head (a tied head makes a random model repeat its input token)
# and max_seq_len 64 so the length checks are easy to hit.
CFG = dataclasses.replace(cpu_tiny().model, tie_embeddings=False, max_seq_len=64)
PROMPTS = [[5, 17, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]  # 3, 11, 1 tokens
G = 2
_SETTINGS = {f.name for f in dataclasses.fields(sampler.SamplingParams)}


def flat(fn, cfg, params, prompts, **kw):
    """``fn`` (``sampler.sample`` / ``sample_with_info`` / ``sample_to_host``) with the
    sampling settings among ``kw`` gathered into one ``SamplingParams``."""
    settings = sampler.SamplingParams(**{k: v for k, v in kw.items() if k in _SETTINGS})
    return fn(cfg, params, prompts, settings, **{k: v for k, v in kw.items() if k not in _SETTINGS})


def _programs(mesh, engine, kv_dtype="auto"):
    """(prefill, decode) of an engine for CFG."""
    return calls.programs(CFG, mesh, engines.ENGINES[engine], kv_dtype)


def _host(prompts, group_size, mesh, engine="scan", bucket=16):
    """The host batch of an engine's layout, prompts in a 16-token bucket."""
    layout = engines.ENGINES[engine].layout(len(prompts), group_size, batch_degree(mesh))
    return layouts.host_batch(prompts, group_size, layout, 0, bucket)
LOGIT_SCALE = 8.0  # final-norm gain: logits std ~1.8 instead of ~0.2, so choices are clear-cut


def _peaky(params):
    params = dict(params)
    params["final_norm"] = {"scale": params["final_norm"]["scale"] * LOGIT_SCALE}
    return params


@pytest.fixture(scope="module")
def params():
    return _peaky(model.init_params(CFG, jax.random.key(0)))


@functools.lru_cache(maxsize=None)
def _jitted_logits():
    return jax.jit(functools.partial(model.forward_logits, CFG))


def _training_logits(params, r: sampler.Rollout):
    """What the train step computes: logits predicting each completion token, from the
    forward pass over [prompt, completion] with default positions. [B, Tc, V]."""
    tokens = jnp.concatenate([r.prompt_tokens, r.tokens], axis=1)
    mask = jnp.concatenate([r.prompt_mask, r.mask], axis=1)
    logits = _jitted_logits()(params, tokens, mask)
    tp = r.prompt_tokens.shape[1]
    return np.asarray(logits[:, tp - 1:-1])


def _sample(params, prompts=PROMPTS, **kw):
    kw = {"key": jax.random.key(7), "group_size": G, "max_new_tokens": 12, **kw}
    return flat(sampler.sample, CFG, params, prompts, **kw)


def test_rollout_layout(params):
    r = _sample(params, max_new_tokens=12)
    assert r.prompt_tokens.shape == r.prompt_mask.shape == (6, 16)
    assert r.tokens.shape == r.mask.shape == r.logprobs.shape == (6, 12)  # max_new_tokens, not the bucket
    assert r.tokens.dtype == jnp.int32 and r.logprobs.dtype == jnp.float32 and r.lengths.dtype == jnp.int32
    # Row = prompt_index * G + g; prompts are left-padded with pad_id 0.
    for i, p in enumerate(PROMPTS):
        for g in range(G):
            row = i * G + g
            np.testing.assert_array_equal(r.prompt_tokens[row, 16 - len(p):], p)
            assert not r.prompt_mask[row, : 16 - len(p)].any() and r.prompt_mask[row, 16 - len(p):].all()
            assert (np.asarray(r.prompt_tokens[row, : 16 - len(p)]) == 0).all()


def test_greedy_equals_stepwise_argmax_of_full_forward(params):
    n = 12
    r = _sample(params, temperature=0.0, max_new_tokens=n)
    # Reference: no cache, no left padding; each prompt alone, right-padded to a fixed
    # width (causal, so padding after the last token cannot change its logits).
    width = 32
    seqs = [list(p) for p in PROMPTS]
    for _ in range(n):
        buf = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            buf[i, : len(s)] = s
        logits = np.asarray(_jitted_logits()(params, jnp.asarray(buf)))
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    ref = np.array([s[len(p):] for s, p in zip(seqs, PROMPTS)])
    np.testing.assert_array_equal(np.asarray(r.tokens), np.repeat(ref, G, axis=0))
    assert len(set(ref.ravel().tolist())) > 5  # the reference is not a constant sequence
    assert r.mask.all() and (np.asarray(r.lengths) == n).all() and not r.finished.any()


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_match_full_forward_pass(params, temperature):
    r = _sample(params, temperature=temperature, key=jax.random.key(3))
    t = temperature if temperature > 0 else 1.0  # documented convention: greedy reports T=1
    logp = jax.nn.log_softmax(_training_logits(params, r) / t, axis=-1)
    ref = np.take_along_axis(np.asarray(logp), np.asarray(r.tokens)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(r.logprobs), ref, atol=1e-5)


def _allowed(scaled, top_k, top_p, slack=1e-4):
    """Reference filter on one row of tempered logits (numpy, float64). `slack` widens both
    cut-offs a little: the sampler's cached logits differ from these by ~1e-6, so a token
    lying exactly on a cut-off must not count as a violation."""
    scaled = scaled.astype(np.float64)
    allowed = np.ones(scaled.shape, bool)
    if top_k:
        kth = np.sort(scaled)[::-1][top_k - 1]
        allowed &= scaled >= kth - slack
    if top_p < 1:
        order = np.argsort(-scaled)
        order = order[: top_k] if top_k else order
        p = np.exp(scaled[order] - scaled[order].max())
        p /= p.sum()
        n_keep = 1 + int(np.sum(np.cumsum(p) < top_p - slack))
        allowed &= scaled >= scaled[order[n_keep - 1]] - slack
    return allowed


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (8, 0.7)])
def test_top_k_top_p_never_leave_the_allowed_set(params, top_k, top_p):
    temperature = 1.0
    r = _sample(params, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16,
                key=jax.random.key(11))
    scaled = _training_logits(params, r) / temperature
    tokens = np.asarray(r.tokens)
    sizes = []
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            allowed = _allowed(scaled[b, t], top_k, top_p)
            sizes.append(allowed.sum())
            assert allowed[tokens[b, t]], (b, t, tokens[b, t])
    # The filter really restricts the choice (so the check above has teeth) ...
    assert np.mean(sizes) < 0.1 * CFG.vocab_size
    # ... and the log-probs are those of the distribution actually sampled: the tempered
    # softmax renormalised over the kept tokens (issue 18, fix 7).
    ref = np.zeros(tokens.shape)
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            row = scaled[b, t].astype(np.float64)
            kept = row[_allowed(row, top_k, top_p, slack=0.0)]
            ref[b, t] = row[tokens[b, t]] - (kept.max() + np.log(np.exp(kept - kept.max()).sum()))
    np.testing.assert_allclose(np.asarray(r.logprobs), ref, atol=1e-4)
    assert (np.asarray(r.logprobs) > np.take_along_axis(
        np.asarray(jax.nn.log_softmax(scaled, -1)), tokens[..., None], -1)[..., 0] + 1e-3).any()


def test_inverse_cdf_draw_is_the_first_index_reaching_the_target():
    """The two-level draw against numpy's searchsorted over the whole row, float64 (the
    draw takes the weights vocab-major, [V, B]).

    Integer weights keep every float32 sum exact and targets halfway between two cumulative
    sums leave no rounding tie, so the draw must match index for index: over three blocks
    with the last one padded, runs of zero weight (a whole zero block included), the first
    and last index, and u = 1."""
    rng = np.random.default_rng(0)
    vocab = 2 * draw.DRAW_BLOCK + 300
    weights = rng.integers(0, 4, size=(6, vocab)).astype(np.float32)
    weights[1, : draw.DRAW_BLOCK + 10] = 0  # a whole empty block, then some
    weights[2] = 0
    weights[2, [0, vocab - 1]] = [1, 2]  # mass only at both ends
    weights[3, :-1] = 0
    weights[3, -1] = 5  # mass only on the last (padded block's) index
    cums = np.cumsum(weights.astype(np.float64), axis=1)
    draws = jax.jit(draw.inverse_cdf)
    for trial in range(40):
        k = np.array([rng.integers(0, c[-1]) for c in cums], np.float64)
        u = (k + 0.5) / cums[:, -1]
        got = np.asarray(draws(jnp.asarray(weights.T), jnp.asarray(u, jnp.float32)))
        target = np.asarray(jnp.asarray(u, jnp.float32), np.float64) * cums[:, -1]
        want = [np.searchsorted(c, t, side="left") for c, t in zip(cums, target)]
        np.testing.assert_array_equal(got, want)
        assert (weights[np.arange(6), got] > 0).all()
    last = np.asarray(draws(jnp.asarray(weights.T), jnp.ones(6, jnp.float32)))
    np.testing.assert_array_equal(last, [np.flatnonzero(w)[-1] for w in weights])


def test_first_max_is_numpy_argmax_with_ties():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 5, size=(8, 3000)).astype(np.float32)  # many ties at the maximum
    x[3] = -1.0
    x[4, -1] = 9.0
    np.testing.assert_array_equal(np.asarray(jax.jit(draw.first_max)(jnp.asarray(x.T))),
                                  np.argmax(x, axis=-1))


def test_sampled_frequencies_match_softmax(params):
    """4096 draws of one next token at T=0.8 against p = softmax(logits / 0.8).

    Pearson's chi-square over the tokens with expected count >= 5 (the rest pooled in one
    bin, so the chi-square approximation holds). With a correct sampler the statistic is
    chi2(df); p-value < 1e-3 would happen by chance once in a thousand seeds (the seed is
    fixed, so the test is deterministic). The same statistic against softmax(logits) (the
    wrong temperature) must be rejected, which shows the test can tell the difference.
    """
    n, temperature = 4096, 0.8
    prompt = [9, 8, 7, 6]
    r = flat(sampler.sample, CFG, params, [prompt], key=jax.random.key(123), group_size=n,
                        max_new_tokens=1, temperature=temperature)
    counts = np.bincount(np.asarray(r.tokens[:, 0]), minlength=CFG.vocab_size)
    buf = np.zeros((len(PROMPTS), 32), np.int32)  # the greedy test's shape: no new compile
    buf[0, : len(prompt)] = prompt
    logits = np.asarray(_jitted_logits()(params, jnp.asarray(buf)))[0, len(prompt) - 1].astype(np.float64)

    def p_value(p):
        expected = n * p
        big = expected >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        chi2 = np.sum((obs - exp) ** 2 / exp)
        return stats.chi2.sf(chi2, df=len(obs) - 1)

    softmax = lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    assert p_value(softmax(logits / temperature)) > 1e-3
    assert p_value(softmax(logits)) < 1e-6
    # Log-probs of the draws are log_softmax(logits / T) at the drawn token.
    ref = np.log(softmax(logits / temperature))[np.asarray(r.tokens[:, 0])]
    np.testing.assert_allclose(np.asarray(r.logprobs[:, 0]), ref, atol=1e-5)


def test_stop_tokens_end_completions(params):
    n, pad = 12, 3
    base = _sample(params, temperature=1.0, max_new_tokens=n, pad_id=pad)
    tokens = np.asarray(base.tokens)
    # Two stop tokens: one from row 0, and one from row 2 chosen so that some row has neither.
    s1 = int(tokens[0, 4])
    s2 = next(int(t) for t in tokens[2, 2:]
              if any(not np.isin(row, [s1, int(t)]).any() for row in tokens))
    stops = (s1, s2)
    r, info = flat(sampler.sample_with_info, CFG, params, PROMPTS, key=jax.random.key(7), group_size=G,
                                        max_new_tokens=n, temperature=1.0, pad_id=pad, stop_tokens=stops)
    seen = set()
    for b, row in enumerate(tokens):
        hits = np.flatnonzero(np.isin(row, stops))
        length = int(hits[0]) + 1 if len(hits) else n
        seen.add(bool(len(hits)))
        assert int(r.lengths[b]) == length and bool(r.finished[b]) == bool(len(hits))
        np.testing.assert_array_equal(r.tokens[b, :length], row[:length])  # same key, same draws
        np.testing.assert_array_equal(r.logprobs[b, :length], base.logprobs[b, :length])
        assert r.mask[b, :length].all() and not r.mask[b, length:].any()
        assert (np.asarray(r.tokens[b, length:]) == pad).all()
        assert (np.asarray(r.logprobs[b, length:]) == 0).all()
    assert seen == {True, False}  # both finish reasons occur
    assert info.decode_steps == n  # an unfinished row keeps the loop going to the end

    # When every row has stopped, the loop stops: all tokens of the first two columns stop.
    early = tuple(sorted(set(tokens[:, :2].ravel().tolist())))
    r, info = flat(sampler.sample_with_info, CFG, params, PROMPTS, key=jax.random.key(7), group_size=G,
                                        max_new_tokens=n, temperature=1.0, pad_id=pad, stop_tokens=early)
    assert r.finished.all() and (np.asarray(r.lengths) <= 2).all()
    assert info.decode_steps == int(np.max(r.lengths)) < n


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefill_equals_repeated_prompts(params, temperature):
    """Row r draws from fold_in(fold_in(key, step), r) whichever way the batch is built."""
    shared = _sample(params, temperature=temperature)
    repeated = [p for p in PROMPTS for _ in range(G)]
    alone = _sample(params, prompts=repeated, group_size=1, temperature=temperature)
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(alone.tokens))
    np.testing.assert_array_equal(np.asarray(shared.prompt_tokens), np.asarray(alone.prompt_tokens))
    np.testing.assert_array_equal(np.asarray(shared.mask), np.asarray(alone.mask))
    # Different prefill batch shapes may round differently in the last bits.
    np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(alone.logprobs), atol=1e-5)
    if temperature > 0:  # sampling, and the group's samples differ from one another
        assert (np.asarray(shared.tokens[0]) != np.asarray(shared.tokens[1])).any()


def test_calls_of_one_prompt_equal_one_call(params):
    """sample_to_host in calls of 1 prompt: each call's rows keep their index in the batch
    (the randomness index) and the batch's prompt bucket, so the rows equal one call's."""
    kw = dict(key=jax.random.key(7), group_size=G, max_new_tokens=12, temperature=1.0)
    one = _sample(params, temperature=1.0)
    calls = flat(sampler.sample_to_host, CFG, params, PROMPTS, prompts_per_call=1, **kw)
    assert isinstance(calls.tokens, np.ndarray) and calls.tokens.shape == (6, 12)
    for name in ("prompt_tokens", "prompt_mask", "tokens", "mask", "lengths", "finished"):
        np.testing.assert_array_equal(np.asarray(getattr(one, name)), getattr(calls, name), err_msg=name)
    np.testing.assert_allclose(np.asarray(one.logprobs), calls.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="prompts_per_call must be an int >= 0"):
        flat(sampler.sample_to_host, CFG, params, PROMPTS, prompts_per_call=-1, **kw)


def test_decode_engine_resolution_and_its_errors():
    """auto: feature_major on one CPU device, unrolled on a CPU mesh; feature_major on a mesh
    and an unknown name are refused naming rl.decode."""
    mesh = mesh_from_shape((2, 1, 1))
    assert sampler.resolve("auto", None).name == "feature_major"
    assert sampler.resolve("auto", mesh).name == "unrolled"
    assert sampler.resolve("scan", mesh).name == "scan"
    with pytest.raises(ConfigError, match="rl.decode=feature_major runs on one CPU device; this sampler has a mesh of 2"):
        sampler.resolve("feature_major", mesh).name
    with pytest.raises(ConfigError, match="rl.decode='fast' is not one of"):
        sampler.resolve("fast", None).name
    # An int8 cache: auto on one CPU device takes the unrolled engine; feature_major is refused.
    assert sampler.resolve("auto", None, "int8").name == "unrolled"
    assert sampler.resolve("auto", None, "bfloat16").name == "feature_major"
    with pytest.raises(ConfigError, match="rl.kv_dtype=int8 needs the scan, unrolled or shared decode engine"):
        sampler.resolve("feature_major", None, "int8").name
    with pytest.raises(ConfigError, match="rl.kv_dtype='fp8' is not one of"):
        sampler.resolve("auto", None, "fp8").name


@pytest.mark.parametrize("engine,new_tokens", [("scan", 12), ("unrolled", 12), ("shared", 12), ("shared", 48)])
def test_an_int8_cache_reports_log_probs_near_the_full_forward(params, engine, new_tokens):
    """Every engine over an int8 cache (int8 keys and values, a scale per slot and head):
    the log-prob it reports for each token it drew is within 0.05 of the float32 forward
    pass over the whole sequence (what the trainer recomputes), and not equal to it. 48
    new tokens: the shared engine's completion cache grows between two phases, scales too."""
    prefill, _ = _programs(None, engine, "int8")
    host = _host(PROMPTS, G, None, engine)
    cache, _ = prefill.eval_shape(params, host.prompt_tokens, host.prompt_mask,
                                  host.src_rows if engine != "shared" else None, cache_len=16)
    assert cache.k.dtype == cache.v.dtype == jnp.int8
    assert cache.k_scale.shape == cache.v_scale.shape == cache.k.shape[:3] + (16,)
    assert len(engines.ENGINES[engine].cache_plan(16, shapes.bucket_length(new_tokens), 4)[1]) == (2 if new_tokens == 48 else 1)
    r = _sample(params, temperature=1.0, engine=engine, kv_dtype="int8", max_new_tokens=new_tokens)
    logp = jax.nn.log_softmax(_training_logits(params, r), axis=-1)
    want = np.take_along_axis(np.asarray(logp), np.asarray(r.tokens)[..., None], axis=-1)[..., 0]
    gap = np.abs(np.where(np.asarray(r.mask), np.asarray(r.logprobs) - want, 0.0))
    assert 0 < gap.max() < 0.05


def test_an_int8_cache_on_a_mesh_draws_what_one_device_draws(params):
    """The int8 cache's scales are sharded and copied like its keys: on 8 devices (rows over
    4 shards, heads over 'tensor') the unrolled and shared engines draw what one device draws."""
    kw = dict(key=jax.random.key(5), group_size=G, max_new_tokens=12, temperature=1.0, kv_dtype="int8")
    mesh8 = mesh_from_shape((2, 2, 2))
    p8 = _peaky(model.init_params(CFG, jax.random.key(0), mesh8))
    a = flat(sampler.sample, CFG, params, PROMPTS, engine="scan", **kw)
    for engine in ("unrolled", "shared"):
        b = flat(sampler.sample, CFG, p8, PROMPTS, mesh=mesh8, engine=engine, **kw)
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens), err_msg=engine)
        np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-4, err_msg=engine)


@pytest.mark.parametrize("engine", ["unrolled", "feature_major", "shared"])
def test_every_decode_engine_draws_what_the_scan_engine_draws(params, engine):
    a = _sample(params, temperature=1.0, engine=engine)
    b = _sample(params, temperature=1.0, engine="scan")
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)


@pytest.mark.parametrize("num,group,degree", [(3, 2, 4), (16, 64, 64), (5, 3, 4), (2, 16, 8),
                                               (7, 1, 4), (1, 8, 8), (3, 5, 1)])
def test_prefill_layout_keeps_every_rows_prompt_on_its_shard(num, group, degree):
    slots, src = layouts.prefill_layout(num, group, degree)
    rows = num * group
    assert len(slots) % degree == 0 and len(src) % degree == 0 and len(src) - rows < degree
    per_slot_block, per_row_block = len(slots) // degree, len(src) // degree
    for r in range(len(src)):
        assert src[r] // per_slot_block == r // per_row_block  # same shard
        if r < rows:
            assert slots[src[r]] == r // group
    # Every prompt is prefilled at least once, and no shard prefills more than it needs.
    assert set(range(num)) <= set(slots.tolist())
    if group == 1:
        np.testing.assert_array_equal(slots[src[:rows]], np.arange(rows))


@pytest.mark.parametrize("num,group,degree", [(3, 2, 4), (16, 64, 64), (5, 3, 4), (2, 16, 8),
                                               (7, 1, 4), (1, 8, 8), (3, 5, 1)])
def test_shared_layout_gives_each_slot_a_run_of_rows_on_one_shard(num, group, degree):
    """The shared engine's rows read their slot's cache in place: slot of row b is b // r for
    one r, every slot's rows lie on one shard, and every real row's slot holds its prompt."""
    slots, src = layouts.shared_layout(num, group, degree)
    rows = num * group
    assert len(src) % degree == 0 and len(src) - rows < degree
    r = len(src) // len(slots)
    np.testing.assert_array_equal(src, np.arange(len(src)) // r)
    per_shard = len(src) // degree
    assert per_shard % r == 0 and group % r == 0
    np.testing.assert_array_equal(slots[src[:rows]], np.arange(rows) // group)
    assert (slots[len(src[:rows]) // r + (rows % r > 0):] == -1).all()


def test_phase_steps_follow_the_decode_loop():
    """Steps per phase as `_decode`'s condition runs them: step s writes slot Tp + s - 1."""
    assert cache.phase_steps((32, 64, 96, 128), 128, 127) == [32, 32, 32, 31]
    assert cache.phase_steps((48, 80, 112, 144), 128, 127) == [32, 32, 32, 31]  # Tp = 16
    assert cache.phase_steps((32, 64, 96, 128), 128, 40) == [32, 8, 0, 0]
    assert cache.phase_steps((144,), 128, 99) == [99]
    # Two phases (completion slots 32 then 64): the shared engine still draws what the
    # scan engine draws, and a row that never stops runs all max_new_tokens columns.
    assert engines.ENGINES["shared"].cache_plan(16, 64, 4)[1] == (32, 64)
    kw = dict(key=jax.random.key(1), group_size=G, max_new_tokens=50, temperature=1.0, stop_tokens=())
    params = _peaky(model.init_params(CFG, jax.random.key(0)))
    r, info = flat(sampler.sample_with_info, CFG, params, PROMPTS, engine="shared", **kw)
    assert info.decode_steps == 50 and r.mask.all()
    np.testing.assert_array_equal(np.asarray(r.tokens), np.asarray(flat(sampler.sample, CFG, params, PROMPTS, engine="scan", **kw).tokens))
    # rl.decode_phases: at most that many phases, each at least 32 slots; one phase draws the same.
    assert engines.ENGINES["shared"].cache_plan(16, 64, 1)[1] == (64,)
    assert engines.ENGINES["shared"].cache_plan(16, 1024, 16)[1] == tuple(range(64, 1025, 64))
    assert engines.ENGINES["feature_major"].cache_plan(16, 128, 8) == (48, (48, 80, 112, 144))
    one = flat(sampler.sample, CFG, params, PROMPTS, engine="shared", decode_phases=1, **kw)
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(r.tokens))


def test_shared_engine_on_a_mesh_draws_what_one_device_draws(params):
    """The shared engine with the batch over 4 shards (3 prompts x G = 2 padded to 8 rows:
    a prompt's two rows on one shard) and heads over 'tensor' samples what the scan engine
    samples on one device."""
    kw = dict(key=jax.random.key(5), group_size=G, max_new_tokens=12, temperature=1.0)
    mesh8 = mesh_from_shape((2, 2, 2))
    p8 = _peaky(model.init_params(CFG, jax.random.key(0), mesh8))
    a = flat(sampler.sample, CFG, params, PROMPTS, engine="scan", **kw)
    b = flat(sampler.sample, CFG, p8, PROMPTS, mesh=mesh8, engine="shared", **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)


def test_prefill_moves_no_cache_between_devices():
    """2 prompts x G = 16 on 8 data-parallel replicas (the sampling mesh of a slice preset:
    whole weights on every device): each device copies its prompt's cache to its own 4
    rows, so the compiled prefill has no collective at all."""
    from grpo_jax import aot

    mesh = mesh_from_shape((8, 1, 1))
    p8 = model.init_params(CFG, jax.random.key(0), mesh)
    host = _host([[1, 2, 3], [4, 5]], 16, mesh)
    prefill, _ = _programs(mesh, "unrolled")
    put = lambda x: jax.device_put(x, batch_sharding(mesh, x.ndim, x.shape[0]))
    lowered = prefill.lower(p8, put(host.prompt_tokens), put(host.prompt_mask), put(host.src_rows),
                            cache_len=32)
    cache, _ = prefill.eval_shape(p8, put(host.prompt_tokens), put(host.prompt_mask),
                                  put(host.src_rows), cache_len=32)
    assert cache.k.shape[1] == 32
    assert aot.collectives(lowered.compile().as_text()) == {}


def test_same_results_on_meshes(params):
    """(1,1,1) and (2,2,2): batch sharded 4 ways (3 prompts × G=2 = 6 rows padded to 8 with
    dummy rows), heads and vocab over 'tensor', embed over 'fsdp' — same samples."""
    kw = dict(key=jax.random.key(5), group_size=G, max_new_tokens=12, temperature=1.0, top_k=50)
    mesh1, mesh8 = mesh_from_shape((1, 1, 1)), mesh_from_shape((2, 2, 2))
    # `params` is init_params(CFG, key(0)); the same key on the 8-device mesh gives the same
    # values, created directly in their shards.
    p8 = _peaky(model.init_params(CFG, jax.random.key(0), mesh8))
    assert p8["layers"]["mlp"]["up"].sharding.spec == P(None, "fsdp", "tensor")
    a, ia = flat(sampler.sample_with_info, CFG, params, PROMPTS, mesh=mesh1, **kw)
    b, ib = flat(sampler.sample_with_info, CFG, p8, PROMPTS, mesh=mesh8, **kw)
    assert (ia.prompt_rows, ia.sample_rows) == (3, 6) and (ib.prompt_rows, ib.sample_rows) == (4, 8)
    assert b.tokens.shape == (6, 12)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)
    assert p8["layers"]["mlp"]["up"].sharding.spec == P(None, "fsdp", "tensor")  # untouched

    # Dummy rows start finished: when every real row stops early the loop stops early.
    # (mesh omitted: the sampler takes the mesh the params live on)
    stops = tuple(sorted(set(np.asarray(a.tokens[:, 0]).tolist())))
    r, info = flat(sampler.sample_with_info, CFG, p8, PROMPTS, stop_tokens=stops, **kw)
    assert info.sample_rows == 8 and r.finished.all() and info.decode_steps == 1


def test_one_compilation_per_bucket(params):
    """Prompt lengths, max_new_tokens (within its bucket), temperature, top_p's value, stop
    tokens, pad id and key are all traced: a new batch in the same buckets never retraces."""
    rng = np.random.default_rng(0)

    def batch(max_len):
        return [rng.integers(0, CFG.vocab_size, rng.integers(1, max_len + 1)).tolist() for _ in PROMPTS]

    _sample(params, prompts=batch(16), top_p=0.9)
    before = dict(TRACE_COUNTS)
    for i, (max_new, temp) in enumerate([(5, 0.0), (16, 1.3), (9, 0.5)]):
        r = _sample(params, prompts=batch(16), max_new_tokens=max_new, temperature=temp, top_p=0.5 + 0.1 * i,
                    stop_tokens=tuple(range(i)), pad_id=i, key=jax.random.key(i))
        assert r.tokens.shape == (6, max_new)
    assert dict(TRACE_COUNTS) == before
    # A longer prompt moves to the next prompt bucket: exactly one new trace of each.
    _sample(params, prompts=[list(range(20)), [1], [2, 3]], top_p=0.9)
    after = dict(TRACE_COUNTS)
    assert (after["prefill"] - before["prefill"], after["decode"] - before["decode"]) == (1, 1)


@pytest.mark.parametrize("prompts,kwargs,error,match", [
    ([], {}, ValueError, "prompts is empty"),
    ([[1, 2], []], {}, ValueError, "prompt 1 is empty"),
    ([[1] * 57], {"max_new_tokens": 8}, ValueError, "at most cfg.max_seq_len - max_new_tokens = 56"),
    ([[1, 600]], {}, ValueError, "outside the vocabulary"),
    (["hello"], {}, TypeError, "tokenize it first"),
    ([[1]], {"group_size": 0}, ValueError, "group_size must be"),
    ([[1]], {"max_new_tokens": 0}, ValueError, "max_new_tokens must be"),
    ([[1]], {"temperature": -0.5}, ValueError, "temperature must be >= 0"),
    ([[1]], {"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
    ([[1]], {"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
    ([[1]], {"decode_phases": 0}, ValueError, r"decode_phases must be an int >= 1, got 0"),
    ([[1]], {"top_k": -1}, ValueError, "top_k must be"),
    ([[1]], {"stop_tokens": (2, 512)}, ValueError, r"stop_tokens \[512\] outside"),
])
def test_bad_input_raises_clear_errors(params, prompts, kwargs, error, match):
    kwargs = {"key": jax.random.key(0), "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        flat(sampler.sample, CFG, params, prompts, **kwargs)


def test_prefill_chunks_hold_at_most_the_chunk_tokens():
    tokens = engines.PREFILL_CHUNK_TOKENS
    fm = "feature_major"
    assert engines.ENGINES[fm].prefill_chunks(64, 64) == -(-64 * 64 // tokens) > 1
    assert engines.ENGINES[fm].prefill_chunks(3, tokens) == 3  # one row each
    assert engines.ENGINES[fm].prefill_chunks(3, 2 * tokens) == 3  # a row is never split
    assert engines.ENGINES[fm].prefill_chunks(tokens // 16, 16) == 1
    for engine in ("scan", "unrolled"):  # the model's forward: one pass
        assert engines.ENGINES[engine].prefill_chunks(64, 64) == 1


def test_prefill_in_row_chunks_equals_one_pass(params):
    """3 prompts in chunks of 2 rows (the last one padded with a dummy row), each prompt's
    cache then copied to its G rows: the cache and logits of one prefill pass."""
    host = _host(PROMPTS, G, None)
    prefill, _ = _programs(None, "feature_major")
    run = lambda chunk: prefill(params, host.prompt_tokens, host.prompt_mask, host.src_rows, cache_len=32,
                                chunk_tokens=chunk)
    assert engines.ENGINES["feature_major"].prefill_chunks(3, 16, 2 * 16) == 2
    one, chunked = run(None), run(2 * 16)  # 2 rows of the 16-token bucket
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(chunked)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)


def test_per_layer_prefill_cache_equals_the_stacked_one(params):
    """The feature-major decode's cache comes from the prefill as one buffer per layer; it
    holds what the stacked cache holds, row copies of the shared prefill included."""
    host = _host(PROMPTS, G, None)
    args = (params, host.prompt_tokens, host.prompt_mask, host.src_rows)
    run = lambda engine: _programs(None, engine)[0](*args, cache_len=32)
    (stacked, logits), (layers, logits_pl) = run("scan"), run("feature_major")
    assert isinstance(layers.k, list) and len(layers.k) == len(layers.v) == CFG.num_layers
    for i in range(CFG.num_layers):
        np.testing.assert_array_equal(np.asarray(layers.k[i]), np.asarray(stacked.k[i]))
        np.testing.assert_array_equal(np.asarray(layers.v[i]), np.asarray(stacked.v[i]))
    np.testing.assert_array_equal(np.asarray(layers.mask), np.asarray(stacked.mask))
    np.testing.assert_array_equal(np.asarray(logits_pl), np.asarray(logits))
    assert layers.k[0].shape == (len(PROMPTS) * G, CFG.num_kv_heads, CFG.head_dim, 32)
