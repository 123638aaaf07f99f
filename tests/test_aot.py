"""Ahead-of-time TPU compiles on CPU (grpo_jax.aot, launch/compile.py); need libtpu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import aot
from grpo_jax.config import apply_overrides, get_preset
from grpo_jax.tpu_specs import chip_of

pytestmark = pytest.mark.skipif(not aot.libtpu_available(),
                                reason="libtpu not installed (pip install -r requirements-tpu.txt)")
PROMPT = 32


@pytest.fixture(scope="module")
def tiny():
    # Unrolled layers and one micro-batch: no loop bodies, so cost_analysis counts every FLOP.
    cfg = apply_overrides(get_preset("cpu-tiny"), ["model.scan_layers=false"])
    mesh, topology = aot.topology_mesh(cfg, "v5e:2x2")
    rows = cfg.data.batch_size * cfg.rl.group_size
    compiled, _ = aot.compile_train_step(cfg, mesh, rows, PROMPT)
    return cfg, mesh, topology, rows, compiled


def test_train_step_report_matches_memory_analysis(tiny):
    cfg, mesh, topology, rows, compiled = tiny
    m = compiled.memory_analysis()
    rep = aot.report(compiled, chip_of(topology), mesh.size, aot.train_flops(cfg, rows, PROMPT))
    assert rep["argument_bytes"] == m.argument_size_in_bytes
    assert rep["temp_bytes"] == m.temp_size_in_bytes
    assert rep["peak_bytes"] == (m.argument_size_in_bytes + m.temp_size_in_bytes
                                 + m.output_size_in_bytes - m.alias_size_in_bytes)
    assert rep["fits"] and rep["hbm_capacity_bytes"] == 16e9


def test_analytic_flops_match_compiler_within_10_percent(tiny):
    cfg, mesh, _, rows, compiled = tiny
    counted = compiled.cost_analysis()
    counted = counted[0] if isinstance(counted, (list, tuple)) else counted
    analytic = aot.train_flops(cfg, rows, PROMPT) / mesh.size
    assert abs(counted["flops"] / analytic - 1) < 0.10, (counted["flops"], analytic)


def test_fit_check_passes_where_it_fits_and_leaves_the_cpu_backend():
    from launch.compile import check

    results = check(get_preset("cpu-tiny"), "v5e:2x2", PROMPT, log=lambda *_: None)
    assert set(results) == {"sample_prefill", "sample_decode", "train_step", "summary"}
    assert results["summary"]["fits"]
    # The sampler is charged for the train state it shares HBM with, computed from the
    # abstract state before the train step compiles: its shards' bytes, which the train
    # step's donated (aliased) buffers exceed only by TPU tile padding (tiny arrays here;
    # within 2% at 7B widths, tests/test_aot_sharding.py).
    resident = results["sample_decode"]["resident_bytes"]
    cfg = get_preset("cpu-tiny")
    assert resident == aot.bytes_per_chip(aot.train_state(cfg, aot.topology_mesh(cfg, "v5e:2x2")[0])[1])
    assert 0 < resident <= results["train_step"]["alias_bytes"]
    # Loading libtpu for compiles leaves computation on the CPU devices.
    assert jax.default_backend() == "cpu" and jax.devices()[0].platform == "cpu"


# cpu-tiny widths keep the compiles fast; the sizes put one program over a 16 GB v5e chip.
FIT_CASES = {
    # 80 x 64 rollouts of 8192 tokens in one sampler call: the train step fits in
    # micro-batches, but the prefill's outputs (the KV cache, 11.1 GB/chip) plus its
    # temporaries (5.5 GB) reach 16.6 GB: caught by our peak-HBM report, before the
    # train step is compiled.
    "sample_prefill: peak HBM .* exceeds the chip's 16 GB": [
        "data.batch_size=80", "rl.group_size=64", "rl.max_new_tokens=8192",
        "model.max_seq_len=8448", "rl.num_micro_batches=640"],
    # Whole 512 x 4352-token batch in one micro-batch: the compiler itself runs out of HBM
    # (35.1 GB of temporaries). Attention in causal query blocks shrank the step: 128 rows
    # now fit, 192 compile to 17.3 GB/chip and our peak-HBM check catches them instead.
    "train_step: RESOURCE_EXHAUSTED": [
        "data.batch_size=64", "rl.group_size=8", "rl.max_new_tokens=4096",
        "model.max_seq_len=4352", "rl.num_micro_batches=1"],
}


@pytest.mark.parametrize("message", list(FIT_CASES))
def test_fit_check_names_the_program_that_does_not_fit(message):
    from launch.compile import check

    cfg = apply_overrides(get_preset("cpu-tiny"), FIT_CASES[message])
    with pytest.raises(aot.FitError, match="^" + message):
        check(cfg, "v5e:2x2", 256, log=lambda *_: None)


def test_collectives_are_counted_with_their_result_bytes():
    # Hand-written HLO: a sync all-gather, an async all-reduce pair (counted once, at its
    # start) and an all-to-all with a tuple result.
    hlo = "\n".join([
        "  %ag = bf16[4096,1024]{1,0} all-gather(%x), dimensions={0}",
        "  %ars = f32[8,128]{1,0} all-reduce-start(%y), to_apply=%add",
        "  %ard = f32[8,128]{1,0} all-reduce-done(%ars)",
        "  %a2a = (s32[64,2]{1,0}, s32[64,2]{1,0}) all-to-all(%p, %q), dimensions={0}",
        "  %dot = f32[8,8]{1,0} dot(%a, %b)"])
    assert aot.collectives(hlo) == {"all-gather": {"count": 1, "bytes": 4096 * 1024 * 2},
                                    "all-reduce": {"count": 1, "bytes": 8 * 128 * 4},
                                    "all-to-all": {"count": 1, "bytes": 2 * 64 * 2 * 4}}
    # A real TPU compile: replicating a [4096, 1024] array sharded over 4 chips is one
    # all-gather whose result is the whole array (the compiler may narrow it to bf16).
    devices = aot.topology_devices("v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    w = jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=sharded)
    compiled = jax.jit(lambda w: w * 2, out_shardings=whole).lower(w).compile()
    found = aot.collectives(compiled.as_text())
    assert list(found) == ["all-gather"] and found["all-gather"]["count"] == 1
    assert found["all-gather"]["bytes"] in (4096 * 1024 * 2, 4096 * 1024 * 4)
