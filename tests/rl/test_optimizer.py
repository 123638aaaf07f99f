"""The paper's multi-step schedule and AdamW's decay mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import optimizer
from grpo_jax.config import OptimizerConfig


@pytest.mark.parametrize("step,expected_factor", [
    (0, 1 / 2000), (999, 1000 / 2000), (1999, 1.0), (5000, 1.0), (7999, 1.0),
    (8000, 0.316), (8999, 0.316), (9000, 0.1), (9999, 0.1),
])
def test_multistep_schedule_matches_the_paper(step, expected_factor):
    # peak 4.2e-4 (7B), 2000 warmup steps, 10k steps: ×0.316 at 80%, ×0.1 at 90%
    sched = optimizer.multistep_schedule(4.2e-4, 2000, 10_000)
    np.testing.assert_allclose(float(sched(step)), 4.2e-4 * expected_factor, rtol=1e-6)


def test_decay_applies_only_to_masked_params():
    params = {"embedding": jnp.ones((4, 3)), "final_norm": {"scale": jnp.ones(3)},
              "layers": {"attn": {"q": jnp.ones((2, 3, 3)), "q_bias": jnp.ones((2, 3))}},
              "value_bias": jnp.ones(())}
    mask = optimizer.decay_mask(params)
    assert mask == {"embedding": True, "final_norm": {"scale": False},
                    "layers": {"attn": {"q": True, "q_bias": False}}, "value_bias": False}
    cfg = OptimizerConfig(peak_lr=0.1, warmup_steps=0, schedule="constant", weight_decay=0.5, grad_clip=0)
    tx, _ = optimizer.make_optimizer(cfg, 10)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    # zero gradient: Adam's part is 0, so the update is exactly -lr * wd * param where decayed
    np.testing.assert_allclose(updates["embedding"], -0.1 * 0.5 * np.ones((4, 3)), rtol=1e-6)
    np.testing.assert_allclose(updates["layers"]["attn"]["q"], -0.05, rtol=1e-6)
    np.testing.assert_array_equal(updates["final_norm"]["scale"], 0.0)
    np.testing.assert_array_equal(updates["layers"]["attn"]["q_bias"], 0.0)
    np.testing.assert_array_equal(updates["value_bias"], 0.0)


def test_grad_clip_and_accumulation():
    params = {"w": jnp.zeros(4)}
    cfg = OptimizerConfig(peak_lr=1.0, warmup_steps=0, schedule="constant", weight_decay=0.0,
                          grad_clip=1.0, b1=0.0, b2=0.0, eps=1e-12)
    tx, _ = optimizer.make_optimizer(cfg, 10)
    g = {"w": jnp.array([3.0, 4.0, 0.0, 0.0])}  # norm 5, clipped to 1; b2=0 Adam gives sign-like step
    updates, _ = tx.update(g, tx.init(params), params)
    np.testing.assert_allclose(updates["w"][:2], [-1.0, -1.0], rtol=1e-5)
    acc = OptimizerConfig(peak_lr=1.0, warmup_steps=0, schedule="constant", weight_decay=0.0,
                          grad_clip=0, grad_accum_steps=2, b1=0.0, b2=0.0, eps=1e-12)
    tx2, _ = optimizer.make_optimizer(acc, 10)
    state = tx2.init(params)
    u1, state = tx2.update({"w": jnp.array([1.0, 0, 0, 0])}, state, params)
    np.testing.assert_array_equal(u1["w"], 0.0)  # first micro-step only accumulates
    u2, state = tx2.update({"w": jnp.array([3.0, 0, 0, 0])}, state, params)
    np.testing.assert_allclose(u2["w"][0], -1.0, rtol=1e-5)  # mean grad 2 -> Adam(b2=0) step of -1
