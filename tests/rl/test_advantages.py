"""grpo_jax.rl.advantages against independent plain-loop numpy references."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from grpo_jax.rl import advantages as adv

GAE_JIT = jax.jit(adv.gae, static_argnames=("gamma", "lam"))
PROCESS_JIT = jax.jit(adv.process_advantages, static_argnames="num_tokens")
HYP = settings(max_examples=30, deadline=None, derandomize=True)


# ----------------------------------------------------------- numpy references
def ref_group(rewards, eps=1e-6, scale_by_std=True, ddof=0):
    rewards = np.asarray(rewards, np.float64)
    num_p, num_g = rewards.shape
    out = np.zeros_like(rewards)
    for p in range(num_p):
        row = list(rewards[p])
        if len(set(row)) <= 1 or num_g - ddof <= 0:
            continue
        mean = sum(row) / num_g
        var = sum((x - mean) ** 2 for x in row) / (num_g - ddof)
        for g in range(num_g):
            out[p, g] = (row[g] - mean) / (var**0.5 + eps) if scale_by_std else row[g] - mean
    return out


def ref_process(step_rewards, step_end, step_mask, num_tokens, eps=1e-6):
    num_p, num_g, num_s = step_rewards.shape
    out = np.zeros((num_p, num_g, num_tokens))
    for p in range(num_p):
        group = [
            float(step_rewards[p, g, s])
            for g in range(num_g)
            for s in range(num_s)
            if step_mask[p, g, s]
        ]
        if len(set(group)) <= 1:
            continue
        mean = sum(group) / len(group)
        std = (sum((x - mean) ** 2 for x in group) / len(group)) ** 0.5
        for g in range(num_g):
            for t in range(num_tokens):
                total = 0.0
                for s in range(num_s):
                    if step_mask[p, g, s] and step_end[p, g, s] >= t:
                        total += (step_rewards[p, g, s] - mean) / (std + eps)
                out[p, g, t] = total
    return out


def ref_gae(rewards, values, mask, gamma, lam):
    """Skips masked positions: each valid token links to the next valid one."""
    num_b, num_t = rewards.shape
    advantages = np.zeros((num_b, num_t))
    returns = np.zeros((num_b, num_t))
    for b in range(num_b):
        valid = [t for t in range(num_t) if mask[b, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(valid):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            a = delta + gamma * lam * next_adv
            advantages[b, t] = a
            returns[b, t] = a + values[b, t]
            next_value, next_adv = values[b, t], a
    return advantages, returns


def right_padded_mask(rng, num_b, num_t, min_len=0):
    lengths = rng.integers(min_len, num_t + 1, size=num_b)
    return np.arange(num_t)[None, :] < lengths[:, None]


# ------------------------------------------------------ group_relative_advantages
@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("ddof", [0, 1])
def test_group_relative_matches_reference(scale_by_std, ddof):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(5, 6)).astype(np.float32)
    rewards[1] = 0.7  # all equal
    rewards[2] = rng.integers(0, 2, size=6)  # binary rewards
    rewards[3] = [0.1] * 5 + [0.2]
    got = adv.group_relative_advantages(rewards, scale_by_std=scale_by_std, ddof=ddof)
    chex.assert_shape(got, (5, 6))
    np.testing.assert_allclose(
        got, ref_group(rewards, scale_by_std=scale_by_std, ddof=ddof), rtol=1e-5, atol=1e-5
    )


def test_group_relative_constant_groups_are_exact_zeros():
    rewards = jnp.array([[0.1, 0.1, 0.1], [1e30, 1e30, 1e30], [3.0, 3.0, 3.0]])
    for scale in (True, False):
        out = adv.group_relative_advantages(rewards, scale_by_std=scale)
        assert np.all(np.asarray(out) == 0.0)
    grads = jax.grad(lambda r: adv.group_relative_advantages(r).sum())(rewards)
    assert np.all(np.isfinite(grads))
    np.testing.assert_array_equal(adv.nonconstant_groups(rewards), [False, False, False])


@pytest.mark.parametrize("ddof", [0, 1])
def test_group_relative_single_output_is_zero(ddof):
    out = adv.group_relative_advantages(jnp.array([[1.0], [5.0]]), ddof=ddof)
    chex.assert_shape(out, (2, 1))
    assert np.all(np.asarray(out) == 0.0)


def test_group_relative_jit_and_vmap():
    rewards = np.random.default_rng(1).normal(size=(3, 4, 8)).astype(np.float32)
    fn = jax.jit(functools.partial(adv.group_relative_advantages, scale_by_std=True))
    vmapped = jax.vmap(fn)(rewards)
    for k in range(3):
        np.testing.assert_allclose(vmapped[k], ref_group(rewards[k]), rtol=1e-5, atol=1e-5)


def test_group_relative_bf16_upcasts():
    out = adv.group_relative_advantages(jnp.array([[0.0, 1.0]], jnp.bfloat16))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, [[-1.0, 1.0]], atol=1e-5)


@HYP
@given(hnp.arrays(np.float32, (3, 5), elements=st.floats(-100, 100, width=32)))
def test_group_relative_sums_to_zero_and_unit_std(rewards):
    out = np.asarray(adv.group_relative_advantages(rewards))
    np.testing.assert_allclose(out.sum(axis=1), 0.0, atol=1e-3)
    for p in range(3):
        if len(set(rewards[p].tolist())) > 1:
            spread = rewards[p].max() - rewards[p].min()
            if spread > 1e-2:  # eps negligible w.r.t. std
                np.testing.assert_allclose(out[p].std(), 1.0, rtol=1e-3)
        else:
            assert np.all(out[p] == 0.0)


# --------------------------------------------------------------- process_advantages
def random_steps(rng, num_p, num_g, num_s, num_t):
    step_rewards = rng.normal(size=(num_p, num_g, num_s)).astype(np.float32)
    step_mask = np.zeros((num_p, num_g, num_s), bool)
    step_end = np.zeros((num_p, num_g, num_s), np.int32)
    for p in range(num_p):
        for g in range(num_g):
            k = rng.integers(0, num_s + 1)  # ragged number of steps, possibly none
            ends = np.sort(rng.choice(num_t, size=k, replace=False))
            step_mask[p, g, :k] = True
            step_end[p, g, :k] = ends
            step_end[p, g, k:] = rng.integers(0, num_t, size=num_s - k)  # ignored junk
    return step_rewards, step_end, step_mask


def test_process_matches_reference():
    rng = np.random.default_rng(2)
    step_rewards, step_end, step_mask = random_steps(rng, 4, 3, 4, 10)
    step_mask[1] = False  # a group with no steps at all
    step_rewards[2] = 0.5  # zero-variance group
    got = PROCESS_JIT(step_rewards, step_end, step_mask, 10)
    chex.assert_shape(got, (4, 3, 10))
    want = ref_process(step_rewards, step_end, step_mask, 10)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got[1:3]) == 0.0)


def test_process_hand_example():
    # One question, two outputs over 5 tokens. Output 0: steps ending at tokens 1, 4 with
    # rewards 1, 0. Output 1: one step ending at 2 with reward 1. R = {1, 0, 1}:
    # mean 2/3, std sqrt(2)/3.
    step_rewards = np.array([[[1.0, 0.0], [1.0, 9.0]]], np.float32)
    step_end = np.array([[[1, 4], [2, 0]]], np.int32)
    step_mask = np.array([[[True, True], [True, False]]])
    got = np.asarray(PROCESS_JIT(step_rewards, step_end, step_mask, 5, eps=0.0))
    hi, lo = (1 - 2 / 3) / (2**0.5 / 3), (0 - 2 / 3) / (2**0.5 / 3)
    np.testing.assert_allclose(got[0, 0], [hi + lo, hi + lo, lo, lo, lo], rtol=1e-5)
    np.testing.assert_allclose(got[0, 1], [hi, hi, hi, 0, 0], rtol=1e-5, atol=1e-6)


def test_process_out_of_range_ends_and_jit():
    step_rewards = np.array([[[1.0, 2.0, 3.0]]], np.float32)
    step_end = np.array([[[-1, 2, 99]]], np.int32)
    step_mask = np.ones((1, 1, 3), bool)
    fn = jax.jit(adv.process_advantages, static_argnames="num_tokens")
    got = np.asarray(fn(step_rewards, step_end, step_mask, num_tokens=4))
    std = (2 / 3) ** 0.5
    # step 0 (end −1) counts for no token; step 2 (end 99) counts for every token.
    np.testing.assert_allclose(got[0, 0], [1 / std, 1 / std, 1 / std, 1 / std], rtol=1e-5)


def test_process_vmap_matches_reference():
    rng = np.random.default_rng(3)
    batches = [random_steps(rng, 2, 3, 3, 6) for _ in range(3)]
    stacked = [np.stack(parts) for parts in zip(*batches)]
    got = jax.vmap(lambda r, e, m: adv.process_advantages(r, e, m, 6))(*stacked)
    for k, (r, e, m) in enumerate(batches):
        np.testing.assert_allclose(got[k], ref_process(r, e, m, 6), rtol=1e-5, atol=1e-5)


def test_process_last_token_sum_of_steps_equals_outcome_like():
    # With one step per output ending at the last token, process supervision reduces to
    # outcome supervision's normalised reward on every token.
    rewards = np.array([[0.0, 1.0, 1.0, 0.5]], np.float32)
    got = PROCESS_JIT(
        rewards[..., None], np.full((1, 4, 1), 7, np.int32), np.ones((1, 4, 1), bool), 8
    )
    outcome = adv.group_relative_advantages(rewards)
    np.testing.assert_allclose(got, np.repeat(outcome[..., None], 8, axis=-1), rtol=1e-5)


# --------------------------------------------------------------------------- gae
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_right_padded_matches_reference(gamma, lam):
    rng = np.random.default_rng(4)
    mask = right_padded_mask(rng, 6, 9)
    mask[0] = False  # empty row
    mask[1] = True  # full row
    rewards = rng.normal(size=(6, 9)).astype(np.float32)
    values = rng.normal(size=(6, 9)).astype(np.float32)
    got_a, got_r = GAE_JIT(rewards, values, mask, gamma=gamma, lam=lam)
    want_a, want_r = ref_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(got_a, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_r, want_r, rtol=1e-5, atol=1e-5)


def test_gae_right_padding_is_standard_recursion():
    # Independent of the hole semantics: the textbook recursion with V(T_i) = 0.
    rng = np.random.default_rng(5)
    rewards = rng.normal(size=(1, 5))
    values = rng.normal(size=(1, 5))
    mask = np.array([[1, 1, 1, 0, 0]], bool)
    gamma, lam = 0.9, 0.8
    v = [values[0, 0], values[0, 1], values[0, 2], 0.0]
    deltas = [rewards[0, t] + gamma * v[t + 1] - v[t] for t in range(3)]
    a2 = deltas[2]
    a1 = deltas[1] + gamma * lam * a2
    a0 = deltas[0] + gamma * lam * a1
    got_a, got_r = adv.gae(rewards, values, mask, gamma=gamma, lam=lam)
    np.testing.assert_allclose(got_a, [[a0, a1, a2, 0, 0]], rtol=1e-5)
    np.testing.assert_allclose(got_r, [[a0 + v[0], a1 + v[1], a2 + v[2], 0, 0]], rtol=1e-5)


def test_gae_interior_holes_are_skipped():
    rng = np.random.default_rng(6)
    mask = rng.random((5, 8)) < 0.6
    rewards = rng.normal(size=(5, 8)).astype(np.float32)
    values = rng.normal(size=(5, 8)).astype(np.float32)
    got_a, got_r = adv.gae(rewards, values, mask, gamma=0.95, lam=0.9)
    want_a, want_r = ref_gae(rewards, values, mask, 0.95, 0.9)
    np.testing.assert_allclose(got_a, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_r, want_r, rtol=1e-5, atol=1e-5)
    # Removing the holes (compacting each row) gives the same advantages.
    for b in range(5):
        idx = np.flatnonzero(mask[b])
        a, _ = adv.gae(
            rewards[b : b + 1, idx], values[b : b + 1, idx], np.ones((1, len(idx)), bool),
            gamma=0.95, lam=0.9,
        )
        np.testing.assert_allclose(np.asarray(got_a)[b, idx], a[0], rtol=1e-5, atol=1e-5)


def test_gae_jit_and_vmap():
    rng = np.random.default_rng(7)
    rewards = rng.normal(size=(2, 3, 6)).astype(np.float32)
    values = rng.normal(size=(2, 3, 6)).astype(np.float32)
    mask = np.stack([right_padded_mask(rng, 3, 6) for _ in range(2)])
    fn = jax.jit(functools.partial(adv.gae, gamma=0.99, lam=0.95))
    got_a, got_r = jax.vmap(fn)(rewards, values, mask)
    for k in range(2):
        want_a, want_r = ref_gae(rewards[k], values[k], mask[k], 0.99, 0.95)
        np.testing.assert_allclose(got_a[k], want_a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_r[k], want_r, rtol=1e-5, atol=1e-5)


@HYP
@given(
    hnp.arrays(np.float32, (2, 6), elements=st.floats(-10, 10, width=32)),
    hnp.arrays(np.float32, (2, 6), elements=st.floats(-10, 10, width=32)),
    st.lists(st.integers(0, 6), min_size=2, max_size=2),
)
def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value(rewards, values, lengths):
    mask = np.arange(6)[None, :] < np.array(lengths)[:, None]
    got_a, got_r = map(np.asarray, GAE_JIT(rewards, values, mask, gamma=1.0, lam=1.0))
    for b in range(2):
        for t in range(6):
            if mask[b, t]:
                to_go = float(np.sum(rewards[b, t : lengths[b]], dtype=np.float64))
                assert abs(got_a[b, t] - (to_go - values[b, t])) < 1e-3
                assert abs(got_r[b, t] - to_go) < 1e-3
            else:
                assert got_a[b, t] == 0.0 and got_r[b, t] == 0.0


# ------------------------------------------------------------------------ whiten
def test_whiten_matches_reference():
    rng = np.random.default_rng(8)
    x = rng.normal(3.0, 2.0, size=(4, 7)).astype(np.float32)
    mask = right_padded_mask(rng, 4, 7, min_len=1)
    x_bad = np.where(mask, x, 1e6).astype(np.float32)  # padded garbage must not matter
    vals = [float(x[b, t]) for b in range(4) for t in range(7) if mask[b, t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    want = np.where(mask, (x - mean) / np.sqrt(var + 1e-8), 0.0)
    np.testing.assert_allclose(adv.whiten(x_bad, mask), want, rtol=1e-4, atol=1e-5)
    want_noshift = np.where(mask, (x - mean) / np.sqrt(var + 1e-8) + mean, 0.0)
    np.testing.assert_allclose(
        adv.whiten(x_bad, mask, shift_mean=False), want_noshift, rtol=1e-4, atol=1e-5
    )
    assert np.all(np.asarray(adv.whiten(x, np.zeros_like(mask))) == 0.0)


# ------------------------------------------------------------- ppo_token_rewards
def test_ppo_token_rewards_matches_reference():
    rng = np.random.default_rng(9)
    num_b, num_t, beta = 5, 6, 0.05
    mask = right_padded_mask(rng, num_b, num_t)
    mask[0] = False
    mask[1] = [1, 1, 0, 1, 0, 0]  # interior hole: score at the highest valid index
    score = rng.normal(size=num_b).astype(np.float32)
    logp = rng.normal(size=(num_b, num_t)).astype(np.float32)
    ref_logp = rng.normal(size=(num_b, num_t)).astype(np.float32)
    want = np.zeros((num_b, num_t))
    for b in range(num_b):
        valid = [t for t in range(num_t) if mask[b, t]]
        for t in valid:
            want[b, t] = -beta * (logp[b, t] - ref_logp[b, t])
        if valid:
            want[b, valid[-1]] += score[b]
    got = jax.jit(adv.ppo_token_rewards)(score, logp, ref_logp, mask, beta)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_shape_checks_raise():
    with pytest.raises(AssertionError):
        adv.group_relative_advantages(jnp.zeros(4))
    with pytest.raises(AssertionError):
        adv.gae(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)), gamma=1.0, lam=1.0)
    with pytest.raises(AssertionError):
        adv.process_advantages(
            jnp.zeros((1, 2, 3)), jnp.zeros((1, 2, 3)), jnp.ones((1, 2, 3), bool), 4
        )  # float step_end
