"""Checkpoints: round trip across meshes, bit-identical resume, fallback from a corrupted latest,
unreadable steps named and set aside, saves that Orbax would skip refused."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.checkpoints import checkpointing
from grpo_jax.model import transformer as model
from grpo_jax.parallel import sharding
from grpo_jax.config import ModelConfig, OptimizerConfig
from grpo_jax.errors import CheckpointError, UnreadableCheckpointError
from grpo_jax.rl.optimizer import make_optimizer
from tests.checkpoint_files import damage, files

CFG = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, max_seq_len=32)
TX, _ = make_optimizer(OptimizerConfig(peak_lr=1e-2, warmup_steps=0), total_steps=100)


def _state(mesh, seed=0):
    params = model.init_params(CFG, jax.random.key(seed), mesh)
    return {"params": params, "opt_state": TX.init(params), "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(seed + 1))}


def _train_step(state, tokens):
    def loss(p):
        lp = jax.nn.log_softmax(model.forward_logits(CFG, p, tokens[:, :-1]))
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()

    l, g = jax.value_and_grad(loss)(state["params"])
    updates, opt_state = TX.update(g, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
            "step": state["step"] + 1, "rng": state["rng"]}, l


def _shardings(mesh):
    return jax.tree.map(lambda x: x.sharding, _state(mesh))


def test_round_trip_across_mesh_shapes(tmp_path):
    save_mesh = sharding.mesh_from_shape((1, 8, 1))
    state = _state(save_mesh)
    ckpt = checkpointing.Checkpointer(tmp_path, keep=2)
    ckpt.save(3, state, {"data_position": 17})
    with pytest.raises(CheckpointError, match=f"checkpoint step 3 already exists in {re.escape(str(tmp_path))}"):
        ckpt.save(3, state)  # never silently "re-saved", as Orbax would
    restore_mesh = sharding.mesh_from_shape((2, 2, 2))
    target = checkpointing.abstract_like(_state(restore_mesh))
    step, restored, meta = ckpt.restore(target)
    assert step == 3 and meta == {"data_position": 17}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), state, restored)
    assert restored["params"]["layers"]["attn"]["q"].sharding.spec == \
        _state(restore_mesh)["params"]["layers"]["attn"]["q"].sharding.spec
    ckpt.close()


def test_resume_gives_bit_identical_next_step(tmp_path):
    mesh = sharding.mesh_from_shape((1, 1, 1))
    tokens = jax.random.randint(jax.random.key(9), (4, 9), 0, CFG.vocab_size)
    step_fn = jax.jit(_train_step)
    state, _ = step_fn(_state(mesh), tokens)
    ckpt = checkpointing.Checkpointer(tmp_path)
    ckpt.save(1, state)
    uninterrupted, loss_a = step_fn(state, tokens)
    _, restored, _ = ckpt.restore(checkpointing.abstract_like(state))
    resumed, loss_b = step_fn(restored, tokens)
    assert float(loss_a) == float(loss_b)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), uninterrupted, resumed)
    ckpt.close()


def test_keep_last_n_and_corrupted_latest_falls_back(tmp_path, caplog):
    mesh = sharding.mesh_from_shape((1, 1, 1))
    ckpt = checkpointing.Checkpointer(tmp_path, keep=2)
    states = {s: _state(mesh, seed=s) for s in (1, 2, 3)}
    for s, st in states.items():
        ckpt.save(s, st, {"step": s})
    assert ckpt.all_steps() == [2, 3]
    ckpt.close()
    # Corrupt every file of the latest step's state item.
    for root, _, files in os.walk(tmp_path / "3" / "state"):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"garbage")
    ckpt = checkpointing.Checkpointer(tmp_path, keep=2)
    with caplog.at_level("WARNING"):
        step, restored, meta = ckpt.restore(checkpointing.abstract_like(states[1]))
    assert step == 2 and meta == {"step": 2}
    assert any("step 3" in r.message and "unreadable" in r.message for r in caplog.records)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), states[2], restored)
    ckpt.close()


def test_partial_save_is_invisible(tmp_path):
    """A save killed before Orbax's final rename leaves only a temporary directory."""
    mesh = sharding.mesh_from_shape((1, 1, 1))
    ckpt = checkpointing.Checkpointer(tmp_path)
    ckpt.save(1, _state(mesh))
    ckpt.close()
    os.makedirs(tmp_path / "2.orbax-checkpoint-tmp-123" / "state")
    ckpt = checkpointing.Checkpointer(tmp_path)
    assert ckpt.latest_step() == 1
    step, _, _ = ckpt.restore(checkpointing.abstract_like(_state(mesh)))
    assert step == 1
    ckpt.close()


def test_checkpoint_that_does_not_match_the_model_is_a_clear_error(tmp_path):
    mesh = sharding.mesh_from_shape((1, 1, 1))
    ckpt = checkpointing.Checkpointer(tmp_path)
    ckpt.save(1, _state(mesh))
    bigger = ModelConfig(**{**CFG.__dict__, "embed_dim": 64})
    params = model.init_params(bigger, jax.random.key(0))
    target = checkpointing.abstract_like({"params": params, "opt_state": TX.init(params),
                                          "step": jnp.zeros((), jnp.int32),
                                          "rng": jax.random.key_data(jax.random.key(1))})
    with pytest.raises(checkpointing.CheckpointError) as err:
        ckpt.restore(target, step=1)
    ckpt.close()
    # Named by parameter path and both shapes, from the stored metadata; Orbax's advice to
    # turn its shape check off never reaches the user.
    assert "['params']['embedding'] is stored as (64, 32), the model expects (64, 64)" in str(err.value)
    assert "strict" not in str(err.value)


def test_every_step_unreadable_is_named_then_set_aside_and_saved_again(tmp_path):
    mesh = sharding.mesh_from_shape((1, 1, 1))
    ckpt = checkpointing.Checkpointer(tmp_path, keep=5)
    for s in (1, 2):
        ckpt.save(s, _state(mesh, seed=s), {"step": s})
    ckpt.close()
    damage(tmp_path)
    damaged = {s: files(tmp_path / str(s)) for s in (1, 2)}
    ckpt = checkpointing.Checkpointer(tmp_path, keep=5)
    target = checkpointing.abstract_like(_state(mesh))
    with pytest.raises(UnreadableCheckpointError, match=f"no readable checkpoint in {re.escape(str(tmp_path))}: "
                       r"steps 1, 2 are unreadable \(step 2: ") as err:
        ckpt.restore(target)
    assert err.value.steps == [2, 1]
    assert ckpt.set_aside(err.value.steps) == str(tmp_path / "unreadable")
    assert ckpt.all_steps() == [] and sorted(os.listdir(tmp_path)) == ["unreadable"]
    for s in (1, 2):  # kept byte for byte
        assert files(tmp_path / "unreadable" / str(s)) == damaged[s]
    fresh = _state(mesh, seed=7)
    ckpt.save(1, fresh, {"step": 1})  # the step numbers are free again
    ckpt.save(2, fresh, {"step": 2})
    step, restored, meta = ckpt.restore(target)
    assert step == 2 and meta == {"step": 2}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), fresh, restored)
    ckpt.set_aside([2])  # a step set aside twice keeps both copies
    assert sorted(os.listdir(tmp_path / "unreadable")) == ["1", "2", "2.1"]
    assert files(tmp_path / "unreadable" / "2") == damaged[2]
    assert ckpt.all_steps() == [1]
    ckpt.close()


@pytest.mark.parametrize("newest_only", [True, False])
def test_a_damaged_meta_makes_its_step_unreadable(tmp_path, caplog, newest_only):
    """The state arrays intact, the JSON meta item (config, data position) cut short."""
    mesh = sharding.mesh_from_shape((1, 1, 1))
    ckpt = checkpointing.Checkpointer(tmp_path, keep=5)
    for s in (1, 2):
        ckpt.save(s, _state(mesh, seed=s), {"step": s})
    for s in (2,) if newest_only else (1, 2):
        damage(tmp_path / str(s) / "meta")
    target = checkpointing.abstract_like(_state(mesh))
    if newest_only:
        with caplog.at_level("WARNING"):
            step, _, meta = ckpt.restore(target)
        assert step == 1 and meta == {"step": 1}
        assert any("step 2" in r.message and "restored step 1 instead" in r.message for r in caplog.records)
    else:
        with pytest.raises(UnreadableCheckpointError, match="steps 1, 2 are unreadable"):
            ckpt.restore(target)
    ckpt.close()


def test_a_save_orbax_would_skip_is_an_error(tmp_path):
    """Orbax saves nothing, silently, for a step not newer than its latest."""
    mesh = sharding.mesh_from_shape((1, 1, 1))
    ckpt = checkpointing.Checkpointer(tmp_path, keep=5)
    ckpt.save(4, _state(mesh))
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 was not saved in .*: it is not newer "
                       r"than the latest step there \(4\)"):
        ckpt.save(2, _state(mesh))
    assert ckpt.all_steps() == [4]
    ckpt.close()
