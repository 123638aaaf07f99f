"""bench_packing: its batch has prompts and completions in the stated ranges, padded on the
sides packing needs, and packs into fewer rows."""

import numpy as np
import pytest

from grpo_jax.model import packing

@pytest.fixture
def bench(benchmark_module):
    return benchmark_module("bench_packing")


def test_the_batch_lengths_and_its_packing(bench):
    batch = bench.make_batch(32, 64, 256, vocab=100)
    prompts, completions = np.asarray(batch.prompt_mask).sum(1), np.asarray(batch.mask).sum(1)
    assert prompts.min() >= 32 and prompts.max() <= 64
    assert completions.min() >= 32 and completions.max() <= 256
    assert np.asarray(batch.prompt_mask)[:, -1].all() and np.asarray(batch.mask)[:, 0].all()
    rows = packing.rows_per_block(batch, 4, 1, 1) * 4
    # No packing holds more than 320 positions per row; this one saves rows.
    assert (prompts + completions).sum() / 320 <= rows < 32
