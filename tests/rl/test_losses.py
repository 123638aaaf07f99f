"""grpo_jax.rl.losses against plain-loop numpy references, hand-checked numbers, and the
gradient coefficients of DeepSeekMath's unified paradigm (Eq. 5, Appendix A.1)."""
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from grpo_jax.rl import losses

HYP = settings(max_examples=30, deadline=None, derandomize=True)
MODES = ("sequence_mean", "token_mean", "constant")


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def ragged_mask(rng, num_b, num_t):
    lengths = rng.integers(0, num_t + 1, size=num_b)
    lengths[0] = 0  # always one empty row
    lengths[-1] = num_t  # and one full row
    return np.arange(num_t)[None, :] < lengths[:, None]


# ----------------------------------------------------------------- numpy references
def ref_kl(logp, ref_logp, kind):
    out = np.zeros(logp.shape)
    for idx in np.ndindex(logp.shape):
        lp, rp = float(logp[idx]), float(ref_logp[idx])
        if kind == "k1":
            out[idx] = lp - rp
        elif kind == "k2":
            out[idx] = 0.5 * (lp - rp) ** 2
        else:
            ratio = math.exp(rp) / math.exp(lp)  # π_ref / π_θ
            out[idx] = ratio - math.log(ratio) - 1
    return out


def ref_surrogate(logp, old_logp, advantages, eps_low, eps_high):
    num_b, num_t = logp.shape
    out = np.zeros((num_b, num_t))
    for b in range(num_b):
        for t in range(num_t):
            a = float(advantages[b, t if advantages.shape[1] > 1 else 0])
            rho = math.exp(float(logp[b, t]) - float(old_logp[b, t]))
            out[b, t] = min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a)
    return out


def ref_aggregate(x, mask, mode):
    num_b, num_t = x.shape
    if mode == "sequence_mean":
        means = []
        for b in range(num_b):
            vals = [float(x[b, t]) for t in range(num_t) if mask[b, t]]
            if vals:
                means.append(sum(vals) / len(vals))
        return sum(means) / len(means) if means else 0.0
    total = sum(float(x[b, t]) for b in range(num_b) for t in range(num_t) if mask[b, t])
    count = int(np.sum(mask))
    if mode == "token_mean":
        return total / count if count else 0.0
    return total / (num_b * num_t)


# ------------------------------------------------------------------------ kl_penalty
@pytest.mark.parametrize("kind", losses.KL_KINDS)
def test_kl_penalty_matches_reference(kind):
    rng = np.random.default_rng(0)
    logp = np.log(rng.uniform(0.01, 1.0, size=(4, 6))).astype(np.float32)
    ref_logp = np.log(rng.uniform(0.01, 1.0, size=(4, 6))).astype(np.float32)
    got = losses.kl_penalty(logp, ref_logp, kind=kind)
    chex.assert_shape(got, (4, 6))
    np.testing.assert_allclose(got, ref_kl(logp, ref_logp, kind), rtol=1e-5, atol=1e-6)


def test_kl_penalty_default_is_k3_and_unknown_kind_raises():
    logp, ref = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -0.5]])
    np.testing.assert_array_equal(losses.kl_penalty(logp, ref), losses.kl_penalty(logp, ref, "k3"))
    with pytest.raises(ValueError, match=r"k1.*k2.*k3"):
        losses.kl_penalty(logp, ref, kind="k4")


def test_kl_penalty_vmap_and_jit():
    rng = np.random.default_rng(1)
    logp = -rng.uniform(0, 3, size=(3, 2, 5)).astype(np.float32)
    ref_logp = -rng.uniform(0, 3, size=(3, 2, 5)).astype(np.float32)
    for kind in losses.KL_KINDS:
        fn = jax.jit(functools.partial(losses.kl_penalty, kind=kind))
        got = jax.vmap(fn)(logp, ref_logp)
        for k in range(3):
            want = ref_kl(logp[k], ref_logp[k], kind)
            np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6)


@HYP
@given(
    hnp.arrays(np.float32, (2, 8), elements=st.floats(-30, 0, width=32)),
    hnp.arrays(np.float32, (2, 8), elements=st.floats(-30, 0, width=32)),
)
def test_k3_is_nonnegative_and_zero_on_policy(logp, ref_logp):
    assert np.all(np.asarray(losses.kl_penalty(logp, ref_logp, "k3")) >= 0.0)
    assert np.all(np.asarray(losses.kl_penalty(logp, logp, "k3")) == 0.0)


def test_k3_gradient_is_one_minus_ratio():
    # d/dlogp [π_ref/π_θ − log(π_ref/π_θ) − 1] = 1 − π_ref/π_θ.
    logp = jnp.array([[-1.0, -2.0, -0.1]])
    ref = jnp.array([[-1.5, -0.5, -0.1]])
    grad = jax.grad(lambda lp: losses.kl_penalty(lp, ref).sum())(logp)
    np.testing.assert_allclose(grad, 1.0 - np.exp(ref - logp), rtol=1e-6)


# ----------------------------------------------------------------- clipped_surrogate
@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28)])
def test_clipped_surrogate_matches_reference(eps_low, eps_high):
    rng = np.random.default_rng(2)
    old_logp = -rng.uniform(0.1, 3, size=(4, 7)).astype(np.float32)
    logp = (old_logp + rng.normal(0, 0.4, size=(4, 7))).astype(np.float32)
    adv_tok = rng.normal(size=(4, 7)).astype(np.float32)
    adv_seq = rng.normal(size=(4, 1)).astype(np.float32)
    for a in (adv_tok, adv_seq):
        got = losses.clipped_surrogate(logp, old_logp, a, eps_low=eps_low, eps_high=eps_high)
        chex.assert_shape(got, (4, 7))
        want = ref_surrogate(logp, old_logp, a, eps_low, eps_high)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_clipped_surrogate_vmap():
    rng = np.random.default_rng(3)
    old_logp = -rng.uniform(0.1, 3, size=(3, 2, 5)).astype(np.float32)
    logp = (old_logp + rng.normal(0, 0.4, size=(3, 2, 5))).astype(np.float32)
    a = rng.normal(size=(3, 2, 1)).astype(np.float32)
    fn = jax.jit(functools.partial(losses.clipped_surrogate, eps_low=0.2, eps_high=0.3))
    got = jax.vmap(fn)(logp, old_logp, a)
    for k in range(3):
        want = ref_surrogate(logp[k], old_logp[k], a[k], 0.2, 0.3)
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6)


def test_clipped_surrogate_gradient_zero_exactly_on_clipped_side():
    eps_low, eps_high = 0.2, 0.3
    rho = np.array([0.5, 0.79, 0.9, 1.0, 1.2, 1.29, 1.31, 2.0], np.float32)
    old_logp = np.full((2, 8), -1.0, np.float32)
    logp = old_logp + np.log(rho)[None, :]
    a = np.array([[1.5], [-0.7]], np.float32)
    grad = np.asarray(
        jax.grad(
            lambda lp: losses.clipped_surrogate(
                lp, old_logp, a, eps_low=eps_low, eps_high=eps_high
            ).sum()
        )(logp)
    )
    clipped = np.asarray(
        losses.clipped_tokens(logp, old_logp, a, eps_low=eps_low, eps_high=eps_high)
    )
    for b in range(2):
        for t in range(8):
            r, adv = float(rho[t]), float(a[b, 0])
            on_clipped_side = (adv > 0 and r > 1 + eps_high) or (adv < 0 and r < 1 - eps_low)
            assert clipped[b, t] == on_clipped_side
            if on_clipped_side:
                assert grad[b, t] == 0.0
            else:
                assert grad[b, t] == pytest.approx(adv * r, rel=1e-5)
    # Hand-checked: A>0 clips only above 1.3 (two tokens), A<0 only below 0.8 (two).
    assert clipped.sum() == 4


def test_clip_fraction_over_valid_tokens():
    rng = np.random.default_rng(4)
    old_logp = -rng.uniform(0.1, 3, size=(5, 6)).astype(np.float32)
    logp = (old_logp + rng.normal(0, 0.5, size=(5, 6))).astype(np.float32)
    a = rng.normal(size=(5, 6)).astype(np.float32)
    mask = ragged_mask(rng, 5, 6)
    hits, count = 0, 0
    for b in range(5):
        for t in range(6):
            if not mask[b, t]:
                continue
            rho = math.exp(float(logp[b, t] - old_logp[b, t]))
            count += 1
            hits += (a[b, t] > 0 and rho > 1.25) or (a[b, t] < 0 and rho < 0.8)
    got = losses.clip_fraction(logp, old_logp, a, mask, 0.2, 0.25)
    assert float(got) == pytest.approx(hits / count, rel=1e-6)
    assert float(losses.clip_fraction(logp, old_logp, a, np.zeros_like(mask), 0.2, 0.2)) == 0.0


# ------------------------------------------------------------------------ aggregate
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_reference(mode):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 5)).astype(np.float32)
    mask = ragged_mask(rng, 6, 5)
    x_bad = np.where(mask, x, np.nan).astype(np.float32)  # padding must not leak
    got = jax.jit(losses.aggregate, static_argnames="mode")(x_bad, mask, mode=mode)
    assert float(got) == pytest.approx(ref_aggregate(x, mask, mode), rel=1e-5, abs=1e-6)


def test_aggregate_weights_long_and_short_outputs_by_hand():
    # Output 0: 4 valid tokens of value 1. Output 1: 1 valid token of value 5. T = 4.
    x = jnp.array([[1.0, 1.0, 1.0, 1.0], [5.0, 9.0, 9.0, 9.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0]], bool)
    # sequence_mean: (mean(1,1,1,1) + mean(5)) / 2 = 3; each token of the long output
    # weighs 1/(2·4) = 1/8, the short output's token 1/2.
    # token_mean: (4 + 5) / 5 = 1.8; every valid token weighs 1/5.
    # constant: (4 + 5) / (2·4) = 1.125; every valid token weighs 1/8.
    expected = {"sequence_mean": 3.0, "token_mean": 1.8, "constant": 1.125}
    weights = {
        "sequence_mean": [[1 / 8] * 4, [1 / 2, 0, 0, 0]],
        "token_mean": [[1 / 5] * 4, [1 / 5, 0, 0, 0]],
        "constant": [[1 / 8] * 4, [1 / 8, 0, 0, 0]],
    }
    for mode in MODES:
        assert float(losses.aggregate(x, mask, mode)) == pytest.approx(expected[mode])
        grad = jax.grad(lambda v, m=mode: losses.aggregate(v, mask, m))(x)
        np.testing.assert_allclose(grad, weights[mode], rtol=1e-6)
    # Dr. GRPO's constant length when the array's T is not max_new_tokens.
    assert float(losses.aggregate(x, mask, "constant", constant_length=9)) == pytest.approx(
        9 / 18
    )


def test_aggregate_empty_rows_never_nan():
    x = jnp.array([[jnp.nan, jnp.inf], [2.0, 4.0]])
    empty = jnp.zeros((2, 2), bool)
    for mode in MODES:
        assert float(losses.aggregate(x, empty, mode)) == 0.0
        grad = jax.grad(lambda v, m=mode: losses.aggregate(v, empty, m))(jnp.ones((2, 2)))
        assert np.all(np.asarray(grad) == 0.0)
    # The empty row is left out of sequence_mean's outer mean: (3)/1, not (0 + 3)/2.
    mask = jnp.array([[0, 0], [1, 1]], bool)
    assert float(losses.aggregate(x, mask, "sequence_mean")) == pytest.approx(3.0)


def test_aggregate_unknown_mode_raises():
    with pytest.raises(ValueError, match=r"sequence_mean.*token_mean.*constant"):
        losses.aggregate(jnp.ones((2, 2)), jnp.ones((2, 2)), "mean_of_means")


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_parts_micro_batches_equal_full_batch(mode):
    rng = np.random.default_rng(6)
    num_b, num_t = 12, 7
    x = rng.normal(size=(num_b, num_t)).astype(np.float32)
    mask = ragged_mask(rng, num_b, num_t)
    mask[4:7] = False  # a micro-batch with only empty rows
    params = jnp.asarray(rng.normal(size=(num_t,)).astype(np.float32))

    def per_token(w, xs):  # a toy per-token loss depending on parameters w
        return jnp.tanh(xs * w[None, :]) ** 2

    full, full_grad = jax.jit(
        jax.value_and_grad(lambda w: losses.aggregate(per_token(w, x), mask, mode))
    )(params)

    @jax.jit
    def micro_step(w, xs, ms):
        # Gradient accumulation: grad of each numerator, one division at the end.
        parts = losses.aggregate_parts(per_token(w, xs), ms, mode)
        grad = jax.grad(lambda w_: losses.aggregate_parts(per_token(w_, xs), ms, mode)[0])(w)
        return parts, grad

    num_sum, den_sum, grad_sum = 0.0, 0.0, jnp.zeros_like(params)
    for xs, ms in zip(np.split(x, 4), np.split(mask, 4)):
        (num, den), g = micro_step(params, xs, ms)
        num_sum, den_sum, grad_sum = num_sum + num, den_sum + den, grad_sum + g
    one_num, one_den = losses.aggregate_parts(per_token(params, x), mask, mode)
    assert float(one_den) == pytest.approx(float(den_sum))
    assert float(num_sum / den_sum) == pytest.approx(float(full), rel=1e-5)
    np.testing.assert_allclose(grad_sum / den_sum, full_grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------- value_loss
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_value_loss_matches_reference(clip_eps):
    rng = np.random.default_rng(7)
    values, old_values, returns = rng.normal(size=(3, 4, 5)).astype(np.float32)
    mask = ragged_mask(rng, 4, 5)
    want = np.zeros((4, 5))
    for b in range(4):
        for t in range(5):
            if not mask[b, t]:
                continue
            v, vo, r = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
            loss = (v - r) ** 2
            if clip_eps is not None:
                vc = vo + min(max(v - vo, -clip_eps), clip_eps)
                loss = max(loss, (vc - r) ** 2)
            want[b, t] = 0.5 * loss
    got = losses.value_loss(values, old_values, returns, mask, clip_eps=clip_eps)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_value_loss_clipping_stops_gradient_when_moving_away():
    # V moved from 0 to 1 (beyond clip 0.2) and the target is 2: the clipped value 0.2 is
    # further from 2, so the clipped term dominates and V gets no gradient.
    v, vo, r, m = (jnp.array([[x]]) for x in (1.0, 0.0, 2.0, 1.0))
    g = jax.grad(lambda v_: losses.value_loss(v_, vo, r, m, clip_eps=0.2).sum())(v)
    assert float(g[0, 0]) == 0.0
    g = jax.grad(lambda v_: losses.value_loss(v_, vo, r, m).sum())(v)
    assert float(g[0, 0]) == pytest.approx(-1.0)


# ------------------------------------------------------------------------ dpo_loss
def test_dpo_loss_matches_reference_and_gradient_coefficient():
    rng = np.random.default_rng(8)
    pc, pr, rc, rr = (-rng.uniform(1, 20, size=5).astype(np.float32) for _ in range(4))
    beta = 0.1
    got = losses.dpo_loss(pc, pr, rc, rr, beta)
    chex.assert_shape(got, (5,))
    grads = jax.grad(lambda *a: losses.dpo_loss(*a, beta).sum(), argnums=(0, 1, 2, 3))(
        pc, pr, rc, rr
    )
    for b in range(5):
        chosen = float(pc[b]) - float(rc[b])
        rejected = float(pr[b]) - float(rr[b])
        assert float(got[b]) == pytest.approx(
            -math.log(sigmoid(beta * (chosen - rejected))), rel=1e-5
        )
        # Eq. 14: GC_DPO = σ(β log π(o−)/π_ref(o−) − β log π(o+)/π_ref(o+)); the loss is
        # −J so its gradient is −β·GC on the chosen output and +β·GC on the rejected one.
        gc = sigmoid(beta * rejected - beta * chosen)
        assert float(grads[0][b]) == pytest.approx(-beta * gc, rel=1e-5)
        assert float(grads[1][b]) == pytest.approx(beta * gc, rel=1e-5)
        assert float(grads[2][b]) == pytest.approx(beta * gc, rel=1e-5)
        assert float(grads[3][b]) == pytest.approx(-beta * gc, rel=1e-5)


def test_dpo_loss_large_margins_are_finite():
    big = jnp.array([1e4, -1e4])
    zero = jnp.zeros(2)
    out = np.asarray(losses.dpo_loss(big, zero, zero, zero, 1.0))
    assert np.all(np.isfinite(out))
    assert out[0] == pytest.approx(0.0, abs=1e-6) and out[1] == pytest.approx(1e4)


# ------------------------------------------------------------ sft / entropy / shapes
def test_sft_and_rft_gradient_coefficients():
    # Eq. 7: GC_SFT = 1; Eq. 10: GC_RFT = 𝕀(o). Loss −J, sequence_mean over 2 outputs.
    rng = np.random.default_rng(9)
    logp = -rng.uniform(0.1, 3, size=(2, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    lengths = mask.sum(axis=1, keepdims=True)
    np.testing.assert_array_equal(losses.sft_loss(logp), -logp)
    grad = jax.grad(lambda lp: losses.aggregate(losses.sft_loss(lp), mask, "sequence_mean"))(logp)
    np.testing.assert_allclose(grad, np.where(mask, -1.0 / (2 * lengths), 0.0), rtol=1e-6)
    correct = jnp.array([[1.0], [0.0]])
    grad = jax.grad(
        lambda lp: losses.aggregate(correct * losses.sft_loss(lp), mask, "sequence_mean")
    )(logp)
    np.testing.assert_allclose(grad, np.where(mask, -correct / (2 * lengths), 0.0), rtol=1e-6)


def test_entropy_from_logits():
    rng = np.random.default_rng(10)
    logits = (rng.normal(size=(2, 3, 11)) * 5).astype(np.float32)
    want = np.zeros((2, 3))
    for idx in np.ndindex(2, 3):
        z = logits[idx].astype(np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        want[idx] = -sum(pi * math.log(pi) for pi in p if pi > 0)
    got = jax.jit(losses.entropy_from_logits)(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(losses.entropy_from_logits(jnp.zeros(7))) == pytest.approx(math.log(7))
    masked = jnp.array([0.0, -jnp.inf, 0.0, 1e4 * 0])
    assert float(losses.entropy_from_logits(masked)) == pytest.approx(math.log(3))
    grad = jax.grad(losses.entropy_from_logits)(jnp.array([0.0, -jnp.inf, 1.0]))
    assert np.all(np.isfinite(np.asarray(grad)))


def test_shape_checks_raise():
    with pytest.raises(AssertionError):
        losses.kl_penalty(jnp.zeros((2, 3)), jnp.zeros((2, 4)))
    with pytest.raises(AssertionError):
        losses.clipped_surrogate(
            jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((3, 1)), eps_low=0.2, eps_high=0.2
        )
    with pytest.raises(AssertionError):
        losses.aggregate(jnp.zeros((2, 3)), jnp.zeros((2, 4)), "token_mean")
    with pytest.raises(AssertionError):
        losses.dpo_loss(jnp.zeros(2), jnp.zeros(3), jnp.zeros(2), jnp.zeros(2), 0.1)


# ------------------------------------------------ unified paradigm: GRPO and PPO GC
def test_grpo_gradient_coefficient_eq21():
    """With ρ = 1 (π_old = π_θ), −∂/∂logp of −J_GRPO is GC_GRPO / (G·|o_i|) per token:

    GC = Â_i,t + β (π_ref/π_θ − 1)  (Eq. 21), J aggregated with sequence_mean (Eq. 19).
    """
    rng = np.random.default_rng(11)
    num_b, num_t, beta = 4, 6, 0.04
    logp = -rng.uniform(0.1, 3, size=(num_b, num_t)).astype(np.float32)
    ref_logp = (logp + rng.normal(0, 0.5, size=(num_b, num_t))).astype(np.float32)
    a = rng.normal(size=(num_b, 1)).astype(np.float32)
    mask = np.array(
        [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], bool
    )

    def grpo_loss(lp):
        objective = losses.clipped_surrogate(
            lp, jax.lax.stop_gradient(lp), a, eps_low=0.2, eps_high=0.2
        ) - beta * losses.kl_penalty(lp, ref_logp, "k3")
        return -losses.aggregate(objective, mask, "sequence_mean")

    grad = np.asarray(jax.jit(jax.grad(grpo_loss))(logp))
    num_outputs = 3  # the empty output is not counted
    for b in range(num_b):
        length = int(mask[b].sum())
        for t in range(num_t):
            if mask[b, t]:
                gc = float(a[b, 0]) + beta * (math.exp(ref_logp[b, t] - logp[b, t]) - 1)
                want = -gc / (num_outputs * length)
                assert grad[b, t] == pytest.approx(want, rel=1e-5, abs=1e-7)
            else:
                assert grad[b, t] == 0.0


def test_ppo_gradient_coefficient_eq18():
    # Single update (ρ = 1): GC_PPO = A_t, per-token GAE advantages.
    rng = np.random.default_rng(12)
    logp = -rng.uniform(0.1, 3, size=(2, 5)).astype(np.float32)
    a = rng.normal(size=(2, 5)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)

    def ppo_loss(lp):
        obj = losses.clipped_surrogate(lp, jax.lax.stop_gradient(lp), a, eps_low=0.2, eps_high=0.2)
        return -losses.aggregate(obj, mask, "sequence_mean")

    grad = jax.jit(jax.grad(ppo_loss))(logp)
    lengths = mask.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(grad, np.where(mask, -a / (2 * lengths), 0.0), rtol=1e-5)
