"""Ahead-of-time TPU compilation on a CPU-only machine (needs ``libtpu`` installed).

``topology_mesh(slice)`` builds the slice's real train mesh from
``jax.experimental.topologies``; ``compile_train_step(cfg, mesh, ...)`` lowers and compiles
the train step on abstract, sharded arguments; ``report(compiled, chip)`` turns the
executable's ``memory_analysis()``/``cost_analysis()`` into per-chip numbers and
``check_fit`` raises ``FitError`` naming the program when peak HBM exceeds the chip.

The programs are the run's own (``grpo_jax.programs``); their FLOPs and bytes come from
cost twins with every loop trip counted (``sampler_cost``, ``train_cost``), and MFU counts
the model's FLOPs only (``model_flops``). All numbers are compiler estimates, not
measurements on a TPU.
"""

import contextlib
import dataclasses
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from grpo_jax import lora, loops, packing, programs
from grpo_jax import model as model_lib
from grpo_jax import train_step as ts
from grpo_jax.algorithms import algorithm_of
from grpo_jax.config import Config
from grpo_jax.batching import Batch
from grpo_jax.sampler import Sampler
from grpo_jax.sampler.cache import phase_steps
from grpo_jax.shapes import bucket_length
from grpo_jax.sharding import batch_sharding, make_mesh, replicated
from grpo_jax.slices import get_slice
from grpo_jax.tpu_specs import TOPOLOGIES, ChipSpec, chip_of, expected_seconds


class NotCounted(RuntimeError):
    """A cost twin (the program with every loop written out) that the compiler cannot fit
    in HBM: the program itself fits, but its loop trips cannot be counted."""


class FitError(RuntimeError):
    """A program whose per-chip peak HBM exceeds the chip's capacity (or fails to compile)."""


def libtpu_available() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def topology_devices(topology: str) -> list:
    """The TPU devices of ``topology`` (e.g. ``v5p:4x4x4``), usable for AOT compiles only."""
    from jax.experimental import topologies

    # libtpu takes a machine-wide lock file by default; compiling needs no TPU, so let
    # several processes (pytest workers, concurrent checks) load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # A v4 chip has two TensorCores; the topology lists each as a device unless asked for
    # megacore, the mode a v4 TPU VM runs JAX in (one device per chip, as grpo_jax.slices counts).
    extra = {"chip_config_name": "megacore"} if topology.startswith("v4:") else {}
    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu", **extra).devices)


def topology_mesh(cfg: Config, slice_name: str) -> tuple[Any, str]:
    """(train mesh, topology name) of a slice preset (``v5p-128``) or a raw topology
    (``v5e:2x2``, whose train mesh follows ``cfg.mesh``)."""
    if ":" in slice_name:
        topology = slice_name
        mesh_cfg = cfg.mesh
    else:
        preset = get_slice(slice_name)
        topology = TOPOLOGIES[preset.name]
        mesh_cfg = dataclasses.replace(cfg.mesh, slice=preset.name)
    return make_mesh(mesh_cfg, topology_devices(topology)), topology


def _abstract(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def abstract_batch(rows: int, prompt_len: int, completion_len: int, mesh) -> Batch:
    """A Batch of ShapeDtypeStructs: [rows, prompt_len] prompts, [rows, completion_len]
    completions, one step slot; rows sharded over the batch axes."""
    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape), rows))

    tp, tc = (rows, prompt_len), (rows, completion_len)
    return Batch(prompt_tokens=arr(tp, jnp.int32), prompt_mask=arr(tp, bool),
                    tokens=arr(tc, jnp.int32), mask=arr(tc, bool),
                    sample_logprobs=arr(tc, jnp.float32), rewards=arr((rows,), jnp.float32),
                    correct=arr((rows,), bool), truncated=arr((rows,), bool),
                    step_rewards=arr((rows, 1), jnp.float32), step_end=arr((rows, 1), jnp.int32),
                    step_mask=arr((rows, 1), bool))


def train_state(cfg: Config, mesh):
    """(TrainStep, abstract TrainState): the run's train step (``programs.train_step``) and
    its state as ShapeDtypeStructs sharded like a real run's (policy, optimizer, reference,
    value model; under LoRA the frozen base and the adapters)."""
    step = programs.train_step(cfg, mesh)
    params = model_lib.param_shapes(cfg.model)
    trained = lora.adapter_shapes(cfg.model) if lora.enabled(cfg.model) else params
    shapes = ts.TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32), params=trained,
        opt_state=jax.eval_shape(step.tx.init, trained),
        ref_params=params if step.state_shardings.ref_params is not None else None,
        base_params=params if step.state_shardings.base_params is not None else None)
    if step.value_tx is not None:
        vparams = model_lib.param_shapes(cfg.model, value_head=True)
        shapes = shapes.replace(value_params=vparams, value_opt_state=jax.eval_shape(step.value_tx.init, vparams))
    return step, _abstract(shapes, step.state_shardings)


def bytes_per_chip(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (its shards only,
    without the TPU's tile padding, which matters only for tiny arrays)."""
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def lower_train_step(cfg: Config, mesh, rows: int, prompt_len: int):
    """The run's train step lowered for a batch of ``rows`` x (prompt_len +
    rl.max_new_tokens) tokens, on abstract state and batch sharded like a real run's."""
    step, state = train_state(cfg, mesh)
    batch = abstract_batch(rows, prompt_len, cfg.rl.max_new_tokens, mesh)
    if cfg.rl.pack:  # the largest packing the batch can need (one sequence per row)
        batch = batch.replace(packing=packing.abstract(rows, prompt_len, cfg.rl.max_new_tokens, mesh))
    return step.lower(state, batch)


def compile_train_step(cfg: Config, mesh, rows: int, prompt_len: int):
    """(compiled train step, seconds); see ``lower_train_step``."""
    return compile_lowered("train_step", lower_train_step(cfg, mesh, rows, prompt_len))


def memory(compiled) -> dict:
    """Per-chip bytes from ``memory_analysis()``; peak = arguments + temps + outputs -
    aliases (donated outputs reuse their argument buffers)."""
    m = compiled.memory_analysis()
    out = {"argument_bytes": int(m.argument_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
           "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes)}
    out["peak_bytes"] = (out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"]
                         - out["alias_bytes"])
    return out


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1,
                "f64": 8, "s64": 8}
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


_SCATTER_FUSION = re.compile(r"^%?all-reduce-scatter\S* .*-> (.*) \{$")
# A piece of an asynchronous collective: its channel id and its fusion config's flag_start
# (-1 on the start, a flag index on each continuation).
_ASYNC_PIECE = re.compile(r'channel_id=(\d+),.*"async_collective_fusion_config":\{"flag_start":"(-?\d+)"')
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")


def _computations(hlo_text: str) -> dict:
    """{computation name: (header line, instruction lines)} of an HLO module's text
    (instructions before any header: the computation named "")."""
    comps, name = {"": ("", [])}, ""
    for line in hlo_text.splitlines():
        header = None if line.startswith(" ") else _HEADER.match(line.rstrip())
        if header:
            name = header.group(1)
            comps[name] = (line.rstrip(), [])
        elif line.startswith("  "):
            comps[name][1].append(line)
    return comps


def _loop_trips(comps: dict) -> dict:
    """{computation: [trip count of each while loop around it, outermost first]}. A loop's
    trips are the bound its condition compares the counter with (the largest s32 constant
    there: scans count up from 0 to their length)."""
    parent, trips = {}, {}
    for name, (_, lines) in comps.items():
        for line in lines:
            for callee in re.findall(r"(?:body|condition|calls|to_apply)=%([\w.\-]+)", line):
                parent.setdefault(callee, name)
            loop = re.search(r" while\(.*condition=%([\w.\-]+), body=%([\w.\-]+)", line)
            if loop:
                bounds = re.findall(r"s32\[\]\S* constant\((\d+)\)", "\n".join(comps.get(loop.group(1), ("", []))[1]))
                trips[loop.group(2)] = max(map(int, bounds)) if bounds else 1
    out = {}
    for name in comps:
        chain, c = [], name
        while c in parent:
            if c in trips:
                chain.append(trips[c])
            c = parent[c]
        out[name] = chain[::-1]
    return out


def collective_ops(hlo_text: str) -> list[dict]:
    """Every collective instruction of the optimized HLO: {"kind", "bytes", "shapes",
    "loops"}: its result shapes (e.g. ``["bf16[4096,11008]"]``) and their bytes, and the
    trip counts of the while loops around it, outermost first (it runs their product of
    times per call). The TPU backend writes a reduce-scatter as an ``all-reduce-scatter``
    fusion around an all-reduce of the whole array: that all-reduce is listed as the
    reduce-scatter it is, with the fusion's result (the shard). An asynchronous collective
    that the TPU backend overlaps with other work is split into pieces, each written as the
    whole collective with one channel id: its start (``flag_start`` -1) and continuations
    spread over the fusions it overlaps (in a loop body, or over the layers of a
    written-out program). It moves its bytes once, so it is listed once, where it starts."""
    comps = _computations(hlo_text)
    loops_of = _loop_trips(comps)
    ops, started, continued = [], set(), {}
    for name, (header, lines) in comps.items():
        scatter = _SCATTER_FUSION.match(header)
        for line in lines:
            if "=" not in line:
                continue
            rhs = line.split("=", 1)[1]
            kind = next((c for c in _COLLECTIVES if re.search(rf"\s{c}(-start)?\(", rhs)), None)
            if kind is None:
                continue
            head = rhs.split(kind, 1)[0]
            if kind == "all-reduce" and scatter:
                kind, head = "reduce-scatter", scatter.group(1)
            shapes = _SHAPE.findall(head)
            nbytes = sum((int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1)
                         * _DTYPE_BYTES.get(dtype, 4) for dtype, dims in shapes)
            op = {"kind": kind, "bytes": nbytes, "shapes": [f"{t}[{d}]" for t, d in shapes],
                  "loops": loops_of[name]}
            piece = _ASYNC_PIECE.search(rhs)
            if piece is None or piece.group(2) == "-1":
                ops.append(op)
                if piece is not None:
                    started.add(piece.group(1))
            else:
                continued.setdefault(piece.group(1), op)
    # A chain whose start is not in the text is listed once, at its first piece.
    return ops + [op for chain, op in continued.items() if chain not in started]


def collectives(hlo_text: str) -> dict:
    """{collective: {"count", "bytes"}} over the optimized HLO (``collective_ops``; an op
    inside a loop body is counted once, like cost_analysis)."""
    out = {}
    for op in collective_ops(hlo_text):
        entry = out.setdefault(op["kind"], {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += op["bytes"]
    return {k: out[k] for k in _COLLECTIVES if k in out}


def train_flops(cfg: Config, rows: int, prompt_len: int) -> float:
    """Analytic FLOPs the train step executes over the whole slice: matmuls (2 per
    multiply-add) and attention scores, forward for the reference model, forward +
    backward (3x forward) for the policy, plus one forward recomputed under remat."""
    m = cfg.model
    t = prompt_len + cfg.rl.max_new_tokens
    d, h, kv, hd, f = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
    per_token = m.num_layers * (2 * d * (h + 2 * kv) * hd + 2 * h * hd * d + 3 * 2 * d * f
                                + 2 * 2 * h * hd * t)  # qk^T and pv over t keys
    per_token += 2 * d * m.vocab_size
    fwd = per_token * rows * t
    passes = 3 + (1 if m.remat != "none" else 0) + (1 if algorithm_of(cfg).needs_reference(cfg) else 0)
    return float(fwd * passes)


def matmul_params(m) -> int:
    """N of the 6N rule: the weights a token is multiplied by (every layer's projections
    and MLP, and the unembedding; not the embedding lookup)."""
    d, h, kv, hd, f = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
    return m.num_layers * (d * (h + 2 * kv) * hd + h * hd * d + 3 * d * f) + d * m.vocab_size


def model_flops(cfg: Config, questions: int, prompt_len: int) -> dict:
    """The model's useful FLOPs over the whole slice for one step of ``questions`` (the
    numerator of MFU): 2N per prefilled prompt token (each question's prompt once), 2N per
    sampled token, 6N per trained token (prompt and completion, per update; 4N with LoRA,
    whose frozen weights need no gradient: forward and dx only) and 2N per reference-model
    token. Attention scores, remat recomputation, padding rows and per-row prefill copies
    are cost, not useful work."""
    n = matmul_params(cfg.model)
    rows = questions * programs.group_size(cfg)
    seq = prompt_len + cfg.rl.max_new_tokens
    ref = 2 * n if algorithm_of(cfg).needs_reference(cfg) else 0
    trained = (4 if lora.enabled(cfg.model) else 6) * n
    return {"prefill": 2.0 * n * questions * prompt_len,
            "decode": 2.0 * n * rows * cfg.rl.max_new_tokens,
            "train_step": float((trained * cfg.rl.num_updates + ref) * rows * seq)}


# ---------------------------------------------------------------------- the cost count

# The TPU SPMD partitioner may split a sharded dot into a loop over its shards (windowed
# einsum: each trip all-gathers or reduce-scatters one block while multiplying another),
# which a cost twin may not hold. Off in the twins: the same dots, each counted whole.
# Memory-space assignment (MSA) is off in the twins too: it stages operands in on-chip
# VMEM with asynchronous copies, and XLA's cost analysis charges such a copy its whole
# source buffer and its destination, then the consumer's read again, without telling HBM
# from VMEM, so a weight streamed once through VMEM is counted three times or more (a
# sliced prefetch charges the whole source per slice). Without MSA every operand is read
# from HBM and every result written there, once per op: the HBM traffic a roofline wants,
# which MSA can only lower.
TWIN_OPTIONS = {"tpu": {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                        "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
                        "xla_msa_enable": False}}


def loop_free_cost(name: str, lowered, mesh) -> np.ndarray:
    """[FLOPs, bytes accessed, collective bytes, collectives] per chip of a cost twin
    lowered for ``mesh``, compiled (collective bytes: the results of its collectives,
    ``collective_ops``);
    RuntimeError if a loop is left in it (its body would be counted once), NotCounted if
    the compiler runs out of HBM for it (written out, a program holds more at once)."""
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.devices()[0].platform
    try:
        compiled = lowered.compile(compiler_options=TWIN_OPTIONS.get(platform, {}))
    except Exception as e:  # jax raises JaxRuntimeError; match on XLA's status text
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise NotCounted(f"{name}: its cost twin (every loop written out) does not fit HBM: "
                         f"{str(e).splitlines()[0]}") from None
    text = compiled.as_text()
    if re.search(r"\swhile\(", text):
        raise RuntimeError(f"{name}: the cost twin still holds a while loop; its count would miss trips")
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    ops = collective_ops(text)
    return np.array([float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
                     float(sum(op["bytes"] for op in ops)), float(len(ops))])


def _bilinear(c: dict, x: float, y: float) -> np.ndarray:
    """The value at (x, y) of the function a + b·x + c·y + d·x·y through the four points
    c[(i, j)], i, j in {1, 2}."""
    d = c[2, 2] - c[2, 1] - c[1, 2] + c[1, 1]
    b = c[2, 1] - c[1, 1] - d
    e = c[1, 2] - c[1, 1] - d
    a = c[1, 1] - b - e - d
    return a + b * x + e * y + d * x * y


def _variant(cfg: Config, layers: int, **rl) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers),
                               rl=dataclasses.replace(cfg.rl, **rl))


@contextlib.contextmanager
def _threefry_unrolled_on_cpu():
    """Lower jax's threefry hash (the sampler's random bits) unrolled on the CPU backend too
    while the context is open: jax's CPU rule rolls its 5 rounds into a while loop, which a
    cost twin may not hold; every other backend already lowers it unrolled. Restores jax's
    CPU rule on exit. Uses jax internals (no public switch exists in jax 0.10)."""
    from jax._src.interpreters import mlir
    from jax._src.random import threefry2x32 as tf

    rules = mlir._platform_specific_lowerings["cpu"]
    saved = rules.get(tf.threefry2x32_p)
    mlir.register_lowering(tf.threefry2x32_p, tf._threefry2x32_lowering_rule, platform="cpu", inline=False)
    try:
        yield
    finally:
        if saved is None:
            rules.pop(tf.threefry2x32_p, None)
        else:
            rules[tf.threefry2x32_p] = saved


def sampler_cost(cfg: Config, mesh, prompts: int, group_size: int, prompt_len: int) -> dict:
    """Per-chip {"prefill" | "decode": [FLOPs, bytes]} of one sampler call with every loop
    trip counted, and "decode_per_token": the decode's [FLOPs, bytes] per step, averaged
    over the rl.max_new_tokens - 1 steps.

    XLA counts a loop body once, so the count compiles cost twins of the run's programs
    (``sampler_calls(unrolled=True)``): the same code with every loop written out, at 1 and
    2 layers and 1 and 2 decode steps. Each count is linear in the layers (and for decode
    in steps, with a layers x steps term), so the four points give the count at the
    model's depth and rl.max_new_tokens exactly, with nothing dropped: the run's own
    copies, in-loop slicing and cache writes are in the twin too. An engine that decodes in
    phases over a growing cache (``DecodeEngine.cache_plan``) is counted at its first and last
    window, and a step's cost is linear in the window between them (attention and the
    cache slots are; nothing else depends on it)."""
    call = run_sampler(cfg, mesh).call(prompts, group_size, prompt_len)
    tc, windows = call.num_cols, call.windows
    pre, dec = {}, {w: {} for w in dict.fromkeys((windows[0], windows[-1]))}
    with _threefry_unrolled_on_cpu():
        for layers in (1, 2):
            variant = _variant(cfg, layers)
            for w in dec:
                for steps in (1, 2):
                    calls = sampler_calls(variant, mesh, prompts, group_size, prompt_len, unrolled=True,
                                          cost_steps=steps, window=w)
                    if steps == 1 and layers not in pre:
                        program, args, kwargs = calls["prefill"]
                        pre[layers] = loop_free_cost("sample_prefill", program.lower(*args, **kwargs), mesh)
                    program, args, kwargs = calls["decode"]
                    dec[w][layers, steps] = loop_free_cost("sample_decode", program.lower(*args, **kwargs), mesh)
    depth = cfg.model.num_layers
    prefill = pre[1] + (depth - 1) * (pre[2] - pre[1])
    per_window = {w: _bilinear(c, depth, 2) - _bilinear(c, depth, 1) for w, c in dec.items()}
    fixed = _bilinear(dec[windows[-1]], depth, 1) - per_window[windows[-1]]
    lo, hi = windows[0], windows[-1]
    at = lambda w: per_window[hi] if lo == hi else per_window[lo] + (w - lo) / (hi - lo) * (per_window[hi] - per_window[lo])
    steps = cfg.rl.max_new_tokens - 1  # the first token is drawn from the prefill's logits
    decode = fixed + sum(n * at(w) for n, w in zip(phase_steps(windows, tc, steps), windows))
    return {"prefill": prefill, "decode": decode, "decode_per_token": (decode - fixed) / max(steps, 1)}


def train_cost(cfg: Config, mesh, rows: int, prompt_len: int) -> np.ndarray:
    """Per-chip [FLOPs, bytes] of the train step with every loop trip counted: cost twins
    at 1 and 2 layers and a and 2a micro-batches of rows / rl.num_micro_batches rows each
    (every loop written out, ``loops.unrolled``), extrapolated bilinearly to the model's
    depth and rl.num_micro_batches (see ``sampler_cost``). a is the fewest micro-batches
    that hold whole groups (group advantages need every output of a question). With
    ``model.attention=splash`` the count leaves the attention kernels out: XLA's cost
    analysis does not see into them (``grpo_jax.splash``)."""
    micro = cfg.rl.num_micro_batches
    per_micro = rows // micro
    group = programs.group_size(cfg)
    a = group // math.gcd(per_micro, group)
    cost = {}
    for layers in (1, 2):
        for j in (1, 2):
            variant = _variant(cfg, layers, num_micro_batches=a * j)
            with loops.unrolled():
                lowered = lower_train_step(variant, mesh, per_micro * a * j, prompt_len)
            cost[layers, j] = loop_free_cost("train_step", lowered, mesh)
    return _bilinear(cost, cfg.model.num_layers, micro / a)


def decode_bytes_analytic(cfg: Config, mesh, prompts: int, group_size: int, prompt_len: int) -> float:
    """Bytes a decode step must move per chip at least, averaged over the
    rl.max_new_tokens - 1 steps: its shard of the sampling weights and of the KV its
    attention needs. Every slot of the cache for the engines that read them all; for the
    shared engine, each prompt slot's cache once and each row's filled completion slots
    (step s: s of them)."""
    _, args, _ = sampler_calls(cfg, mesh, prompts, group_size, prompt_len)["decode"]
    params, cache = args[0], args[1]
    call = run_sampler(cfg, mesh).call(prompts, group_size, prompt_len)
    size = (lambda x: float(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(x)))) \
        if call.mesh is None else bytes_per_chip
    kv = size((cache.k, cache.v, cache.k_scale, cache.v_scale))  # no scales unless int8
    if call.engine.reads_prompt_in_place:
        rows = len(call.layout[1])
        slots_per_row = cache.mask.shape[0] / rows
        mean_filled = cfg.rl.max_new_tokens / 2  # (1 + ... + steps) / steps, steps = max_new_tokens - 1
        kv = kv * (1 + mean_filled / (slots_per_row * prompt_len))
    return float(size(params) + kv)


def fit(compiled, chip: ChipSpec, resident_bytes: int = 0) -> dict:
    """Per-chip memory of a compiled program (``memory``) against the chip's HBM, with
    ``resident_bytes`` of other buffers live meanwhile: fits, headroom."""
    mem = memory(compiled)
    used = mem["peak_bytes"] + resident_bytes
    return {**mem, "resident_bytes": resident_bytes, "hbm_capacity_bytes": chip.hbm_bytes,
            "fits": used <= chip.hbm_bytes, "headroom": 1 - used / chip.hbm_bytes}


def report(compiled, chip: ChipSpec, cost: np.ndarray | NotCounted, model_flops_per_chip: float,
           resident_bytes: int = 0) -> dict:
    """Per chip: memory of the compiled program (the fit), its cost with every loop trip
    (``sampler_cost`` / ``train_cost``), collectives, and the roofline estimate
    max(FLOPs / peak, bytes / HBM bandwidth, collective bytes / ICI all-reduce bandwidth):
    a lower bound that assumes the three overlap perfectly and ignores each collective's
    latency (``ici_collectives`` says how many a call runs). ``resident_bytes``: other buffers live on each
    chip while the program runs (the train state during sampling); the program fits when
    its peak plus these fit HBM. ``expected_seconds``: that bound over the fraction of it
    measured programs reach on the chip (``tpu_specs.EFFICIENCY``). ``cost`` a NotCounted:
    the fit without a time (FLOPs, bytes and the estimates None, "not_counted" its reason)."""
    if isinstance(cost, NotCounted):
        return {**fit(compiled, chip, resident_bytes), "flops_per_chip": None, "bytes_per_chip": None,
                "model_flops_per_chip": model_flops_per_chip, "collectives": collectives(compiled.as_text()),
                "estimated_seconds": None, "expected_seconds": None, "bound": None, "not_counted": str(cost)}
    flops, nbytes = float(cost[0]), float(cost[1])
    ici_bytes, ici_ops = (float(cost[2]), float(cost[3])) if len(cost) > 2 else (0.0, 0.0)
    times = {"compute": flops / chip.peak_bf16_flops, "memory": nbytes / chip.hbm_bandwidth,
             "interconnect": ici_bytes / chip.ici_bandwidth}
    bound = max(times, key=times.get)
    return {**fit(compiled, chip, resident_bytes), "flops_per_chip": flops, "bytes_per_chip": nbytes,
            "model_flops_per_chip": model_flops_per_chip,
            "collectives": collectives(compiled.as_text()),
            "ici_bytes_per_chip": ici_bytes, "ici_collectives": ici_ops, "ici_seconds": times["interconnect"],
            "estimated_seconds": times[bound], "bound": bound,
            "expected_seconds": expected_seconds(times[bound], bound, chip.name)}


def check_fit(name: str, rep: dict) -> None:
    """Raise FitError naming the program and its numbers when it does not fit HBM."""
    if not rep["fits"]:
        raise FitError(
            f"{name}: peak HBM {rep['peak_bytes'] / 1e9:.2f} GB per chip (arguments "
            f"{rep['argument_bytes'] / 1e9:.2f} + temps {rep['temp_bytes'] / 1e9:.2f} + outputs "
            f"{rep['output_bytes'] / 1e9:.2f} - aliases {rep['alias_bytes'] / 1e9:.2f})"
            + (f" + {rep['resident_bytes'] / 1e9:.2f} GB train state held meanwhile" if rep["resident_bytes"] else "")
            + f" exceeds the chip's {rep['hbm_capacity_bytes'] / 1e9:.0f} GB")


def run_sampler(cfg: Config, mesh, evaluation: bool = False) -> Sampler:
    """The sampler a run of ``cfg`` builds (``Sampler.for_run``), on the sampling ``mesh``
    (None: one device); with ``evaluation`` the in-run evaluation's (``Sampler.evaluation``:
    greedy)."""
    sampler = dataclasses.replace(Sampler.for_run(cfg), mesh=mesh)
    return sampler.evaluation() if evaluation else sampler


def sample_mesh(cfg: Config, slice_name: str):
    """The sampler's mesh as the trainer builds it (``Sampler.for_run``): the slice
    preset's ``sample_mesh`` (replicas x tensor), or the train mesh for a raw topology."""
    train, _ = topology_mesh(cfg, slice_name)
    if ":" not in slice_name:
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, slice=get_slice(slice_name).name))
    return Sampler.for_run(cfg, train).mesh


def sampler_calls(cfg: Config, mesh, prompts: int, group_size: int, prompt_len: int, *,
                  evaluation: bool = False, **twin) -> dict:
    """{"prefill" | "decode": (program, args, kwargs)}: the sampler call a run makes
    (`run_sampler`: the rollout's, or with ``evaluation`` the in-run evaluation's) with
    abstract arguments (``Sampler.abstract_call``), for one call of ``prompts`` x
    ``group_size`` rows, a prompt bucket of ``prompt_len`` and rl.max_new_tokens new
    tokens. ``mesh`` None: one device. ``twin``: the cost twin (``sampler.sampler_call``'s
    unrolled, cost_steps and window)."""
    return run_sampler(cfg, mesh, evaluation).abstract_call(prompts, group_size, prompt_len, **twin)


def lower_sampler(cfg: Config, mesh, prompts: int, group_size: int, prompt_len: int, **kwargs) -> dict:
    """{"prefill": lowered, "decode": lowered}; see ``sampler_calls``."""
    return {name: program.lower(*args, **static)
            for name, (program, args, static) in sampler_calls(cfg, mesh, prompts, group_size, prompt_len,
                                                               **kwargs).items()}


def compile_sampler(cfg: Config, mesh, prompts: int, group_size: int, prompt_len: int, *,
                    evaluation: bool = False) -> dict:
    """{"prefill": (compiled, s), "decode": (compiled, s)}: the run's sampler programs for
    one call (``sampler_calls``). FitError names the program the compiler finds too big."""
    prefix = "eval" if evaluation else "sample"
    return {name: compile_lowered(f"{prefix}_{name}", lowered)
            for name, lowered in lower_sampler(cfg, mesh, prompts, group_size, prompt_len,
                                               evaluation=evaluation).items()}


def compile_lowered(name: str, lowered) -> tuple[Any, float]:
    """(compiled, seconds); FitError naming the program when the compiler runs out of HBM
    (XLA refuses to compile what cannot fit)."""
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # jax raises JaxRuntimeError; match on XLA's status text
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise FitError(f"{name}: {str(e).splitlines()[0]}") from None
    return compiled, time.perf_counter() - start
