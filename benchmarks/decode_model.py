"""A decode step's bytes and FLOPs, part by part, for each engine: a model, not a measurement.

    python benchmarks/decode_model.py            # the table of benchmarks/NOTES.md

One decode step samples one token for each of B = questions x group rows whose prompts fill
P prompt slots (the prompt bucket), N new tokens in a completion bucket of Tc = bucket_length(N)
columns. Step s (1 … N − 1; the first token comes from the prefill's logits) writes its token's
keys and values into the cache and attends over s completion slots and the prompt's. Every
figure is the mean over those N − 1 steps (what ``bench_accelerator.py``'s decode,
t(N) − t(1), runs), from the model's shape alone. The parts, as the profile splits a step
(``profile_ops.DECODE_PARTS``):

* **weights**: every parameter but an untied input embedding, read once (``weight_read_bytes``);
  FLOPs 2 per matmul weight per row (``matmul_weights``), the unembedding's under "logits".
* **embedding**: B rows of the embedding gathered.
* **KV read** (attention): the cache slots the engine's attention reads, at the KV's dtype
  (``kv_bytes_per_slot``); FLOPs 4 H D per layer per slot a row attends to (q·k and the
  probabilities times v: the masked slots cost as much as the filled ones).
* **cache update**: the step's new slot of every row, and the copies the engine makes by
  design (the shared and feature-major engines grow their cache between decode phases: each
  growth reads the old cache and writes the new one, counted here spread over the steps;
  ``generate``'s cache is concatenated anew at every step).
* **logits**: the unembedding's [V, B] float32 logits written once, and read by the sampling:
  each reduction over the vocabulary reads them once, elementwise work fusing into it (ours,
  ``draw.next_token`` untruncated: the max, the sum of exp, the per-block sums of the two-level
  draw: 3 reads). FLOPs: the unembedding's 2 E V per row, and ``SAMPLING_FLOPS`` per
  vocabulary entry per row.

The engines (``grpo_jax.sampler.engines``), and the peer:

* ``scan``, ``unrolled``: every row attends over the whole cache, P + Tc slots, each row's
  own copy of its prompt's.
* ``shared``: each question's prompt slots read once for its rows (``model.PrefixCache``),
  and each row's completion slots of its decode phase's window (``cache.decode_windows``
  from 0, ``rl.decode_phases`` phases), filled or not.
* ``feature_major`` (one CPU device): each row's cache of its phase's window, prompt
  included (``cache.decode_windows`` from P).
* ``generate`` (Hugging Face transformers, dynamic cache, the bench's peer): each row its
  P + s slots; its cache concatenated anew every step (the old slots read, all written); its
  logits written in the weights' dtype, then a float32 copy, a softmax and the multinomial
  draw, each a read of its input and a write of its output.

Not modelled: copies XLA adds on its own (a layer's slice of a stacked cache, a stacked
cache rewritten by a scan's step), the cache's mask (a byte per slot per row against a
slot's kilobytes), RoPE, norms, biases and the loop's bookkeeping ([B] vectors per step).
The profile (``profile_ops.py``) shows what they cost; where the model and the profile
disagree, the program reads what the model does not.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # run as a script: the sampler's modules import jax

import numpy as np  # noqa: E402

from grpo_jax.sampler.cache import decode_windows  # noqa: E402
from grpo_jax.sampler.settings import DECODE_PHASES  # noqa: E402
from grpo_jax.shapes import bucket_length  # noqa: E402

ENGINES = ("scan", "unrolled", "shared", "feature_major", "generate")
# Per vocabulary entry per row in the sampling: the division by T, the max, the subtraction,
# the exp, the sum and the block sum (``draw.next_token``); a softmax and a draw for generate.
SAMPLING_FLOPS = 6
LOGIT_BYTES = 4  # float32 logits, as every engine's step returns them
OUR_LOGIT_READS = 3  # the max, the sum of exp, the block sums (module docstring)


def matmul_weights(m) -> int:
    """N: the weights a token is multiplied by: per layer q, k, v, o and the MLP's gate, up and
    down; the unembedding once (tied or not). Not the embedding lookup, norms or biases."""
    e, h, k, d, f = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
    return m.num_layers * (e * h * d + 2 * e * k * d + h * d * e + 3 * e * f) + e * m.vocab_size


def weight_read_bytes(m, itemsize: int) -> int:
    """Bytes of weights one decode step reads: every parameter but an untied input embedding
    (a step gathers only its rows' tokens from it)."""
    e, h, k, d, f, layers, v = (m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim,
                                m.num_layers, m.vocab_size)
    per_layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f + 2 * e
    if m.attention_bias:
        per_layer += h * d + 2 * k * d
    return itemsize * (layers * per_layer + e + e * v)


def kv_bytes_per_slot(m, kv_itemsize: float) -> float:
    """KV bytes of one token of one row, every layer (k and v)."""
    return m.num_layers * 2 * m.num_kv_heads * m.head_dim * kv_itemsize


def decode_floor(m, *, questions: int, group: int, prompt: int, new_tokens: int, weight_bytes: float,
                 kv_itemsize: float, hbm_bandwidth: float) -> dict:
    """The bytes a decode step must read at least, and the tokens/s they allow: the weights
    and the KV its attention needs, averaged over steps 1 … N−1, per row prompt + N/2 slots
    ("per_row"), or each question's prompt once plus every row's N/2 ("shared_prompt", the
    issue's floor). floor tok/s = rows / (bytes / HBM bandwidth)."""
    rows, slot = questions * group, kv_bytes_per_slot(m, kv_itemsize)
    mean_new = new_tokens / 2
    out = {"weight_bytes": weight_bytes, "kv_bytes_per_slot": slot}
    for name, kv in (("per_row", rows * (prompt + mean_new) * slot),
                     ("shared_prompt", (questions * prompt + rows * mean_new) * slot)):
        step = weight_bytes + kv
        out[name] = {"bytes_per_step": step, "tokens_per_s": rows / (step / hbm_bandwidth)}
    return out


def _phase_windows(windows: tuple[int, ...], first_slot: int, steps: np.ndarray) -> np.ndarray:
    """The window each step runs in: step s writes slot first_slot + s − 1 and runs in the
    first phase whose window holds it (``loop.decode``'s condition)."""
    return np.asarray(windows)[np.searchsorted(windows, first_slot + steps)]


def _growth_slots(windows: tuple[int, ...], start: int) -> int:
    """Slots a phased cache reads and writes growing through ``windows`` from ``start`` slots:
    each growth reads the old cache and writes the new one (``engines.*.grow``)."""
    total, before = 0, start
    for w in windows:
        if w != before:
            total += before + w
        before = w
    return total


def decode_step(m, engine: str, *, questions: int, group: int, prompt: int, new_tokens: int,
                weight_itemsize: float = 2, kv_itemsize: float = 2, phases: int = DECODE_PHASES) -> dict:
    """The mean decode step of ``engine`` (module docstring): {"bytes": {part: bytes},
    "flops": {part: FLOPs}, "rows", "attended_slots" (mean per row), "bytes_total",
    "flops_total"}; parts: weights, embedding, kv_read, cache_update, logits."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {ENGINES}")
    rows, p, tc = questions * group, prompt, bucket_length(new_tokens)
    steps = np.arange(1, new_tokens, dtype=np.float64)
    if not steps.size:
        raise ValueError(f"new_tokens must be >= 2 (the decode is steps 1 … N−1), got {new_tokens}")
    slot = kv_bytes_per_slot(m, kv_itemsize)
    vb = m.vocab_size * rows
    logits_written = LOGIT_BYTES * vb
    logits_read = OUR_LOGIT_READS * LOGIT_BYTES * vb
    update_slots = rows * np.ones_like(steps)  # each row's new slot
    if engine in ("scan", "unrolled"):
        attended = np.full_like(steps, p + tc)
        read_slots = rows * attended
    elif engine == "shared":
        windows = decode_windows(0, tc, phases)
        own = _phase_windows(windows, 0, steps)
        attended, read_slots = p + own, questions * p + rows * own
        update_slots = update_slots + rows * _growth_slots(windows, 0) / steps.size
    elif engine == "feature_major":
        windows = decode_windows(p, tc, phases)
        attended = _phase_windows(windows, p, steps)
        read_slots = rows * attended
        update_slots = update_slots + rows * _growth_slots(windows, windows[0]) / steps.size
    else:  # generate: the cache of P + s slots, the old P + s − 1 read and all P + s written
        attended = p + steps
        read_slots = rows * attended
        update_slots = rows * (2 * attended - 1)
        # lm_head in the weights' dtype, a float32 copy, softmax, multinomial
        logits_written = weight_itemsize * vb
        logits_read = weight_itemsize * vb + 4 * LOGIT_BYTES * vb
    unembed = m.embed_dim * m.vocab_size
    nbytes = {"weights": float(weight_read_bytes(m, weight_itemsize)),
              "embedding": float(rows * m.embed_dim * weight_itemsize),
              "kv_read": float(read_slots.mean() * slot),
              "cache_update": float(update_slots.mean() * slot),
              "logits": float(logits_written + logits_read)}
    flops = {"weights": 2.0 * rows * (matmul_weights(m) - unembed), "embedding": 0.0,
             "kv_read": 4.0 * m.num_layers * m.num_heads * m.head_dim * rows * float(attended.mean()),
             "cache_update": 0.0,
             "logits": 2.0 * rows * unembed + SAMPLING_FLOPS * vb}
    return {"engine": engine, "rows": rows, "attended_slots": float(attended.mean()), "bytes": nbytes,
            "flops": flops, "bytes_total": sum(nbytes.values()), "flops_total": sum(flops.values())}


def step_seconds(step: dict, *, hbm_bandwidth: float, peak_flops: float) -> float:
    """The step's floor: the larger of its bytes over the bandwidth and its FLOPs over the peak."""
    return max(step["bytes_total"] / hbm_bandwidth, step["flops_total"] / peak_flops)


# The GPU table's shapes (benchmarks/NOTES.md, "The H200 session"): the decode of
# bench_accelerator.py's full shape, 16 questions x 16, 128-token prompts, 256 new tokens,
# bf16 sampling weights and cache.
SHAPES = (("qwen2.5-1.5b", "qwen2.5-1.5b", []),
          ("7B shape, 8 layers", "deepseekmath-rl-7b", ["model.num_layers=8"]))
ROLLOUT = {"questions": 16, "group": 16, "prompt": 128, "new_tokens": 256}
# bf16 dense FLOP/s and HBM bytes/s: the datasheets' (bench_accelerator.DEVICE_PEAKS), and the
# rates the H200 session's probes reached (a bf16 8192³ matmul, a 2 GiB read).
DEVICES = (("H100 SXM", 989e12, 3.35e12), ("H200", 989e12, 4.8e12), ("H200 as probed", 697e12, 3.56e12))


def table(shapes=SHAPES, rollout=ROLLOUT, devices=DEVICES) -> list[str]:
    """Markdown lines: per shape and engine, the step's MB by part, GFLOP, FLOP per byte, and the
    floor's ms per step, tokens/s and bound (memory or compute) on each device (feature_major:
    CPU only, no GPU time)."""
    from grpo_jax.config import apply_overrides, get_preset

    head = ("| shape | engine | weights + embedding MB | KV read MB | cache update MB | logits MB | total MB | GFLOP "
            "| FLOP/byte | " + " | ".join(f"{d}: ms/step (tok/s)" for d, _, _ in devices) + " |")
    lines = [head, "|---" * (9 + len(devices)) + "|"]
    for label, preset, overrides in shapes:
        cfg = apply_overrides(get_preset(preset), overrides)
        for engine in ENGINES:
            s = decode_step(cfg.model, engine, **rollout, phases=cfg.rl.decode_phases)
            b = s["bytes"]
            mb = lambda x: f"{x / 1e6:,.0f}"  # noqa: E731
            cells = [label, engine, mb(b["weights"] + b["embedding"]), mb(b["kv_read"]), mb(b["cache_update"]),
                     mb(b["logits"]), mb(s["bytes_total"]), f"{s['flops_total'] / 1e9:,.0f}",
                     f"{s['flops_total'] / s['bytes_total']:.0f}"]
            for _, peak, bandwidth in devices:
                if engine == "feature_major":
                    cells.append("– (CPU only)")
                    continue
                t = step_seconds(s, hbm_bandwidth=bandwidth, peak_flops=peak)
                bound = "memory" if t == s["bytes_total"] / bandwidth else "compute"
                cells.append(f"{1e3 * t:.2f} ({s['rows'] / t:,.0f}), {bound}")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
