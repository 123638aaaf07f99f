"""Where a rollout's (or an update's) time goes, op by op: one call under the JAX profiler.

Runs SmolLM2-135M's sampler (imported weights; `--tiny` for the cpu-tiny model with random
weights) once to compile, once more under `jax.profiler`, and prints for the decode and the
prefill program a table of wall time per HLO op, named by the JAX operation it came from
(`layers/mlp/dot_general f32[32,1536]`) and summed over layers and steps.

A rollout's decode is also split by part of its step (``summarize_decode``): embedding,
layers (projections, MLP, norms), attention over the cache, cache update, unembedding,
sampling, and the loop's own work (its ops outside those, and the instants no op runs). The
parts are the named scopes of the model and the sampler (``DECODE_SCOPES``), so the split
holds for every engine; they add up to the decode program's span.

Wall time, not thunk time: XLA's CPU runtime runs independent thunks at the same time on
its threads, so each instant of the program is shared equally among the thunks running
then; a control-flow thunk (a while, a conditional) takes only the instants when none of its
body's thunks runs. The op names come from the compiled HLO (`XLA_FLAGS=--xla_dump_to`, set here before
jax loads), the times from the trace JSON the profiler writes; no TensorBoard or xprof
needed. Profiling slows the run down (about 1.3x here), so read shares, not absolute
times, and time things with `bench_rollout.py`.

What it found on the 2-core AMD EPYC (2026-11-24, batch 32, 64 new tokens): the dense
matmuls take 3/4 of a decode step; before the fixes of that day, a `cumsum` and three
`argmax`es over the 49152-way vocabulary took 14 ms of a 100 ms step, and RoPE's sin and
cos were evaluated again inside every layer's fusions.

`--update` profiles one GRPO update instead (`bench_train_step`'s: `--rows` × 256 tokens,
4 micro-batches, no remat, β = 0.04) and adds a summary by part of the model (MLP,
attention, log-probs over the vocabulary, the rest) and kind (matmul or not). On the same
machine it found the update's autodiff-chosen layouts: a transposed SiLU backward, a
per-chunk transpose of the embedding gradient, attention probabilities kept per layer.

`--device` profiles on whatever device jax sees (a GPU, a TPU) instead of the CPU: the op
names then come from that backend's optimised HLO and the times from the device's own
events in the trace (its kernels, each tagged with the HLO op it runs), and `--preset NAME`
takes that preset's model shape with random weights (a machine without the SmolLM2
download; e.g. `--device --update --preset qwen2.5-1.5b --rows 16`).

`--hlo` runs nothing: it lowers and compiles one update of `--preset`'s model (default
smollm2-135m; `--layers` of them, `--rows` x (256 + 512) tokens, one micro-batch) for the
device jax sees and prints what its HLO holds: every dot by operand and result dtype with its
FLOPs (from the lowered program, as the model wrote it, before a backend's own rewrites: XLA's
CPU backend upcasts bf16 dots to float32), and the largest copies and transposes of the
compiled program (a weight-sized one is a copy of a weight).

Usage:  python benchmarks/profile_ops.py [--batch 32] [--group 1] [--engine auto] [--new-tokens 64] [--top 25]
        python benchmarks/profile_ops.py --update [--rows 16] [--device] [--preset NAME]
        python benchmarks/profile_ops.py --hlo [--preset qwen2.5-1.5b] [--layers 2] [--rows 8]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

DUMP_FLAGS = "--xla_dump_hlo_as_text --xla_dump_hlo_pass_re=NONE"
_NOISE = re.compile(r"jit\(\w+\)/|closed_call/|while/body/|Transformer/")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def op_names(hlo_text: str) -> dict[str, str]:
    """instruction name -> 'jax op path result-shape', from an optimised HLO module's text
    (the `op_name` metadata XLA keeps on each instruction; jit and loop prefixes dropped).

    An instruction XLA made without one (a layout copy, a cumsum rewritten as reduce-windows)
    is named after the first op it feeds, directly or through others like it, that has one:
    that op's path, then ``(XLA's <opcode>)``, so it counts in that op's part of the model
    and still reads as XLA's own."""
    named, unnamed, users = {}, {}, {}
    for instructions in hlo_computations(hlo_text).values():
        for name, shape, opcode, rest in instructions:
            shape = "(tuple)" if shape.startswith("(") else shape
            jax_op = _OP_NAME.search(rest)
            if jax_op:
                named[name] = (_NOISE.sub("", jax_op.group(1)), shape)
            else:
                unnamed[name] = (opcode, shape)
            for operand in _OPERAND.findall(rest):
                users.setdefault(operand, name)
    out = {name: f"{path} {shape}" for name, (path, shape) in named.items()}
    for name, (opcode, shape) in unnamed.items():
        user, seen = users.get(name), {name}
        while user in unnamed and user not in seen:
            seen.add(user)
            user = users.get(user)
        if user in named:
            scope = named[user][0].rpartition("/")[0]  # the user's scopes, not its primitive
            out[name] = f"{scope + '/' if scope else ''}(XLA's {opcode}) {shape}"
    return out


def wall_time_by_op(events: list[dict], label, containers=frozenset()) -> dict[str, tuple[int, float]]:
    """label(event) -> key. Returns key -> (count, wall microseconds), where each instant
    covered by n overlapping events is split equally among them (trace 'X' events with
    'ts' and 'dur' in microseconds).

    ``containers``: the names of events that run others inside them (a CPU trace's while,
    conditional and call thunks, ``control_flow_ops``; their body's thunks run on any
    thread): such an event takes only the instants when no other event runs, the innermost
    (latest started) of them, so that the time inside it is its body's, never shared with it."""
    edges = sorted([(e["ts"], 1, i) for i, e in enumerate(events)] +
                   [(e["ts"] + e["dur"], 0, i) for i, e in enumerate(events)])
    share = [0.0] * len(events)
    running: set[int] = set()
    holding: dict[int, float] = {}  # running containers -> their start
    last = None
    for t, starts, i in edges:
        if last is not None and t > last:
            if running:
                for j in running:
                    share[j] += (t - last) / len(running)
            elif holding:
                share[max(holding, key=holding.get)] += t - last
        last = t
        container = events[i]["name"] in containers
        if starts and container:
            holding[i] = t
        elif starts:
            running.add(i)
        elif container:
            holding.pop(i, None)
        else:
            running.discard(i)
    out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e, s in zip(events, share):
        row = out[label(e)]
        row[0] += 1
        row[1] += s
    return {k: (c, w) for k, (c, w) in out.items()}


def device_pids(trace: dict) -> set:
    """The trace's processes that are accelerator devices ("/device:GPU:0", "/device:TPU:0"),
    by their process_name metadata; empty for a CPU run (its thunks run on host threads)."""
    return {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "M" and e.get("name") == "process_name"
            and re.search(r"/device:(GPU|TPU)", str(e.get("args", {}).get("name", "")))}


def module_events(trace: dict, module: str) -> list[dict]:
    """The events of one compiled program (the profiler tags them with hlo_module): on an
    accelerator its device's kernels only (the host's launches of them would count twice),
    on a CPU its thunks."""
    devices = device_pids(trace)
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"
            and e.get("args", {}).get("hlo_module") == module and not e["name"].startswith("end:")
            and (not devices or e.get("pid") in devices)]


def hlo_op(event: dict) -> str:
    """The HLO instruction an event runs: a device kernel names it in its "hlo_op" argument
    (its own name is the kernel's), a CPU thunk by its name."""
    return event.get("args", {}).get("hlo_op") or event["name"]


def part_of(op: str) -> tuple[str, str]:
    """(part of the model, 'matmul' or 'other') of an op name from `op_names`."""
    kind = "matmul" if "dot_general" in op else "other"
    if "layers/mlp" in op:
        return "MLP", kind
    if "layers/attn" in op:
        return "attention", kind
    if "logprobs/" in op:  # logprobs.token_logprobs' named scope
        return "log-probs over the vocabulary", kind
    return "rest", kind


def phase_of(op: str) -> str:
    """Which pass of a train step an op name from `op_names` belongs to: remat's recomputation
    of the forward inside the backward pass (jax names it ``rematted_computation``), the
    backward pass (``transpose(jvp(...))``), the policy's forward (``jvp(...)``), or the rest
    (the reference's forward without gradients, the optimizer, the loss)."""
    if "rematted_computation" in op:
        return "recomputation (remat)"
    if "transpose(" in op:
        return "backward"
    if "jvp(" in op:
        return "forward (policy)"
    return "reference forward, optimizer, rest"


_GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|wgmma|matmul|cublas", re.I)


def is_matmul(op: str, kernel: str = "") -> bool:
    """A matmul by its JAX op (``dot_general``) or, on a GPU, by its library kernel's name
    (cuBLAS and CUTLASS kernels carry gemm/nvjet/xmma in theirs)."""
    return "dot_general" in op or bool(_GEMM_KERNEL.search(kernel))


def op_of(names: dict[str, str], event: dict) -> str:
    """The op name (`op_names`) of a kernel event. XLA's GPU runtime runs most kernels inside
    command buffers (CUDA graphs), and the profiler then tags a kernel with the command
    buffer's instruction instead of its own; a fusion's kernel is named after its fusion
    instruction (``loop_add_fusion_2`` for ``%loop_add_fusion.2``), which finds it. A library
    kernel inside a command buffer (cuBLAS) keeps the command buffer's name."""
    op = hlo_op(event)
    if op in names:
        return names[op]
    kernel = event.get("name", "")
    return names.get(kernel) or names.get(re.sub(r"_(\d+)$", r".\1", kernel)) or op


def module_name(hlo_text: str) -> str:
    """The jit module's name (``jit_step``) from an HLO module's text: what the profiler tags
    that program's events with."""
    m = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    if not m:
        raise ValueError("not an HLO module's text: no 'HloModule NAME' at its start")
    return m.group(1)


def summarize_program(trace: dict, hlo_text: str, top: int = 30) -> dict:
    """One compiled program's time in a profiler trace, from its optimised HLO text
    (``compiled.as_text()``): kernel milliseconds by part of the model and kind, by pass, and
    the ``top`` ops; JSON-ready. Kernel time is summed as wall time (overlapping events
    share it), so the tables add up to ``kernel_ms``."""
    module = module_name(hlo_text)
    names = op_names(hlo_text)
    events = module_events(trace, module)
    if not events:  # a profiler that tags no kernel with its module: the devices' every kernel
        devices = device_pids(trace)
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") in devices]
        module += " (untagged: every device kernel of the trace)"
    if not events:
        raise ValueError(f"no events of {module} in the trace (modules there: "
                         f"{sorted({e.get('args', {}).get('hlo_module', '?') for e in trace['traceEvents']})[:12]})")
    rows = wall_time_by_op(events, lambda e: (op_of(names, e), e["name"]), _containers(trace, hlo_text))
    sums: dict[str, dict] = {"by_part": collections.defaultdict(float), "by_phase": collections.defaultdict(float),
                             "by_op": collections.defaultdict(lambda: [0, 0.0]),
                             "by_kernel": collections.defaultdict(lambda: [0, 0.0])}
    for (op, kernel), (count, wall) in rows.items():
        kind = "matmul" if is_matmul(op, kernel) else "other"
        sums["by_part"][f"{part_of(op)[0]} | {kind}"] += wall / 1e3
        sums["by_phase"][f"{phase_of(op)} | {kind}"] += wall / 1e3
        sums["by_op"][op][0] += count
        sums["by_op"][op][1] += wall / 1e3
        sums["by_kernel"][kernel][0] += count
        sums["by_kernel"][kernel][1] += wall / 1e3
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    ordered = lambda d: dict(sorted(d.items(), key=lambda kv: -kv[1]))  # noqa: E731
    top_of = lambda d: sorted(d.items(), key=lambda kv: -kv[1][1])[:top]  # noqa: E731
    return {"module": module, "events": len(events), "span_ms": span,
            "kernel_ms": sum(w for _, w in rows.values()) / 1e3,
            "matmul_ms": sum(w for (op, k), (_, w) in rows.items() if is_matmul(op, k)) / 1e3,
            "by_part": ordered(sums["by_part"]), "by_phase": ordered(sums["by_phase"]),
            "top_ops": [{"op": op, "calls": c, "ms": ms} for op, (c, ms) in top_of(sums["by_op"])],
            "top_kernels": [{"kernel": k, "calls": c, "ms": ms} for k, (c, ms) in top_of(sums["by_kernel"])]}


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_CALLED = re.compile(r"\b(?:to_apply|calls|body)=%?([\w.\-]+)")
CONTROL_FLOW = ("while", "conditional", "call")


def hlo_computations(hlo_text: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """computation -> its instructions in schedule order, each (name, result shape, opcode,
    the rest of its line), from an HLO module's text (lines before any computation's header
    under "")."""
    comps: dict[str, list] = {"": []}
    current = comps[""]
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = comps.setdefault(header.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        instruction = _OPCODE.match(line)
        if instruction and current is not None:
            current.append(instruction.groups())
    return comps


def control_flow_ops(hlo_text: str) -> set[str]:
    """The instructions that run other instructions inside them (while, conditional, call)."""
    return {name for instructions in hlo_computations(hlo_text).values()
            for name, _, opcode, _ in instructions if opcode in CONTROL_FLOW}


def _containers(trace: dict, hlo_text: str) -> set[str]:
    """`wall_time_by_op`'s containers: a CPU trace's control-flow thunks; none on a device,
    whose events are kernels only."""
    return set() if device_pids(trace) else control_flow_ops(hlo_text)


def library_calls(hlo_text: str) -> dict[str, list[str]]:
    """command buffer -> the op names (`op_names`) of the library calls (custom-calls: cuBLAS,
    cuDNN) it runs, in schedule order, through the computations it calls (a while's body once)."""
    comps, names = hlo_computations(hlo_text), op_names(hlo_text)

    def calls_in(comp: str, seen: frozenset) -> list[str]:
        out = []
        for name, _, opcode, rest in comps.get(comp, ()):
            if opcode == "custom-call":
                out.append(names.get(name, name))
            out += [c for called in _CALLED.findall(rest) if called not in seen
                    for c in calls_in(called, seen | {called})]
        return out

    return {name: [c for called in _CALLED.findall(rest) for c in calls_in(called, frozenset({called}))]
            for instructions in comps.values() for name, _, _, rest in instructions
            if name.startswith("command_buffer")}


def library_kernel_ops(events: list[dict], names: dict[str, str], calls: dict[str, list[str]]) -> dict[int, str]:
    """id(event) -> op name of the kernels inside a command buffer that `op_of` cannot name
    (a library's, tagged with the buffer only): in each run of consecutive events of one
    buffer, the k-th such kernel is the (k mod n)-th of the buffer's n library calls
    (`library_calls`), a run of a buffer executed m times holding m rounds of them. A run whose
    count is not a whole number of rounds (a library call of two kernels) stays unnamed."""
    out: dict[int, str] = {}
    buffer, run = None, []

    def close():
        lib = calls.get(buffer) or []
        if lib and run and len(run) % len(lib) == 0:
            out.update({id(e): lib[k % len(lib)] for k, e in enumerate(run)})

    for e in sorted(events, key=lambda e: e["ts"]):
        if hlo_op(e) != buffer:
            close()
            buffer, run = hlo_op(e), []
        if buffer in calls and op_of(names, e) == buffer:
            run.append(e)
    close()
    return out


# The parts of a decode step, by the named scopes of the model and the sampler (``embed``,
# ``attend``, ``cache_update``, ``unembed``, ``sample``; the layers' modules), checked in this
# order on an op's path. What none names is the loop's own work: its ops, and the instants no
# op runs (launches, the loop's condition read on the host).
DECODE_SCOPES = (("cache_update", "cache update"), ("attend", "attention"), ("embed", "embedding"),
                 ("unembed", "unembedding"), ("sample", "sampling"), ("layers", "layers"), ("final_norm", "layers"))
NO_SOURCE = "no JAX op: XLA's own (copies of the loop's carry), or a library kernel in a command buffer"
IDLE = "loop: no op running"
DECODE_PARTS = ("embedding", "layers", "attention", "cache update", "unembedding", "sampling", "loop: its ops",
                NO_SOURCE, IDLE)


def decode_part_of(op: str, named: bool = True) -> str:
    """The part of a decode step an op name (`op_names`: 'path shape') belongs to; ``named``
    False: an instruction with no JAX op."""
    if not named:
        return NO_SOURCE
    segments = op.split(" ")[0].split("/")
    return next((part for scope, part in DECODE_SCOPES if scope in segments), "loop: its ops")


def summarize_decode(trace: dict, hlo_text: str, steps: int, top: int = 12) -> dict:
    """A decode program's time in a profiler trace split by part of the step (`DECODE_PARTS`),
    from its optimised HLO text: milliseconds per part, with the instants no op runs as a
    part, so the parts add up to the program's span; per step (``steps``: the loop's trips),
    and each part's ``top`` ops. JSON-ready."""
    module, names = module_name(hlo_text), op_names(hlo_text)
    events = module_events(trace, module)
    if not events:
        raise ValueError(f"no events of {module} in the trace")
    named = library_kernel_ops(events, names, library_calls(hlo_text)) if device_pids(trace) else {}
    label = lambda e: named.get(id(e)) or op_of(names, e)  # noqa: E731
    known = set(names.values()) | set(named.values())
    rows = wall_time_by_op(events, label, _containers(trace, hlo_text))
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    parts = dict.fromkeys(DECODE_PARTS, 0.0)
    ops: dict[str, list] = collections.defaultdict(list)
    for op, (count, wall) in rows.items():
        part = decode_part_of(op, op in known)
        parts[part] += wall / 1e3
        ops[part].append({"op": op, "calls": count, "ms": wall / 1e3})
    parts[IDLE] = span - sum(parts.values())
    return {"module": module, "events": len(events), "span_ms": span, "steps": steps,
            "ms_per_step": span / max(steps, 1), "by_part": parts,
            "top_ops": {p: sorted(v, key=lambda r: -r["ms"])[:top] for p, v in ops.items()}}


def decode_tables(summary: dict) -> list[str]:
    """Markdown lines of a `summarize_decode` result: the split, then each part's largest ops."""
    span, steps = summary["span_ms"] or 1.0, max(summary["steps"], 1)
    lines = [f"{summary['module']}: {summary['events']} events over {summary['span_ms']:.1f} ms, "
             f"{summary['steps']} steps: {summary['ms_per_step']:.3f} ms per step", "",
             "| part | ms | ms per step | share |", "|---|---|---|---|"]
    lines += [f"| {part} | {ms:.1f} | {ms / steps:.3f} | {100 * ms / span:.1f}% |"
              for part, ms in summary["by_part"].items()]
    lines += ["", "| part | op (HLO result shape) | calls | ms | share |", "|---|---|---|---|---|"]
    for part, rows in summary["top_ops"].items():
        lines += [f"| {part} | {r['op'].strip() or '(no op_name)'} | {r['calls']} | {r['ms']:.1f} | "
                  f"{100 * r['ms'] / span:.1f}% |" for r in rows[:5]]
    return lines


def decode_program_text(sampler, weights, prompts, group_size: int, key) -> str:
    """The optimised HLO text of the decode program ``sampler.generate(weights, prompts,
    group_size=group_size)`` runs in one call: lowered on that call's own arguments (one
    prefill), so the compile is the one the call made, from jax's cache."""
    from grpo_jax.shapes import bucket_length

    call = sampler.call(len(prompts), group_size, bucket_length(max(len(p) for p in prompts)))
    host = call.host_batch(prompts)
    cache, logits0 = call.prefill(*call.prefill_args(weights, host), **call.prefill_kwargs)
    args = call.decode_args(weights, cache, logits0, host, key)
    return call.decode.lower(*args, **call.decode_kwargs).compile().as_text()


def summary_tables(summary: dict) -> list[str]:
    """Markdown lines of a `summarize_program` result."""
    total = summary["kernel_ms"] or 1.0
    lines = [f"{summary['module']}: {summary['events']} kernels, {summary['kernel_ms']:.1f} ms of kernel time "
             f"({100 * summary['matmul_ms'] / total:.1f}% in matmuls) over a {summary['span_ms']:.1f} ms span", ""]
    for key, title in (("by_part", "part | kind"), ("by_phase", "pass | kind")):
        lines += [f"| {title} | ms | share |", "|---|---|---|---|"]
        lines += [f"| {k} | {ms:.1f} | {100 * ms / total:.1f}% |" for k, ms in summary[key].items()] + [""]
    lines += ["| op (HLO result shape) | calls | ms | share |", "|---|---|---|---|"]
    lines += [f"| {r['op'].strip() or '(no op_name)'} | {r['calls']} | {r['ms']:.1f} | {100 * r['ms'] / total:.1f}% |"
              for r in summary["top_ops"]]
    lines += ["", "| kernel | calls | ms | share |", "|---|---|---|---|"]
    lines += [f"| {r['kernel'][:90]} | {r['calls']} | {r['ms']:.1f} | {100 * r['ms'] / total:.1f}% |"
              for r in summary["top_kernels"]]
    return lines


def by_part(rows: dict[str, tuple[int, float]]) -> list[str]:
    """A table of wall time summed by `part_of`, largest first."""
    sums: dict[tuple[str, str], float] = collections.defaultdict(float)
    for op, (_, wall) in rows.items():
        sums[part_of(op)] += wall
    total = sum(sums.values())
    lines = ["| part | kind | ms | share |", "|---|---|---|---|"]
    for (part, kind), wall in sorted(sums.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {part} | {kind} | {wall / 1e3:.1f} | {100 * wall / total:.1f}% |")
    return lines


def table(rows: dict[str, tuple[int, float]], top: int, steps: int) -> list[str]:
    total = sum(w for _, w in rows.values())
    lines = ["| op (HLO result shape) | calls | ms total | ms per step | share |", "|---|---|---|---|---|"]
    for name, (count, wall) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {name.strip() or '(no op_name)'} | {count} | {wall / 1e3:.1f} | "
                     f"{wall / 1e3 / steps:.2f} | {100 * wall / total:.1f}% |")
    return lines


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=25, help="rows per table")
    ap.add_argument("--tiny", action="store_true", help="cpu-tiny with random weights (no model download)")
    ap.add_argument("--preset", default="", help="this preset's model shape with random weights (no download)")
    ap.add_argument("--device", action="store_true",
                    help="profile on the device jax sees (GPU, TPU) instead of the CPU")
    ap.add_argument("--keep", default="", help="keep the trace and HLO dump in this directory")
    ap.add_argument("--update", action="store_true",
                    help="profile one GRPO update (bench_train_step's) instead of a rollout")
    ap.add_argument("--rows", type=int, default=16, help="--update: sequences (a multiple of 4)")
    ap.add_argument("--hlo", action="store_true", help="print the update's dots and copies; run nothing")
    ap.add_argument("--layers", type=int, default=2, help="--hlo: the model's layers (they are all alike)")
    ap.add_argument("--sample-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the rollout samples from a copy in this dtype (rl.sample_dtype)")
    ap.add_argument("--group", type=int, default=1, help="rows per prompt (rl.group_size)")
    ap.add_argument("--engine", default="auto", help="the decode engine (rl.decode)")
    ap.add_argument("overrides", nargs="*", help="--hlo: config overrides, section.field=value")
    args = ap.parse_args(argv)
    if min(args.batch, args.prompt_len, args.new_tokens) < 2:
        ap.error("--batch, --prompt-len and --new-tokens must each be at least 2")
    if args.update and (args.rows < 4 or args.rows % 4):
        ap.error(f"--rows must be a positive multiple of 4 (groups of 4), got {args.rows}")
    if args.update:  # bench_train_step's prompts: 64 tokens, one per group of 4
        args.prompt_len, args.batch = 64, max(args.batch, args.rows // 4)
    return args


def model_and_prompts(args):
    """(model config, params, `args.batch` prompts of `args.prompt_len` token ids, the model's name)."""
    import common
    import jax
    import numpy as np

    if args.tiny or args.preset:
        from grpo_jax.model import transformer as model
        from grpo_jax.config import get_preset

        name = args.preset or "cpu-tiny"
        cfg = get_preset(name).model
        params = model.init_params(cfg, jax.random.key(0))
        rng = np.random.default_rng(0)
        prompts = rng.integers(1, cfg.vocab_size, size=(args.batch, args.prompt_len)).tolist()
        return cfg, params, prompts, f"{name} (random weights)"
    cfg, params, tok = common.smollm2()
    return cfg, params, common.fixed_length_prompts(tok.encode, args.batch, args.prompt_len)[1], "SmolLM2-135M"


def profiled_run(args, cfg, params, prompts, name: str):
    """(the callable to profile, its programs as (jit name, calls per run)): one GRPO update
    with `--update`, else one rollout."""
    import jax
    import numpy as np

    from grpo_jax import sampler

    if args.update:
        import bench_train_step

        print(f"compiling ({name}, one GRPO update of {args.rows} × 256 tokens)...", flush=True)
        return _update_runner(bench_train_step, cfg, params, prompts, args.rows), (("step", 1),)
    policy = sampler.sampling_copy(cfg, params, args.sample_dtype)
    settings = sampler.SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, engine=args.engine)

    def run():
        r = sampler.sample(cfg, policy, prompts, settings, key=jax.random.key(0), group_size=args.group)
        return np.asarray(r.tokens)

    print(f"compiling ({name}, {args.batch} prompts x {args.group}, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens, engine {args.engine})...", flush=True)
    return run, (("decode", args.new_tokens - 1), ("prefill", 1))


def trace_of(run, trace_dir: Path) -> dict:
    """The profiler's trace events of one call of `run` after a first (compiling) call."""
    import jax

    run()
    start = time.perf_counter()
    jax.profiler.start_trace(str(trace_dir))
    run()
    jax.profiler.stop_trace()
    print(f"profiled run: {time.perf_counter() - start:.2f} s (profiler on)\n")
    trace_files = sorted(glob.glob(str(trace_dir / "plugins" / "profile" / "*" / "*.trace.json.gz")))
    if not trace_files:
        raise SystemExit(f"profile_ops: no trace written under {trace_dir}")
    return json.load(gzip.open(trace_files[-1]))


def program_text(dump: Path, program: str) -> str:
    """The optimised HLO text of the jitted function ``program`` from an XLA dump folder."""
    hlo_files = sorted(glob.glob(str(dump / f"*jit_{program}.*after_optimizations.txt")))
    if not hlo_files:
        raise SystemExit(f"profile_ops: no optimised HLO for {program} in {dump}")
    return Path(hlo_files[-1]).read_text()


def print_program(trace: dict, dump: Path, program: str, steps: int, top: int, parts: bool) -> None:
    """The wall-time table of one compiled program (and its summary by part if `parts`)."""
    text = program_text(dump, program)
    names = op_names(text)
    events = module_events(trace, f"jit_{program}")
    rows = wall_time_by_op(events, lambda e: names.get(hlo_op(e), hlo_op(e)), _containers(trace, text))
    wall = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    per = f", {wall / steps:.1f} ms per step over {steps} steps" if steps > 1 else ""
    print(f"## {program.strip('_')}: {wall:.0f} ms wall{per}, {len(events)} thunks\n")
    print("\n".join(table(rows, top, steps)) + "\n")
    if parts:
        print("\n".join(by_part(rows)) + "\n")


_STABLEHLO_DOT = re.compile(r"stablehlo\.dot_general .*?contracting_dims = \[([\d, ]*)\] x .*?"
                            r": \(tensor<([\dx]*)x(\w+)>, tensor<[\dx]*x(\w+)>\) -> tensor<([\dx]*)x(\w+)>")
_COPY = re.compile(r"^\s*%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (copy|transpose)\((.*)$", re.M)


def dots_by_dtype(stablehlo: str) -> dict[tuple[str, str, str], list]:
    """(lhs, rhs, result dtype) -> [count, FLOPs] of every dot_general in a lowered module's text
    (2 x result elements x contracted size; a dot in a loop body counted once)."""
    out: dict = collections.defaultdict(lambda: [0, 0.0])
    for m in _STABLEHLO_DOT.finditer(stablehlo):
        contracting = [int(i) for i in m.group(1).replace(" ", "").split(",") if i]
        lhs = [int(d) for d in m.group(2).split("x") if d]
        result = [int(d) for d in m.group(5).split("x") if d]
        size = 1
        for i in contracting:
            size *= lhs[i]
        row = out[(m.group(3), m.group(4), m.group(6))]
        row[0] += 1
        row[1] += 2.0 * float(np.prod(result or [1])) * size
    return dict(out)


def largest_copies(hlo: str, top: int) -> list[tuple[str, str, int, str]]:
    """(instruction, shape, bytes, jax op) of the ``top`` largest copies and transposes."""
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2, "pred": 1, "u32": 4, "s8": 1}
    rows = []
    for m in _COPY.finditer(hlo):
        dims = [int(d) for d in m.group(3).split(",") if d]
        nbytes = int(np.prod(dims or [1])) * sizes.get(m.group(2), 4)
        op = _OP_NAME.search(m.group(5))
        rows.append((f"{m.group(4)} {m.group(1)}", f"{m.group(2)}[{m.group(3)}]", nbytes,
                     _NOISE.sub("", op.group(1)) if op else "(no op_name: a layout copy XLA added)"))
    return sorted(rows, key=lambda r: -r[2])[:top]


def hlo_report(args) -> None:
    """``--hlo``: the update's dots by dtype and its largest copies (module docstring)."""
    import jax

    from grpo_jax import aot
    from grpo_jax.parallel import sharding
    from grpo_jax.config import apply_overrides, get_preset

    cfg = get_preset(args.preset or "smollm2-135m")
    cfg = apply_overrides(cfg, [f"model.num_layers={args.layers}", "rl.num_micro_batches=1", "rl.max_new_tokens=512",
                                f"data.batch_size={args.rows // cfg.rl.group_size or 1}", *args.overrides])
    rows = cfg.data.batch_size * cfg.rl.group_size
    mesh = sharding.mesh_from_shape((1, 1, 1))
    lowered = aot.lower_train_step(cfg, mesh, rows, 256)
    compiled = lowered.compile()
    m = cfg.model
    print(f"## the update of {args.preset or 'smollm2-135m'}'s model, {m.num_layers} layers, {rows} x (256 + 512) "
          f"tokens, dtype {m.dtype}, remat {m.remat}, unembed {m.unembed_dtype}, on {jax.devices()[0].device_kind}\n")
    dots = dots_by_dtype(lowered.as_text())
    total = sum(f for _, f in dots.values())
    print("| dot operands -> result | dots | GFLOP (loop bodies once) | share |\n|---|---|---|---|")
    for (a, b, r), (n, f) in sorted(dots.items(), key=lambda kv: -kv[1][1]):
        print(f"| {a} x {b} -> {r} | {n} | {f / 1e9:.1f} | {100 * f / total:.1f}% |")
    print("\n| largest copies / transposes (compiled) | shape | MB | jax op |\n|---|---|---|---|")
    for name, shape, nbytes, op in largest_copies(compiled.as_text(), args.top):
        print(f"| {name} | {shape} | {nbytes / 1e6:.1f} | {op} |")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hlo:
        if args.device:
            os.environ.setdefault("JAX_PLATFORMS", "")
        import common  # noqa: F401  (JAX_PLATFORMS before jax)

        hlo_report(args)
        return 0
    if args.device:  # before common is imported: it defaults jax to the CPU
        os.environ.setdefault("JAX_PLATFORMS", "")
    work = Path(args.keep or tempfile.mkdtemp(prefix="grpo_jax_profile_"))
    dump = work / "hlo"
    # Before jax loads (model_and_prompts imports it): jax reads XLA_FLAGS then.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} {DUMP_FLAGS}".strip()
    cfg, params, prompts, name = model_and_prompts(args)
    run, programs = profiled_run(args, cfg, params, prompts, name)
    trace = trace_of(run, work / "trace")
    for program, steps in programs:
        print_program(trace, dump, program, steps, args.top, parts=args.update)
    if not args.update:
        split = summarize_decode(trace, program_text(dump, "decode"), args.new_tokens - 1)
        print("## the decode by part of its step\n\n" + "\n".join(decode_tables(split)) + "\n")
    if args.keep:
        print(f"trace and HLO kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _update_runner(bench_train_step, cfg, params, prompts, rows: int):
    """A callable running one GRPO update on `rows` sequences: the first rows/4 prompts cut to
    64 tokens, each 4 times, with 192 random completion tokens (bench_train_step's shapes)."""
    import numpy as np

    rng = np.random.default_rng(0)
    prompt_ids = np.repeat(np.array([p[:64] for p in prompts[:rows // 4]], np.int32), 4, axis=0)
    completion_ids = rng.integers(3, cfg.vocab_size, (rows, 192)).astype(np.int32)
    rewards = rng.normal(size=rows).astype(np.float32)
    grpo_cfg = bench_train_step.grpo_config(cfg, rows, 4, ["model.remat=none"])
    return bench_train_step.OurUpdate(grpo_cfg, params, rows, prompt_ids, completion_ids, rewards)


if __name__ == "__main__":
    raise SystemExit(main())
