"""The jitted, sharded train step: learning, mesh / micro-batch invariance, every option
matters, β = 0 keeps no reference, memory order, and sampler / recomputed log-prob parity.

Compiling a train step is the expensive part on CPU, so compiled steps are cached per
static configuration for the whole module (``_step``) and option values are switched with
``TrainStep.with_config``, which reuses the compiled program (the values are data).
"""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.rl import batching
from grpo_jax.model import logprobs, transformer as model
from grpo_jax.rl import train_step as ts
from grpo_jax.config import Config, ModelConfig, RLConfig
from grpo_jax.parallel.sharding import mesh_from_shape

TINY = ModelConfig(vocab_size=64, embed_dim=32, num_layers=1, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64, max_seq_len=64)  # 1 layer: compile time dominates
P, G, TP, TC = 2, 4, 16, 8  # the sampler's shapes for 2 prompts × 4 samples, 8 new tokens
B = P * G
CHUNK = 3  # 3 chunks of the 8 completion positions (≠ num_layers, for the jaxpr count)
# SGD: every change of gradient scale shows in the params (Adam's first step would hide it)
TX = optax.sgd(0.05, momentum=0.9)
VALUE_TX = optax.sgd(0.05, momentum=0.9)


def _cfg(**rl) -> Config:
    base = RLConfig(group_size=G, beta=0.04, max_new_tokens=TC, logprob_chunk_size=CHUNK)
    return Config(model=TINY, rl=dataclasses.replace(base, **rl)).validate()


def _batch() -> batching.Batch:
    rng = np.random.default_rng(0)
    plen = rng.integers(3, TP + 1, B)
    pmask = np.arange(TP)[None] >= (TP - plen)[:, None]
    clen = np.array([8, 3, 6, 1, 8, 5, 2, 7])
    cmask = np.arange(TC)[None] < clen[:, None]
    rewards = np.array([1.0, 0.0, 1.0, 0.5, 0.3, 0.3, 0.3, 0.3])  # group 1: zero variance
    steps = np.array([[0, 3, 7]] * B)
    return batching.make_batch(
        np.where(pmask, rng.integers(1, 64, (B, TP)), 0), pmask,
        np.where(cmask, rng.integers(1, 64, (B, TC)), 0), cmask,
        rewards=rewards, correct=rewards > 0.4, truncated=clen == TC,
        step_rewards=rng.normal(size=(B, 3)), step_end=steps, step_mask=steps < clen[:, None])


BATCH = _batch()


def _random_params(rng, value_head=False):
    """Like model.init_params (N(0, 0.02) weights, unit norm scales) without compiling the
    model's init: host numpy arrays shaped by model.param_shapes."""
    def fill(path, s):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "norm" in name:
            return np.ones(s.shape, np.float32)
        if name == "value_bias":
            return np.zeros(s.shape, np.float32)
        return (0.02 * rng.standard_normal(s.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(fill, model.param_shapes(TINY, value_head))


@pytest.fixture(scope="module")
def params():
    """Host arrays: the policy, a nearby reference, a value model (trunk + head)."""
    rng = np.random.default_rng(0)
    policy = _random_params(rng)
    ref = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(np.float32), policy)
    value = dict(policy, **{k: v for k, v in _random_params(rng, True).items()
                            if k in ("value_head", "value_bias")})
    value["value_head"] = 5 * value["value_head"]
    return {"policy": policy, "ref": ref, "value": value}


_SHARDINGS: dict = {}


def _shardings(mesh_shape, value_head=False):
    key = (mesh_shape, value_head)
    if key not in _SHARDINGS:
        _SHARDINGS[key] = model.param_shardings(TINY, mesh_from_shape(mesh_shape), value_head)
    return _SHARDINGS[key]


_STEPS: dict = {}


def _step(cfg: Config, mesh_shape=(1, 1, 1)) -> ts.TrainStep:
    """A compiled step for cfg's static part (cached), carrying cfg's values."""
    key = (ts.static_config_key(cfg), mesh_shape)
    if key not in _STEPS:
        _STEPS[key] = ts.make_train_step(cfg, TX, mesh_from_shape(mesh_shape), value_tx=VALUE_TX)
    return _STEPS[key].with_config(cfg)


def _state(cfg: Config, params, mesh_shape=(1, 1, 1), perturbed_ref=True) -> ts.TrainState:
    """A fresh state (own buffers: the step donates it) on the mesh; the reference differs
    from the policy so that KL terms have gradients from the first step."""
    put = lambda tree, value_head=False: jax.device_put(
        jax.tree.map(np.array, tree), _shardings(mesh_shape, value_head))
    state = ts.init_train_state(cfg, put(params["policy"]), TX, value_params=put(params["value"], True),
                                value_tx=VALUE_TX)
    if state.ref_params is not None and perturbed_ref:
        state = state.replace(ref_params=put(params["ref"]))
    return state


def _run(cfg, params, batch=BATCH, steps=1, mesh_shape=(1, 1, 1)):
    step, state = _step(cfg, mesh_shape), _state(cfg, params, mesh_shape)
    history = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    return jax.device_get(state), history


def _flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def _max_diff(a, b):
    return float(np.max(np.abs(_flat(a) - _flat(b))))


# ----------------------------------------------------------------- API and state

def test_metrics_and_state_layout(params):
    cfg = _cfg()
    state, (metrics,) = _run(cfg, params)
    assert set(ts.METRIC_NAMES) <= set(metrics)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert int(state.step) == 1 and state.value_params is None and state.ref_params is not None
    assert metrics["tokens"] == float(BATCH.mask.sum())
    assert metrics["reward_mean"] == pytest.approx(float(BATCH.rewards.mean()))
    assert metrics["kl"] > 0 and metrics["entropy"] > 0 and metrics["grad_norm"] > 0
    assert metrics["groups_kept_fraction"] == 1.0


def test_empty_loss_leaves_the_state_unchanged(params):
    """Every group has zero reward variance and is skipped: nothing to learn from, so the
    update is skipped (params and optimiser state unchanged), the loss is 0, not NaN."""
    cfg = _cfg(skip_zero_variance_groups=True)
    batch = BATCH.replace(rewards=np.ones(B, np.float32))
    state, (m,) = _run(cfg, params, batch=batch)
    assert m["groups_kept_fraction"] == 0.0 and m["loss"] == 0.0
    np.testing.assert_array_equal(_flat(state.params), _flat(params["policy"]))
    assert int(state.step) == 1


def test_state_owns_copies_and_callers_params_survive_the_step(params):
    mesh_params = jax.device_put(jax.tree.map(np.array, params["policy"]), _shardings((1, 1, 1)))
    cfg = _cfg()
    state = ts.init_train_state(cfg, mesh_params, TX)
    _step(cfg)(state, BATCH)  # donates the state's buffers, not the caller's
    np.testing.assert_array_equal(_flat(mesh_params), _flat(params["policy"]))


def test_reset_reference_copies_the_policy(params):
    state = _state(_cfg(), params)
    state = ts.reset_reference(state)
    np.testing.assert_array_equal(_flat(state.ref_params), _flat(state.params))
    leaves = zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(state.params))
    assert all(a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer() for a, b in leaves)
    assert ts.reset_reference(_state(_cfg(beta=0.0), params)).ref_params is None


def test_batch_from_rollout_fields():
    @dataclasses.dataclass
    class FakeRollout:
        prompt_tokens: np.ndarray
        prompt_mask: np.ndarray
        tokens: np.ndarray
        mask: np.ndarray
        logprobs: np.ndarray
        finished: np.ndarray
        tool_mask: np.ndarray | None = None

    rollout = FakeRollout(BATCH.prompt_tokens, BATCH.prompt_mask, BATCH.tokens, BATCH.mask,
                          np.full((B, TC), -1.0, np.float32), ~BATCH.truncated)
    batch = batching.batch_from_rollout(rollout, rewards=list(range(B)), correct=[True] * B)
    np.testing.assert_array_equal(batch.truncated, BATCH.truncated)
    assert batch.rewards.dtype == np.float32 and batch.correct.all()
    assert batch.step_rewards.shape == (B, 1) and not batch.step_mask.any()
    np.testing.assert_array_equal(batch.sample_logprobs, -1.0)
    assert batch.tool_mask is None  # no tool: the train step's inputs are as before
    tool_mask = np.asarray(BATCH.mask) & (np.arange(TC) == 1)
    with_tools = batching.batch_from_rollout(dataclasses.replace(rollout, tool_mask=tool_mask), rewards=[0.0] * B,
                                             correct=[True] * B)
    np.testing.assert_array_equal(with_tools.tool_mask, tool_mask)


def _count_step_eqns(cfg, params, predicate) -> int:
    """Equations of the step's jaxpr (at any nesting depth) for which ``predicate`` holds."""
    state = _state(cfg, params)
    jaxpr = jax.make_jaxpr(_step(cfg).fn)(state, jax.tree.map(jnp.asarray, BATCH),
                                          ts.RLHParams.from_config(cfg.rl))

    def count(jx):
        n = 0
        for eqn in jx.eqns:
            n += bool(predicate(eqn))
            for p in eqn.params.values():
                for q in (p if isinstance(p, (list, tuple)) else [p]):
                    if isinstance(q, jax.extend.core.ClosedJaxpr):
                        n += count(q.jaxpr)
                    elif isinstance(q, jax.extend.core.Jaxpr):
                        n += count(q)
        return n

    return count(jaxpr.jaxpr)


def test_beta_zero_keeps_no_reference_and_runs_the_model_fewer_times(params):
    with_ref, no_ref = _cfg(beta=0.04), _cfg(beta=0.0)
    assert _state(no_ref, params).ref_params is None
    with pytest.raises(ValueError, match="reference"):  # a β>0 state for a β=0 step
        _step(no_ref)(_state(with_ref, params), BATCH)

    def layer_scans(cfg):
        return _count_step_eqns(cfg, params, lambda eqn: eqn.primitive.name == "scan"
                                and eqn.params["length"] == TINY.num_layers)

    # β > 0: reference forward + policy forward + its backward; β = 0: no reference forward
    assert layer_scans(with_ref) == layer_scans(no_ref) + 1
    _, (m,) = _run(no_ref, params)
    assert m["kl"] == 0.0


def test_logprob_keep_probs_gives_the_same_step_without_recomputing_logits(params):
    """rl.logprob_keep_probs reaches the differentiated log-probs: the same loss and
    parameters, and the step's program has fewer [rows, chunk, V] matmuls (the backward
    pass reuses the forward's softmax instead of recomputing the logits)."""
    keep, recompute = _cfg(logprob_keep_probs=True), _cfg()
    a, (ma,) = _run(keep, params)
    b, (mb,) = _run(recompute, params)
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-7), key
    np.testing.assert_allclose(_flat(a.params), _flat(b.params), rtol=1e-5, atol=1e-6)

    def logit_dots(cfg):
        return _count_step_eqns(cfg, params, lambda eqn: eqn.primitive.name == "dot_general"
                                and eqn.outvars[0].aval.shape[-2:] == (CHUNK, TINY.vocab_size))

    # GRPO with μ = 1: the reference's and the policy's forward logits, plus the policy's
    # recomputed logits in its backward pass unless the softmax is kept
    assert logit_dots(recompute) == logit_dots(keep) + 1


# ----------------------------------------------------------------- learning

def _surrogate(cfg, params_tree, batch=BATCH):
    """−Σ_i Â_i · mean_t log π_θ(o_i,t): the GRPO policy-gradient loss against a fixed π_old."""
    fn = jax.jit(lambda p: logprobs.sequence_logprobs(TINY, p, batch, temperature=1.0, chunk_size=CHUNK))
    logp = np.asarray(fn(params_tree))
    r = batch.rewards.reshape(P, G)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)
    return float(-(adv * logp.sum(1) / batch.mask.sum(1)).mean())


def test_grpo_improves_its_objective_on_a_fixed_batch(params):
    cfg = _cfg()
    before = _surrogate(cfg, params["policy"])
    state, history = _run(cfg, params, steps=4)
    after = _surrogate(cfg, state.params)
    assert after < before - 1e-3, (before, after)
    assert history[-1]["kl"] > 0


@pytest.mark.parametrize("name", ["sft", "dpo", "ppo"])
def test_loss_decreases_on_a_fixed_batch(params, name):
    cfg = _cfg(algorithm=name)
    _, history = _run(cfg, params, steps=4)
    key = "value_loss" if name == "ppo" else "loss"
    losses = [h[key] for h in history]
    assert losses[-1] < losses[0], losses


# ----------------------------------------------------------------- invariance

MODES = ("sequence_mean", "token_mean", "constant")


def test_same_step_on_mesh_2x2x2_with_4_micro_batches_as_on_1x1x1_with_1(params):
    """One comparison covers both invariances: a 2x2x2 mesh with 4 micro-batches gives the
    same loss and parameters as one device with one batch, for every aggregation mode
    (ragged masks, β > 0). Micro-batching alone is also checked on arrays in
    test_algorithms.py::test_loss_parts_add_up_over_micro_batches for every algorithm."""
    for mode in MODES:
        one, (m1,) = _run(_cfg(aggregation=mode), params, mesh_shape=(1, 1, 1))
        four, (m4,) = _run(_cfg(aggregation=mode, num_micro_batches=4), params, mesh_shape=(2, 2, 2))
        for key in ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "grad_norm"):
            assert m1[key] == pytest.approx(m4[key], rel=1e-5, abs=1e-7), (mode, key)
        np.testing.assert_allclose(_flat(one.params), _flat(four.params), rtol=1e-5, atol=1e-6,
                                   err_msg=mode)


# ----------------------------------------------------------------- every option matters

GRPO_OPTIONS = [
    ("beta", 0.04, 0.5),
    ("kl_estimator", "k3", "k1"),
    ("kl_estimator", "k3", "k2"),
    ("scale_by_std", True, False),
    ("supervision", "outcome", "process"),
    ("skip_zero_variance_groups", False, True),
    ("mask_truncated", False, True),
    ("aggregation", "sequence_mean", "token_mean"),
    ("aggregation", "sequence_mean", "constant"),
    ("aggregation", "token_mean", "constant"),
    ("temperature", 1.0, 0.7),
]


@pytest.mark.parametrize("option,a,b", GRPO_OPTIONS)
def test_grpo_option_changes_the_step(params, option, a, b):
    state_a, (ma,) = _run(_cfg(**{option: a}), params)
    state_b, (mb,) = _run(_cfg(**{option: b}), params)
    assert _max_diff(state_a.params, state_b.params) > 1e-6, (option, ma, mb)


def test_grpo_beta_zero_changes_the_step(params):
    with_ref, _ = _run(_cfg(beta=0.04), params)
    no_ref, _ = _run(_cfg(beta=0.0), params)
    assert _max_diff(with_ref.params, no_ref.params) > 1e-6


@pytest.mark.parametrize("option,a,b", [("num_updates", 1, 3), ("eps_low", 0.2, 1e-3),
                                        ("eps_high", 0.2, 1e-3)])
def test_grpo_multi_update_options_change_the_step(params, option, a, b):
    """μ > 1: the ratio moves away from 1 after the first update, so the clip range acts."""
    base = {} if option == "num_updates" else {"num_updates": 3}
    state_a, (ma,) = _run(_cfg(**base, **{option: a}), params)
    state_b, (mb,) = _run(_cfg(**base, **{option: b}), params)
    assert _max_diff(state_a.params, state_b.params) > 1e-6, option
    if option != "num_updates":
        assert mb["clip_fraction"] > ma["clip_fraction"], (ma["clip_fraction"], mb["clip_fraction"])


PPO_OPTIONS = [
    ("gamma", 1.0, 0.9, "params"),
    ("lam", 0.95, 0.5, "params"),
    ("whiten_advantages", True, False, "params"),
    ("beta", 0.04, 0.5, "params"),
    ("mask_truncated", False, True, "params"),
    ("aggregation", "sequence_mean", "token_mean", "params"),
    ("temperature", 1.0, 0.7, "params"),
]


@pytest.mark.parametrize("option,a,b,field", PPO_OPTIONS)
def test_ppo_option_changes_the_step(params, option, a, b, field):
    state_a, _ = _run(_cfg(algorithm="ppo", **{option: a}), params)
    state_b, _ = _run(_cfg(algorithm="ppo", **{option: b}), params)
    assert _max_diff(getattr(state_a, field), getattr(state_b, field)) > 1e-6, option


@pytest.mark.parametrize("option,a,b", [("value_clip", 0.0, 1e-3), ("eps_low", 0.2, 1e-3)])
def test_ppo_multi_update_options_change_the_step(params, option, a, b):
    """μ = 2: V_ψ and ρ move after the first update, so value and ratio clipping act."""
    state_a, _ = _run(_cfg(algorithm="ppo", num_updates=2, **{option: a}), params)
    state_b, _ = _run(_cfg(algorithm="ppo", num_updates=2, **{option: b}), params)
    field = "value_params" if option == "value_clip" else "params"
    assert _max_diff(getattr(state_a, field), getattr(state_b, field)) > 1e-6, option


# ----------------------------------------------------------------- memory

def test_peak_memory_order_beta0_grpo_ppo(params):
    """Peak bytes of the compiled step = argument bytes (params, reference, value model,
    optimiser state, batch; outputs alias the donated state) + temporaries."""
    peaks = {}
    for label, cfg in (("grpo beta=0", _cfg(beta=0.0)), ("grpo beta>0", _cfg(beta=0.04)),
                       ("ppo beta>0", _cfg(algorithm="ppo", beta=0.04))):
        compiled = _step(cfg).compiled(_state(cfg, params), BATCH)
        mem = compiled.memory_analysis()
        peaks[label] = mem.argument_size_in_bytes + mem.temp_size_in_bytes
        print(f"{label}: peak {peaks[label]} = arguments {mem.argument_size_in_bytes} + "
              f"temp {mem.temp_size_in_bytes} (outputs {mem.output_size_in_bytes}, "
              f"aliased {mem.alias_size_in_bytes})")
    assert peaks["grpo beta=0"] < peaks["grpo beta>0"] < peaks["ppo beta>0"], peaks


# ----------------------------------------------------------------- log-prob parity

def test_logprob_mismatch_is_zero_for_recomputed_logprobs(params):
    cfg = _cfg()
    fn = jax.jit(lambda p: logprobs.sequence_logprobs(TINY, p, BATCH, temperature=1.0, chunk_size=CHUNK))
    batch = BATCH.replace(sample_logprobs=np.asarray(fn(params["policy"])))
    _, (m,) = _run(cfg, params, batch=batch)
    assert m["logprob_mismatch_max"] < 1e-5
    _, (m_bad,) = _run(cfg, params)  # BATCH's sample log-probs are zeros
    assert m_bad["logprob_mismatch_max"] > 1.0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_mismatch_with_the_sampler(params, temperature):
    sampler = pytest.importorskip("grpo_jax.sampler")
    cfg = _cfg(temperature=temperature)
    policy = jax.device_put(jax.tree.map(np.array, params["policy"]), _shardings((1, 1, 1)))
    prompts = [[5, 9, 13, 2, 7], [3, 4, 60, 11, 12, 30, 31, 8, 1]]
    rollout = sampler.sample(TINY, policy, prompts,
                             sampler.SamplingParams(max_new_tokens=TC, temperature=temperature, stop_tokens=[0]),
                             key=jax.random.key(3), group_size=G)
    assert rollout.tokens.shape == (B, TC) and rollout.prompt_tokens.shape == (B, TP)
    batch = batching.batch_from_rollout(rollout, rewards=np.arange(B, dtype=np.float32) % 3,
                                        correct=np.zeros(B, bool))
    assert batch.truncated.dtype == bool
    _, (m,) = _run(cfg, params, batch=batch)
    assert m["logprob_mismatch_max"] < 1e-4, m["logprob_mismatch_max"]
