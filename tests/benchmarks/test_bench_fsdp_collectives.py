"""fsdp_collectives: the hand-written FSDP is the partitioner's gradient, written with one
all-gather and one reduce-scatter; its compiled-collective table reads libtpu's program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from grpo_jax import aot

@pytest.fixture
def bench(benchmark_module):
    return benchmark_module("fsdp_collectives")


def test_shard_map_gradient_equals_the_partitioners(bench):
    """data 2 x fsdp 4 on the fake CPU devices, small shapes, float32: equal gradients, and the
    program handed to the compiler gathers once and reduce-scatters once (the scan body)."""
    mesh = bench.fsdp_mesh(jax.devices()[:8], 4)
    ws = jax.random.normal(jax.random.key(0), (2, 16, 24), jnp.float32) * 0.3
    x = jax.random.normal(jax.random.key(1), (8, 3, 16), jnp.float32)
    ws = jax.device_put(ws, NamedSharding(mesh, bench.W_SPEC))
    x = jax.device_put(x, NamedSharding(mesh, bench.X_SPEC))
    with jax.set_mesh(mesh):
        g_auto = bench.gradient(bench.loss_gspmd, mesh)(ws, x)
        by_hand = bench.gradient(bench.loss_shard_map(mesh), mesh)
        g_hand = by_hand(ws, x)
        written = bench.written_collectives(by_hand.lower(ws, x).as_text())
    expected = jax.grad(bench.loss_gspmd)(np.asarray(ws), np.asarray(x))
    np.testing.assert_allclose(np.asarray(g_hand), np.asarray(g_auto), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_auto), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert g_hand.sharding.spec == bench.W_SPEC
    assert (written["all_gather"], written["reduce_scatter"]) == (1, 1)


@pytest.mark.skipif(not aot.libtpu_available(), reason="needs libtpu (make install-test)")
def test_compiled_table_reads_libtpus_reduce_scatter(bench):
    """v5p:2x2x1 (4 chips), fsdp 4, w [2, 256, 512]: the gradient leaves as the shard
    [256 / 4, 512] of a reduce-scatter, the forward gathers whole matrices."""
    mesh = bench.fsdp_mesh(aot.topology_devices("v5p:2x2x1"), 4)
    with jax.set_mesh(mesh):
        lowered = bench.gradient(bench.loss_gspmd, mesh).lower(
            *bench.abstract_args(mesh, rows=1, tokens=128, d=256, f=512))
        table = bench.compiled_collectives(lowered.compile().as_text())
    assert table["reduce-scatter"][1] == "bf16[64,512]"
    assert table["all-gather"][1].endswith("[1,256,512]")
