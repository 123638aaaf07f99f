"""rl.pack: sequences packed end to end for the train step's forward passes (grpo_jax.model.packing)
give the same loss and gradient as the padded rows; the layout by hand; bad rows refused."""

import jax
import numpy as np
import pytest
from tests.rl.test_programs import _cfg as _trainer_cfg
from tests.rl.test_programs import _record
from tests.rl.test_tool_tokens import with_tool_tokens
from tests.rl.test_train_step import BATCH, _cfg, _flat, _run, params  # noqa: F401  (params: the fixture)
from tests.rl.test_trainer import SevensTask, tok  # noqa: F401  (tok: the fixture)

from grpo_jax.rl import algorithms
from grpo_jax import aot
from grpo_jax.model import packing
from grpo_jax.rl.batching import make_batch
from grpo_jax.config import apply_overrides, get_preset
from grpo_jax.model.transformer import init_params
from grpo_jax.parallel.sharding import mesh_from_shape
from grpo_jax.rl.trainer import Trainer


def _tiny_batch():
    """3 rows, Tp = 4, Tc = 3: prompts of 2, 4 and 1 tokens, completions of 3, 0 and 1."""
    n, l = np.array([2, 4, 1]), np.array([3, 0, 1])
    pmask = np.arange(4)[None] >= (4 - n)[:, None]
    cmask = np.arange(3)[None] < l[:, None]
    prompts = np.array([[0, 0, 11, 12], [21, 22, 23, 24], [0, 0, 0, 31]])
    completions = np.array([[13, 14, 15], [0, 0, 0], [32, 0, 0]])
    return make_batch(prompts, pmask, completions, cmask)


def test_the_layout_by_hand():
    """Rows of 7 positions; first fit, longest first: row 0 (5 tokens) opens a row, row 1
    (4) does not fit beside it and opens another, row 2 (2) fills the first. Index: the
    hidden state before each completion token, flat in the packed rows."""
    packed = packing.pack(_tiny_batch(), num_micro_batches=1).packing
    np.testing.assert_array_equal(packed.tokens, [[11, 12, 13, 14, 15, 31, 32], [21, 22, 23, 24, 0, 0, 0]])
    np.testing.assert_array_equal(packed.segments, [[1, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(packed.positions, [[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 0, 0, 0]])
    # Row 0 is predicted at 1, 2, 3; row 1 has no completion (clamped to its last prompt
    # token, 7 + 3); row 2's one token at 5, then clamped.
    np.testing.assert_array_equal(packed.index, [[1, 2, 3], [10, 10, 10], [5, 5, 5]])
    assert packed.blocks == 1


def test_rows_are_dealt_to_micro_batches_on_their_own_device():
    """16 rows of one prompt token (Tp = 8, Tc = 1, so rows of 9 positions) over 2 devices:
    every device packs its 8 rows into one. At 4 micro-batches the rows of a device are
    dealt longest first, back and forth (equal lengths: in row order), so micro-batch k gets
    rows k and 7 - k on device 0 and 8 + k and 15 - k on device 1; the reordered batch puts
    them where split_micro_batches takes micro-batch k's rows from."""
    tokens = np.zeros((16, 8), np.int32)
    tokens[:, -1] = np.arange(1, 17)
    batch = make_batch(tokens, tokens > 0, np.zeros((16, 1), np.int32), np.zeros((16, 1), bool))
    assert packing.rows_per_block(batch, 1, 1, 2) == 1
    packed = packing.pack(batch, 4, 1, 2).packing
    assert packed.tokens.shape == (4 * 2 * 1, 9)
    split = packed.tokens.reshape(2, 4, 9).transpose(1, 0, 2)  # [micro, device row, L]
    np.testing.assert_array_equal(split[:, :, :2], [[[1, 8], [9, 16]], [[2, 7], [10, 15]], [[3, 6], [11, 14]],
                                                    [[4, 5], [12, 13]]])
    # Positions k and k + 4 of a block are micro-batch k's (strided split); order is per block.
    np.testing.assert_array_equal(packed.order, [0, 1, 2, 3, 7, 6, 5, 4] * 2)
    np.testing.assert_array_equal(packed.order[packed.inverse[:8]], np.arange(8))
    reordered = np.asarray(packing.in_order(batch, packed).prompt_tokens)[:, -1]
    micro = algorithms.split_micro_batches(reordered, 4)
    np.testing.assert_array_equal(micro, [[1, 8, 9, 16], [2, 7, 10, 15], [3, 6, 11, 14], [4, 5, 12, 13]])
    np.testing.assert_array_equal(packing.rows_back(packing.in_order(batch, packed), packed).prompt_tokens,
                                  batch.prompt_tokens)
    long = make_batch(np.ones((16, 8), np.int32), np.ones((16, 8), bool), np.zeros((16, 8), np.int32),
                      np.ones((16, 8), bool))
    assert packing.rows_per_block(long, 1, 1, 1) == 16  # nothing fits beside anything: no gain


def test_rows_not_padded_on_their_side_are_refused():
    batch = _tiny_batch()
    holes = batch.replace(mask=np.array([[True, False, True], [False] * 3, [True, False, False]]))
    with pytest.raises(ValueError, match=r"completions right-padded \(real tokens first\); row 0 is not"):
        packing.pack(holes, 1)
    right = batch.replace(prompt_mask=np.array([[True, True, False, False]] + [[True] * 4] * 2))
    with pytest.raises(ValueError, match=r"prompts left-padded \(real tokens last\); row 0 is not"):
        packing.pack(right, 1)


@pytest.mark.parametrize("algorithm,mesh_shape,micro", [("grpo", (1, 1, 1), 1), ("ppo", (1, 2, 2), 2)])
def test_packed_and_padded_batches_give_the_same_loss_and_gradient(params, algorithm, mesh_shape, micro):
    """One train step (reference log-probs, β > 0; PPO's value model too) on the test batch
    (prompts of 3-16 tokens, completions of 1-8): packed, it ends with the padded step's
    metrics and parameters; PPO packed on 2 x 2 devices with 2 micro-batches against
    padded on one device in one. GRPO's completions hold a tool's tokens (multi-turn
    rollouts): context for the forward pass in both layouts, out of the loss in both."""
    batch = with_tool_tokens(BATCH)[0] if algorithm == "grpo" else BATCH
    padded_state, (padded,) = _run(_cfg(algorithm=algorithm), params, batch=batch)
    packed_cfg = _cfg(algorithm=algorithm, pack=True, num_micro_batches=micro)
    packed_state, (packed,) = _run(packed_cfg, params, batch=batch, mesh_shape=mesh_shape)
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "value_loss"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key
    np.testing.assert_allclose(_flat(packed_state.params), _flat(padded_state.params), rtol=1e-5, atol=1e-6)
    if algorithm == "ppo":
        np.testing.assert_allclose(_flat(packed_state.value_params), _flat(padded_state.value_params),
                                   rtol=1e-5, atol=1e-6)
    # On one device the 8 padded rows of 24 positions pack into fewer (2 rows per device
    # and micro-batch on the mesh: some pairs do not fit one row, so there it saves nothing).
    assert packing.rows_per_block(BATCH, 1, 1, 1) < 8


def test_the_check_lowers_the_largest_packing():
    """aot.lower_train_step with rl.pack: one sequence per row, sharded like the batch."""
    cfg = apply_overrides(get_preset("cpu-tiny"), ["rl.pack=true", "rl.num_micro_batches=2"])
    mesh = mesh_from_shape((2, 2, 1))
    text = aot.lower_train_step(cfg, mesh, 16, 16).as_text()
    width = 16 + cfg.rl.max_new_tokens
    assert f"tensor<16x{width}xi32>" in text  # the packed tokens, segments and positions
    abstract = packing.abstract(16, 16, cfg.rl.max_new_tokens, mesh)
    assert abstract.blocks == 4 and abstract.index.shape == (16, cfg.rl.max_new_tokens)
    assert jax.tree.leaves(abstract)[0].sharding.spec[0] == ("data", "fsdp")


def test_the_trainer_packs_each_batch_on_its_mesh(tmp_path, monkeypatch, tok):
    """cpu-tiny on 8 fake devices (fsdp 8) with 2 micro-batches: the step the trainer runs
    gets the rollout's sequences packed per micro-batch and device, and trains on all of
    its completion tokens."""
    cfg = _trainer_cfg(tmp_path, tok.vocab_size, "rl.pack=true", "rl.num_micro_batches=2")
    seen = _record(monkeypatch)
    trainer = Trainer(cfg, task=SevensTask(), tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                      progress=False, resume=False)
    (metrics,) = trainer.train(1)
    trainer.close()
    batch = seen["train_step"][1]
    blocks = trainer.mesh.shape["data"] * trainer.mesh.shape["fsdp"]
    assert batch.packing.blocks == blocks == 8
    rows = cfg.data.batch_size * cfg.rl.group_size
    assert batch.packing.tokens.shape[0] % (2 * blocks) == 0 and batch.packing.index.shape == batch.mask.shape
    assert metrics["tokens"] == float(np.asarray(batch.mask).sum()) > 0 and np.isfinite(metrics["loss"])
    assert batch.packing.tokens.shape[0] <= rows
