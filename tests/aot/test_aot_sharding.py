"""The compiled 7B-width train step on a v5p-128 holds no whole weight matrix on a chip
(grpo_jax.aot; needs libtpu). Its own file so that it compiles in parallel with
test_aot.py under `pytest -n 2 --dist loadfile` (tests/conftest.py starts both early)."""
import re

import jax
import pytest

from grpo_jax import aot
from grpo_jax.model import transformer as model_lib
from grpo_jax.config import apply_overrides, get_preset

pytestmark = pytest.mark.skipif(not aot.libtpu_available(),
                                reason="libtpu not installed (pip install -r requirements-tpu.txt)")


def test_7b_widths_train_step_on_v5p_128_is_fully_sharded():
    # Same widths as the 7B preset, 2 layers and 64 + 64 tokens (the property is per weight
    # matrix, not per depth or length), on the real v5p-128 mesh: 64 chips, fsdp=64.
    cfg = apply_overrides(get_preset("deepseekmath-rl-7b"),
                          ["model.num_layers=2", "data.batch_size=1", "rl.num_micro_batches=1",
                           "rl.max_new_tokens=64", "model.max_seq_len=512"])
    mesh, _ = aot.topology_mesh(cfg, "v5p-128")
    compiled, _ = aot.compile_train_step(cfg, mesh, cfg.rl.group_size, 64)
    m = cfg.model
    # FSDP gathers one layer's weights inside the layer loop and the unembedding
    # [embed, vocab] where the log-probs use it (found by this test: 1.7 GB f32 per chip on
    # v5p-128; a vocab-parallel unembedding would avoid it). The stacked layer weights and
    # the embedding table must never be whole on one chip.
    full = [(m.vocab_size, m.embed_dim),
            (m.num_layers, m.embed_dim, m.mlp_dim), (m.num_layers, m.mlp_dim, m.embed_dim)]
    shapes = {tuple(int(d) for d in dims.split(",")) for dims in
              re.findall(r"(?:f32|bf16)\[([\d,]+)\]", compiled.as_text())}
    assert not [s for s in full if s in shapes], "an unsharded weight matrix is materialised"
    params = sum(x.size for x in jax.tree.leaves(model_lib.param_shapes(m)))
    state_bytes = params * (4 + 4 + 4 + 4)  # f32 params, Adam mu and nu, f32 reference
    per_chip = compiled.memory_analysis().argument_size_in_bytes
    assert 0.9 < per_chip / (state_bytes / mesh.size) < 1.2, per_chip
    # The fit check's train-state estimate (unpadded shard bytes) is the donated state.
    estimate = aot.bytes_per_chip(aot.train_state(cfg, mesh)[1])
    assert abs(estimate / compiled.memory_analysis().alias_size_in_bytes - 1) < 0.02
