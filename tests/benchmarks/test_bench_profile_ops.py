"""profile_ops' pure parts: op names from HLO text, wall time shared among overlapping thunks."""

import pytest

HLO = '''
  %ynn_fusion.6 = f32[32,49152]{1,0} fusion(%a, %b), kind=kCustom, calls=%fc.6, metadata={op_name="jit(_decode)/while/body/...e,ve->...v/dot_general" stack_frame_id=197}
  %ynn_fusion.386 = f32[32,1536]{1,0} fusion(%c, %d), kind=kCustom, calls=%fc.386, metadata={op_name="jit(_decode)/while/body/Transformer/closed_call/layers/mlp/dot_general" stack_frame_id=366}
  %copy.72 = f32[4]{0} copy(%e)
'''


@pytest.fixture
def profile_ops(benchmark_module):
    return benchmark_module("profile_ops")


def test_op_names_strip_the_jit_and_loop_prefixes_and_keep_the_shape(profile_ops):
    names = profile_ops.op_names(HLO)
    assert names == {"ynn_fusion.6": "...e,ve->...v/dot_general f32[32,49152]{1,0}",
                     "ynn_fusion.386": "layers/mlp/dot_general f32[32,1536]{1,0}"}


def test_wall_time_is_shared_among_overlapping_events(profile_ops):
    events = [{"name": "a", "ts": 0.0, "dur": 10.0}, {"name": "b", "ts": 5.0, "dur": 10.0},
              {"name": "a", "ts": 20.0, "dur": 4.0}, {"name": "c", "ts": 21.0, "dur": 2.0}]
    rows = profile_ops.wall_time_by_op(events, lambda e: e["name"])
    # a: 5 alone + 5 shared with b (2.5), then 1 + 2 shared with c (1) + 1 alone = 7.5 + 3
    assert rows["a"] == (2, pytest.approx(10.5))
    assert rows["b"] == (1, pytest.approx(7.5))
    assert rows["c"] == (1, pytest.approx(1.0))
    covered = 15.0 + 4.0  # [0, 15) and [20, 24): gaps get no time
    assert sum(w for _, w in rows.values()) == pytest.approx(covered)


def test_module_events_keep_one_program_and_drop_end_markers(profile_ops):
    trace = {"traceEvents": [
        {"ph": "X", "name": "f", "ts": 0, "dur": 1, "args": {"hlo_module": "jit__decode"}},
        {"ph": "X", "name": "end: f", "ts": 1, "dur": 0, "args": {"hlo_module": "jit__decode"}},
        {"ph": "X", "name": "g", "ts": 0, "dur": 1, "args": {"hlo_module": "jit__prefill"}},
        {"ph": "M", "name": "thread_name", "args": {}}]}
    assert [e["name"] for e in profile_ops.module_events(trace, "jit__decode")] == ["f"]


def test_parts_of_the_model_and_kinds(profile_ops):
    assert profile_ops.part_of("transpose(jvp(Transformer))/layers/mlp/...e,...f->ef/dot_general f32[576,1536]") == ("MLP", "matmul")
    assert profile_ops.part_of("layers/attn/reduce_sum f32[4,3,3,255,255]") == ("attention", "other")
    assert profile_ops.part_of("jvp()/logprobs/reduce_sum f32[4,64]") == ("log-probs over the vocabulary", "other")
    assert profile_ops.part_of("transpose(jvp())/logprobs/bcv,ve->bce/dot_general f32[256,576]") == \
        ("log-probs over the vocabulary", "matmul")
    assert profile_ops.part_of("closed_call f32[30,4,255,1536]") == ("rest", "other")
    rows = {"layers/mlp/dot_general a": (2, 3e6), "layers/mlp/dot_general b": (1, 1e6),
            "layers/mlp/mul c": (1, 0.5e6), "copy d": (1, 0.5e6)}
    lines = profile_ops.by_part(rows)
    assert lines[2] == "| MLP | matmul | 4000.0 | 80.0% |"
    assert lines[3:] == ["| MLP | other | 500.0 | 10.0% |", "| rest | other | 500.0 | 10.0% |"]


def test_on_an_accelerator_the_devices_kernels_are_counted_by_their_hlo_op(profile_ops):
    """A GPU trace: the host thread launches each op (its events tagged too) and the device
    runs kernels named by the library, each carrying the HLO op it runs; only the device's
    events count, under the HLO op's name."""
    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "fusion.3", "ts": 0, "dur": 1, "args": {"hlo_module": "jit_step"}},
        {"ph": "X", "pid": 7, "name": "sm90_xmma_gemm_bf16", "ts": 1, "dur": 5,
         "args": {"hlo_module": "jit_step", "hlo_op": "fusion.3"}},
        {"ph": "X", "pid": 7, "name": "loop_add_fusion", "ts": 6, "dur": 2,
         "args": {"hlo_module": "jit_other", "hlo_op": "add.1"}}]}
    assert profile_ops.device_pids(trace) == {7}
    events = profile_ops.module_events(trace, "jit_step")
    assert [e["name"] for e in events] == ["sm90_xmma_gemm_bf16"]
    assert profile_ops.hlo_op(events[0]) == "fusion.3"
    assert profile_ops.hlo_op({"name": "fusion.9", "args": {}}) == "fusion.9"  # a CPU thunk


GPU_HLO = """HloModule jit_step, entry_computation_layout={()->()}
  %loop_multiply_fusion.2 = bf16[8,767,8960]{2,1,0} fusion(%a), kind=kLoop, calls=%f2, metadata={op_name="jit(step)/transpose(jvp(Transformer))/while/body/closed_call/checkpoint/layers/mlp/mul"}
  %cublas-gemm.7 = bf16[6136,8960]{1,0} custom-call(%b, %c), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(Transformer))/while/body/closed_call/checkpoint/rematted_computation/layers/mlp/dot_general"}
  %fusion.9 = f32[8,64,151936]{2,1,0} fusion(%d), kind=kLoop, calls=%f9, metadata={op_name="jit(step)/logprobs/exp"}
  %command_buffer.3 = (bf16[8]) call(%e), to_apply=%cb3
"""


def test_phases_of_a_train_step(profile_ops):
    assert profile_ops.phase_of("transpose(jvp(Transformer))/checkpoint/rematted_computation/layers/mlp/dot_general") \
        == "recomputation (remat)"
    assert profile_ops.phase_of("transpose(jvp(Transformer))/layers/mlp/mul") == "backward"
    assert profile_ops.phase_of("jvp(Transformer)/layers/attn/exp") == "forward (policy)"
    assert profile_ops.phase_of("layers/attn/exp") == "reference forward, optimizer, rest"
    assert profile_ops.is_matmul("x/mul", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT")
    assert profile_ops.is_matmul("x/dot_general f32[2]", "")
    assert not profile_ops.is_matmul("x/mul", "loop_multiply_fusion_2")


def test_a_gpu_programs_kernels_are_summed_by_part_pass_and_op(profile_ops):
    """Kernels tagged with their own op, and kernels inside a command buffer (tagged with the
    buffer) found by their fusion's name; a library kernel in a buffer keeps the buffer's name,
    and counts as a matmul by its kernel name. Each table adds up to the kernel time."""
    dev = {"hlo_module": "jit_step"}
    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 7, "name": "nvjet_sm90_gemm", "ts": 0, "dur": 6000, "args": {**dev, "hlo_op": "cublas-gemm.7"}},
        {"ph": "X", "pid": 7, "name": "loop_multiply_fusion_2", "ts": 6000, "dur": 2000,
         "args": {**dev, "hlo_op": "command_buffer.3"}},
        {"ph": "X", "pid": 7, "name": "sm90_xmma_gemm_f32f32_tf32f32", "ts": 8000, "dur": 1000,
         "args": {**dev, "hlo_op": "command_buffer.3"}},
        {"ph": "X", "pid": 7, "name": "fusion_9", "ts": 9000, "dur": 1000, "args": {**dev, "hlo_op": "fusion.9"}},
        {"ph": "X", "pid": 7, "name": "other_module_kernel", "ts": 0, "dur": 500, "args": {"hlo_module": "jit_x"}}]}
    s = profile_ops.summarize_program(trace, GPU_HLO, top=10)
    assert s["module"] == "jit_step" and s["events"] == 4
    assert s["kernel_ms"] == pytest.approx(10.0) and s["matmul_ms"] == pytest.approx(7.0)
    assert s["by_part"] == {"MLP | matmul": pytest.approx(6.0), "MLP | other": pytest.approx(2.0),
                            "rest | matmul": pytest.approx(1.0),
                            "log-probs over the vocabulary | other": pytest.approx(1.0)}
    assert s["by_phase"]["recomputation (remat) | matmul"] == pytest.approx(6.0)
    assert s["by_phase"]["backward | other"] == pytest.approx(2.0)
    assert s["by_phase"]["reference forward, optimizer, rest | matmul"] == pytest.approx(1.0)
    assert sum(s["by_phase"].values()) == pytest.approx(s["kernel_ms"]) == pytest.approx(sum(s["by_part"].values()))
    assert [r["op"] for r in s["top_ops"]][:2] == [
        "transpose(jvp(Transformer))/checkpoint/rematted_computation/layers/mlp/dot_general bf16[6136,8960]{1,0}",
        "transpose(jvp(Transformer))/checkpoint/layers/mlp/mul bf16[8,767,8960]{2,1,0}"]
    lines = profile_ops.summary_tables(s)
    assert lines[0].startswith("jit_step: 4 kernels, 10.0 ms of kernel time (70.0% in matmuls)")


def test_a_trace_without_the_programs_events_says_which_modules_it_has(profile_ops):
    trace = {"traceEvents": [{"ph": "X", "name": "k", "ts": 0, "dur": 1, "args": {"hlo_module": "jit_other"}}]}
    with pytest.raises(ValueError, match="no events of jit_step.*jit_other"):
        profile_ops.summarize_program(trace, GPU_HLO)
    with pytest.raises(ValueError, match="HloModule"):
        profile_ops.module_name("ENTRY %main {}")


def test_a_control_flow_thunk_takes_only_the_instants_its_body_leaves(profile_ops):
    """A CPU trace: a while thunk W spans its body's thunks, which run on other threads; a
    conditional K inside it. W and K take only the instants when none of their body runs,
    the innermost of them; the parts add up to the span."""
    events = [{"name": "W", "ts": 0.0, "dur": 100.0}, {"name": "A", "ts": 10.0, "dur": 30.0},
              {"name": "B", "ts": 30.0, "dur": 30.0}, {"name": "K", "ts": 60.0, "dur": 15.0},
              {"name": "C", "ts": 70.0, "dur": 30.0}]
    rows = profile_ops.wall_time_by_op(events, lambda e: e["name"], containers={"W", "K"})
    # [0, 10) W; [10, 30) A; [30, 40) A and B; [40, 60) B; [60, 70) K, not W; [70, 100) C
    assert {k: w for k, (_, w) in rows.items()} == {"W": 10.0, "A": 25.0, "B": 25.0, "K": 10.0, "C": 30.0}
    shared = profile_ops.wall_time_by_op(events, lambda e: e["name"])  # without: W shares every instant
    assert shared["W"][1] > 30.0


DECODE_HLO = """HloModule jit_decode, entry_computation_layout={()->()}

%body.1 (p: (s32[])) -> (s32[]) {
  %fusion.1 = f32[8,64]{1,0} fusion(%p), kind=kLoop, calls=%f1, metadata={op_name="jit(decode)/while/body/layers/attn/attend/exp"}
  %copy.5 = f32[8,64]{1,0} copy(%fusion.1)
  %wrapped_reduce-window.2 = f32[8,4,16]{2,1,0} fusion(%copy.5), kind=kLoop, calls=%w2
  %fusion.3 = s32[8]{0} fusion(%wrapped_reduce-window.2), kind=kLoop, calls=%f3, metadata={op_name="jit(decode)/while/body/sample/cond/branch_0_fun/reduce_sum"}
  %copy.9 = s32[8]{0} copy(%fusion.3)
  ROOT %tuple.4 = (s32[]) tuple(%copy.9)
}

ENTRY %main.2 (a: s32[]) -> s32[] {
  %while.7 = (s32[], f32[8]{0}) while(%a), condition=%cond.1, body=%body.1, metadata={op_name="jit(decode)/while"}
  %cond.5 = (s32[8]{0}) conditional(%a, %x, %y), branch_computations={%b1, %b2}, metadata={op_name="jit(decode)/while/body/sample/cond"}
}
"""


def test_hlo_computations_and_control_flow_ops(profile_ops):
    comps = profile_ops.hlo_computations(DECODE_HLO)
    assert [i[0] for i in comps["body.1"]] == ["fusion.1", "copy.5", "wrapped_reduce-window.2", "fusion.3", "copy.9",
                                               "tuple.4"]
    assert comps["body.1"][0][1:3] == ("f32[8,64]{1,0}", "fusion")
    assert profile_ops.control_flow_ops(DECODE_HLO) == {"while.7", "cond.5"}


def test_xlas_unnamed_ops_are_named_after_the_op_they_feed(profile_ops):
    names = profile_ops.op_names(DECODE_HLO)
    assert names["fusion.1"] == "layers/attn/attend/exp f32[8,64]{1,0}"
    assert names["while.7"] == "while (tuple)"
    # copy.5 feeds an unnamed reduce-window, which feeds the sampling's reduce_sum
    assert names["copy.5"] == "sample/cond/branch_0_fun/(XLA's copy) f32[8,64]{1,0}"
    assert names["wrapped_reduce-window.2"] == "sample/cond/branch_0_fun/(XLA's fusion) f32[8,4,16]{2,1,0}"
    assert "copy.9" not in names and "tuple.4" not in names  # the loop's carry: no named op downstream


@pytest.mark.parametrize("op,part", [
    ("embed/gather f32[8,1,128]", "embedding"),
    ("layers/mlp/...e,ef->...f/dot_general f32[8,384]", "layers"),
    ("layers/attn/bte,ehd->bthd/dot_general f32[8,64]", "layers"),
    ("final_norm/mul f32[8,128]", "layers"),
    ("layers/attn/attend/prkgd,pkds->prkgs/dot_general f32[2,2,16,8]", "attention"),
    ("layers/attn/cache_update/dynamic_update_slice f32[8,2,32,64]", "cache update"),
    ("cache_update/pad f32[8,2,32,64]", "cache update"),
    ("unembed/transpose f32[512,8]", "unembedding"),
    ("sample/cond/branch_0_fun/(XLA's fusion) f32[8,4,16]", "sampling"),
    ("while (tuple)", "loop: its ops"),
    ("transpose f32[512,8]", "loop: its ops")])
def test_decode_parts_by_named_scope(profile_ops, op, part):
    assert profile_ops.decode_part_of(op) == part


def test_the_unnamed_go_to_their_own_part(profile_ops):
    assert profile_ops.decode_part_of("command_buffer.3", named=False) == profile_ops.NO_SOURCE
    assert set(profile_ops.DECODE_PARTS) >= {p for _, p in profile_ops.DECODE_SCOPES}


GPU_DECODE_HLO = """HloModule jit_decode, entry_computation_layout={()->()}

%cb.1 (p: bf16[8]) -> bf16[8] {
  %loop_add_fusion.2 = bf16[256,1536]{1,0} fusion(%p), kind=kLoop, calls=%f2, metadata={op_name="jit(decode)/while/body/layers/mlp/add"}
  %cublas-gemm.1 = bf16[256,8960]{1,0} custom-call(%loop_add_fusion.2), custom_call_target="__cublas$gemm", metadata={op_name="jit(decode)/while/body/layers/mlp/dot_general"}
  %cublas-gemm.2 = bf16[256,12,1,256]{3,2,1,0} custom-call(%loop_add_fusion.2), custom_call_target="__cublas$gemm", metadata={op_name="jit(decode)/while/body/layers/attn/attend/dot_general"}
}

%cb.2 (p: bf16[8]) -> bf16[8] {
  %cublas-gemm.3 = f32[256,151936]{1,0} custom-call(%p), custom_call_target="__cublas$gemm", metadata={op_name="jit(decode)/while/body/unembed/dot_general"}
}

ENTRY %main.1 (a: bf16[8]) -> bf16[8] {
  %command_buffer.1 = bf16[8] call(%a), to_apply=%cb.1
  %command_buffer.2 = bf16[8] call(%a), to_apply=%cb.1
  %command_buffer.3 = bf16[8] call(%a), to_apply=%cb.2
  %input_reduce_fusion.4 = f32[256]{0} fusion(%a), kind=kInput, calls=%f4, metadata={op_name="jit(decode)/while/body/sample/reduce_max"}
}
"""


def _kernel(name, ts, dur, op):
    return {"ph": "X", "pid": 7, "name": name, "ts": ts, "dur": dur, "args": {"hlo_module": "jit_decode", "hlo_op": op}}


def test_library_calls_of_a_command_buffer_in_schedule_order(profile_ops):
    calls = profile_ops.library_calls(GPU_DECODE_HLO)
    assert calls["command_buffer.1"] == ["layers/mlp/dot_general bf16[256,8960]{1,0}",
                                         "layers/attn/attend/dot_general bf16[256,12,1,256]{3,2,1,0}"]
    assert calls["command_buffer.3"] == ["unembed/dot_general f32[256,151936]{1,0}"]


def test_a_gpu_decode_is_split_by_part_and_library_kernels_by_their_buffers_calls(profile_ops):
    """Buffer 1 runs twice back to back (two layers): its fusion is found by its kernel's name,
    its four library kernels are its two calls, twice over. Buffer 2 launched three library
    kernels for its two calls: left unnamed. Buffer 3's gemm is the unembedding. The gaps
    between kernels are the loop's instants with no op; the parts add up to the span."""
    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        _kernel("loop_add_fusion_2", 0, 10, "command_buffer.1"), _kernel("nvjet_a", 10, 100, "command_buffer.1"),
        _kernel("nvjet_b", 110, 20, "command_buffer.1"), _kernel("loop_add_fusion_2", 130, 10, "command_buffer.1"),
        _kernel("nvjet_a", 140, 100, "command_buffer.1"), _kernel("nvjet_b", 240, 20, "command_buffer.1"),
        _kernel("nvjet_a", 300, 50, "command_buffer.2"), _kernel("splitk", 350, 5, "command_buffer.2"),
        _kernel("nvjet_b", 355, 20, "command_buffer.2"),
        _kernel("nvjet_c", 400, 80, "command_buffer.3"), _kernel("reduce_kernel", 480, 20, "input_reduce_fusion.4")]}
    s = profile_ops.summarize_decode(trace, GPU_DECODE_HLO, steps=2)
    p = {k: pytest.approx(v / 1e3) for k, v in {
        "layers": 10 + 100 + 10 + 100, "attention": 20 + 20, "unembedding": 80, "sampling": 20,
        profile_ops.NO_SOURCE: 50 + 5 + 20, profile_ops.IDLE: (300 - 260) + (400 - 375)}.items()}
    assert {k: v for k, v in s["by_part"].items() if v} == p
    assert list(s["by_part"]) == list(profile_ops.DECODE_PARTS)
    assert sum(s["by_part"].values()) == pytest.approx(s["span_ms"]) == pytest.approx(0.5)
    assert s["ms_per_step"] == pytest.approx(0.25)
    lines = profile_ops.decode_tables(s)
    assert lines[0].startswith("jit_decode: 11 events over 0.5 ms, 2 steps: 0.250 ms per step")
    assert "| unembedding | 0.1 | 0.040 | 16.0% |" in lines
