"""Algorithms: the unified paradigm by autodiff, registry, micro-batch additivity, options.

Everything here runs on log-prob arrays (no model): ``extras_from_logprobs`` and
``loss_parts_from_logprobs`` are the pure halves of ``prepare`` / ``loss_parts``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import advantages as adv_lib
from grpo_jax.rl import algorithms as alg
from grpo_jax.rl.batching import make_batch
from grpo_jax.config import Config, RLConfig
from tests.random_batches import B, G, TC, random_batch, random_logps


def _cfg(**rl) -> Config:
    return Config(rl=RLConfig(group_size=G, **rl))


def _grad(algo, cfg, logp, batch, extras, values=None):
    fn = lambda lp: algo.loss_from_logprobs(lp, batch, extras, cfg, values=values)
    return np.asarray(jax.jit(jax.grad(fn))(logp))


def _lengths(batch):
    return np.asarray(batch.mask).sum(1).astype(np.float64)


# ----------------------------------------------------------------- registry

def test_registry_and_table_rows():
    assert sorted(alg.ALGORITHMS) == sorted(["sft", "rft", "online_rft", "dpo", "ppo", "grpo"])
    for name, a in alg.ALGORITHMS.items():
        assert alg.get_algorithm(name) is a and a.name == name
        assert a.data_source in alg.DATA_SOURCES
        assert "GC" in type(a).__doc__ and "data source" in type(a).__doc__
    with pytest.raises(ValueError, match="known algorithms.*grpo"):
        alg.get_algorithm("reinforce")
    # data sources: offline vs online is the only difference between RFT and Online RFT
    assert alg.get_algorithm("rft").data_source.name == "sft_policy"
    assert alg.get_algorithm("online_rft").data_source.name == "policy"
    assert alg.get_algorithm("dpo").data_source.name == "sft_policy_pairs"
    assert alg.get_algorithm("sft").data_source.name == "dataset"
    assert [n for n, a in alg.ALGORITHMS.items() if a.needs_value_model] == ["ppo"]


@pytest.mark.parametrize("name,beta,expected", [
    ("grpo", 0.04, True), ("grpo", 0.0, False), ("ppo", 0.04, True), ("ppo", 0.0, False),
    ("dpo", 0.0, True), ("sft", 0.04, False), ("rft", 0.04, False), ("online_rft", 0.04, False)])
def test_needs_reference(name, beta, expected):
    assert alg.get_algorithm(name).needs_reference(_cfg(beta=beta)) is expected


def test_old_logprobs_only_when_needed():
    grpo = alg.get_algorithm("grpo")
    assert not grpo.needs_old_logprobs(_cfg(num_updates=1))
    assert grpo.needs_old_logprobs(_cfg(num_updates=2))
    assert alg.get_algorithm("ppo").needs_old_logprobs(_cfg())


def test_hparams_are_the_numbers_only():
    """Modes are compiled in (Python branches on cfg); only numbers are traced data."""
    hp = alg.RLHParams.from_config(RLConfig(beta=0.5, tis_cap=2.0))
    assert float(hp.beta) == 0.5 and float(hp.tis_cap) == 2.0
    for leaf in jax.tree.leaves(hp):
        assert np.asarray(leaf).dtype == np.float32
    names = {f.name for f in dataclasses.fields(alg.RLHParams)}
    assert not names & {"aggregation", "kl_estimator", "supervision", "scale_by_std",
                        "whiten_advantages", "skip_zero_variance_groups", "mask_truncated"}


# ----------------------------------------------------------------- the unified paradigm
# d loss / d logp[i,t] = −GC(q, o_i, t) / (|o_i| · #outputs)   (sequence_mean, ρ = 1)

@pytest.mark.parametrize("name", ["sft", "rft", "online_rft"])
def test_gradient_coefficient_sft_rft(name):
    cfg, batch = _cfg(), random_batch(1)
    algo = alg.get_algorithm(name)
    logp = random_logps(2, batch)
    extras, _ = algo.extras_from_logprobs(batch, cfg)
    gc = np.ones(B) if name == "sft" else np.asarray(batch.correct, np.float64)
    expected = np.where(batch.mask, -(gc / _lengths(batch))[:, None] / B, 0.0)
    np.testing.assert_allclose(_grad(algo, cfg, logp, batch, extras), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("num_updates", [1, 2])
def test_gradient_coefficient_grpo(num_updates):
    """GC = Â_i,t + β(π_ref/π_θ − 1) with k3, at ρ = 1 (μ = 1: stop_gradient(logp) as π_θold;
    μ > 1: π_θold log-probs passed in, equal to logp)."""
    beta = 0.3
    cfg, batch = _cfg(beta=beta, kl_estimator="k3", num_updates=num_updates), random_batch(3)
    algo = alg.get_algorithm("grpo")
    logp, ref = random_logps(4, batch), random_logps(5, batch)
    extras, _ = algo.extras_from_logprobs(batch, cfg, ref_logp=ref,
                                          old_logp=logp if num_updates > 1 else None)
    r = np.asarray(batch.rewards, np.float64).reshape(-1, G)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)
    gc = adv[:, None] + beta * (np.exp(np.asarray(ref, np.float64) - np.asarray(logp, np.float64)) - 1)
    expected = np.where(batch.mask, -gc / _lengths(batch)[:, None] / B, 0.0)
    np.testing.assert_allclose(_grad(algo, cfg, logp, batch, extras), expected, rtol=1e-4, atol=1e-6)


def test_gradient_coefficient_ppo():
    """GC = A_t, the GAE advantage from KL-shaped token rewards and the old values."""
    cfg, batch = _cfg(beta=0.1, gamma=0.9, lam=0.8, whiten_advantages=False), random_batch(6)
    algo = alg.get_algorithm("ppo")
    logp, ref = random_logps(7, batch), random_logps(8, batch)
    values = jnp.asarray(np.random.default_rng(9).normal(size=(B, TC)), jnp.float32)
    extras, _ = algo.extras_from_logprobs(batch, cfg, old_logp=logp, ref_logp=ref, old_values=values)
    # independent GAE: r_t = −β log(π/π_ref) (+ score at the last token), δ, A by recursion
    m, lp, rf, v = (np.asarray(x, np.float64) for x in (batch.mask, logp, ref, values))
    A = np.zeros((B, TC))
    for i in range(B):
        n = int(m[i].sum())
        rew = -0.1 * (lp[i, :n] - rf[i, :n])
        rew[n - 1] += float(batch.rewards[i])
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(range(n)):
            delta = rew[t] + 0.9 * nxt_v - v[i, t]
            nxt_a = delta + 0.9 * 0.8 * nxt_a
            nxt_v = v[i, t]
            A[i, t] = nxt_a
    np.testing.assert_allclose(extras.advantages, A, rtol=1e-4, atol=1e-5)
    expected = np.where(batch.mask, -A / _lengths(batch)[:, None] / B, 0.0)
    np.testing.assert_allclose(_grad(algo, cfg, logp, batch, extras, values=values), expected,
                               rtol=1e-4, atol=1e-6)


def test_gradient_coefficient_dpo():
    """GC = ±β σ(β ℓ(o−) − β ℓ(o+)), ℓ(o) = 1/|o| Σ log π_θ/π_ref; + on chosen, − on rejected."""
    beta = 0.7
    cfg, batch = _cfg(dpo_beta=beta), random_batch(10)
    algo = alg.get_algorithm("dpo")
    logp, ref = random_logps(11, batch), random_logps(12, batch)
    extras, _ = algo.extras_from_logprobs(batch, cfg, ref_logp=ref)
    n = _lengths(batch)
    ell = (np.asarray(logp, np.float64) - np.asarray(ref, np.float64)).sum(1) / n
    chosen, rejected = ell[0::2], ell[1::2]
    sig = 1 / (1 + np.exp(-(beta * rejected - beta * chosen)))
    gc = np.zeros(B)
    gc[0::2], gc[1::2] = beta * sig, -beta * sig
    expected = np.where(batch.mask, -(gc / n)[:, None] / (B // 2), 0.0)
    np.testing.assert_allclose(_grad(algo, cfg, logp, batch, extras), expected, rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------- micro-batches

@pytest.mark.parametrize("unit", [1, 2])
def test_split_merge_round_trip_and_layout(unit):
    x = jnp.arange(16 * 3).reshape(16, 3)
    split = alg.split_micro_batches(x, 4, unit)
    assert split.shape == (4, 4, 3)
    np.testing.assert_array_equal(alg.merge_micro_batches(split, unit), x)
    rows = np.asarray(split[..., 0]) // 3
    if unit == 1:  # strided: micro-batch k = rows k, k+4, ...
        np.testing.assert_array_equal(rows[1], [1, 5, 9, 13])
    else:  # pairs stay together
        np.testing.assert_array_equal(rows[1], [2, 3, 10, 11])
    out = alg.map_micro_batches(lambda t: t * 2, x, 4, unit)
    np.testing.assert_array_equal(out, x * 2)
    with pytest.raises(ValueError, match="not a multiple"):
        alg.split_micro_batches(jnp.zeros((6, 2)), 4, unit)


@pytest.mark.parametrize("name", ["grpo", "ppo", "dpo", "sft", "rft"])
def test_loss_parts_add_up_over_micro_batches(name):
    """Σ_k num_k / Σ_k den_k over 4 micro-batches (and its gradient) equals the full batch,
    for every aggregation mode."""
    batch = random_batch(13)
    algo = alg.get_algorithm(name)
    logp, ref, old = random_logps(14, batch), random_logps(15, batch), random_logps(16, batch)
    values = jnp.asarray(np.random.default_rng(17).normal(size=(B, TC)), jnp.float32)
    unit = algo.micro_batch_unit

    def full(lp, extras, hp, cfg):
        return algo.loss_from_logprobs(lp, batch, extras, cfg, hp, values=values)

    def micro(lp, extras, hp, cfg):
        parts = alg.split_micro_batches((lp, batch, extras, values), 4, unit)
        num, den, _ = jax.vmap(
            lambda a, b, e, v: algo.loss_parts_from_logprobs(a, b, e, cfg, hp, values=v))(*parts)
        return jnp.sum(num) / jnp.sum(den)

    for mode in ("sequence_mean", "token_mean", "constant"):
        cfg = _cfg(beta=0.05, num_updates=2, aggregation=mode)
        hp = alg.RLHParams.from_config(cfg.rl)
        extras, _ = algo.extras_from_logprobs(batch, cfg, hp, old_logp=old, ref_logp=ref,
                                              old_values=values)
        full_fn = jax.jit(jax.value_and_grad(lambda lp, e, h: full(lp, e, h, cfg)))
        micro_fn = jax.jit(jax.value_and_grad(lambda lp, e, h: micro(lp, e, h, cfg)))
        (l1, g1), (l2, g2) = full_fn(logp, extras, hp), micro_fn(logp, extras, hp)
        np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-7, err_msg=mode)
        np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-8, err_msg=mode)


# ----------------------------------------------------------------- GRPO / PPO options

def test_grpo_skip_zero_variance_groups_and_mask_truncated():
    rewards = np.array([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5])  # group 1 has zero variance
    truncated = np.array([True, False, False, False, False, False, False, False])
    batch = random_batch(18, rewards=rewards, truncated=truncated)
    algo = alg.get_algorithm("grpo")
    base = np.asarray(batch.mask)
    extras, metrics = algo.extras_from_logprobs(batch, _cfg(beta=0.0))
    np.testing.assert_array_equal(extras.loss_mask, base)
    assert float(metrics["groups_kept_fraction"]) == 1.0
    extras, metrics = algo.extras_from_logprobs(batch, _cfg(beta=0.0, skip_zero_variance_groups=True))
    np.testing.assert_array_equal(extras.loss_mask[4:], False)
    np.testing.assert_array_equal(extras.loss_mask[:4], base[:4])
    assert float(metrics["groups_kept_fraction"]) == 0.5
    extras, _ = algo.extras_from_logprobs(batch, _cfg(beta=0.0, mask_truncated=True))
    np.testing.assert_array_equal(extras.loss_mask[0], False)
    np.testing.assert_array_equal(extras.loss_mask[1:], base[1:])


def test_grpo_process_supervision_with_and_without_std_scaling():
    batch = random_batch(19)
    algo = alg.get_algorithm("grpo")
    shape = (B // G, G, 3)
    args = (jnp.asarray(batch.step_rewards).reshape(shape), jnp.asarray(batch.step_end).reshape(shape),
            jnp.asarray(batch.step_mask).reshape(shape))
    scaled = np.asarray(adv_lib.process_advantages(*args, TC)).reshape(B, TC)
    extras, _ = algo.extras_from_logprobs(batch, _cfg(beta=0.0, supervision="process"))
    np.testing.assert_allclose(extras.advantages, np.where(extras.loss_mask, scaled, 0), atol=1e-6)
    # no std scaling: Σ over later steps of (r − mean(R)) of the group
    extras, _ = algo.extras_from_logprobs(batch, _cfg(beta=0.0, supervision="process", scale_by_std=False))
    r = np.asarray(batch.step_rewards, np.float64).reshape(shape)
    valid = np.asarray(batch.step_mask).reshape(shape)
    end = np.asarray(batch.step_end).reshape(shape)
    expected = np.zeros(shape[:2] + (TC,))
    for p in range(shape[0]):
        mean = r[p][valid[p]].mean()
        for g in range(G):
            for s in range(3):
                if valid[p, g, s]:
                    expected[p, g, : end[p, g, s] + 1] += r[p, g, s] - mean
    expected = np.where(extras.loss_mask, expected.reshape(B, TC), 0)
    np.testing.assert_allclose(extras.advantages, expected, atol=1e-5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimator_is_the_configured_one(kind):
    """GRPO's KL term is rl.kl_estimator's: d loss / d logp = −Â/… + β ∂k/∂logp."""
    batch, beta = random_batch(20), 0.7
    algo = alg.get_algorithm("grpo")
    logp, ref = random_logps(21, batch), random_logps(22, batch)
    cfg = _cfg(beta=beta, kl_estimator=kind, scale_by_std=False, aggregation="token_mean")
    zero = make_batch(batch.prompt_tokens, batch.prompt_mask, batch.tokens, batch.mask,
                      rewards=np.zeros(B))  # Â = 0: only the KL term is left
    extras, _ = algo.extras_from_logprobs(zero, cfg, ref_logp=ref)
    loss = float(algo.loss_from_logprobs(logp, zero, extras, cfg))
    d = (np.asarray(ref, np.float64) - np.asarray(logp, np.float64))[np.asarray(batch.mask)]
    want = {"k1": -d, "k2": 0.5 * d ** 2, "k3": np.exp(d) - d - 1}[kind]
    assert loss == pytest.approx(beta * want.mean(), rel=1e-5)


def test_ppo_whitening_and_value_clip_switches():
    batch = random_batch(23)
    algo = alg.get_algorithm("ppo")
    logp = random_logps(24, batch)
    values = jnp.asarray(np.random.default_rng(25).normal(size=(B, TC)), jnp.float32)
    white, _ = algo.extras_from_logprobs(batch, _cfg(beta=0.0), old_logp=logp, old_values=values)
    raw, _ = algo.extras_from_logprobs(batch, _cfg(beta=0.0, whiten_advantages=False),
                                       old_logp=logp, old_values=values)
    m = np.asarray(white.loss_mask)
    assert abs(np.asarray(white.advantages)[m].mean()) < 1e-5
    assert abs(np.asarray(white.advantages)[m].std() - 1) < 1e-3
    assert not np.allclose(white.advantages, raw.advantages)
    moved = values + 0.5  # V far from V_old: clipping matters
    losses_ = [float(algo.loss_from_logprobs(logp, batch, white, _cfg(beta=0.0, value_clip=c), values=moved))
               for c in (0.0, 0.1)]
    assert losses_[0] != pytest.approx(losses_[1])


@pytest.mark.parametrize("name,fields", [
    ("sft", {"loss_mask"}), ("rft", {"loss_mask"}), ("dpo", {"loss_mask", "ref_logp"}),
    ("grpo", {"loss_mask", "advantages", "old_logp", "ref_logp"}),
    ("ppo", {"loss_mask", "advantages", "old_logp", "old_values", "returns"})])
def test_extras_name_the_arrays_each_algorithm_has(name, fields):
    cfg, batch = _cfg(beta=0.04), random_batch(30)
    algo = alg.get_algorithm(name)
    logp = random_logps(31, batch)
    extras, _ = algo.extras_from_logprobs(batch, cfg, old_logp=logp, ref_logp=logp,
                                          old_values=logp)
    assert isinstance(extras, alg.Extras)
    present = {f.name for f in dataclasses.fields(extras) if getattr(extras, f.name) is not None}
    assert present == fields
