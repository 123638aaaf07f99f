"""Shared helpers for the benchmarks: timing, machine description, models, output.

Every benchmark script is a standalone program (`--help`, `--quick`, `--json FILE`) that
prints markdown tables; `run_all.py` runs each one in a fresh process and collects the
JSON it writes. Conventions used throughout:

* warm-up (JAX compilation, torch's first call) is always excluded from the timings;
* reps of the things being compared are interleaved, so both see the same background
  load on a shared machine, and every number is the median over reps with its spread
  (min–max) kept next to it;
* torch runs with `OMP_WAIT_POLICY=PASSIVE` (set here, before torch is imported) and
  as many intra-op threads as there are cores; with OpenMP's default spin-waiting, any
  other process on the cores slows torch down several-fold, which would flatter JAX.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch / OpenMP initialise
# The benchmarks measure CPUs: with libtpu installed (make test) jax would first probe for a TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent

# ============================================================================ timing

def summarize(samples: Sequence[float]) -> dict:
    """Median and spread of a list of seconds (or any positive measurements)."""
    xs = sorted(float(x) for x in samples)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs),
            "samples": xs}


def spread(s: dict) -> str:
    """'12.3 s (11.9–13.0)' for a summarize() dict of seconds."""
    return f"{fmt(s['median'])} ({fmt(s['min'])}–{fmt(s['max'])})"


def rate_spread(work: float, s: dict) -> str:
    """Throughput median and range for a summarize() dict of seconds."""
    return f"{fmt(work / s['median'])} ({fmt(work / s['max'])}–{fmt(work / s['min'])})"


def interleaved(fns: dict[str, Callable[[], float]], reps: int, warmup: int = 1) -> dict[str, dict]:
    """Run every callable `warmup` times (discarded), then `reps` rounds in which each runs
    once, in turn. A callable returns the seconds it measured itself (so it can exclude
    set-up such as host→device copies); returns name -> summarize(seconds)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            out[name].append(fn())
    return {name: summarize(xs) for name, xs in out.items()}


class Stopwatch:
    """Accumulates wall time per label: `with sw("sampling"): ...`."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, label: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - start

    def reset(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


# ============================================================================ formatting

def fmt(x: float | None, digits: int = 3) -> str:
    """Compact human number: 3 significant digits, thousands separators above 1000."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax == 0:
        return "0"
    return f"{x:.{max(0, digits - 1 - int(math.floor(math.log10(ax))))}f}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


class Report:
    """Collects markdown (printed as it comes) and JSON results of one benchmark."""

    def __init__(self, name: str, args):
        self.name, self.args = name, args
        self.lines: list[str] = []
        self.results: dict[str, Any] = {}
        self.details: dict[str, Any] = {}
        self.started = time.time()
        self.load_start = os.getloadavg()

    def emit(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def table(self, headers, rows) -> None:
        self.emit(markdown_table(headers, rows))
        self.emit()

    def finish(self) -> int:
        payload = {"benchmark": self.name, "quick": bool(getattr(self.args, "quick", False)),
                   "results": self.results, "details": self.details, "markdown": "\n".join(self.lines),
                   "seconds": time.time() - self.started, "load_start": self.load_start,
                   "load_end": os.getloadavg()}
        self.emit(f"_{self.name}: {payload['seconds']:.0f} s wall; load average "
                  f"{self.load_start[0]:.1f} at start, {payload['load_end'][0]:.1f} at end_")
        payload["markdown"] = "\n".join(self.lines)
        if getattr(self.args, "json", None):
            Path(self.args.json).write_text(json.dumps(payload, indent=2, default=jsonable))
        return 0


def jsonable(x):
    """x as json.dumps can write it (its ``default``): numpy scalars as numbers, arrays as
    lists, anything else as its str."""
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    return str(x)


def base_parser(description: str):
    import argparse

    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small shapes and few reps: finishes in under 2 minutes (smoke test)")
    ap.add_argument("--reps", type=int, default=None, help="timed reps per point (default: 5, quick: 2)")
    ap.add_argument("--json", default="", help="write the results as JSON to this file")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    return ap


def reps_of(args, full: int = 5, quick: int = 2) -> int:
    return args.reps or (quick if args.quick else full)


# ============================================================================ machine

def package_version(module: str) -> str | None:
    """The installed version of distribution ``module``, None when it is not installed."""
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed
        return None


# The CPU features that decide which kernels XLA's CPU backend and torch pick for our dots.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_description(cpuinfo: str, fallback: str) -> tuple[str, str]:
    """(CPU model, its flags among CPU_FLAGS) from /proc/cpuinfo's text. The model is the
    "model name" with its family and model numbers: this project's 2-core "AMD EPYC" measured
    a ~210 GFLOP/s float32 matmul peak one day (family not recorded) and 500 the next, as a
    Zen 5 (family 26), and the two must not be merged or compared as one machine."""
    fields = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first processor's entry
            fields[key.strip()] = value.strip()
    name = fields.get("model name") or fallback
    if "cpu family" in fields and "model" in fields:
        name = f"{name} (family {fields['cpu family']}, model {fields['model']})"
    have = set(fields.get("flags", "").split())
    return name, ",".join(f for f in CPU_FLAGS if f in have)


def machine_info() -> dict:
    """CPU, cores, memory, library versions, git commit, date and load average."""
    cpu, flags = platform.processor() or platform.machine(), ""
    with contextlib.suppress(OSError):
        cpu, flags = cpu_description(Path("/proc/cpuinfo").read_text(), cpu)
    mem = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    commit = None
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "memory_bytes": mem,
        "platform": platform.platform(), "python": platform.python_version(),
        "versions": {m: package_version(m) for m in ("jax", "jaxlib", "flax", "optax", "numpy", "torch",
                                              "transformers", "accelerate", "trl")},
        "git_commit": commit, "load_average": os.getloadavg(),
    }


def peak_bytes(m) -> int:
    """Worst-case bytes a compiled XLA program holds at once, from its CompiledMemoryStats:
    arguments + outputs − outputs aliased to donated arguments + temporaries (the temp
    allocation is already liveness-packed by XLA). `peak_memory_in_bytes` is not used: on
    the CPU backend it leaves the temporaries out."""
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def rollout_rates(runners: dict, prompts, new_tokens: int, reps: int, *, prompt_len: int | None = None) -> dict:
    """Interleaved reps of t(1 new token) and t(N) for every runner (a callable
    (prompts, new_tokens) -> seconds), after one warm-up of each (compiles excluded).
    Per runner: prefill / decode / end-to-end tokens/s from the medians, the median times
    and every rep's times (``t1_samples``, ``tn_samples``). ``prompt_len`` defaults to the
    length of the first prompt (token ids)."""
    return rollout_rates_by_batch(runners, {len(prompts): prompts}, new_tokens, reps,
                                  prompt_len=prompt_len)[len(prompts)]


def rollout_rates_by_batch(runners: dict, prompts_by_batch: dict, new_tokens: int, reps: int, *,
                           prompt_len: int | None = None) -> dict:
    """`rollout_rates` for several batch sizes at once, {batch: its prompts} -> {batch:
    {runner: rates}}: every rep runs every batch size and every runner in turn, so that a
    comparison between batch sizes (per-token speed should not fall as the batch grows)
    sees the same machine state as one between runners. Run one batch at a time, a 12-minute
    benchmark put its largest batch minutes after the others, on a machine whose speed
    drifts by a fifth within an hour."""
    for prompts in prompts_by_batch.values():
        for run in runners.values():
            run(prompts, 1)
            run(prompts, new_tokens)
    samples = {b: {name: {"t1": [], "tn": []} for name in runners} for b in prompts_by_batch}
    for _ in range(reps):
        for b, prompts in prompts_by_batch.items():
            for name, run in runners.items():
                samples[b][name]["t1"].append(run(prompts, 1))
                samples[b][name]["tn"].append(run(prompts, new_tokens))
    out = {}
    for b, prompts in prompts_by_batch.items():
        batch, plen = len(prompts), prompt_len or len(prompts[0])
        out[b] = {}
        for name, s in samples[b].items():
            r = {"t1_samples": s["t1"], "tn_samples": s["tn"]}
            t1, tn = statistics.median(s["t1"]), statistics.median(s["tn"])
            r.update(prefill=batch * plen / t1, e2e=batch * new_tokens / tn, t1=t1, tn=tn,
                     decode=batch * (new_tokens - 1) / statistics.median(rep_seconds(r, "decode")))
            out[b][name] = r
    return out


def rep_seconds(rates: dict, phase: str) -> list[float]:
    """Every rep's seconds of one phase, from a runner's `rollout_rates` dict: t(1 new token)
    for "prefill", t(N) − t(1) for "decode"."""
    if phase == "prefill":
        return rates["t1_samples"]
    return [tn - t1 for t1, tn in zip(rates["t1_samples"], rates["tn_samples"])]


def decode_rate_spread(rates: dict, batch: int, new_tokens: int) -> dict | None:
    """summarize() of every rep's decode tokens/s, batch × (N − 1) / (t(N) − t(1)), from a
    runner's `rollout_rates` dict (None when no rep had t(N) > t(1))."""
    per_rep = [batch * (new_tokens - 1) / t for t in rep_seconds(rates, "decode") if t > 0]
    return summarize(per_rep) if per_rep else None


def per_token_gain(small: dict, large: dict, small_batch: int, large_batch: int, phase: str) -> dict:
    """Per-token speed of the larger batch over the smaller one, rep by rep, for one runner's
    rates dicts from `rollout_rates_by_batch` (its reps of the two batches are adjacent in
    time, so their ratio cancels the machine's drift): summarize() over reps of
    (large_batch / t_large) / (small_batch / t_small), t being t(1 new token) for phase
    "prefill" and t(N) − t(1) for "decode"."""
    return summarize([(large_batch / tl) / (small_batch / ts)
                      for ts, tl in zip(rep_seconds(small, phase), rep_seconds(large, phase))])


def _timed_reps(f, *args, reps: int) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds) of ``reps`` calls of a jitted ``f`` after a warm-up."""
    f(*args).block_until_ready()
    times, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return times, cpu


def matmul_peak_flops(n: int = 2048, reps: int = 7, dtype: str = "float32") -> dict:
    """Measured float32 matmul throughput of this process's XLA CPU backend: a jitted
    [n,n]@[n,n] (2n³ FLOPs), median and best of `reps` after a warm-up. The best is the
    fairest "peak" on a shared machine (the least-disturbed rep)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), getattr(jnp, dtype))
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), getattr(jnp, dtype))
    times, cpu = _timed_reps(jax.jit(lambda x, y: x @ y), a, b, reps=reps)
    s = summarize(times)
    flops = 2.0 * n ** 3
    return {"n": n, "flops_per_s_best": flops / s["min"], "flops_per_s_median": flops / s["median"],
            "flops_per_cpu_s": flops / statistics.median(cpu), "seconds": s}


def stream_bandwidth(nbytes: int = 512 * 2 ** 20, reps: int = 7) -> dict:
    """Measured memory read rate of this process's XLA CPU backend: a jitted sum over a
    float32 array of ``nbytes``, best and median of ``reps`` after a warm-up. A read, like
    decode's weight reads: an elementwise op writing a fresh output measures page faults
    on the new buffer more than the memory (4.6 against 18 GB/s on this machine)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    times, _ = _timed_reps(jax.jit(jnp.sum), x, reps=reps)
    s = summarize(times)
    return {"bytes": nbytes, "bytes_per_s_best": nbytes / s["min"],
            "bytes_per_s_median": nbytes / s["median"], "seconds": s}


def decode_roofline(cfg, batch: int, context: int, *, flops_per_s: float, bytes_per_s: float,
                    weight_bytes: int = 4, cache_bytes: int = 4) -> dict:
    """Best-case decode tokens/s of ``batch`` rows at ``context`` tokens of KV cache: each
    step reads every weight once and the whole cache, and does 2 FLOPs per weight per row
    plus attention; the step takes the larger of bytes / bandwidth and FLOPs / peak.

    ``serial_tokens_per_s``: the same step when reading and arithmetic do not overlap at all
    (bytes / bandwidth + FLOPs / peak), as XLA's CPU dots run a decode-shaped product whose
    weights come from memory (NOTES.md, Zen 5): what a step of nothing but those products
    could reach."""
    import jax
    from grpo_jax.model import transformer as model_lib

    params = sum(x.size for x in jax.tree.leaves(model_lib.param_shapes(cfg)))
    cache = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    # The embedding lookup reads one row per token, but the unembedding reads the whole table.
    step_bytes = params * weight_bytes + cache * cache_bytes
    step_flops = batch * (2 * params + cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * context)
    reading, computing = step_bytes / bytes_per_s, step_flops / flops_per_s
    return {"tokens_per_s": batch / max(reading, computing),
            "bound": "memory" if reading >= computing else "compute",
            "serial_tokens_per_s": batch / (reading + computing),
            "step_bytes": step_bytes, "step_flops": step_flops}


# ============================================================================ models

SMOLLM2 = "smollm2-135m"


def smollm2(overrides: dict | None = None, mesh=None, *, preset: bool = True):
    """(ModelConfig, params, tokenizer) of SmolLM2-135M-Instruct imported from its GGUF
    (downloaded and converted once into ~/.cache/grpo_jax by grpo_jax.model.pretrained).

    The runtime fields (remat, scan_layers, dtype, max_seq_len) come from the
    `smollm2-135m` preset, as the experiment scripts load it, then from `overrides`."""
    from grpo_jax.model import pretrained
    from grpo_jax.config import smollm2_135m

    runtime = {}
    if preset:
        model = smollm2_135m().model
        runtime = {k: getattr(model, k) for k in pretrained.RUNTIME_FIELDS}
    runtime.update(overrides or {})
    return pretrained.load(SMOLLM2, overrides=runtime, mesh=mesh)


def smollm2_tokenizer():
    """The SmolLM2 tokenizer alone (no weights loaded)."""
    from grpo_jax.model import pretrained
    from grpo_jax.text.bpe_tokenizer import BPETokenizer

    return BPETokenizer.from_hf_dir(pretrained.fetch_smollm2())


def smollm2_hf_dir() -> Path:
    """An HF (safetensors + config + tokenizer) copy of the same imported weights, written
    once with `pretrained.export_hf`, so transformers / TRL run the identical model."""
    from grpo_jax.model import pretrained

    out = pretrained.default_cache_dir() / "bench" / "smollm2-135m-hf"
    if not (out / "config.json").exists():
        cfg, params, tok = smollm2()
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        pretrained.export_hf(tmp, cfg, params, tok)
        try:
            os.rename(tmp, out)
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent export won
    return out


def fixed_length_prompts(tokenizer_encode: Callable[[str], list[int]], count: int, length: int,
                         seed: int = 0) -> tuple[list[str], list[list[int]]]:
    """`count` distinct texts that each tokenize to exactly `length` tokens (by adding words
    from a fixed list until the length is reached), with their token ids."""
    import random

    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly count "
             "apples pears and plums under an old bridge near the river bank every morning "
             "before breakfast number letter table chair window garden").split()
    rng = random.Random(seed)
    texts, ids = [], []
    while len(texts) < count:
        text = f"Question {len(texts) + 1}:"
        toks = tokenizer_encode(text)
        while len(toks) < length:
            candidate = text + " " + rng.choice(words)
            cand = tokenizer_encode(candidate)
            if len(cand) > length:
                break
            text, toks = candidate, cand
        if len(toks) == length:
            texts.append(text)
            ids.append(toks)
    return texts, ids


def torch_setup(threads: int):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    from transformers.utils import logging

    logging.set_verbosity_error()
    return torch


def count_letter_reward(text: str, letter: str = "e") -> float:
    """The trivial reward of the whole-step benchmark: how often `letter` occurs."""
    return float(text.count(letter))
