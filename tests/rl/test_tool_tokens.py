"""Tokens a tool wrote into a completion: in the context, out of the loss, the KL and the
entropy, for every algorithm (``algorithms.own_tokens``; rollouts: ``sampler.turns``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.config import ALGORITHM_NAMES, Config, RLConfig
from grpo_jax.rl import algorithms as alg
from tests.random_batches import B, G, TC, random_batch, random_logps
from tests.rl.test_train_step import params  # noqa: F401 (the tiny model's params, a fixture)


def with_tool_tokens(batch):
    """Columns 1-2 of every row long enough to go on after them are a tool's output."""
    mask = np.asarray(batch.mask)
    tool = np.zeros_like(mask)
    tool[:, 1:3] = mask[:, 3:4]
    return batch.replace(tool_mask=tool), mask & ~tool


def _cfg(name="grpo", **rl):
    return Config(rl=RLConfig(algorithm=name, group_size=G, **rl))


def _extras(algo, cfg, batch, logp, ref):
    values = jnp.asarray(np.random.default_rng(9).normal(size=(B, TC)), jnp.float32)
    extras, _ = algo.extras_from_logprobs(batch, cfg, old_logp=logp, ref_logp=ref, old_values=values)
    return extras, values


def test_grpo_loss_and_gradient_equal_a_hand_computation_over_the_models_tokens():
    """J = 1/B Σ_i 1/|o_i| Σ_{t ∈ o_i} (Â_i − β k3_t) at ρ = 1, |o_i| counting the policy's
    tokens only; ∂J/∂log π is −(Â_i + β(π_ref/π_θ − 1))/(|o_i| B) there and 0 on the tool's."""
    beta = 0.3
    batch, own = with_tool_tokens(random_batch(3))
    assert (own != np.asarray(batch.mask)).sum() >= 4  # the holes are there
    cfg, algo = _cfg(beta=beta), alg.get_algorithm("grpo")
    logp, ref = random_logps(4, batch), random_logps(5, batch)
    extras, _ = algo.extras_from_logprobs(batch, cfg, ref_logp=ref)
    r = np.asarray(batch.rewards, np.float64).reshape(-1, G)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)
    lp, rf = np.asarray(logp, np.float64), np.asarray(ref, np.float64)
    k3 = np.exp(rf - lp) - (rf - lp) - 1
    n = own.sum(1)
    loss = -np.sum(np.where(own, adv[:, None] - beta * k3, 0.0).sum(1) / n) / B
    assert float(algo.loss_from_logprobs(logp, batch, extras, cfg)) == pytest.approx(loss, rel=1e-5)
    gc = adv[:, None] + beta * (np.exp(rf - lp) - 1)
    grad = np.asarray(jax.grad(lambda x: algo.loss_from_logprobs(x, batch, extras, cfg))(logp))
    np.testing.assert_allclose(grad, np.where(own, -gc / n[:, None] / B, 0.0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
def test_no_algorithm_gives_a_tool_token_a_gradient(name):
    """The derivative of every algorithm's loss at a tool token is exactly 0, and its loss is
    the one of the batch whose tool tokens carry any other log-probs."""
    batch, own = with_tool_tokens(random_batch(11))
    cfg, algo = _cfg(name, beta=0.2), alg.get_algorithm(name)
    logp, ref = random_logps(12, batch), random_logps(13, batch)
    extras, values = _extras(algo, cfg, batch, logp, ref)
    loss = lambda x: algo.loss_from_logprobs(x, batch, extras, cfg, values=values)
    grad = np.asarray(jax.grad(loss)(logp))
    tool = np.asarray(batch.tool_mask)
    assert np.all(grad[tool] == 0.0) and np.any(grad[own] != 0.0)
    moved = jnp.where(tool, logp - 5.0, logp)
    assert float(loss(moved)) == pytest.approx(float(loss(logp)), rel=1e-6)


def test_ppo_advantages_step_over_the_tools_tokens():
    """GAE links each of the policy's tokens to its next one; the tool's get advantage 0 and
    carry none of the KL reward."""
    batch, own = with_tool_tokens(random_batch(6))
    cfg, algo = _cfg("ppo", beta=0.1, gamma=0.9, lam=0.8, whiten_advantages=False), alg.get_algorithm("ppo")
    logp, ref = random_logps(7, batch), random_logps(8, batch)
    extras, values = _extras(algo, cfg, batch, logp, ref)
    lp, rf, v = (np.asarray(x, np.float64) for x in (logp, ref, values))
    expected = np.zeros((B, TC))
    for i in range(B):
        cols = np.flatnonzero(own[i])
        rew = -0.1 * (lp[i, cols] - rf[i, cols])
        rew[-1] += float(batch.rewards[i])
        nxt_v = nxt_a = 0.0
        for j in reversed(range(len(cols))):
            nxt_a = rew[j] + 0.9 * nxt_v - v[i, cols[j]] + 0.9 * 0.8 * nxt_a
            nxt_v = v[i, cols[j]]
            expected[i, cols[j]] = nxt_a
    np.testing.assert_allclose(extras.advantages, expected, rtol=1e-4, atol=1e-5)


def test_entropy_and_mismatch_metrics_read_the_models_tokens_only():
    batch, own = with_tool_tokens(random_batch(21))
    cfg, algo = _cfg(beta=0.0), alg.get_algorithm("grpo")
    logp = random_logps(22, batch)
    extras, _ = algo.extras_from_logprobs(batch, cfg)
    entropy = jnp.where(jnp.asarray(batch.tool_mask), 1e6, 1.0)  # huge where a tool wrote
    tool_logp = jnp.where(jnp.asarray(batch.tool_mask), logp + 50.0, jnp.asarray(batch.sample_logprobs))
    _, _, metrics = algo.loss_parts_from_logprobs(tool_logp, batch, extras, cfg, entropy=entropy)
    num, den = metrics["entropy"]
    assert float(num) / float(den) == pytest.approx(1.0) and float(den) == own.sum()
    assert float(metrics["logprob_mismatch_max"][0]) == pytest.approx(0.0, abs=1e-6)


def test_without_tools_the_mask_is_the_loss_mask():
    batch = random_batch(1)
    assert batch.tool_mask is None
    np.testing.assert_array_equal(alg.own_tokens(batch), np.asarray(batch.mask))


def test_a_train_step_on_tool_tokens_counts_the_models_and_never_reads_the_tools_logprobs(params):  # noqa: F811
    """The model's step on a batch with tool tokens: ``tokens`` counts the model's; the
    log-probs recorded at the tool's tokens are never read. (The same step packed, where the
    tool's tokens are context too: tests/model/test_packing.py, whose padded GRPO step on
    this batch is this one's program.)"""
    from tests.rl.test_train_step import BATCH, _cfg as step_cfg, _run

    batch, own = with_tool_tokens(BATCH)
    _, (padded,) = _run(step_cfg(), params, batch=batch)
    assert padded["tokens"] == own.sum() < np.asarray(BATCH.mask).sum()
    noisy = batch.replace(sample_logprobs=np.where(np.asarray(batch.tool_mask), -30.0, batch.sample_logprobs))
    _, (noisy_metrics,) = _run(step_cfg(), params, batch=noisy)
    assert noisy_metrics["loss"] == padded["loss"] and noisy_metrics["logprob_mismatch_max"] == padded["logprob_mismatch_max"]
