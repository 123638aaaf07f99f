#!/usr/bin/env python3
"""The update and the rollout of a preset's shape on whatever device jax sees, ours beside
Hugging Face transformers + torch, in one run: seconds, tokens per second, MFU, the decode's
HBM floor and peak memory, as a table and JSON.

    python benchmarks/bench_accelerator.py --json OUT.json              # qwen2.5-1.5b's shape
    python benchmarks/bench_accelerator.py --preset deepseekmath-rl-7b model.num_layers=8 \\
        --group 16 --micro-batches 16 --json OUT.json                   # the 7B shape, 8 layers
    python benchmarks/bench_accelerator.py --tiny                      # CPU, seconds, tiny shapes

Random-initialised weights of the preset's shape (its model and its rl.* settings, with
``section.field=value`` overrides); nothing is downloaded. Four parts, each in its own child
process (JAX keeps a memory pool for the life of its process, so torch must not share one, and a
child that runs out of time is killed without taking the others with it; ``--in-process`` runs
them in this process, as the tests do):

* ``jax_update``: the run's train step (``programs.train_step``, as the trainer builds it: GRPO
  with the reference forward inside the step when rl.beta > 0, AdamW), ``--rows`` rows of
  ``--prompt`` + ``--completion`` tokens in rl.num_micro_batches micro-batches.
* ``torch_update``: what TRL runs per step without vLLM, on the same token ids' shape: float32
  master weights, bf16 autocast when model.dtype is bfloat16, a float32 reference copy without
  grad, completion-only logits, the clipped surrogate + β k3, sequence mean, the same
  micro-batches with gradient accumulation, clipping 1.0, AdamW (fused on CUDA); gradient
  checkpointing on when model.remat is not "none".
* ``jax_rollout``: the trainer's sampler call (``Sampler.for_run``'s ``generate`` on its
  rl.sample_dtype copy, the engine rl.decode resolves to) for ``--questions`` x rl.group_size
  rows of ``--sample-prompt`` tokens, no stop token, so every row decodes ``--new-tokens``.
* ``torch_generate``: ``generate`` (sampling at T 1, the sampling copy's dtype, sdpa attention,
  ``min_new_tokens = max_new_tokens``) on the same rows, each row prefilling its own prompt.

Both sides are timed alike: the median of ``--reps`` calls after one warm-up (the compile), each
call blocked until done. The rollout runs 1 and N new tokens; its decode is t(N) − t(1) for
rows × (N − 1) tokens, on either side.

Formulas (``update_flops``; ``decode_model.decode_floor``, beside the model of each engine's
step, part by part: ``decode_model.py``):

* MFU = (6N policy + 2N reference) × rows × (prompt + completion) / seconds / peak, N = the
  matmul weights (every layer's projections and MLP, and the unembedding; not the embedding
  lookup, norms or biases). Attention scores and recomputation are cost, not counted.
* peak: bf16 dense FLOP/s and HBM bytes/s from ``DEVICE_PEAKS`` by the device's kind, each
  with its source; ``--peak-flops`` / ``--hbm-bandwidth`` override. A CPU has no table entry:
  its float32 matmul and streaming rate are measured in the run instead. The probe part of
  ``jax_rollout`` also measures a bf16 matmul and an HBM read on the device, reported beside.
* decode HBM floor: a decode step must read the sampling weights once (all but an untied input
  embedding, of which it reads only the rows' tokens) and the KV its attention needs; averaged
  over steps 1 … N−1, per row prompt + N/2 slots (``per_row``), or, for an engine that shares a
  question's prompt cache among its rows (``shared``), each prompt once plus every row's N/2
  (``shared_prompt``). floor tok/s = rows / (bytes / HBM bandwidth); the table gives measured
  decode tok/s / floor. The issue's target is against the shared-prompt floor, whichever side.
  The JSON also gives each side's modelled step (``decode_model.decode_step`` of the engine
  that ran; ``generate`` for the peer: weights, KV, cache update, logits) and the measured
  tok/s over what that step allows (``of_modelled_step``).
* peak memory: the device allocator's peak (``memory_stats``, a fresh process per part) where
  the device has one, else the compiled program's own (arguments + temporaries + outputs −
  aliases) for the update; torch: ``cuda.max_memory_allocated``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path


# Whatever device jax sees (common.py defaults JAX_PLATFORMS to cpu for the CPU benchmarks);
# --tiny sets cpu before anything imports jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu" if "--tiny" in sys.argv else "")

import common  # noqa: E402  (after JAX_PLATFORMS)
import decode_model  # noqa: E402
from decode_model import decode_floor, matmul_weights, weight_read_bytes  # noqa: E402

PARTS = ("jax_update", "torch_update", "jax_rollout", "torch_generate")

# Device kind (as jax and torch name it) -> bf16 dense FLOP/s, HBM bytes/s, source. The first
# entry whose key is in the device kind wins, so the more specific names come first.
DEVICE_PEAKS = (
    ("H100 PCIe", 756e12, 2.0e12, "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): PCIe, "
                                  "756 TFLOP/s dense BF16 (1,513 with sparsity), 2.0 TB/s"),
    ("H100 NVL", 835e12, 3.9e12, "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): NVL, "
                                 "835 TFLOP/s dense BF16 (1,671 with sparsity), 3.9 TB/s"),
    ("H100", 989e12, 3.35e12, "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): SXM, "
                              "989 TFLOP/s dense BF16 (1,979 with sparsity), 3.35 TB/s HBM3"),
    ("H200", 989e12, 4.8e12, "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): SXM, "
                             "989 TFLOP/s dense BF16 (1,979 with sparsity), 4.8 TB/s HBM3e"),
    ("A100", 312e12, 2.039e12, "NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): "
                               "312 TFLOP/s dense BF16, 2,039 GB/s (80 GB SXM)"),
    ("TPU v5 lite", None, None, "v5e"), ("TPU v6 lite", None, None, "v6e"),
    ("TPU v5", None, None, "v5p"), ("TPU v4", None, None, "v4"),
)

SHAPES = {  # the shapes (qwen2.5-1.5b's: one H100), and seconds on a CPU
    "full": dict(rows=64, prompt=256, completion=512, questions=16, sample_prompt=128, new_tokens=256),
    "tiny": dict(rows=8, prompt=16, completion=16, questions=2, sample_prompt=16, new_tokens=8),
}


# ============================================================================ counts

def update_flops(m, rows: int, prompt: int, completion: int, reference: bool) -> float:
    """Model FLOPs of one update: (6N + 2N for the reference) per token of every row."""
    return (6 + (2 if reference else 0)) * matmul_weights(m) * rows * (prompt + completion)


def device_peaks(kind: str) -> tuple[float | None, float | None, str]:
    """(bf16 FLOP/s, HBM bytes/s, source) of a device kind from DEVICE_PEAKS (TPUs from
    grpo_jax.aot.tpu_specs); (None, None, "") when it is not in the table."""
    for key, flops, bandwidth, source in DEVICE_PEAKS:
        if key in kind:
            if flops is None:
                from grpo_jax.aot.tpu_specs import CHIPS

                chip = CHIPS[source]
                return chip.peak_bf16_flops, chip.hbm_bandwidth, f"grpo_jax/aot/tpu_specs.py ({source}: Cloud TPU docs)"
            return flops, bandwidth, source
    return None, None, ""


# ============================================================================ configuration

def build_config(args):
    """The preset with the run's shape: rl.group_size rows per question, the completion as
    rl.max_new_tokens, the batch as rows / group questions."""
    from grpo_jax import config as C

    cfg = C.get_preset(args.preset)
    if args.overrides:
        cfg = C.apply_overrides(cfg, args.overrides)
    rl = {"max_new_tokens": args.completion, "sample_prompts": 0}  # the update samples nothing
    if args.micro_batches:
        rl["num_micro_batches"] = args.micro_batches
    if args.group:
        rl["group_size"] = args.group
    cfg = cfg.replace(rl=rl)
    g = cfg.rl.group_size
    if args.rows % g or (args.rows // cfg.rl.num_micro_batches) * cfg.rl.num_micro_batches != args.rows:
        raise SystemExit(f"--rows {args.rows} must be a multiple of rl.group_size={g} and of "
                         f"rl.num_micro_batches={cfg.rl.num_micro_batches}")
    return cfg.replace(data={"batch_size": args.rows // g}).validate()


def sampler_config(cfg, args):
    return cfg.replace(rl={"max_new_tokens": args.new_tokens, "sample_prompts": 0, "temperature": 1.0,
                           "top_k": 0, "top_p": 1.0}).validate()


def timed(fn, reps: int) -> tuple[float, list[float]]:
    """(warm-up seconds, each rep's seconds) of ``fn``, which blocks until its work is done."""
    t = time.perf_counter()
    fn()
    warm = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return warm, times


def _jax_device():
    import jax

    d = jax.devices()[0]
    return {"platform": d.platform, "kind": d.device_kind, "count": len(jax.devices()),
            "jax": jax.__version__}


def _jax_peak_memory() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


# ============================================================================ parts: ours

def part_jax_update(args) -> dict:
    import jax
    import numpy as np

    from grpo_jax.rl import batching, programs
    from grpo_jax.parallel import sharding
    from grpo_jax.model import transformer as model_lib
    from grpo_jax.rl import train_step as ts

    cfg = build_config(args)
    m = cfg.model
    mesh = sharding.mesh_from_shape((1, 1, 1))
    step = programs.train_step(cfg, mesh)
    state = ts.init_train_state(cfg, model_lib.init_params(m, jax.random.key(0), mesh), step.tx)
    state = jax.device_put(state, step.state_shardings)
    rng = np.random.default_rng(0)
    rows, tp, tc = args.rows, args.prompt, args.completion
    prompt = rng.integers(3, m.vocab_size, (rows, tp)).astype(np.int32)
    completion = rng.integers(3, m.vocab_size, (rows, tc)).astype(np.int32)
    batch = batching.make_batch(prompt, np.ones((rows, tp), bool), completion, np.ones((rows, tc), bool),
                                rewards=rng.normal(size=rows).astype(np.float32))
    batch = sharding.shard_batch(batch, mesh)
    t = time.perf_counter()
    compiled = step.compiled(state, batch)
    compile_s = time.perf_counter() - t
    box = {}

    def one():
        nonlocal state
        state, metrics = step(state, batch)
        box["metrics"] = jax.block_until_ready(metrics)

    warm, times = timed(one, args.reps)
    loss = float(jax.device_get(box["metrics"])["loss"])
    profile = None
    if args.profile and not args.this_variant:
        import profile_ops

        profile = _profile(one, lambda trace: profile_ops.summarize_program(trace, compiled.as_text()))
    peak, source = _jax_peak_memory(), "device allocator (peak_bytes_in_use)"
    if peak is None:
        peak, source = common.peak_bytes(compiled.memory_analysis()), "compiled program (memory_analysis)"
    return {"side": "ours", "device": _jax_device(), "seconds": common.summarize(times), "first_call_s": warm,
            "compile_s": compile_s, "tokens": int(batch.prompt_tokens.size + batch.tokens.size),
            "rows": rows, "prompt": tp, "completion": tc, "micro_batches": cfg.rl.num_micro_batches,
            "reference": state.ref_params is not None, "loss": loss, "peak_bytes": int(peak),
            "peak_source": source,
            "settings": {k: getattr(m, k) for k in ("dtype", "param_dtype", "remat", "attention", "scan_layers",
                                                    "unembed_dtype") if hasattr(m, k)}
            | {"logprob_chunk_size": cfg.rl.logprob_chunk_size, "beta": cfg.rl.beta}, "profile": profile}


def _profile(one, summarize) -> dict:
    """One more call of ``one`` under jax's profiler, ``summarize(trace)``: the update's kernels
    by part of the model, pass and op (``profile_ops.summarize_program``), the rollout's decode
    by part of its step (``profile_ops.summarize_decode``). Run after the timed reps, so the
    profiler's overhead touches no timing; a profile that fails is reported as {"error": ...}
    beside the timings, which stand."""
    import tempfile

    import profile_ops

    try:
        with tempfile.TemporaryDirectory(prefix="bench_accelerator_trace_") as d:
            trace = profile_ops.trace_of(one, Path(d))
        return summarize(trace)
    except Exception:  # noqa: BLE001 - the part's measurements are taken already
        return {"error": traceback.format_exc()}


def probe(tiny: bool) -> dict:
    """The device's measured bf16 matmul FLOP/s (square, 8192 or 512 with --tiny) and read
    bandwidth (a sum over 2 GiB of bf16, 4 MiB with --tiny), best of 10 after a warm-up."""
    import jax
    import jax.numpy as jnp

    n = 512 if tiny else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    _, times = timed(lambda: f(a, b).block_until_ready(), 10)
    out = {"matmul_n": n, "matmul_bf16_flops_per_s": 2.0 * n ** 3 / min(times)}
    del a, b
    nbytes = 2 ** 22 if tiny else 2 ** 31
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    g = jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32))
    _, times = timed(lambda: g(x).block_until_ready(), 10)
    out.update(read_bytes=nbytes, read_bytes_per_s=nbytes / min(times))
    return out


def part_jax_rollout(args) -> dict:
    import jax
    import numpy as np

    from grpo_jax.model import transformer as model_lib
    from grpo_jax import sampler
    from grpo_jax.parallel import sharding
    from grpo_jax.sampler import cache as sampler_cache

    cfg = sampler_config(build_config(args), args)
    m, rl = cfg.model, cfg.rl
    mesh = sharding.mesh_from_shape((1, 1, 1))
    run_sampler = sampler.Sampler.for_run(cfg, mesh)
    copy = run_sampler.copy(model_lib.init_params(m, jax.random.key(0), mesh))
    engine = run_sampler.engine.name
    q, g, tp = args.questions, rl.group_size, args.sample_prompt
    prompts = np.random.default_rng(1).integers(3, m.vocab_size, (q, tp)).tolist()
    calls = {"n": 0, "generated": {}}

    def run(new_tokens):
        calls["n"] += 1
        r = run_sampler.evaluation(1.0).with_settings(max_new_tokens=new_tokens).generate(
            copy, prompts, key=jax.random.key(calls["n"]), group_size=g)
        calls["generated"][new_tokens] = int(np.asarray(r.mask).sum())

    out = _rollout_times(run, args)
    out.update(side="ours", device=_jax_device(), engine=engine, sample_dtype=rl.sample_dtype,
               kv_dtype=rl.kv_dtype, generated_tokens=calls["generated"][args.new_tokens])
    out["weight_itemsize"] = 2 if rl.sample_dtype == "bfloat16" else 4
    # int8 keeps a float32 scale per slot and kv head (model.quantize_kv).
    out["kv_itemsize"] = (1 + 4 / m.head_dim if rl.kv_dtype == "int8"
                          else np.dtype(sampler_cache.dtype(m, rl.kv_dtype)).itemsize)
    peak = _jax_peak_memory()
    out["peak_bytes"], out["peak_source"] = peak, "device allocator (peak_bytes_in_use)" if peak else "not measured"
    out["profile"] = None
    if args.profile:  # after the timed calls and the peak, as the update's
        import profile_ops

        n = args.new_tokens
        drawn = run_sampler.evaluation(1.0).with_settings(max_new_tokens=n)
        out["profile"] = _profile(lambda: run(n), lambda trace: profile_ops.summarize_decode(
            trace, profile_ops.decode_program_text(drawn, copy, prompts, g, jax.random.key(0)), n - 1))
    out["probe"] = probe(args.tiny)
    return out


def _rollout_times(run, args) -> dict:
    """t(1 new token) and t(N) for ``run(new_tokens)``, interleaved rep by rep after a warm-up
    of each (their compiles)."""
    n = args.new_tokens
    first = {}
    for k in (1, n):
        t = time.perf_counter()
        run(k)
        first[k] = time.perf_counter() - t
    t1, tn = [], []
    for _ in range(args.reps):
        for k, xs in ((1, t1), (n, tn)):
            t = time.perf_counter()
            run(k)
            xs.append(time.perf_counter() - t)
    decode = [b - a for a, b in zip(t1, tn)]
    rows = args.questions * args.group_size_resolved
    return {"rows": rows, "questions": args.questions, "group": args.group_size_resolved,
            "prompt": args.sample_prompt, "new_tokens": n, "first_call_s": first[n],
            "t1": common.summarize(t1), "tn": common.summarize(tn), "decode_seconds": common.summarize(decode),
            "decode_tokens": rows * (n - 1), "decode_tokens_per_s": rows * (n - 1) / statistics.median(decode)}


# ============================================================================ parts: the peer

def hf_model(m, dtype, device):
    """A transformers causal LM of the model's shape, random weights: Qwen2 when q/k/v carry
    biases (Qwen2's only biases), else Llama."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    from transformers.utils import logging

    logging.set_verbosity_error()
    kind = Qwen2Config if m.attention_bias else LlamaConfig
    c = kind(vocab_size=m.vocab_size, hidden_size=m.embed_dim, intermediate_size=m.mlp_dim,
             num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
             head_dim=m.head_dim, rms_norm_eps=m.rms_eps, rope_theta=m.rope_theta,
             tie_word_embeddings=m.tie_embeddings, max_position_embeddings=max(m.max_seq_len, 2048),
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(c, dtype=dtype, attn_implementation="sdpa")
    return model.to(device)


def _torch(args):
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    else:
        torch.cuda.reset_peak_memory_stats()
    info = {"platform": device, "kind": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": common.package_version("transformers")}
    return torch, device, info


def _sync(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def _torch_peak(torch, device) -> tuple[int | None, str]:
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    return None, "not measured"


def part_torch_update(args) -> dict:
    import copy as copylib

    cfg = build_config(args)
    m, rl = cfg.model, cfg.rl
    torch, device, info = _torch(args)
    rows, tp, tc, g = args.rows, args.prompt, args.completion, rl.group_size
    micro = rl.num_micro_batches
    policy = hf_model(m, torch.float32, device)
    policy.config.use_cache = False
    checkpointing = m.remat != "none"
    if checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.train()
    reference = rl.beta > 0
    ref = copylib.deepcopy(policy).eval().requires_grad_(False) if reference else None
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.optimizer.peak_lr, betas=(cfg.optimizer.b1, cfg.optimizer.b2),
                            eps=cfg.optimizer.eps, weight_decay=cfg.optimizer.weight_decay,
                            **({"fused": True} if device == "cuda" else {}))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, m.vocab_size, (rows, tp + tc), generator=gen).to(device)
    rewards = torch.randn(rows // g, g, generator=gen)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(rows).to(device)
    autocast = m.dtype == "bfloat16"
    per = rows // micro
    box = {}

    def logps(model, x):
        logits = model(input_ids=x, logits_to_keep=tc + 1).logits[:, :-1].float()
        return logits.gather(-1, x[:, tp:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    def step():
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                ref_lp = [logps(ref, ids[i * per:(i + 1) * per]) for i in range(micro)] if reference else None
            for i in range(micro):
                lp = logps(policy, ids[i * per:(i + 1) * per])
                ratio = torch.exp(lp - lp.detach())
                a = adv[i * per:(i + 1) * per, None]
                objective = torch.minimum(ratio * a, torch.clamp(ratio, 1 - rl.eps_low, 1 + rl.eps_high) * a)
                if reference:
                    d = ref_lp[i] - lp
                    objective = objective - rl.beta * (torch.exp(d) - d - 1)
                loss = -objective.mean(1).sum() / rows
                loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optimizer.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(torch, device)
        box["loss"] = float(loss.detach())

    warm, times = timed(step, args.reps)
    peak, source = _torch_peak(torch, device)
    return {"side": "HF + torch", "device": info, "seconds": common.summarize(times), "first_call_s": warm,
            "tokens": int(ids.numel()), "rows": rows, "prompt": tp, "completion": tc, "micro_batches": micro,
            "reference": reference, "loss": box["loss"], "peak_bytes": peak, "peak_source": source,
            "settings": {"autocast_bf16": autocast, "gradient_checkpointing": checkpointing,
                         "attn_implementation": "sdpa"}}


def part_torch_generate(args) -> dict:
    cfg = sampler_config(build_config(args), args)
    m, rl = cfg.model, cfg.rl
    torch, device, info = _torch(args)
    dtype = torch.bfloat16 if rl.sample_dtype == "bfloat16" else torch.float32
    model = hf_model(m, dtype, device).eval()
    q, g, tp = args.questions, rl.group_size, args.sample_prompt
    prompts = torch.randint(3, m.vocab_size, (q, tp), generator=torch.Generator().manual_seed(1))
    ids = prompts.repeat_interleave(g, dim=0).to(device)
    generated = {}
    kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}

    def run(k):
        with torch.inference_mode():
            o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                               use_cache=True, pad_token_id=0, eos_token_id=2, **kwargs)
        _sync(torch, device)
        generated[k] = int((o.shape[1] - tp) * o.shape[0])

    try:
        run(1)
    except (ValueError, TypeError):  # a transformers that refuses top_k=0: keep its default
        kwargs.pop("top_k")
    out = _rollout_times(run, args)
    peak, source = _torch_peak(torch, device)
    out.update(side="HF + torch", device=info, generated_tokens=generated[args.new_tokens],
               sampling_kwargs=dict(kwargs), weight_itemsize=2 if dtype == torch.bfloat16 else 4,
               kv_itemsize=2 if dtype == torch.bfloat16 else 4, peak_bytes=peak, peak_source=source)
    return out


PART_FUNCTIONS = {"jax_update": part_jax_update, "torch_update": part_torch_update,
                  "jax_rollout": part_jax_rollout, "torch_generate": part_torch_generate}


# ============================================================================ the run

def child_env(part: str, tiny: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if part.startswith("jax") and not tiny:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")  # alone on the device in its process
    if part.startswith("torch"):
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def with_variant(args, variant: str):
    """``args`` with a variant's overrides after the run's own."""
    return argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *variant.split()], "this_variant": variant})


def run_part(part: str, args, argv: list[str], deadline: float, variant: str = "") -> dict:
    """{"status": "ok", "result": ...} or {"status": "error" | "killed (time)" | "skipped", ...};
    ``variant``: overrides added to the run's for this part."""
    started = time.time()
    if deadline - started < 5:
        return {"status": "skipped", "reason": f"--budget spent ({args.budget:.0f} s)"}
    if args.in_process:
        try:
            result = PART_FUNCTIONS[part](with_variant(args, variant))
            return {"status": "ok", "result": result, "seconds": time.time() - started}
        except Exception:  # noqa: BLE001 - a part's failure is a result of the run
            return {"status": "error", "error": traceback.format_exc(), "seconds": time.time() - started}
    out = Path(args.work) / f"{part}{abs(hash(variant)) if variant else ''}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", part, "--child-out", str(out),
           "--child-variant", variant]
    try:
        proc = subprocess.run(cmd, env=child_env(part, args.tiny), timeout=deadline - started)
    except subprocess.TimeoutExpired:
        return {"status": "killed (time)", "seconds": time.time() - started}
    if out.exists():
        return json.loads(out.read_text()) | {"seconds": time.time() - started}
    return {"status": "error", "error": f"child exited {proc.returncode} without a result",
            "seconds": time.time() - started}


def peaks(args, parts: dict) -> dict:
    """The peak FLOP/s and HBM bandwidth the MFU and the floor are taken against, with their source."""
    device = next((p["result"]["device"] for p in parts.values()
                   if p.get("status") == "ok" and p["result"]["side"] == "ours"), None)
    kind = device["kind"] if device else ""
    flops, bandwidth, source = device_peaks(kind)
    probe_ = next((p["result"]["probe"] for p in parts.values() if p.get("status") == "ok" and "probe" in p["result"]), {})
    if flops is None and device and device["platform"] == "cpu":
        m = common.matmul_peak_flops(512 if args.tiny else 2048, reps=3 if args.tiny else 7)
        s = common.stream_bandwidth(2 ** 24 if args.tiny else 512 * 2 ** 20, reps=3 if args.tiny else 7)
        flops, bandwidth = m["flops_per_s_best"], s["bytes_per_s_best"]
        source = (f"measured in this run on {common.machine_info()['cpu']}: float32 matmul "
                  f"{m['n']}^3, best rep; a jitted sum over {s['bytes'] / 2 ** 20:.0f} MiB")
    out = {"device_kind": kind, "peak_flops": flops, "hbm_bandwidth": bandwidth, "source": source,
           "measured_probe": probe_}
    if args.peak_flops:
        out["peak_flops"], out["source"] = args.peak_flops, f"--peak-flops {args.peak_flops:g}"
    if args.hbm_bandwidth:
        out["hbm_bandwidth"] = args.hbm_bandwidth
        out["source"] += f"; --hbm-bandwidth {args.hbm_bandwidth:g}"
    return out


def derive(args, parts: dict, pk: dict) -> None:
    """Adds tokens/s, MFU and the decode's floor ratios to every part's result, in place."""
    for name, p in parts.items():
        if p.get("status") != "ok":
            continue
        r = p["result"]
        m = build_config(with_variant(args, r.get("variant", ""))).model
        if "update" in name:
            r["flops"] = update_flops(m, r["rows"], r["prompt"], r["completion"], r["reference"])
            r["tokens_per_s"] = r["tokens"] / r["seconds"]["median"]
            r["mfu"] = r["flops"] / r["seconds"]["median"] / pk["peak_flops"] if pk["peak_flops"] else None
        else:
            floor = decode_floor(m, questions=r["questions"], group=r["group"], prompt=r["prompt"],
                                 new_tokens=r["new_tokens"], weight_bytes=weight_read_bytes(m, r["weight_itemsize"]),
                                 kv_itemsize=r["kv_itemsize"], hbm_bandwidth=pk["hbm_bandwidth"] or float("nan"))
            r["floor"] = floor
            for kind in ("per_row", "shared_prompt"):
                r[f"of_{kind}_floor"] = (r["decode_tokens_per_s"] / floor[kind]["tokens_per_s"]
                                         if pk["hbm_bandwidth"] else None)
            phases = build_config(args).rl.decode_phases
            engine = r["engine"] if r["side"] == "ours" else "generate"
            step = decode_model.decode_step(m, engine, questions=r["questions"], group=r["group"], prompt=r["prompt"],
                                            new_tokens=r["new_tokens"], phases=phases,
                                            weight_itemsize=r["weight_itemsize"], kv_itemsize=r["kv_itemsize"])
            r["modelled_step"], r["of_modelled_step"] = step, None
            if pk["hbm_bandwidth"] and pk["peak_flops"]:
                seconds = decode_model.step_seconds(step, hbm_bandwidth=pk["hbm_bandwidth"],
                                                    peak_flops=pk["peak_flops"])
                r["of_modelled_step"] = r["decode_tokens_per_s"] / (step["rows"] / seconds)


def ratios(parts: dict) -> dict:
    ok = lambda n: parts.get(n, {}).get("status") == "ok"
    out = {}
    for name in parts:
        if name.startswith("jax_update") and ok(name) and ok("torch_update"):
            key = "update_peer_seconds_over_ours" + name[len("jax_update"):].replace(" ", ", ", 1)
            out[key] = (parts["torch_update"]["result"]["seconds"]["median"]
                        / parts[name]["result"]["seconds"]["median"])
    if ok("jax_rollout") and ok("torch_generate"):
        out["decode_ours_over_peer"] = (parts["jax_rollout"]["result"]["decode_tokens_per_s"]
                                        / parts["torch_generate"]["result"]["decode_tokens_per_s"])
    return out


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def table_rows(report: dict) -> list[list[str]]:
    """The printed table, from the report's own numbers (the JSON and the table agree)."""
    rows = []
    for name, p in report["parts"].items():
        work = "update" if "update" in name else "decode"
        side = "ours" if name.startswith("jax") else "HF + torch"
        if name.startswith("jax_update "):
            side = f"ours, {name.split(' ', 1)[1]}"
        if p.get("status") != "ok":
            rows.append([work, side, p.get("status", "?"), "", "", "", "", ""])
            continue
        r = p["result"]
        if work == "update":
            s = r["seconds"]
            rows.append([work, side, f"{common.fmt(s['median'])} ({common.fmt(s['min'])}–{common.fmt(s['max'])})",
                         f"{r['tokens']:,}", common.fmt(r["tokens_per_s"]), pct(r["mfu"]), "",
                         common.fmt_bytes(r["peak_bytes"])])
        else:
            s = r["decode_seconds"]
            rows.append([work, side, f"{common.fmt(s['median'])} ({common.fmt(s['min'])}–{common.fmt(s['max'])})",
                         f"{r['decode_tokens']:,}", common.fmt(r["decode_tokens_per_s"]), "",
                         f"{common.fmt(r['of_shared_prompt_floor'])} / {common.fmt(r['of_per_row_floor'])}"
                         if r["of_shared_prompt_floor"] is not None else "–",
                         common.fmt_bytes(r["peak_bytes"])])
    return rows


TABLE_HEADERS = ["work", "side", "seconds: median (min–max)", "tokens", "tok/s", "MFU (8N)",
                 "of the HBM floor: shared-prompt / per-row", "peak memory"]


def parse_args(argv):
    from grpo_jax.config import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("overrides", nargs="*", help="config overrides, section.field=value")
    ap.add_argument("--preset", default=None, help=f"config preset (default qwen2.5-1.5b; --tiny: cpu-tiny); "
                                                   f"one of {', '.join(PRESETS)}")
    ap.add_argument("--tiny", action="store_true", help="cpu-tiny's shape and tiny batches, on CPU: seconds")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    for name, what in (("rows", "update rows (questions x rl.group_size)"), ("prompt", "update prompt tokens"),
                       ("completion", "update completion tokens"), ("questions", "rollout questions"),
                       ("sample-prompt", "rollout prompt tokens"), ("new-tokens", "rollout new tokens")):
        ap.add_argument(f"--{name}", type=int, default=None,
                        help=f"{what} (default {SHAPES['full'][name.replace('-', '_')]}, "
                             f"--tiny {SHAPES['tiny'][name.replace('-', '_')]})")
    ap.add_argument("--group", type=int, default=0, help="rl.group_size (default: the preset's)")
    ap.add_argument("--micro-batches", type=int, default=0, help="rl.num_micro_batches (default: the preset's)")
    ap.add_argument("--variant", action="append", default=[],
                    help="also run our update with these overrides added (space-separated; repeatable), "
                         "e.g. --variant 'model.unembed_dtype=bfloat16': one more table row each")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more call of our update (not the variants') and print where its kernel "
                         "time goes: by part of the model, by pass (forward, remat's recomputation, backward), "
                         "by op (profile_ops.summarize_program); and one more rollout, its decode split by part "
                         "of the step (profile_ops.summarize_decode)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per part after the warm-up (3; --tiny 2)")
    ap.add_argument("--peak-flops", type=float, default=0.0, help="MFU's peak FLOP/s (default: DEVICE_PEAKS)")
    ap.add_argument("--hbm-bandwidth", type=float, default=0.0, help="the floor's bytes/s (default: DEVICE_PEAKS)")
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds: no part starts past it and a child still running then is killed (default 540)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads on CPU")
    ap.add_argument("--in-process", action="store_true", help="run every part in this process (tests)")
    ap.add_argument("--json", default="", help="write the report here")
    ap.add_argument("--work", default="", help="folder for the children's results (default: beside --json, or /tmp)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--child-variant", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = SHAPES["tiny" if args.tiny else "full"]
    for k, v in shape.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.preset = args.preset or ("cpu-tiny" if args.tiny else "qwen2.5-1.5b")
    args.reps = args.reps or (2 if args.tiny else 3)
    bad = [p for p in args.parts.split(",") if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; choose from {', '.join(PARTS)}")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (the decode is t(N) - t(1))")
    args.group_size_resolved = build_config(args).rl.group_size
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        try:
            record = {"status": "ok", "result": PART_FUNCTIONS[args.child](with_variant(args, args.child_variant))}
        except Exception:  # noqa: BLE001
            record = {"status": "error", "error": traceback.format_exc()}
            print(record["error"], file=sys.stderr)
        Path(args.child_out).write_text(json.dumps(record, default=common.jsonable))
        return 0
    args.work = args.work or str(Path(args.json).resolve().parent if args.json else Path("/tmp"))
    Path(args.work).mkdir(parents=True, exist_ok=True)
    started = time.time()
    deadline = started + args.budget
    parts = {}
    todo = [(p, p, "") for p in args.parts.split(",")]
    todo += [(f"jax_update {v}", "jax_update", v) for v in args.variant]
    for name, part, variant in todo:
        print(f"[{name}] ...", flush=True)
        parts[name] = p = run_part(part, args, argv, deadline, variant)
        if variant and p["status"] == "ok":
            p["result"]["variant"] = variant
        print(f"[{name}] {p['status']}" + (f" in {p['seconds']:.0f} s" if "seconds" in p else "")
              + (f"\n{p['error']}" if "error" in p else ""), flush=True)
    pk = peaks(args, parts)
    derive(args, parts, pk)
    cfg = build_config(args)
    report = {"benchmark": "bench_accelerator", "argv": argv, "preset": args.preset,
              "overrides": args.overrides, "machine": common.machine_info(), "peaks": pk,
              "model": {"matmul_weights": matmul_weights(cfg.model), **{k: getattr(cfg.model, k) for k in (
                  "num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size",
                  "dtype", "remat")}},
              "parts": parts, "ratios": ratios(parts), "seconds": time.time() - started}
    headline = f"{args.preset}{' ' + ' '.join(args.overrides) if args.overrides else ''} on {pk['device_kind'] or '?'}"
    print(f"\n{headline}; peak {pk['peak_flops'] or 0:.4g} FLOP/s, HBM {pk['hbm_bandwidth'] or 0:.4g} B/s "
          f"({pk['source'] or 'no peak known: pass --peak-flops / --hbm-bandwidth'})\n")
    print(common.markdown_table(TABLE_HEADERS, table_rows(report)))
    for k, v in report["ratios"].items():
        print(f"{k}: {v:.2f}x")
    for name in ("jax_rollout", "torch_generate"):
        r = parts.get(name, {}).get("result", {})
        if r.get("of_modelled_step") is not None:
            print(f"{name}: {r['of_modelled_step']:.2f} of its modelled step's tok/s "
                  f"(decode_model.py, {r['modelled_step']['engine']})")
    for part, what, tables in (("jax_update", "update's kernel time", "summary_tables"),
                               ("jax_rollout", "decode's time", "decode_tables")):
        p = parts.get(part, {})
        profile = p["result"].get("profile") if p.get("status") == "ok" else None
        if profile:
            import profile_ops

            print(f"\nwhere our {what} goes (one more call under jax's profiler):\n")
            print(profile["error"] if "error" in profile else "\n".join(getattr(profile_ops, tables)(profile)))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=common.jsonable))
        print(f"wrote {args.json}")
    return 0 if all(p["status"] == "ok" for p in parts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
