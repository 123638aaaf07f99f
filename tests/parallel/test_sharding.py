"""Mesh construction, the rules table, and sharding-invariance of forward and grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from grpo_jax.model import transformer as model
from grpo_jax.parallel import sharding
from grpo_jax.config import MeshConfig, ModelConfig
from grpo_jax.errors import ConfigError
from tests.shards import per_device_bytes

CFG = ModelConfig(vocab_size=128, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, max_seq_len=64)


def _loss(params, tokens):
    logits = model.forward_logits(CFG, params, tokens[:, :-1])
    lp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()


@pytest.fixture(scope="module")
def reference():
    params = model.init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, CFG.vocab_size)
    loss, grads = jax.jit(jax.value_and_grad(_loss))(params, tokens)
    return params, tokens, loss, grads


@pytest.mark.parametrize("shape", [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)])
def test_same_forward_and_grads_on_every_mesh(reference, shape):
    params, tokens, loss, grads = reference
    mesh = sharding.mesh_from_shape(shape)
    sharded = model.init_params(CFG, jax.random.key(0), mesh)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params, sharded)
    batch = sharding.shard_batch(tokens, mesh)
    l, g = jax.jit(jax.value_and_grad(_loss))(sharded, batch)
    np.testing.assert_allclose(l, loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6), g, grads)


def test_params_are_sharded_as_the_rules_say():
    mesh = sharding.mesh_from_shape((2, 2, 2))
    params = model.init_params(CFG, jax.random.key(0), mesh)
    assert params["embedding"].sharding.spec == P("tensor", "fsdp")
    assert params["layers"]["attn"]["q"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert params["layers"]["mlp"]["down"].sharding.spec == P(None, "tensor", "fsdp")
    assert params["final_norm"]["scale"].sharding.spec == P(None)
    # each device holds a quarter of q: fsdp halves embed, tensor halves heads
    shard = params["layers"]["attn"]["q"].addressable_shards[0].data
    assert shard.shape == (2, 16, 2, 8)


def test_axis_that_does_not_divide_is_dropped():
    mesh = sharding.mesh_from_shape((1, 1, 8))
    # 3 kv heads cannot be split 8 ways: replicated on that dim instead of failing
    assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 3, 16), mesh) == P(None, None, None)
    assert sharding.logical_to_spec(("embed", "heads", "head_dim"), (64, 8, 16), mesh) == P(None, "tensor", None)
    with pytest.raises(KeyError, match="no rule"):
        sharding.logical_to_spec(("nonsense",), (4,), mesh)


def test_per_device_param_bytes_shrink_with_fsdp():
    sizes = {}
    for n in (1, 2, 4, 8):
        mesh = sharding.mesh_from_shape((1, n, 1))
        sizes[n] = per_device_bytes(model.init_params(CFG, jax.random.key(0), mesh))
    total = sum(x.size * 4 for x in jax.tree.leaves(model.init_params(CFG, jax.random.key(0))))
    assert sizes[1] == total
    assert sizes[1] > sizes[2] > sizes[4] > sizes[8]
    assert sizes[8] < 0.2 * sizes[1]


def test_mesh_fill_in_and_errors():
    assert sharding.resolve_mesh_shape(MeshConfig(ici_data=2, ici_fsdp=-1), 8) == ((2, 4, 1), (1, 1, 1))
    assert sharding.resolve_mesh_shape(MeshConfig(ici_fsdp=-1, dcn_data=2), 8) == ((1, 4, 1), (2, 1, 1))
    with pytest.raises(sharding.MeshError, match="there are 8 devices"):
        sharding.resolve_mesh_shape(MeshConfig(ici_data=2, ici_fsdp=2, ici_tensor=4), 8)
    with pytest.raises(sharding.MeshError, match="not a multiple of 3"):
        sharding.resolve_mesh_shape(MeshConfig(ici_data=3, ici_fsdp=-1), 8)
    mesh = sharding.make_mesh(MeshConfig(ici_data=2, ici_fsdp=-1, ici_tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_sample_mesh_tensor_degree():
    """mesh.sample_tensor sets the sampler's replicas x tensor on any device count and
    over a slice preset's own (v5litepod-8 samples on 2 x tensor 4); 0 keeps the preset's,
    or the train mesh without a slice; a degree that does not divide a slice's devices
    and a negative one are refused, naming the field."""
    shape = lambda cfg: dict(sharding.make_sample_mesh(cfg).shape)
    assert shape(MeshConfig(sample_tensor=2)) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert shape(MeshConfig(slice="v5litepod-8")) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert shape(MeshConfig(slice="v5litepod-8", sample_tensor=8)) == {"data": 1, "fsdp": 1, "tensor": 8}
    assert shape(MeshConfig(ici_fsdp=-1)) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert shape(MeshConfig(dcn_data=2, sample_tensor=2)) == {"data": 4, "fsdp": 1, "tensor": 2}
    with pytest.raises(sharding.MeshError, match="mesh.sample_tensor=3 does not divide the 8 devices"):
        sharding.make_sample_mesh(MeshConfig(sample_tensor=3))
    with pytest.raises(ConfigError, match="mesh.sample_tensor must be >= 0"):
        MeshConfig(sample_tensor=-1).validate()


def test_multislice_mesh_on_cpu_devices():
    mesh = sharding.make_mesh(MeshConfig(ici_data=1, ici_fsdp=-1, ici_tensor=1, dcn_data=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    # the DCN axis is outermost: the first "slice" (devices 0-3) is data index 0
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert sorted(ids[0].ravel()) == [0, 1, 2, 3]


def test_shard_batch_rejects_ragged_leading_sizes():
    mesh = sharding.mesh_from_shape((2, 1, 1))
    with pytest.raises(ValueError, match="different leading sizes"):
        sharding.shard_batch({"a": np.zeros((4, 2)), "b": np.zeros((6,))}, mesh)
    out = sharding.shard_batch({"a": np.zeros((4, 2))}, mesh)
    assert out["a"].sharding.spec == P(("data",), None) or out["a"].sharding.spec == P("data", None)


def _hidden(params, tokens):
    return model.forward_hidden(CFG, params, tokens)[0]


@pytest.mark.parametrize("shape, spec", [((2, 2, 2), '[{"data", "fsdp"}, {}, {}]'),
                                         ((1, 4, 2), '[{"fsdp"}, {}, {}]')])
def test_residual_stream_is_constrained_at_the_block_boundary(reference, shape, spec):
    params, tokens, _, _ = reference
    mesh = sharding.mesh_from_shape(shape)
    sharded = model.init_params(CFG, jax.random.key(0), mesh)
    batch = sharding.shard_batch(tokens, mesh)
    with sharding.on_mesh(mesh):
        hlo = jax.jit(_hidden).lower(sharded, batch).as_text()
        hidden = jax.jit(_hidden)(sharded, batch)
    # The rules table's spec for [batch, seq, embed] (embed's fsdp is taken by the batch rows)
    # annotates the block output [8, 12, 32]: once in the scanned layer body.
    block_out = [line for line in hlo.splitlines()
                 if "sdy.sharding_constraint" in line and "tensor<8x12x32xf32>" in line]
    assert len(block_out) == 1 and spec in block_out[0], block_out
    # Off the mesh the model carries no constraint, and the constraint changes no value.
    assert "sharding_constraint" not in jax.jit(_hidden).lower(params, tokens).as_text()
    np.testing.assert_allclose(hidden, jax.jit(_hidden)(params, tokens), rtol=1e-5, atol=1e-6)


def test_sampler_is_traced_on_its_mesh(reference):
    from grpo_jax import sampler
    from grpo_jax.sampler import calls, engines

    params, _, _, _ = reference
    mesh = sharding.mesh_from_shape((2, 2, 2))
    sharded = model.init_params(CFG, jax.random.key(0), mesh)
    out = sampler.sample(CFG, sharded, [[1, 2, 3]] * 4,
                         sampler.SamplingParams(max_new_tokens=4, temperature=0.0),
                         key=jax.random.key(0), group_size=2, mesh=mesh)
    ref = sampler.sample(CFG, params, [[1, 2, 3]] * 4,
                         sampler.SamplingParams(max_new_tokens=4, temperature=0.0),
                         key=jax.random.key(0), group_size=2)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    prefill, _ = calls.programs(CFG, mesh, engines.ENGINES["unrolled"], "auto")
    assert "sdy.sharding_constraint" in prefill.lower(
        sharded, *[sharding.shard_batch(x, mesh) for x in (np.ones((8, 4), np.int32), np.ones((8, 4), bool))],
        None, cache_len=8).as_text()
