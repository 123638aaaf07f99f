"""What a program costs per chip, with every loop trip counted: FLOPs, HBM bytes and
collective bytes of cost twins (the run's programs with every loop written out), the
model's useful FLOPs (MFU's numerator), and the roofline report of a compiled program."""

import contextlib
import dataclasses
import functools
import math
import re

import jax
import numpy as np

from grpo_jax.model import lora
from grpo_jax import loops
from grpo_jax.rl import programs
from grpo_jax.rl.algorithms import algorithm_of
from grpo_jax.aot.fit import bytes_per_chip, fit
from grpo_jax.aot.hlo import collective_ops, collectives
from grpo_jax.aot.lowering import lower_train_step, run_sampler, sampler_calls
from grpo_jax.config import Config
from grpo_jax.sampler import SamplerCall
from grpo_jax.sampler.cache import phase_steps
from grpo_jax.aot.tpu_specs import ChipSpec, expected_seconds


class NotCounted(RuntimeError):
    """A cost twin (the program with every loop written out) that the compiler cannot fit
    in HBM: the program itself fits, but its loop trips cannot be counted."""


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
    CPU rule on exit."""
    # jax internals: no public API registers a primitive's lowering for one platform, nor
    # reads one back (jax 0.10).
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


def cost_twin(call: SamplerCall, steps: int, window: int | None = None) -> SamplerCall:
    """The cost twin of a sampler call: its programs traced inside ``loops.unrolled`` (every
    loop written out; the decode's while loop as exactly ``steps`` steps), decoding over one
    phase's cache of ``window`` slots (default the last phase's). The twin returns the
    decode's carried cache for every engine (``DecodeEngine.cache_out``): a dead cache would
    let XLA fuse its last steps' writes away, which the loop, carrying it, does not."""
    windows = (call.windows[-1] if window is None else window,)

    def prefill(fn):
        @functools.wraps(fn)  # jit reads the static arguments' names off fn's signature
        def written_out(*args, **kwargs):
            with loops.unrolled():
                return fn(*args, **kwargs)
        return written_out

    def decode(fn):
        @functools.wraps(fn)
        def written_out(*args, **kwargs):
            with loops.unrolled(while_trips=steps) as finals:
                *outputs, _ = fn(*args, **kwargs)
            return (*outputs, call.engine.cache_out(finals[-1].cache))
        return written_out

    return dataclasses.replace(call, prefill=call.prefill.around(prefill), decode=call.decode.around(decode),
                               windows=windows,
                               cache_len=call.cache_len if call.engine.reads_prompt_in_place else windows[0])


def twin_calls(cfg: Config, mesh, prompts: int, group_size: int, prompt_len: int, steps: int,
               window: int | None = None) -> dict:
    """`sampler_calls` of the run's rollout call's `cost_twin` (``steps`` decode steps over
    ``window`` slots)."""
    return _twin_calls(cfg, mesh, lambda sampler: sampler.call(prompts, group_size, prompt_len), steps, window)


def _twin_calls(cfg: Config, mesh, call_of, steps: int, window: int | None) -> dict:
    """The abstract programs of the `cost_twin` of ``call_of(the run's sampler)``."""
    sampler = run_sampler(cfg, mesh)
    call = call_of(sampler)
    return cost_twin(call, steps, window).abstract(sampler.abstract_weights(call))


def sampler_cost(cfg: Config, mesh, prompts: int, group_size: int, prompt_len: int) -> dict:
    """`call_cost` of the rollout's call of ``prompts`` x ``group_size`` rows, prompts in a
    bucket of ``prompt_len``."""
    return call_cost(cfg, mesh, lambda sampler: sampler.call(prompts, group_size, prompt_len))


def call_cost(cfg: Config, mesh, call_of) -> dict:
    """Per-chip {"prefill" | "decode": [FLOPs, bytes]} of one sampler call with every loop
    trip counted, and "decode_per_token": the decode's [FLOPs, bytes] per step, averaged
    over its max_new_tokens - 1 steps. ``call_of(sampler) -> SamplerCall``: the call, made
    of the run's sampler (`run_sampler`), and made again of each twin's shallower one.

    XLA counts a loop body once, so the count compiles cost twins of the run's programs
    (`twin_calls`): the same code with every loop written out, at 1 and
    2 layers and 1 and 2 decode steps. Each count is linear in the layers (and for decode
    in steps, with a layers x steps term), so the four points give the count at the
    model's depth and the call's max_new_tokens exactly, with nothing dropped: the run's own
    copies, in-loop slicing and cache writes are in the twin too. An engine that decodes in
    phases over a growing cache (``DecodeEngine.cache_plan``) is counted at its first and last
    window, and a step's cost is linear in the window between them (attention and the
    cache slots are; nothing else depends on it)."""
    call = call_of(run_sampler(cfg, mesh))
    tc, windows = call.num_cols, call.windows
    pre, dec = {}, {w: {} for w in dict.fromkeys((windows[0], windows[-1]))}
    with _threefry_unrolled_on_cpu():
        for layers in (1, 2):
            variant = _variant(cfg, layers)
            for w in dec:
                for steps in (1, 2):
                    calls = _twin_calls(variant, mesh, call_of, steps, w)
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
    steps = call.settings.max_new_tokens - 1  # the first token is drawn from the prefill's logits
    decode = fixed + sum(n * at(w) for n, w in zip(phase_steps(windows, tc, steps), windows))
    return {"prefill": prefill, "decode": decode, "decode_per_token": (decode - fixed) / max(steps, 1)}


def train_cost(cfg: Config, mesh, rows: int, prompt_len: int) -> np.ndarray:
    """Per-chip [FLOPs, bytes] of the train step with every loop trip counted: cost twins
    at 1 and 2 layers and a and 2a micro-batches of rows / rl.num_micro_batches rows each
    (every loop written out, ``loops.unrolled``), extrapolated bilinearly to the model's
    depth and rl.num_micro_batches (see ``sampler_cost``). a is the fewest micro-batches
    that hold whole groups (group advantages need every output of a question). With
    ``model.attention=splash`` the count leaves the attention kernels out: XLA's cost
    analysis does not see into them (``grpo_jax.model.splash``)."""
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
