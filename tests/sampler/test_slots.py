"""The slot engine (rl.decode=slots): every row's tokens equal the static engine's for the same
key, whatever the slots, greedy or sampled, with stop tokens, budgets, calls and meshes; its
decode steps are its schedule's; the per-row cache write it rests on; its settings' errors.

Shapes follow tests/sampler/test_sampling.py (the same tiny model, 16-token buckets), so the
static programs are the ones that file compiles.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import sampler
from grpo_jax.config import ConfigError, cpu_tiny
from grpo_jax.model import transformer as model
from grpo_jax.parallel.sharding import mesh_from_shape
from grpo_jax.sampler import engines, slots
from grpo_jax.sampler.prefill import TRACE_COUNTS

CFG = dataclasses.replace(cpu_tiny().model, tie_embeddings=False, max_seq_len=64)
PROMPTS = [[5, 17, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [7, 8]]
G = 3
# Tokens the peaky random model draws often enough that some rows stop early, others not.
STOPS = (3, 9, 77, 100, 200, 250, 301, 400)


def _peaky(params):
    params = dict(params)
    params["final_norm"] = {"scale": params["final_norm"]["scale"] * 8.0}
    return params


@pytest.fixture(scope="module")
def params():
    return _peaky(model.init_params(CFG, jax.random.key(0)))


def _sample(params, engine, *, slots_=0, mesh=None, key=7, **kw):
    kw = {"max_new_tokens": 12, "temperature": 1.0, **kw}
    settings = sampler.SamplingParams(engine=engine, slots=slots_, **kw)
    return sampler.sample_with_info(CFG, params, PROMPTS, settings, key=jax.random.key(key), group_size=G, mesh=mesh)


def _assert_same_rows(static, slotted, atol=1e-5):
    for name in ("prompt_tokens", "prompt_mask", "tokens", "mask", "lengths", "finished"):
        np.testing.assert_array_equal(np.asarray(getattr(static, name)), np.asarray(getattr(slotted, name)),
                                      err_msg=name)
    np.testing.assert_allclose(np.asarray(static.logprobs), np.asarray(slotted.logprobs), atol=atol)


@pytest.mark.parametrize("temperature,stops", [(0.0, ()), (1.0, ()), (0.0, STOPS), (1.0, STOPS)])
@pytest.mark.parametrize("num_slots", [1, 5, 12])
def test_every_row_equals_the_static_engines(params, temperature, stops, num_slots):
    """12 rows on 1 slot (each row alone), 5 (refilled as rows end) or 12 (one static call's
    rows): the same tokens, masks, lengths and stops as the static engine, log-probs to
    float rounding."""
    static, _ = _sample(params, "scan", temperature=temperature, stop_tokens=stops)
    slotted, info = _sample(params, "slots", slots_=num_slots, temperature=temperature, stop_tokens=stops)
    _assert_same_rows(static, slotted)
    assert info.sample_rows == num_slots
    assert (np.asarray(static.lengths) < 12).any() == bool(stops)


@pytest.mark.parametrize("max_new_tokens,top_k,top_p", [(5, 0, 1.0), (16, 20, 0.9), (1, 0, 1.0)])
def test_budgets_and_truncated_sampling_equal_the_static_engines(params, max_new_tokens, top_k, top_p):
    static, _ = _sample(params, "feature_major", max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p,
                        stop_tokens=STOPS)
    slotted, _ = _sample(params, "slots", slots_=4, max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p,
                         stop_tokens=STOPS)
    _assert_same_rows(static, slotted)
    assert slotted.tokens.shape == (len(PROMPTS) * G, max_new_tokens)


def test_an_int8_cache_equals_the_static_engines_int8_cache(params):
    """The slots insert a prompt's int8 keys and values with their scales, and append with them."""
    static, _ = _sample(params, "unrolled", kv_dtype="int8", stop_tokens=STOPS)
    slotted, _ = _sample(params, "slots", slots_=5, kv_dtype="int8", stop_tokens=STOPS)
    _assert_same_rows(static, slotted)


def test_decode_steps_are_the_schedules_and_fewer_than_the_static_calls(params):
    """The host loop is `slots.schedule`: its decode steps on the rows' lengths are the
    engine's, and on 3 slots they undercut static calls of 3 rows (each call runs to its
    longest row)."""
    free, _ = _sample(params, "scan")
    # stop tokens drawn early in a few rows: some rows end early, some run to the budget
    stops = tuple(sorted({int(free.tokens[r, 3]) for r in (0, 5, 10)}))
    slotted, info = _sample(params, "slots", slots_=3, stop_tokens=stops)
    lengths = np.asarray(slotted.lengths)
    assert lengths.min() < 6 and lengths.max() == 12
    assert info.decode_steps == slots.schedule(lengths, 3)[0]
    assert info.decode_steps < slots.static_steps(lengths, 3)


def test_schedule_by_hand():
    # One slot: the rows one after another.
    assert slots.schedule([3, 1, 2], 1) == (6, 6)
    # Two slots, each refilled the step after its row ends: [3] beside [1, 2]; static calls
    # of 2 rows: 3 + 2.
    assert slots.schedule([3, 1, 2], 2) == (3, 6)
    assert slots.static_steps([3, 1, 2], 2) == 5
    assert slots.schedule([3, 1, 2, 2, 5], 2) == (8, 13)  # [3] beside [1, 2], then [2] beside [5]


def test_calls_of_a_few_questions_are_one_queue(params):
    """sample_to_host with prompts_per_call: the static engine's calls' rows, from one queue
    whose slots default to one call's rows."""
    settings = sampler.SamplingParams(max_new_tokens=12, temperature=1.0, stop_tokens=STOPS)
    kw = dict(key=jax.random.key(3), group_size=G, prompts_per_call=1)
    static = sampler.sample_to_host(CFG, params, PROMPTS, settings.replace(engine="scan"), **kw)
    calls = []
    slotted = sampler.sample_to_host(CFG, params, PROMPTS, settings.replace(engine="slots"),
                                     between_calls=lambda: calls.append(1), **kw)
    _assert_same_rows(static, slotted)
    # chunks of two questions (the 3 slots' rows and one question more), each prefilled from
    # the next queued row's question: between_calls ran before each chunk but the first
    assert 1 <= len(calls) <= len(PROMPTS) - 1


def test_on_a_mesh_of_fake_devices(params):
    mesh8 = mesh_from_shape((2, 2, 2))
    p8 = _peaky(model.init_params(CFG, jax.random.key(0), mesh8))
    static, _ = _sample(params, "scan", top_k=50, stop_tokens=STOPS)
    for num_slots, expect in ((4, 4), (6, 8)):  # slots: a multiple of the 4 batch shards
        slotted, info = _sample(p8, "slots", slots_=num_slots, mesh=mesh8, top_k=50, stop_tokens=STOPS)
        _assert_same_rows(static, slotted)
        assert info.sample_rows == expect


def test_one_decode_program_per_shape(params):
    """Temperature, stop tokens, budget within its bucket and key are traced: new values
    never retrace the slot programs."""
    _sample(params, "slots", slots_=4, max_new_tokens=12)
    before = dict(TRACE_COUNTS)
    _sample(params, "slots", slots_=4, max_new_tokens=9, temperature=0.0, stop_tokens=(1, 2), key=1)
    assert dict(TRACE_COUNTS) == before


def test_write_at_a_row_wise_index_writes_each_row_at_its_own_slot():
    buf = jnp.zeros((3, 2, 6))
    x = jnp.arange(3 * 2 * 2, dtype=jnp.float32).reshape(3, 2, 2) + 1
    index = jnp.array([0, 4, 2])
    out = np.asarray(model.write_at(buf, x, index, axis=2))
    want = np.zeros((3, 2, 6))
    for b, i in enumerate([0, 4, 2]):
        want[b, :, i:i + 2] = np.asarray(x[b])
    np.testing.assert_array_equal(out, want)
    # a scalar index: every row at the same slot, as before
    np.testing.assert_array_equal(np.asarray(model.write_at(buf, x, jnp.int32(1), axis=2))[:, :, 1:3], np.asarray(x))
    np.testing.assert_array_equal(np.asarray(model.query_slots(index, 3, 2)), [[0, 1], [4, 5], [2, 3]])


def test_resolution_and_settings_errors():
    engine = engines.resolve("slots", None)
    assert engine.refills and engine.step is engines.ENGINES["feature_major"]
    assert engines.resolve("slots", None, "int8").step is engines.ENGINES["unrolled"]
    assert engines.resolve("slots", mesh_from_shape((2, 2, 2))).step is engines.ENGINES["unrolled"]
    assert not engines.resolve("auto", None).refills
    with pytest.raises(ValueError, match="slots must be an int >= 0"):
        sampler.SamplingParams(max_new_tokens=4, slots=-1)
    from grpo_jax import config as config_lib
    cfg = config_lib.apply_overrides(config_lib.get_preset("cpu-tiny"), ["rl.decode=slots", "rl.decode_slots=8"])
    assert sampler.SamplingParams.from_rl(cfg.validate().rl).slots == 8
    with pytest.raises(ConfigError, match="rl.decode_slots must be >= 0"):
        config_lib.apply_overrides(config_lib.get_preset("cpu-tiny"), ["rl.decode_slots=-2"]).validate()
