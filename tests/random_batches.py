"""Random train-step inputs shared by the algorithm tests: a Batch with ragged completion
masks and its policy log-probs, both fixed by a seed."""

import jax.numpy as jnp
import numpy as np

from grpo_jax.rl.batching import make_batch

B, TC, G = 8, 6, 4  # rows, completion tokens, group size


def random_batch(seed=0, rows=B, tc=TC, **kw):
    """[rows, tc] completions; row 0 full length, the rest ragged; 3 step slots per row."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, tc + 1, rows)
    lens[0] = tc  # at least one full row
    mask = np.arange(tc)[None] < lens[:, None]
    fields = dict(
        sample_logprobs=np.where(mask, -rng.uniform(0.1, 3, (rows, tc)), 0.0),
        rewards=rng.normal(size=rows), correct=rng.random(rows) < 0.5, truncated=lens == tc,
        step_rewards=rng.normal(size=(rows, 3)),
        step_end=np.sort(rng.integers(0, tc, (rows, 3)), axis=1),
        step_mask=rng.random((rows, 3)) < 0.8)
    fields.update(kw)
    return make_batch(np.ones((rows, 2), np.int32), np.ones((rows, 2), bool),
                      rng.integers(0, 50, (rows, tc)), mask, **fields)


def random_logps(seed, batch):
    """[rows, tc] float32 log-probs, 0 on padding."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.where(batch.mask, -rng.uniform(0.1, 3, batch.mask.shape), 0.0), jnp.float32)
