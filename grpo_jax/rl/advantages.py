"""Advantage estimators: GRPO outcome/process supervision, PPO's GAE, whitening.

Notation follows DeepSeekMath §4.1 (Shao et al., 2024): a question q, a group of G outputs
{o_1..o_G} sampled from π_θold, output o_i has |o_i| tokens and (for process supervision)
K_i reasoning steps, step j ending at token index(j).

Shapes: P questions, G outputs per question, S step slots per output, B = P·G rows of a
token batch, T tokens per row. Token masks are 1 on valid completion tokens.

Everything here is a pure function of arrays: jit-able (``process_advantages`` needs
``num_tokens`` static), vmap-able, no Python control flow on array values. Rewards are
data, not parameters: callers should not differentiate through these functions (they are
nonetheless NaN-free under autodiff, including for zero-variance groups).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax import lax

from grpo_jax import loops
from grpo_jax.rl.losses import as_float

__all__ = [
    "group_relative_advantages",
    "nonconstant_groups",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "process_advantages",
    "gae",
    "whiten",
    "ppo_token_rewards",
]


def nonconstant_groups(rewards: jax.Array) -> jax.Array:
    """Whether each group's rewards vary: ``[P, G] -> [P] bool``.

    A group whose G rewards are all equal (or with G = 1) carries no learning signal
    under GRPO; DAPO's dynamic sampling drops such groups.
    """
    chex.assert_rank(rewards, 2)
    return jnp.max(rewards, axis=1) != jnp.min(rewards, axis=1)


def group_relative_advantages(
    rewards: jax.Array,
    *,
    eps: float = 1e-6,
    scale_by_std: bool = True,
    ddof: int = 0,
) -> jax.Array:
    """Outcome-supervision advantages, normalised inside each group of G outputs.

    DeepSeekMath §4.1.2 (outcome supervision, used in the GRPO objective, Eq. 3):

        Â_i,t = r̃_i = (r_i − mean(r)) / (std(r) + eps),   r = {r_1, …, r_G}

    the same value for every token t of output o_i (broadcast it over tokens with
    ``adv[..., None]``). ``scale_by_std=False`` gives Dr. GRPO's r_i − mean(r).
    ``ddof`` is the std's delta degrees of freedom (0: population std as in the paper's
    notation; 1: the unbiased sample std some implementations use).

    A group whose rewards are all equal gets exact zeros (never NaN); so does G = 1, and
    any G ≤ ddof.

    Args:
      rewards: ``[P, G]`` scalar reward per output, P questions × G outputs.
      eps: added to the std in the denominator.
      scale_by_std: divide by std(r) + eps (GRPO) or not (Dr. GRPO).
      ddof: delta degrees of freedom of the std.

    Returns:
      ``[P, G]`` advantages, float (at least float32).
    """
    chex.assert_rank(rewards, 2)
    r = as_float(rewards)
    num_outputs = r.shape[1]
    if num_outputs - ddof <= 0:
        return jnp.zeros_like(r)
    varies = nonconstant_groups(r)[:, None]
    centred = r - jnp.mean(r, axis=1, keepdims=True)
    if scale_by_std:
        var = jnp.sum(centred**2, axis=1, keepdims=True) / (num_outputs - ddof)
        std = jnp.sqrt(jnp.where(varies, var, 1.0))  # NaN-free gradient at var = 0
        centred = centred / (std + eps)
    adv = jnp.where(varies, centred, 0.0)
    chex.assert_shape(adv, rewards.shape)
    return adv


def rloo_advantages(rewards: jax.Array) -> jax.Array:
    """REINFORCE leave-one-out baseline (RLOO; Ahmadian et al. 2024, "Back to Basics").

        Â_i = r_i − 1/(G−1) Σ_{j≠i} r_j  =  G/(G−1) · (r_i − mean(r))

    Each output's baseline is the mean reward of the other G − 1 outputs of its question
    (unbiased: the baseline does not depend on o_i). No std scaling. G = 1 gives zeros.

    Args:
      rewards: ``[P, G]``.

    Returns:
      ``[P, G]`` advantages (one per output; broadcast over its tokens).
    """
    chex.assert_rank(rewards, 2)
    r = as_float(rewards)
    num_outputs = r.shape[1]
    if num_outputs < 2:
        return jnp.zeros_like(r)
    return (r - jnp.mean(r, axis=1, keepdims=True)) * (num_outputs / (num_outputs - 1))


def reinforce_pp_advantages(rewards: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """REINFORCE++ with a group baseline (Hu 2025, "REINFORCE++"): centre in the group,
    normalise over the whole batch.

        Â_i = (r_i − mean_group(r)) / (std_batch(r − mean_group(r)) + eps)

    The batch-level std (all P·G outputs, population std) replaces GRPO's per-group std,
    which the paper argues over-weights groups with small spread. (REINFORCE++'s KL
    shaping of the reward is GRPO's β-term here, added in the loss.) An all-constant
    batch gives zeros.

    Args:
      rewards: ``[P, G]``.

    Returns:
      ``[P, G]`` advantages.
    """
    chex.assert_rank(rewards, 2)
    r = as_float(rewards)
    centred = r - jnp.mean(r, axis=1, keepdims=True)
    std = jnp.sqrt(jnp.mean(jnp.square(centred)))
    return jnp.where(std > 0, centred / (std + eps), 0.0)


def process_advantages(
    step_rewards: jax.Array,
    step_end: jax.Array,
    step_mask: jax.Array,
    num_tokens: int,
    *,
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> jax.Array:
    """Process-supervision advantages: normalised step rewards summed over later steps.

    DeepSeekMath §4.1.3 (process supervision, used in the GRPO objective, Eq. 3): with
    R the set of rewards of every valid step of every output in the group,

        r̃_i^index(j) = (r_i^index(j) − mean(R)) / (std(R) + eps)
        Â_i,t = Σ_{index(j) ≥ t} r̃_i^index(j)

    so a token's advantage is the sum of the normalised rewards of the step it belongs to
    and every later step of the same output. Tokens after the last step's end get 0 (the
    caller's token mask should exclude them anyway). std is the population std (ddof 0).

    A group whose valid step rewards are all equal (including a single valid step, or
    none) gets all-zero advantages, never NaN. Step slots with ``step_mask`` False are
    ignored entirely. A valid step ending at or beyond ``num_tokens`` counts for every
    token; one with a negative end counts for none.

    Args:
      step_rewards: ``[P, G, S]`` reward of step slot s of output g of question p.
      step_end: ``[P, G, S]`` int, token index (into the T completion tokens) of the last
        token of that step, index(j).
      step_mask: ``[P, G, S]`` bool, which step slots are real steps.
      num_tokens: T, the number of completion token positions (static).
      eps: added to std(R) in the denominator.
      scale_by_std: False (Dr. GRPO) only centres: r̃ = r − mean(R).

    Returns:
      ``[P, G, num_tokens]`` per-token advantages, float (at least float32).
    """
    chex.assert_rank(step_rewards, 3)
    chex.assert_equal_shape([step_rewards, step_end, step_mask])
    chex.assert_type(step_end, int)
    num_p, num_g, num_s = step_rewards.shape
    r = as_float(step_rewards)
    valid = step_mask.astype(bool)

    count = jnp.sum(valid, axis=(1, 2), keepdims=True)
    safe_count = jnp.maximum(count, 1)
    mean = jnp.sum(jnp.where(valid, r, 0.0), axis=(1, 2), keepdims=True) / safe_count
    centred = jnp.where(valid, r - mean, 0.0)
    var = jnp.sum(centred**2, axis=(1, 2), keepdims=True) / safe_count
    hi = jnp.max(jnp.where(valid, r, -jnp.inf), axis=(1, 2), keepdims=True)
    lo = jnp.min(jnp.where(valid, r, jnp.inf), axis=(1, 2), keepdims=True)
    varies = (count > 1) & (hi != lo)
    std = jnp.sqrt(jnp.where(varies, var, 1.0))
    normed = jnp.where(varies & valid, centred / (std + eps) if scale_by_std else centred, 0.0)

    # Scatter each normalised step reward onto its end token, then a reverse cumulative
    # sum gives Σ_{index(j) ≥ t}. Invalid / negative-end steps go to an out-of-range slot
    # and are dropped; ends ≥ T are clamped to T−1 (they count for every token).
    end = jnp.minimum(step_end, num_tokens - 1)
    end = jnp.where(valid & (step_end >= 0), end, num_tokens)
    p_idx = jnp.arange(num_p)[:, None, None]
    g_idx = jnp.arange(num_g)[None, :, None]
    per_token = jnp.zeros((num_p, num_g, num_tokens), normed.dtype)
    per_token = per_token.at[p_idx, g_idx, end].add(normed, mode="drop")
    adv = jnp.flip(jnp.cumsum(jnp.flip(per_token, axis=-1), axis=-1), axis=-1)
    chex.assert_shape(adv, (num_p, num_g, num_tokens))
    return adv


def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    *,
    gamma: float,
    lam: float,
) -> tuple[jax.Array, jax.Array]:
    """Generalised Advantage Estimation for PPO (Schulman et al., 2015).

    DeepSeekMath Eq. 1 / Eq. 18 use A_t computed by GAE from the per-token rewards {r_≥t}
    (Eq. 2) and the value model V_ψ:

        δ_t = r_t + γ V(t+1) − V(t),     A_t = δ_t + γ λ A_{t+1},     R_t = A_t + V(t)

    with V and A after the last valid token taken as 0 (the output ended: no bootstrap).

    Masks: right padding (mask 1 on a prefix of each row) is the common case. Interior
    holes (mask 0 between valid tokens, e.g. tool output inside a completion) are also
    supported: masked positions are skipped — their rewards and values are ignored, they
    get advantage and return 0, and each valid token links directly to the next valid
    token (γ and λ applied once per valid step). Implemented as a reverse ``lax.scan``.

    Args:
      rewards: ``[B, T]`` per-token rewards (e.g. from ``ppo_token_rewards``).
      values: ``[B, T]`` value estimates V_ψ at each token.
      mask: ``[B, T]`` bool/0-1, valid completion tokens.
      gamma: discount γ.
      lam: GAE λ.

    Returns:
      ``(advantages [B, T], returns [B, T])``, zero at masked positions. Returns are the
      value model's regression targets.
    """
    chex.assert_rank(rewards, 2)
    chex.assert_equal_shape([rewards, values, mask])
    r = as_float(rewards)
    v = as_float(values).astype(r.dtype)
    m = mask.astype(bool)

    def step(carry, xs):
        next_value, next_adv = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_value - v_t
        adv = delta + gamma * lam * next_adv
        carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv, next_adv))
        return carry, jnp.where(m_t, adv, 0.0)

    zeros = jnp.zeros(r.shape[0], r.dtype)
    _, adv_t = loops.scan(step, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
    advantages = adv_t.T
    returns = jnp.where(m, advantages + v, 0.0)
    chex.assert_equal_shape([advantages, returns, rewards])
    return advantages, returns


def whiten(
    x: jax.Array,
    mask: jax.Array,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> jax.Array:
    """Masked whitening over the whole batch (PPO's optional advantage normalisation).

        x̂ = (x − mean_valid(x)) / sqrt(var_valid(x) + eps)

    mean and (population) variance over the valid entries only. ``shift_mean=False``
    rescales without centring (adds the mean back). Masked entries come back as 0; an
    all-masked input gives all zeros.

    Args:
      x: ``[...]`` values, e.g. GAE advantages ``[B, T]``.
      mask: same shape, bool/0-1.

    Returns:
      Same shape as ``x``.
    """
    chex.assert_equal_shape([x, mask])
    x = as_float(x)
    m = mask.astype(bool)
    count = jnp.maximum(jnp.sum(m), 1)
    mean = jnp.sum(jnp.where(m, x, 0.0)) / count
    var = jnp.sum(jnp.where(m, (x - mean) ** 2, 0.0)) / count
    out = (x - mean) * lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(m, out, 0.0)


def ppo_token_rewards(
    score: jax.Array,
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    beta: float,
) -> jax.Array:
    """PPO's per-token reward: KL penalty at every token, reward-model score at the end.

    DeepSeekMath Eq. 2:

        r_t = r_φ(q, o_≤t) − β log(π_θ(o_t|q,o_<t) / π_ref(o_t|q,o_<t))

    where r_φ is non-zero only at the last valid token of the output (the outcome
    reward model scores the whole output). ``logp`` is the sampling policy's log-prob
    of the sampled tokens; treat the result as data (stop gradients upstream).

    Args:
      score: ``[B]`` reward-model score r_φ(q, o) of each output.
      logp: ``[B, T]`` log π_θ(o_t|q,o_<t) of the sampled tokens.
      ref_logp: ``[B, T]`` log π_ref(o_t|q,o_<t).
      mask: ``[B, T]`` valid completion tokens; the score goes to the last valid one.
      beta: KL coefficient β.

    Returns:
      ``[B, T]`` per-token rewards, 0 at masked positions (rows with no valid token are
      all 0).
    """
    chex.assert_rank([score, logp], [1, 2])
    chex.assert_equal_shape([logp, ref_logp, mask])
    chex.assert_equal_shape_prefix([score, logp], 1)
    m = mask.astype(bool)
    num_tokens = logp.shape[1]
    kl_reward = -beta * (as_float(logp) - as_float(ref_logp))
    positions = jnp.arange(num_tokens)
    last = jnp.max(jnp.where(m, positions, -1), axis=1)  # -1 if the row is empty
    is_last = positions[None, :] == last[:, None]
    rewards = jnp.where(m, kl_reward, 0.0) + jnp.where(is_last, as_float(score)[:, None], 0.0)
    chex.assert_shape(rewards, logp.shape)
    return rewards
