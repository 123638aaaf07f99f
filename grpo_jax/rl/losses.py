"""Per-token objectives and losses, and how they are aggregated into a scalar.

All functions act on per-token log-probabilities of the sampled tokens, ``logp[B, T] =
log π_θ(o_t | q, o_<t)`` (and the old / reference policy's), never on logits, except
``entropy_from_logits``. They return per-token arrays; ``aggregate`` turns a per-token
array and a token mask into the scalar the optimiser sees. Sign convention: functions
named after an *objective* (``clipped_surrogate``) return what is maximised; functions
named ``*_loss`` return what is minimised.

DeepSeekMath's unified paradigm (Eq. 5) writes every method's gradient as

    ∇_θ J = E_(q,o)~D [ 1/|o| Σ_t GC(q, o, t) ∇_θ log π_θ(o_t | q, o_<t) ]

and the tests check that autodiff of these losses reproduces each gradient coefficient
GC (SFT Eq. 7, DPO Eq. 14, PPO Eq. 18, GRPO Eq. 21).

Micro-batching: ``aggregate`` is ``numerator / denominator`` of ``aggregate_parts``, whose
denominators are token / sequence counts that do not depend on parameters. Summing both
parts over micro-batches and dividing at the end reproduces the full-batch ``aggregate``
exactly (up to float summation order), for every mode; so gradient accumulation should
sum ``grad(numerator)`` over micro-batches and divide by the summed denominator.

Padded positions must hold finite log-probs (e.g. 0): masked entries are excluded with
``where``, but an inf inside a per-token function can still leak NaN into gradients.
"""
from __future__ import annotations

from typing import Literal

import chex
import jax
import jax.numpy as jnp

from grpo_jax.config import AGGREGATION_MODES, KL_KINDS

__all__ = [
    "KL_KINDS",
    "AGGREGATION_MODES",
    "kl_penalty",
    "clipped_surrogate",
    "clipped_tokens",
    "clip_fraction",
    "gspo_surrogate",
    "cispo_objective",
    "tis_weights",
    "aggregate",
    "aggregate_parts",
    "value_loss",
    "dpo_loss",
    "sft_loss",
    "entropy_from_logits",
]

KLKind = Literal["k1", "k2", "k3"]
AggregationMode = Literal["sequence_mean", "token_mean", "constant"]


def as_float(x: jax.Array) -> jax.Array:
    """Casts to a float dtype of at least float32 precision (bf16 log-probs and rewards are
    upcast); what every loss, advantage and metric computes in."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def safe_divide(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den where den > 0, else 0, with finite gradients either way (a batch or
    micro-batch without a valid token contributes nothing instead of NaN)."""
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


# --------------------------------------------------------------------------- KL
def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: KLKind = "k3") -> jax.Array:
    """Per-token estimate of D_KL[π_θ ‖ π_ref] from sampled-token log-probs.

    ``k3`` is GRPO's estimator, DeepSeekMath Eq. 4 (Schulman, 2020):

        D_KL[π_θ‖π_ref] = π_ref(o_i,t|q,o_i,<t)/π_θ(o_i,t|q,o_i,<t)
                          − log π_ref(o_i,t|q,o_i,<t)/π_θ(o_i,t|q,o_i,<t) − 1   (≥ 0)

    computed as expm1(d) − d with d = ref_logp − logp. Also ``k1`` = log(π_θ/π_ref) =
    logp − ref_logp (the PPO reward penalty of Eq. 2; unbiased but can be negative and,
    as a loss term, its gradient is zero in expectation on-policy) and ``k2`` =
    ½ (logp − ref_logp)².

    Args:
      logp: ``[B, T]`` (any shape) log π_θ of the sampled tokens.
      ref_logp: same shape, log π_ref of the same tokens.
      kind: one of ``KL_KINDS``.

    Returns:
      Same shape as ``logp``: the per-token estimate (not masked).
    """
    chex.assert_equal_shape([logp, ref_logp])
    logp, ref_logp = as_float(logp), as_float(ref_logp)
    if kind == "k3":
        d = ref_logp - logp
        return jnp.expm1(d) - d
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * jnp.square(logp - ref_logp)
    raise ValueError(f"unknown KL estimator kind {kind!r}; expected one of {KL_KINDS}")


# ------------------------------------------------------------- clipped surrogate
def _ratio_and_advantages(logp, old_logp, advantages):
    chex.assert_rank(logp, 2)
    chex.assert_equal_shape([logp, old_logp])
    chex.assert_rank(advantages, 2)
    chex.assert_is_broadcastable(advantages.shape, logp.shape)
    ratio = jnp.exp(as_float(logp) - as_float(old_logp))
    return ratio, as_float(advantages)


def clipped_surrogate(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
) -> jax.Array:
    """PPO/GRPO clipped surrogate objective, per token (to be maximised).

    DeepSeekMath Eq. 1 (PPO) and the first term of Eq. 3 (GRPO), with DAPO's separate
    lower/upper clip range (ε_low = ε_high = ε recovers the paper):

        min( ρ_t Â_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) Â_t ),
        ρ_t = π_θ(o_t|q,o_<t) / π_θold(o_t|q,o_<t) = exp(logp − old_logp)

    Where the clipped branch is the minimum (ρ > 1+ε_high with Â > 0, or ρ < 1−ε_low
    with Â < 0) the gradient w.r.t. logp is 0; elsewhere it is Â·ρ.

    Args:
      logp: ``[B, T]`` log π_θ of the sampled tokens (differentiated).
      old_logp: ``[B, T]`` log π_θold of the same tokens (data).
      advantages: ``[B, T]``, or ``[B, 1]`` for one advantage per output.
      eps_low: lower clip range ε_low.
      eps_high: upper clip range ε_high.

    Returns:
      ``[B, T]`` per-token objective (not masked; see ``aggregate``).
    """
    ratio, adv = _ratio_and_advantages(logp, old_logp, advantages)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    out = jnp.minimum(unclipped, clipped)
    chex.assert_shape(out, logp.shape)
    return out


def gspo_surrogate(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
) -> jax.Array:
    """GSPO's sequence-level clipped objective (Zheng et al. 2025, "Group Sequence Policy
    Optimization"), written per token so it aggregates like the others (to be maximised):

        s_i = exp( 1/|o_i| Σ_t (log π_θ(o_i,t) − log π_θold(o_i,t)) )      (length-normalised)
        J_i = min( s_i Â_i, clip(s_i, 1 − ε_low, 1 + ε_high) Â_i )

    Every valid token of output i carries J_i's value (so ``sequence_mean`` gives
    1/G Σ_i J_i) through GSPO-token's s_i,t = sg[s_i] · π_θ(o_i,t)/sg[π_θ(o_i,t)], whose
    gradient is GSPO's, s_i Â_i · 1/|o_i| Σ_t ∇ log π_θ(o_i,t), and zero when the
    sequence is clipped. The clip range is on the sequence ratio (the paper uses ε of a
    few 1e-4).

    Args:
      logp, old_logp: ``[B, T]``.
      advantages: ``[B, 1]``, or ``[B, T]`` constant over each row's valid tokens.
      mask: ``[B, T]`` valid tokens (the length |o_i| and the mean).
      eps_low, eps_high: clip range of s_i.

    Returns:
      ``[B, T]`` per-token objective (not masked).
    """
    chex.assert_rank([logp, mask], [2, 2])
    chex.assert_equal_shape([logp, old_logp, mask])
    lp, m = as_float(logp), mask.astype(bool)
    log_ratio = jnp.where(m, lp - as_float(old_logp), 0.0)
    length = jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1)
    seq_ratio = jnp.exp(jnp.sum(log_ratio, axis=1, keepdims=True) / length)
    token_ratio = jax.lax.stop_gradient(seq_ratio) * jnp.exp(lp - jax.lax.stop_gradient(lp))
    adv = as_float(advantages)
    out = jnp.minimum(token_ratio * adv, jnp.clip(token_ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)
    return jnp.broadcast_to(out, logp.shape)


def cispo_objective(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
) -> jax.Array:
    """CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, not the update
    (to be maximised), per token:

        sg( clip(ρ_t, 1 − ε_low, 1 + ε_high) ) · Â_t · log π_θ(o_t|q,o_<t)

    The weight is a constant (stop-gradient), so every token keeps the gradient
    clip(ρ_t)·Â_t·∇ log π_θ, including those PPO's clip would zero. At ρ = 1 the gradient
    equals the clipped surrogate's.

    Args:
      logp, old_logp: ``[B, T]``.
      advantages: ``[B, T]`` or ``[B, 1]``.

    Returns:
      ``[B, T]`` per-token objective (not masked).
    """
    ratio, adv = _ratio_and_advantages(logp, old_logp, advantages)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    out = weight * adv * as_float(logp)
    chex.assert_shape(out, logp.shape)
    return out


def tis_weights(old_logp: jax.Array, sample_logp: jax.Array, cap: float) -> jax.Array:
    """Truncated importance sampling between the trainer and the sampler (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"):

        w_t = min( π_θold(o_t) / π_sampler(o_t), C )      (a constant: stop-gradient)

    π_θold is the trainer's own log-prob of the batch (recomputed), π_sampler the one
    the sampling program recorded (another precision or program, an off-policy chunk).
    Multiplying the per-token policy objective by w_t corrects the expectation for the
    mismatch; the cap C bounds the variance.

    Args:
      old_logp, sample_logp: ``[B, T]``.
      cap: C > 0.

    Returns:
      ``[B, T]`` weights in (0, C].
    """
    chex.assert_equal_shape([old_logp, sample_logp])
    ratio = jnp.exp(as_float(old_logp) - as_float(sample_logp))
    return jax.lax.stop_gradient(jnp.minimum(ratio, cap))


def clipped_tokens(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
) -> jax.Array:
    """``[B, T]`` bool: where the clipped branch of ``clipped_surrogate`` is active.

    That is ρ > 1 + ε_high with Â > 0, or ρ < 1 − ε_low with Â < 0: the tokens whose
    gradient the clip removes. Unmasked; aggregate with ``aggregate_parts(…,
    'token_mean')`` to accumulate a clip fraction over micro-batches.
    """
    ratio, adv = _ratio_and_advantages(logp, old_logp, advantages)
    out = ((ratio > 1.0 + eps_high) & (adv > 0)) | ((ratio < 1.0 - eps_low) & (adv < 0))
    return jnp.broadcast_to(out, logp.shape)


def clip_fraction(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    eps_low: float,
    eps_high: float,
) -> jax.Array:
    """Fraction of valid tokens whose clipped branch is active (a scalar metric).

    Args:
      logp, old_logp: ``[B, T]``.
      advantages: ``[B, T]`` or ``[B, 1]``.
      mask: ``[B, T]`` valid tokens.
      eps_low, eps_high: the clip range of ``clipped_surrogate``.

    Returns:
      Scalar in [0, 1]; 0 if no token is valid.
    """
    clipped = clipped_tokens(logp, old_logp, advantages, eps_low=eps_low, eps_high=eps_high)
    return aggregate(clipped.astype(jnp.float32), mask, "token_mean")


# ------------------------------------------------------------------ aggregation
def aggregate_parts(
    per_token: jax.Array,
    mask: jax.Array,
    mode: AggregationMode,
    *,
    constant_length: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The numerator and denominator of ``aggregate``, additive over micro-batches.

    For rows split into micro-batches k, ``Σ_k num_k / Σ_k den_k`` equals ``aggregate``
    of the whole batch, for every mode, because each numerator is a sum over rows and
    each denominator a parameter-free count:

    ============== ================================= ===================================
    mode           numerator                         denominator
    ============== ================================= ===================================
    sequence_mean  Σ_i (Σ_t m_it x_it / Σ_t m_it)    #rows with Σ_t m_it > 0
    token_mean     Σ_i Σ_t m_it x_it                 Σ_i Σ_t m_it
    constant       Σ_i Σ_t m_it x_it                 B × L  (L = constant_length or T)
    ============== ================================= ===================================

    Gradient accumulation: accumulate ``grad(num_k)`` and ``den_k``, then divide once.
    (Equivalently, compute the full-batch denominator first from the full mask and
    scale every micro-batch loss by it.)

    Args:
      per_token: ``[B, T]`` per-token values x.
      mask: ``[B, T]`` bool or non-negative float weights m (1 on valid tokens).
      mode: one of ``AGGREGATION_MODES``.
      constant_length: L for ``constant`` mode (Dr. GRPO's max_new_tokens) when it is
        not the array's T, e.g. when T also spans prompt positions. Ignored otherwise.

    Returns:
      ``(numerator, denominator)``, float scalars.
    """
    chex.assert_rank(per_token, 2)
    chex.assert_equal_shape([per_token, mask])
    x = as_float(per_token)
    m = mask.astype(x.dtype)
    weighted = jnp.where(m != 0, x * m, 0.0)  # garbage at padded positions never leaks
    if mode == "sequence_mean":
        tokens_per_row = jnp.sum(m, axis=1)
        nonempty = tokens_per_row > 0
        row_mean = jnp.sum(weighted, axis=1) / jnp.where(nonempty, tokens_per_row, 1.0)
        return jnp.sum(row_mean), jnp.sum(nonempty).astype(x.dtype)
    if mode == "token_mean":
        return jnp.sum(weighted), jnp.sum(m)
    if mode == "constant":
        length = per_token.shape[1] if constant_length is None else constant_length
        return jnp.sum(weighted), jnp.asarray(per_token.shape[0] * length, x.dtype)
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")


def aggregate(
    per_token: jax.Array,
    mask: jax.Array,
    mode: AggregationMode,
    *,
    constant_length: int | None = None,
) -> jax.Array:
    """Reduces a per-token array over valid tokens to a scalar.

    ``sequence_mean`` is DeepSeekMath's 1/G Σ_i 1/|o_i| Σ_t (Eq. 3, Eq. 5): mean over
    the valid tokens of each output, then mean over outputs (outputs with no valid token
    are left out of the outer mean; all-empty gives 0). ``token_mean`` (DAPO) weights
    every valid token equally: Σ m x / Σ m. ``constant`` (Dr. GRPO) is Σ m x / (B × L),
    L = ``constant_length`` or T. Never NaN when nothing is valid.

    Args:
      per_token: ``[B, T]``.
      mask: ``[B, T]`` bool or 0/1 weights.
      mode: one of ``AGGREGATION_MODES``.
      constant_length: see ``aggregate_parts``.

    Returns:
      Float scalar, ``numerator / denominator`` of ``aggregate_parts``.
    """
    num, den = aggregate_parts(per_token, mask, mode, constant_length=constant_length)
    return safe_divide(num, den)


# ----------------------------------------------------------------- other losses
def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float | None = None,
) -> jax.Array:
    """PPO value-model loss per token (to be minimised).

        ½ (V_ψ(t) − R_t)²                                      (clip_eps None)
        ½ max( (V − R)², (V_old + clip(V − V_old, −ε, ε) − R)² )  (value clipping)

    R_t are the GAE returns (targets for V_ψ, DeepSeekMath Eq. 1 and §4.1.1).

    Args:
      values: ``[B, T]`` current value predictions (differentiated).
      old_values: ``[B, T]`` value predictions at sampling time (data).
      returns: ``[B, T]`` regression targets, e.g. from ``advantages.gae``.
      mask: ``[B, T]``, masked positions give 0.
      clip_eps: value clip range ε, or None for no clipping.

    Returns:
      ``[B, T]`` per-token loss.
    """
    chex.assert_rank(values, 2)
    chex.assert_equal_shape([values, old_values, returns, mask])
    v, v_old, ret = as_float(values), as_float(old_values), as_float(returns)
    loss = jnp.square(v - ret)
    if clip_eps is not None:
        v_clipped = v_old + jnp.clip(v - v_old, -clip_eps, clip_eps)
        loss = jnp.maximum(loss, jnp.square(v_clipped - ret))
    return jnp.where(mask.astype(bool), 0.5 * loss, 0.0)


def dpo_loss(
    policy_chosen_logp: jax.Array,
    policy_rejected_logp: jax.Array,
    ref_chosen_logp: jax.Array,
    ref_rejected_logp: jax.Array,
    beta: float,
) -> jax.Array:
    """DPO loss per preference pair (to be minimised): minus DeepSeekMath Eq. 12.

        −log σ( β (log π_θ(o+)/π_ref(o+)) − β (log π_θ(o−)/π_ref(o−)) )

    Its gradient gives the coefficient GC_DPO of Eq. 14,
    σ(β log π_θ(o−)/π_ref(o−) − β log π_θ(o+)/π_ref(o+)), with + on the chosen output
    and − on the rejected one. Inputs are sequence-level log-probs: sums of token
    log-probs over each output (standard DPO), or per-token means (Eq. 12's 1/|o|
    form); the caller chooses by how it reduces.

    Args:
      policy_chosen_logp: ``[B]`` log π_θ(o+ | q).
      policy_rejected_logp: ``[B]`` log π_θ(o− | q).
      ref_chosen_logp: ``[B]`` log π_ref(o+ | q).
      ref_rejected_logp: ``[B]`` log π_ref(o− | q).
      beta: β.

    Returns:
      ``[B]`` per-pair loss; softplus(−margin), stable for large margins.
    """
    chex.assert_rank(policy_chosen_logp, 1)
    chex.assert_equal_shape(
        [policy_chosen_logp, policy_rejected_logp, ref_chosen_logp, ref_rejected_logp]
    )
    chosen = as_float(policy_chosen_logp) - as_float(ref_chosen_logp)
    rejected = as_float(policy_rejected_logp) - as_float(ref_rejected_logp)
    margin = beta * (chosen - rejected)
    return jax.nn.softplus(-margin)


def sft_loss(logp: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood −log π_θ(o_t|q,o_<t) (to be minimised).

    DeepSeekMath Eq. 6 maximises 1/|o| Σ_t log π_θ(o_t|q,o_<t); aggregated with
    ``sequence_mean`` this is exactly minus Eq. 6 (GC = 1, Eq. 7). Multiply by the
    indicator 𝕀(o) per output for RFT / Online RFT (GC of Eq. 10).

    Args:
      logp: ``[B, T]`` (any shape) log-probs of the target tokens.

    Returns:
      Same shape: −logp (not masked).
    """
    return -as_float(logp)


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of the categorical distribution over the last axis, H = −Σ_v p_v log p_v.

    Stable for large logits and for −inf logits (masked vocabulary entries contribute 0,
    with finite gradients).

    Args:
      logits: ``[..., V]`` unnormalised log-probabilities.

    Returns:
      ``[...]`` entropy in nats.
    """
    if jnp.ndim(logits) < 1:
        raise ValueError(f"logits need a vocabulary axis; got shape {jnp.shape(logits)}")
    logits = as_float(logits)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(log_p)
    safe_log_p = jnp.where(p > 0, log_p, 0.0)
    return -jnp.sum(p * safe_log_p, axis=-1)
