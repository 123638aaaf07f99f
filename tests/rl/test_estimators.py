"""GSPO, RLOO, REINFORCE++, CISPO and TIS against independent numpy references."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import advantages as adv_lib
from grpo_jax.rl import algorithms as alg
from grpo_jax.rl import losses
from grpo_jax.config import Config, ConfigError, RLConfig
from grpo_jax.rl.batching import make_batch

RNG = np.random.default_rng(0)
B, T, G = 8, 5, 4


def _arrays():
    lens = np.array([5, 3, 1, 4, 5, 2, 3, 5])
    mask = np.arange(T)[None] < lens[:, None]
    logp = np.where(mask, -RNG.uniform(0.1, 2, (B, T)), 0.0)
    old = np.where(mask, logp + RNG.normal(0, 0.3, (B, T)), 0.0)
    adv = RNG.normal(size=(B, 1))
    return mask, logp, old, adv


def test_rloo_numpy():
    r = RNG.normal(size=(3, 5))
    expected = np.array([[r[p, i] - np.mean(np.delete(r[p], i)) for i in range(5)] for p in range(3)])
    np.testing.assert_allclose(np.asarray(adv_lib.rloo_advantages(jnp.asarray(r))), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(adv_lib.rloo_advantages(jnp.ones((2, 1)))), 0.0)


def test_reinforce_pp_numpy():
    r = RNG.normal(size=(3, 4))
    centred = r - r.mean(1, keepdims=True)
    expected = centred / (np.sqrt(np.mean(centred.ravel() ** 2)) + 1e-6)
    np.testing.assert_allclose(np.asarray(adv_lib.reinforce_pp_advantages(jnp.asarray(r))), expected, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(adv_lib.reinforce_pp_advantages(jnp.ones((2, 3)))), 0.0)


def test_gspo_value_and_gradient_numpy():
    mask, logp, old, adv = _arrays()
    eps_low, eps_high = 0.1, 0.15
    fn = lambda lp: losses.gspo_surrogate(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                          eps_low=eps_low, eps_high=eps_high)
    out = np.asarray(fn(jnp.asarray(logp, jnp.float32)))
    n = mask.sum(1)
    s = np.exp(np.sum(np.where(mask, logp - old, 0), 1) / n)
    a = adv[:, 0]
    j = np.minimum(s * a, np.clip(s, 1 - eps_low, 1 + eps_high) * a)
    np.testing.assert_allclose(out[mask], np.broadcast_to(j[:, None], (B, T))[mask], rtol=1e-5)
    # gradient of 1/G Σ_i J_i (sequence mean): s_i A_i / |o_i| per token when unclipped, else 0
    grad = np.asarray(jax.grad(lambda lp: losses.aggregate(fn(lp), jnp.asarray(mask), "sequence_mean"))(
        jnp.asarray(logp, jnp.float32)))
    clipped = (s * a) > (np.clip(s, 1 - eps_low, 1 + eps_high) * a)
    per_row = np.where(clipped, 0.0, s * a / n) / B
    np.testing.assert_allclose(grad, np.where(mask, per_row[:, None], 0.0), rtol=1e-4, atol=1e-7)
    assert clipped.any() and not clipped.all()


def test_cispo_value_and_gradient_numpy():
    mask, logp, old, adv = _arrays()
    fn = lambda lp: losses.cispo_objective(lp, jnp.asarray(old), jnp.asarray(adv), eps_low=0.2, eps_high=0.1)
    w = np.clip(np.exp(logp - old), 0.8, 1.1)
    np.testing.assert_allclose(np.asarray(fn(jnp.asarray(logp, jnp.float32))), w * adv * logp, rtol=1e-5, atol=1e-7)
    grad = np.asarray(jax.grad(lambda lp: jnp.sum(fn(lp)))(jnp.asarray(logp, jnp.float32)))
    np.testing.assert_allclose(grad, w * adv, rtol=1e-5)  # every token keeps a gradient
    assert np.all(np.abs(grad) > 0)


def test_tis_weights_numpy():
    old, sample = RNG.normal(size=(3, 4)), RNG.normal(size=(3, 4))
    w = np.asarray(losses.tis_weights(jnp.asarray(old), jnp.asarray(sample), 2.0))
    np.testing.assert_allclose(w, np.minimum(np.exp(old - sample), 2.0), rtol=1e-5)
    g = jax.grad(lambda o: jnp.sum(losses.tis_weights(o, jnp.asarray(sample), 2.0)))(jnp.asarray(old))
    np.testing.assert_array_equal(np.asarray(g), 0.0)


# ----------------------------------------------------------------- wired into GRPO / PPO

def _cfg(**rl):
    return Config(rl=RLConfig(**{"group_size": G, "beta": 0.0, **rl}))


def _batch():
    mask, logp, old, _ = _arrays()
    return make_batch(np.ones((B, 2), np.int32), np.ones((B, 2), bool), np.ones((B, T), np.int32),
                      mask, sample_logprobs=old, rewards=RNG.normal(size=B),
                      truncated=np.zeros(B, bool)), jnp.asarray(logp, jnp.float32)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_grpo_uses_the_advantage_estimator(estimator):
    batch, _ = _batch()
    extras, _ = alg.get_algorithm("grpo").extras_from_logprobs(batch, _cfg(advantage_estimator=estimator))
    r = np.asarray(batch.rewards, np.float64).reshape(-1, G)
    fn = adv_lib.rloo_advantages if estimator == "rloo" else adv_lib.reinforce_pp_advantages
    expected = np.asarray(fn(jnp.asarray(r))).reshape(-1)
    mask = np.asarray(batch.mask)
    np.testing.assert_allclose(np.asarray(extras.advantages),
                               np.where(mask, expected[:, None], 0.0), rtol=1e-5, atol=1e-6)


def test_tis_in_grpo_weights_the_gradient_and_logs_the_mismatch():
    """μ = 1: π_θold = sg(logp); weight min(exp(logp − sample), C); gradient −Â w /(|o| B)."""
    batch, logp = _batch()
    cfg = _cfg(tis_cap=1.2)
    algo = alg.get_algorithm("grpo")
    extras, _ = algo.extras_from_logprobs(batch, cfg)
    grad = np.asarray(jax.grad(lambda lp: algo.loss_from_logprobs(lp, batch, extras, cfg))(logp))
    mask = np.asarray(batch.mask)
    ratio = np.exp(np.asarray(logp, np.float64) - np.asarray(batch.sample_logprobs))
    w = np.minimum(ratio, 1.2)
    adv = np.asarray(extras.advantages)
    expected = np.where(mask, -adv * w / mask.sum(1, keepdims=True) / B, 0.0)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-7)
    _, _, metrics = algo.loss_parts_from_logprobs(logp, batch, extras, cfg)
    num, den = metrics["tis_capped_fraction"]
    assert float(num / den) == pytest.approx(np.mean(ratio[mask] > 1.2), abs=1e-6)
    gap = np.abs(np.log(ratio))[mask]
    num, den = metrics["logprob_mismatch_mean"]
    assert float(num / den) == pytest.approx(gap.mean(), rel=1e-4)
    assert float(metrics["logprob_mismatch_max"][0]) == pytest.approx(gap.max(), rel=1e-4)


@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_policy_loss_is_selected(kind):
    batch, logp = _batch()
    cfg = _cfg(policy_loss=kind, num_updates=2)
    algo = alg.get_algorithm("grpo")
    old = jnp.asarray(batch.sample_logprobs)
    extras, _ = algo.extras_from_logprobs(batch, cfg, old_logp=old)
    loss = float(algo.loss_from_logprobs(logp, batch, extras, cfg))
    adv, mask = extras.advantages, jnp.asarray(batch.mask)
    if kind == "gspo":
        obj = losses.gspo_surrogate(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    else:
        obj = losses.cispo_objective(logp, old, adv, eps_low=0.2, eps_high=0.2)
    assert loss == pytest.approx(float(losses.aggregate(-obj, mask, "sequence_mean")), rel=1e-5)


def test_sequence_level_options_refuse_process_supervision():
    with pytest.raises(ConfigError, match="rl.supervision=process needs"):
        _cfg(supervision="process", policy_loss="gspo").validate()
    with pytest.raises(ConfigError, match="rl.supervision=process needs"):
        _cfg(supervision="process", advantage_estimator="rloo").validate()
