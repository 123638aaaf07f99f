"""Ahead-of-time TPU compiles on CPU (grpo_jax.aot, launch/compile.py); need libtpu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import aot, loops, shapes
from grpo_jax.config import apply_overrides, get_preset
from grpo_jax.errors import MeshError
from grpo_jax.model.transformer import param_shapes as model_param_shapes, param_shardings as model_param_shardings
from grpo_jax.aot.tpu_specs import EFFICIENCY, chip_of

pytestmark = pytest.mark.skipif(not aot.libtpu_available(),
                                reason="libtpu not installed (pip install -r requirements-tpu.txt)")
PROMPT = 32


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("cpu-tiny")
    mesh, topology = aot.topology_mesh(cfg, "v5e:2x2")
    rows = cfg.data.batch_size * cfg.rl.group_size
    compiled, _ = aot.compile_train_step(cfg, mesh, rows, PROMPT)
    return cfg, mesh, topology, rows, compiled


def test_train_step_report_matches_memory_analysis(tiny):
    cfg, mesh, topology, rows, compiled = tiny
    m = compiled.memory_analysis()
    cost = np.array([2e12, 8e11])
    rep = aot.report(compiled, chip_of(topology), cost, 1e12)
    assert rep["argument_bytes"] == m.argument_size_in_bytes
    assert rep["temp_bytes"] == m.temp_size_in_bytes
    assert rep["peak_bytes"] == (m.argument_size_in_bytes + m.temp_size_in_bytes
                                 + m.output_size_in_bytes - m.alias_size_in_bytes)
    assert rep["fits"] and rep["hbm_capacity_bytes"] == 16e9
    assert rep["headroom"] == pytest.approx(1 - rep["peak_bytes"] / 16e9)
    # v5e: 197 TFLOP/s and 819 GB/s per chip; 8e11 bytes take longer than 2e12 FLOPs.
    assert rep["estimated_seconds"] == pytest.approx(8e11 / 819e9) and rep["bound"] == "memory"
    # the bound over the fraction of it measured bandwidth-bound programs reach (tpu_specs.EFFICIENCY)
    assert rep["expected_seconds"] == pytest.approx(8e11 / 819e9 / EFFICIENCY["v5e"].bandwidth)
    # v5e's ICI all-reduce bandwidth: 51.2 TB/s per 256-chip pod, 200 GB/s per chip; 3e11
    # bytes of collectives take longer than the 8e11 bytes of HBM traffic.
    rep = aot.report(compiled, chip_of(topology), np.array([2e12, 8e11, 3e11, 12.0]), 1e12)
    assert rep["ici_seconds"] == pytest.approx(3e11 / 200e9) and rep["ici_collectives"] == 12
    assert rep["estimated_seconds"] == pytest.approx(1.5) and rep["bound"] == "interconnect"
    assert rep["expected_seconds"] == pytest.approx(1.5 / EFFICIENCY["v5e"].bandwidth)
    rep = aot.report(compiled, chip_of(topology), np.array([2e14, 8e11]), 1e12)
    assert rep["bound"] == "compute"
    assert rep["expected_seconds"] == pytest.approx(2e14 / 197e12 / EFFICIENCY["v5e"].compute)


def test_the_run_program_has_loops_and_the_cost_twin_none(tiny, monkeypatch):
    """The train step a run compiles holds loops (cost_analysis would count one trip of
    each); its cost twin traced in loops.unrolled() has none, and the estimator refuses to
    count a program that still has one. On 8 chips the TPU partitioner writes large
    sharded dots as loops over their shards (windowed einsum), which the estimator would
    refuse; the twin's compile switches them off."""
    cfg, mesh, _, rows, compiled = tiny
    assert " while(" in compiled.as_text()
    small = apply_overrides(cfg, ["data.batch_size=4", "rl.group_size=8", "model.num_layers=1",
                                  "rl.num_micro_batches=1"])
    wide, _ = aot.topology_mesh(small, "v5e:2x4")
    with loops.unrolled():
        twin = aot.lower_train_step(small, wide, 32, 256)
    flops = aot.loop_free_cost("train_step", twin, wide)[0]
    assert flops > 0
    monkeypatch.setitem(aot.TWIN_OPTIONS, "tpu", {})
    with pytest.raises(RuntimeError, match="train_step: the cost twin still holds a while loop"):
        aot.loop_free_cost("train_step", twin, wide)


class _OutOfHBM:
    """A lowered program whose compile fails as XLA's does when buffers exceed HBM."""

    def __init__(self, status):
        self.status = status

    def compile(self, compiler_options=None):
        raise RuntimeError(f"{self.status}: Ran out of memory in memory space hbm.\nmore detail")


def test_a_cost_twin_out_of_hbm_leaves_the_time_not_counted(tiny):
    """A twin the compiler cannot fit is NotCounted (naming the program); any other
    compile error still raises. The program's report keeps its fit and drops its time,
    and the step's summary keeps what was counted: the rollout, not the update or MFU."""
    from launch.compile import summary
    from launch.compile_matrix import table

    cfg, mesh, topology, rows, compiled = tiny
    with pytest.raises(aot.NotCounted, match="^train_step: its cost twin .* RESOURCE_EXHAUSTED: Ran out of memory"):
        aot.loop_free_cost("train_step", _OutOfHBM("RESOURCE_EXHAUSTED"), mesh)
    with pytest.raises(RuntimeError, match="^INTERNAL"):
        aot.loop_free_cost("train_step", _OutOfHBM("INTERNAL"), mesh)
    chip = chip_of(topology)
    lost = aot.report(compiled, chip, aot.NotCounted("train_step: twin"), 1e12)
    assert {k: lost[k] for k in aot.fit(compiled, chip)} == aot.fit(compiled, chip)
    assert lost["estimated_seconds"] is None and lost["not_counted"] == "train_step: twin"
    sampled = aot.report(compiled, chip, np.array([2e12, 8e11]), 1e12)
    results = {"sample_decode": {**sampled, "calls_per_step": 3, "compile_seconds": 1.0},
               "train_step": {**lost, "calls_per_step": 1, "compile_seconds": 2.0}}
    s = summary(results, chip, slice_name="v5e:2x2")
    assert s["rollout_seconds"] == pytest.approx(3 * 8e11 / 819e9)
    assert s["update_seconds"] is None and s["mfu"] is None and s["not_counted"] == ["train_step"]
    assert s["compile_seconds"] == 3.0 and s["min_headroom"] == lost["headroom"]
    results["sample_prefill"] = results["sample_decode"]
    row = table([{"preset": "cpu-tiny", "slice": "v5e:2x2", "results": {**results, "summary": {**s, "decode_engine": "shared"}}}])
    assert s["rollout_seconds_expected"] == pytest.approx(s["rollout_seconds"] / EFFICIENCY["v5e"].bandwidth)
    assert s["update_seconds_expected"] is None and s["mfu_expected"] is None
    assert f"| {s['rollout_seconds']:.1f} / – | not counted | not counted |" in row


# One run of the fit check serves the cost tests below: TPU compiles are not in jax's
# persistent cache, so each cost twin the check compiles would otherwise be compiled again.
# 3 layers x 3 micro-batches, 7 tokens: the whole twins the counts are compared with reach
# past the 1-2 layers x 1-2 micro-batches / steps the counts extrapolate from. A tool call
# allowed: the check compiles the rollout's continuations too (one shape at 7 tokens).
CHECKED = ["model.num_layers=3", "rl.num_micro_batches=3", "data.batch_size=3", "rl.group_size=4",
           "model.remat=full", "rl.max_new_tokens=7", "rl.max_tool_calls=1"]
CHECK_PROMPT = 16


@pytest.fixture(scope="module")
def checked():
    from launch.compile import check

    cfg = apply_overrides(get_preset("cpu-tiny"), CHECKED)
    return cfg, check(cfg, "v5e:2x2", CHECK_PROMPT, log=lambda *_: None)


def test_train_cost_counts_every_layer_and_micro_batch(checked):
    """The estimator's train-step count (twins at 1-2 layers x 1-2 micro-batches,
    extrapolated) equals a twin compiled whole at 3 layers x 3 micro-batches within 5%
    (XLA fuses a larger program slightly differently: 3% measured), and its FLOPs are the
    analytic count of the executed work (forward, backward, reference, remat) within 20%."""
    cfg, results = checked
    mesh, _ = aot.topology_mesh(cfg, "v5e:2x2")
    rows = cfg.data.batch_size * cfg.rl.group_size
    counted = [results["train_step"]["flops_per_chip"], results["train_step"]["bytes_per_chip"]]
    with loops.unrolled():
        whole = aot.loop_free_cost("train_step", aot.lower_train_step(cfg, mesh, rows, CHECK_PROMPT), mesh)
    np.testing.assert_allclose(counted, whole[:2], rtol=0.05)
    analytic = aot.train_flops(cfg, rows, CHECK_PROMPT) / mesh.size
    assert abs(counted[0] / analytic - 1) < 0.20, (counted[0], analytic)


def test_sampler_cost_counts_every_layer_and_token(checked):
    """The decode's count (twins at 1-2 layers x 1-2 steps, extrapolated) equals a twin
    compiled whole at 3 layers x 6 steps: FLOPs within 1%, bytes within 10% (where the
    TPU compiler places cpu-tiny's small buffers depends on the program's size: 6%
    measured); per token its FLOPs are the analytic count (2
    per multiply-add of every row's matmuls, attention over every cache slot) within 20%,
    and its bytes are at least the weights' and the whole KV cache's shards (the floor;
    docs/tpu.md explains the rest op by op)."""
    cfg, results = checked
    mesh = aot.sample_mesh(cfg, "v5e:2x2")
    prompts, g = cfg.data.batch_size, cfg.rl.group_size
    decode = results["sample_decode"]
    program, args, kwargs = aot.twin_calls(cfg, mesh, prompts, g, CHECK_PROMPT, cfg.rl.max_new_tokens - 1)["decode"]
    whole = aot.loop_free_cost("sample_decode", program.lower(*args, **kwargs), mesh)
    np.testing.assert_allclose(decode["flops_per_chip"], whole[0], rtol=0.01)
    np.testing.assert_allclose(decode["bytes_per_chip"], whole[1], rtol=0.10)
    m = cfg.model
    rows_per_chip = -(-prompts * g // mesh.size)
    slots = CHECK_PROMPT + shapes.bucket_length(cfg.rl.max_new_tokens)
    flops = rows_per_chip * (2 * aot.matmul_params(m) + 4 * m.num_layers * m.num_heads * m.head_dim * slots)
    assert abs(decode["flops_per_token"] / flops - 1) < 0.20, (decode["flops_per_token"], flops)
    assert decode["bytes_per_token"] >= aot.decode_bytes_analytic(cfg, mesh, prompts, g, CHECK_PROMPT)


@pytest.mark.parametrize("tensor", [1, 2])
def test_decode_twin_counts_each_weight_once_and_every_collective(tensor):
    """A decode step reads each layer's bf16 weights from HBM once. XLA's cost analysis
    counts a VMEM prefetch's source and destination and the consumer's read besides, so
    with memory-space assignment on it charges a weight several times (1.8x here when
    written, 7.7x for the 1.5B decode on v6e-8); the twins compile without it. Per layer
    and step (the 1-2 layers x 1-2 steps difference) the count lies between the layer's
    weight shard and 1.15x it plus the KV a step reads. Split over tensor = 2, a layer
    all-reduces the float32 partial sums of its attention output and of its MLP, one row
    of the embedding width per row of the replica: two collectives, nothing else."""
    cfg = apply_overrides(get_preset("cpu-tiny"), [
        "model.embed_dim=1024", "model.mlp_dim=4096", "model.num_heads=8", "model.num_kv_heads=8",
        "model.head_dim=128", "model.vocab_size=8192", "model.max_seq_len=128", "rl.sample_dtype=bfloat16",
        "data.batch_size=4", "rl.group_size=8", "rl.max_new_tokens=16", f"mesh.sample_tensor={tensor}"])
    mesh = aot.sample_mesh(cfg, "v6e:2x4")
    assert dict(mesh.shape) == {"data": 8 // tensor, "fsdp": 1, "tensor": tensor}
    count = {}
    for layers in (1, 2):
        for steps in (1, 2):
            variant = apply_overrides(cfg, [f"model.num_layers={layers}"])
            program, args, kwargs = aot.twin_calls(variant, mesh, 4, 8, PROMPT, steps)["decode"]
            count[layers, steps] = aot.loop_free_cost("sample_decode", program.lower(*args, **kwargs), mesh)
    _, hbm, ici, collectives = count[2, 2] - count[2, 1] - count[1, 2] + count[1, 1]
    m = cfg.model
    weights = 2 * (m.embed_dim * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                   + m.num_heads * m.head_dim * m.embed_dim + 3 * m.embed_dim * m.mlp_dim) / tensor
    cache = args[1]  # the 2-layer twin's: one layer's k and v per chip is half of it
    kv = sum(a.size * a.dtype.itemsize for a in (cache.k, cache.v)) / mesh.size / 2
    assert weights <= hbm <= 1.15 * (weights + kv), (hbm, weights, kv)
    rows_per_replica = 4 * 8 // mesh.shape["data"]
    assert (collectives, ici) == ((0, 0) if tensor == 1 else (2, 2 * rows_per_replica * m.embed_dim * 4))


def test_model_flops_count_the_6n_rule():
    cfg = get_preset("cpu-tiny")
    m = cfg.model
    n = m.num_layers * (m.embed_dim * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                        + m.num_heads * m.head_dim * m.embed_dim + 3 * m.embed_dim * m.mlp_dim) + m.embed_dim * m.vocab_size
    assert aot.matmul_params(m) == n
    got = aot.model_flops(cfg, 8, 32)
    rows, seq = 8 * cfg.rl.group_size, 32 + cfg.rl.max_new_tokens
    assert got == {"prefill": 2 * n * 8 * 32, "decode": 2 * n * rows * cfg.rl.max_new_tokens,
                   "train_step": (6 * n + 2 * n) * rows * seq}  # β > 0: a reference pass
    # LoRA trains no weight of the model: forward and dx per trained token; the frozen
    # base is the reference.
    lora = apply_overrides(cfg, ["model.lora_rank=8"])
    assert aot.model_flops(lora, 8, 32)["train_step"] == (4 * n + 2 * n) * rows * seq


def test_fit_check_passes_where_it_fits_and_leaves_the_cpu_backend(checked):
    cfg, results = checked
    assert set(results) == {"sample_prefill", "sample_decode", "train_step", "summary", "eval_prefill", "eval_decode",
                            "tool_prefill_32+16", "tool_decode_32+16"}
    assert all(results[f"eval_{name}"]["fits"] for name in ("prefill", "decode"))
    s = results["summary"]
    assert s["fits"] and s["decode_engine"] == "shared" and 0 < s["min_headroom"] < 1
    # MFU: the model's FLOPs of the step over chips x peak x the estimated time.
    useful = aot.model_flops(cfg, cfg.data.batch_size, CHECK_PROMPT)
    mfu = (useful["prefill"] + useful["decode"] + useful["train_step"]) / 4 / 197e12 / (
        s["rollout_seconds"] + s["update_seconds"])
    assert s["mfu"] == pytest.approx(mfu)
    dec = results["sample_decode"]
    assert dec["bytes_per_token"] >= dec["analytic_bytes_per_token"] > 0
    # The shared decode hands back no cache (its completion cache is its own): its outputs
    # (tokens, mask, log-probs, finished flags, the step; padded to TPU tiles) are less
    # than a chip's share of that cache, 3 rows x 16 slots x 3 layers x k, v x 2 heads x 32.
    m = cfg.model
    cache_bytes = 3 * shapes.bucket_length(cfg.rl.max_new_tokens) * m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2
    assert (m.num_layers, m.num_kv_heads, m.head_dim, cache_bytes) == (3, 2, 32, 36864)
    assert 0 < dec["output_bytes"] < cache_bytes
    # The sampler is charged for the train state it shares HBM with, computed from the
    # abstract state before the train step compiles: its shards' bytes, which the train
    # step's donated (aliased) buffers exceed only by TPU tile padding (tiny arrays here;
    # within 2% at 7B widths, tests/aot/test_aot_sharding.py).
    resident = results["sample_decode"]["resident_bytes"]
    assert resident == aot.bytes_per_chip(aot.train_state(cfg, aot.topology_mesh(cfg, "v5e:2x2")[0])[1])
    assert 0 < resident <= results["train_step"]["alias_bytes"]
    # A tool rollout's continuation: 12 running rows padded to 16, each its own context of
    # up to 16 + 6 tokens (a bucket of 32) prefilled afresh, then 16 completion columns;
    # costed, beside the train state, outside the step's summary. Its prefill reads 16 rows
    # x 32 tokens where the first call's reads 12 (3 prompts x G as the engine lays them out
    # on this mesh) x 16: 2.7x the FLOPs measured.
    for name in ("prefill", "decode"):
        rep = results[f"tool_{name}_32+16"]
        assert (rep["rows"], rep["used_tokens"], rep["prompt_bucket"], rep["completion_bucket"]) == (16, 1, 32, 16)
        assert rep["fits"] and rep["peak_bytes"] > 0 and rep["resident_bytes"] == resident
        assert rep["flops_per_chip"] > 0 and rep["estimated_seconds"] > 0 and rep["calls_per_step"] is None
    assert results["tool_prefill_32+16"]["flops_per_chip"] > 2 * results["sample_prefill"]["flops_per_chip"]
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
        "model.max_seq_len=8448", "rl.num_micro_batches=640", "rl.decode=scan"],
    # Whole 512 x 4352-token batch in one micro-batch: the compiler itself runs out of HBM
    # (35.1 GB of temporaries). Attention in causal query blocks shrank the step: 128 rows
    # now fit, 192 compile to 17.3 GB/chip and our peak-HBM check catches them instead.
    "train_step: RESOURCE_EXHAUSTED": [
        "data.batch_size=64", "rl.group_size=8", "rl.max_new_tokens=4096",
        "model.max_seq_len=4352", "rl.num_micro_batches=1", "rl.decode=scan"],
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
    # The TPU's reduce-scatter: an all-reduce of the whole array inside an
    # all-reduce-scatter fusion, here run by a 16-trip loop.
    fused = "\n".join([
        "%all-reduce-scatter.2 (p: bf16[512,1024]) -> bf16[64,1024] {",
        "  %all-reduce.8 = bf16[512,1024]{1,0} all-reduce(%p), to_apply=%add",
        "}",
        "%cond (c: s32[]) -> pred[] {",
        "  %n = s32[] constant(16)",
        "}",
        "%body (b: s32[]) -> s32[] {",
        "  %rs = bf16[64,1024]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.2",
        "}",
        "ENTRY %main (x: s32[]) -> s32[] {",
        "  %loop = s32[] while(%x), condition=%cond, body=%body",
        "}"])
    assert aot.collective_ops(fused) == [{"kind": "reduce-scatter", "bytes": 64 * 1024 * 2,
                                          "shapes": ["bf16[64,1024]"], "loops": [16]}]
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


def test_an_async_collective_split_into_pieces_is_counted_once_where_it_starts():
    # Hand-written: a start outside a 30-trip loop, continuations inside it and after it,
    # all with the start's channel id; beside it an ordinary all-reduce in the loop.
    piece = lambda name, flag: (f'  %{name} = f32[4096,1024]{{1,0}} all-gather(%w), channel_id=6, dimensions={{0}}, '
                                f'backend_config={{"async_collective_fusion_config":{{"flag_start":"{flag}","flag_end":"8"}}}}')
    hlo = "\n".join([
        "%cond (c: s32[]) -> pred[] {",
        "  %n = s32[] constant(30)",
        "}",
        "%body (b: s32[]) -> s32[] {",
        piece("ag.2", 2), piece("ag.3", 2),
        "  %ar = f32[8]{0} all-reduce(%y), channel_id=7, to_apply=%add",
        "}",
        "ENTRY %main (x: s32[]) -> s32[] {",
        piece("ag.1", -1),
        "  %loop = s32[] while(%x), condition=%cond, body=%body",
        piece("ag.4", 2),
        "}"])
    assert sorted(aot.collective_ops(hlo), key=lambda op: op["kind"]) == [
        {"kind": "all-gather", "bytes": 4096 * 1024 * 4, "shapes": ["f32[4096,1024]"], "loops": []},
        {"kind": "all-reduce", "bytes": 8 * 4, "shapes": ["f32[8]"], "loops": [30]}]
    # Continuations whose start is not in the text: one collective, at the first piece.
    headless = aot.collective_ops(hlo.replace(piece("ag.1", -1), ""))
    assert [op["loops"] for op in headless if op["kind"] == "all-gather"] == [[30]]
    # A real compile: cpu-tiny's prefill on a v5litepod-8's sampling mesh (vocab over
    # tensor = 4) gathers the tied embedding for the last token's logits as one async
    # all-gather that the compiler splits over the layers' fusions.
    cfg = get_preset("cpu-tiny")
    mesh = aot.sample_mesh(cfg, "v5litepod-8")
    per_call = cfg.rl.sample_prompts or cfg.data.batch_size
    lowered = aot.lower_sampler(cfg, mesh, per_call, cfg.rl.group_size, 256)["prefill"]
    text = lowered.compile().as_text()
    v, e = cfg.model.vocab_size, cfg.model.embed_dim
    pieces = [line for line in text.splitlines() if f"[{v},{e}]" in line.split("all-gather(")[0]
              and " all-gather(" in line]
    assert len(pieces) > 1  # the compiler did split it (else this test checks nothing)
    gathers = [op for op in aot.collective_ops(text) if op["kind"] == "all-gather" and op["shapes"][0].endswith(f"[{v},{e}]")]
    assert len(gathers) == 1 and gathers[0]["loops"] == []


def test_train_step_gathers_the_unembedding_once_per_pass_and_reduce_scatters_its_gradient():
    """FSDP on v5e:2x4 (fsdp = 8), an untied [E, V] unembedding, 8 log-prob chunks per
    micro-batch: its all-gathers run once per micro-batch (outside the chunk loop), its
    gradient is reduce-scattered to the [E / 8, V] shard outside every loop, and no
    all-reduce carries a whole sharded weight (replicated ones, the norms, are all-reduced).
    Before, each of the 8 chunks of each pass gathered it again and reduce-scattered its
    own gradient."""
    cfg = apply_overrides(get_preset("cpu-tiny"), ["model.tie_embeddings=False", "rl.logprob_chunk_size=8",
                                                   "rl.num_micro_batches=2"])
    mesh, _ = aot.topology_mesh(cfg, "v5e:2x4")
    compiled, _ = aot.compile_train_step(cfg, mesh, cfg.data.batch_size * cfg.rl.group_size, 16)
    ops = aot.collective_ops(compiled.as_text())
    e, v = cfg.model.embed_dim, cfg.model.vocab_size
    unembed = [op for op in ops if any(s.endswith((f"[{e},{v}]", f"[{e // 8},{v}]")) for s in op["shapes"])]
    assert sorted((op["kind"], len(op["loops"])) for op in unembed) == [
        ("all-gather", 1), ("all-gather", 1), ("reduce-scatter", 0)]
    sharded = [x for x, sh in zip(jax.tree.leaves(model_param_shapes(cfg.model)),
                                  jax.tree.leaves(model_param_shardings(cfg.model, mesh))) if not sh.is_fully_replicated]
    weights = {f"[{','.join(map(str, x.shape))}]" for x in sharded}
    assert f"[{e},{v}]" in weights
    assert not [op for op in ops if op["kind"] == "all-reduce"
                and any(s[s.index("["):] in weights for s in op["shapes"])]


def test_the_sample_prompts_search_bisects_to_the_largest_that_fits():
    from launch.compile import largest_fitting

    divisors = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    for limit in (0, 1, 3, 64, 1000, 1024):
        asked = []
        got = largest_fitting(divisors, lambda n: asked.append(n) or n <= limit)
        assert got == max((d for d in divisors if d <= limit), default=None), limit
        assert len(asked) <= 4 and len(set(asked)) == len(asked)  # ⌈log2(12)⌉ compiles, none twice


def test_the_check_splits_the_slice_as_a_run_splits_its_devices():
    """mesh.sample_devices on a slice: the sampler's mesh on the first hosts' chips (tensor 4,
    the preset's), the train mesh on the rest, its fsdp filled from them; no train state is
    resident beside the sampler."""
    v5p = apply_overrides(get_preset("deepseekmath-rl-7b-v5p-128"), ["rl.async_steps=1", "mesh.sample_devices=32"])
    halves = aot.split_of(v5p, "v5p-128")
    train, topology = aot.topology_mesh(v5p, "v5p-128")
    assert topology == "v5p:4x4x4" and train is halves.train and aot.sample_mesh(v5p, "v5p-128") is halves.sample
    assert dict(halves.sample.shape) == {"data": 8, "fsdp": 1, "tensor": 4}
    assert dict(halves.train.shape) == {"data": 1, "fsdp": 32, "tensor": 1}
    hosts = lambda mesh: {d.process_index for d in mesh.devices.flat}
    assert len(hosts(halves.sample)) == 8 and hosts(halves.sample).isdisjoint(hosts(halves.train))
    v5e = apply_overrides(get_preset("deepseekmath-rl-7b-v5litepod-256"), ["rl.async_steps=1", "mesh.sample_devices=192"])
    with pytest.raises(MeshError, match="runs no program on part of a v5litepod-256 slice"):
        aot.split_of(v5e, "v5litepod-256")  # the TPU compiler's refusal, named before any compile
    assert aot.split_of(get_preset("deepseekmath-rl-7b"), "v5p-128") is None
