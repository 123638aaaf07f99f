"""Drawing a token from the logits: temperature, top-k, top-p and the per-row randomness,
in one place (the conventions are the package docstring's).

`Drawing` is the device form of `SamplingParams`' draw settings: its values are traced
(changing them never recompiles), its `filtered` switch is compiled in.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

DRAW_BLOCK = 1024  # vocabulary entries per block of the two-level inverse-CDF draw


@flax.struct.dataclass
class Drawing:
    """What the decode loop draws with: scalars, and the stop tokens as a mask [V]."""

    temperature: jax.Array  # [] float32; 0 = greedy
    top_k: jax.Array  # [] int32; 0 = off
    top_p: jax.Array  # [] float32; 1 = off
    max_new_tokens: jax.Array  # [] int32
    stop_mask: jax.Array  # [V] bool: True at the stop tokens
    pad_id: jax.Array  # [] int32
    filtered: bool = flax.struct.field(pytree_node=False, default=False)  # top-k / top-p on

    @classmethod
    def host(cls, settings, vocab_size: int) -> "Drawing":
        """The host (numpy) form of a ``SamplingParams``; the caller places it."""
        stop_mask = np.zeros((vocab_size,), bool)
        stop_mask[list(settings.stop_tokens)] = True
        return cls(np.float32(settings.temperature), np.int32(settings.top_k), np.float32(settings.top_p),
                   np.int32(settings.max_new_tokens), stop_mask, np.int32(settings.pad_id),
                   filtered=settings.filtered)


def first_max(x):
    """argmax over the vocabulary (first index of the maximum) of x [V,B] -> [B] int32.

    `jnp.argmax` lowers to a variadic (value, index) reduce that XLA's CPU backend does not
    vectorise, where a max followed by a min over the indices that reach it is two
    vectorised reductions (benchmarks/NOTES.md, "Figures behind code comments"). NaN
    columns give index 0."""
    m = jnp.max(x, axis=0, keepdims=True)
    first = jnp.min(jnp.where(x == m, jnp.arange(x.shape[0], dtype=jnp.int32)[:, None], x.shape[0]), axis=0)
    return jnp.where(first < x.shape[0], first, 0).astype(jnp.int32)


def inverse_cdf(weights, u):
    """Draw one index per column with probability proportional to weights [V,B] >= 0 (each
    column with some positive weight): the first index whose cumulative weight reaches
    u * total, u [B] in (0, 1].

    Two levels, so that no cumulative sum runs over the whole vocabulary (a sequential scan
    per row on CPU; benchmarks/NOTES.md, "Figures behind code comments"): the block whose
    running total first reaches the target, then the index inside that block. Along a
    non-decreasing cumulative sum the first index at or past the target is the count of
    entries below it, and it always has positive weight (a zero-weight entry repeats its
    predecessor's sum). If rounding leaves the target above every sum inside the block, the
    block's last index with positive weight is taken."""
    vocab, bsz = weights.shape
    blocks = -(-vocab // DRAW_BLOCK)
    w = jnp.pad(weights, ((0, blocks * DRAW_BLOCK - vocab), (0, 0))).reshape(blocks, DRAW_BLOCK, bsz)
    block_sum = jnp.sum(w, axis=1)  # [blocks, B]
    block_cum = jnp.cumsum(block_sum, axis=0)
    target = u * block_cum[-1]  # [B], <= the total, so some block reaches it
    j = jnp.sum(block_cum < target, axis=0)  # [B]
    before = jnp.take_along_axis(block_cum - block_sum, j[None, :], axis=0)  # [1, B]
    inner = jnp.take_along_axis(w, j[None, None, :], axis=0)[0]  # [block, B]
    i = jnp.sum(before + jnp.cumsum(inner, axis=0) < target, axis=0)
    last = jnp.max(jnp.where(inner > 0, jnp.arange(DRAW_BLOCK)[:, None], -1), axis=0)
    return (j * DRAW_BLOCK + jnp.minimum(i, last)).astype(jnp.int32)


def next_token(logits, u, drawing: Drawing):
    """One sampling step for a batch. logits [V,B] f32 (vocab-major: every engine's step
    returns them so), u [B] in (0,1].

    Returns (token [B] int32, its log-prob [B] f32 under the distribution drawn from:
    log_softmax(logits / T), renormalised over the kept tokens when `drawing.filtered`);
    T = 0 is greedy and its log-probs are those of T = 1 (see the package docstring).
    """
    temperature, top_k, top_p = drawing.temperature, drawing.top_k, drawing.top_p
    vocab = logits.shape[0]
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    top = jnp.max(scaled, axis=0, keepdims=True)
    weights = jnp.exp(scaled - top)  # softmax(scaled) up to the column's normaliser
    log_norm = jnp.log(jnp.sum(weights, axis=0))
    if drawing.filtered:
        desc = -jnp.sort(-scaled.T, axis=-1)  # [B,V], decreasing
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        in_k = jnp.arange(vocab) < k  # the top-k prefix of `desc`
        # Top-p over the top-k tokens, probabilities renormalised over them.
        p_desc = jnp.where(in_k, jnp.exp(desc - desc[:, :1]), 0.0)
        mass = jnp.cumsum(p_desc, axis=-1) / jnp.sum(p_desc, axis=-1, keepdims=True)
        n_keep = jnp.minimum(1 + jnp.sum((mass < top_p) & in_k, axis=-1), k)
        n_keep = jnp.where(top_p >= 1.0, k, n_keep)
        threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)[:, 0]  # [B]
        weights = jnp.where(scaled >= threshold, weights, 0.0)  # ties at the threshold are kept
        # The distribution actually drawn from is the tempered one renormalised over the
        # kept tokens (so π_old in the ratio is the sampler's, not the untruncated
        # policy's). Greedy keeps the T = 1 convention.
        log_norm = jnp.where(greedy, log_norm, jnp.log(jnp.sum(weights, axis=0)))
    # Greedy is one setting for the whole batch: only the branch it needs runs.
    token = jax.lax.cond(greedy, lambda: first_max(scaled), lambda: inverse_cdf(weights, u))
    logp = jnp.take_along_axis(scaled - top, token[None, :], axis=0)[0] - log_norm
    return token, logp


def uniforms(key, step, row_ids):
    """u in (0, 1] for every row [B], from fold_in(fold_in(key, column), row): step is the
    column every row draws (a scalar) or each row's own ([B]: the slot engine's rows, a
    continuation's rows that resume at their own column)."""
    if jnp.ndim(step) == 0:
        step_key = jax.random.fold_in(key, step)
        draw = lambda r: jax.random.uniform(jax.random.fold_in(step_key, r), (), jnp.float32)
        return 1.0 - jax.vmap(draw)(row_ids)
    draw = lambda t, r: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, t), r), (), jnp.float32)
    return 1.0 - jax.vmap(draw)(step, row_ids)
