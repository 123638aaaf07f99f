#!/usr/bin/env python3
"""The log-prob error of bf16 operands for the unembedding (``model.unembed_dtype=bfloat16``),
measured on real rows: completions SmolLM2-135M-Instruct samples for chat arithmetic.

    python benchmarks/logprob_precision.py                       # 32 questions x 4, 96 new tokens
    python benchmarks/logprob_precision.py --questions 8 --json out.json

SmolLM2-135M-Instruct (imported from its GGUF, ``grpo_jax.model.pretrained``), chat-arithmetic
questions in its chat template (``grpo_jax.tasks.chat_arithmetic``, as experiments/smollm2_grpo.py
asks them), completions sampled by the model itself at T = 1 up to its stop token. Every
completion token's log-prob is then scored by the trainer's path (``logprobs.sequence_logprobs``
on the float32 weights) twice, the unembedding with float32 operands and with bf16 operands
summed in float32, under each compute dtype of ``--dtypes`` (float32, this preset's; bfloat16,
the accelerator presets'). Over the real completion tokens it reports Δ = log π_bf16 − log π_f32:
max and mean |Δ|, its 99.9th percentile, and the ratio error it implies, |exp(Δ) − 1| (ρ's
error were π_θ and π_θold scored one each way), against the clipping range ε = 0.2; and per
sequence, |exp(mean_t Δ) − 1| (GSPO's sequence ratio).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import common  # noqa: F401  (JAX_PLATFORMS before jax)

import jax
import jax.numpy as jnp
import numpy as np


def sample_rows(cfg, params, tok, questions: int, group: int, new_tokens: int, seed: int):
    """(rollout, examples): ``questions`` chat-arithmetic questions x ``group`` completions
    sampled at T = 1 from float32 weights, up to the tokenizer's stop tokens."""
    from grpo_jax.tasks import prompts
    from grpo_jax import sampler
    from grpo_jax.tasks.chat_arithmetic import ChatArithmeticTask
    from grpo_jax.text.tokenizer import encode_prompt

    examples = ChatArithmeticTask().examples("train", questions, seed)
    ids = [encode_prompt(tok, prompts.chat_prompt(prompts.question_of(ex), tok, "arithmetic")) for ex in examples]
    settings = sampler.SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_tokens=tok.stop_ids,
                                      pad_id=tok.pad_id)
    rollout = sampler.sample_to_host(cfg, params, ids, settings, key=jax.random.key(seed), group_size=group)
    return rollout, examples


def score(cfg, params, rollout, rows_per_call: int = 32) -> np.ndarray:
    """log π of every completion token ([rows, Tc], 0 off the mask), ``rows_per_call`` rows a call."""
    from grpo_jax.model import logprobs

    fn = jax.jit(lambda p, b: logprobs.sequence_logprobs(cfg, p, b, temperature=1.0, chunk_size=64))
    rows = rollout.tokens.shape[0]
    parts = [np.asarray(fn(params, jax.tree.map(lambda x: x[i:i + rows_per_call], rollout)))
             for i in range(0, rows, rows_per_call)]
    return np.concatenate(parts)


def errors(f32: np.ndarray, bf16: np.ndarray, mask: np.ndarray, eps: float) -> dict:
    """The statistics of the module docstring over the real tokens."""
    delta = (bf16 - f32)[mask]
    ratio = np.abs(np.expm1(delta))
    per_seq = np.where(mask, bf16 - f32, 0.0).sum(1) / np.maximum(mask.sum(1), 1)
    seq_ratio = np.abs(np.expm1(per_seq[mask.any(1)]))
    return {"tokens": int(mask.sum()), "max_abs": float(np.abs(delta).max()), "mean_abs": float(np.abs(delta).mean()),
            "p999_abs": float(np.quantile(np.abs(delta), 0.999)), "mean": float(delta.mean()),
            "max_ratio_error": float(ratio.max()), "max_ratio_error_over_eps": float(ratio.max() / eps),
            "max_sequence_ratio_error": float(seq_ratio.max()),
            "mean_logp": float(f32[mask].mean())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--questions", type=int, default=32, help="chat-arithmetic questions (default 32)")
    ap.add_argument("--group", type=int, default=4, help="completions per question (default 4)")
    ap.add_argument("--new-tokens", type=int, default=96, help="most new tokens per completion (default 96)")
    ap.add_argument("--seed", type=int, default=0, help="questions and sampling seed")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="model.dtype values to score under")
    ap.add_argument("--eps", type=float, default=0.2, help="the clipping range the ratio error is set against")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)

    machine = common.machine_info()
    start = time.time()
    cfg, params, tok = common.smollm2()
    rollout, _ = sample_rows(cfg, params, tok, args.questions, args.group, args.new_tokens, args.seed)
    mask = np.asarray(rollout.mask, bool)
    print(f"SmolLM2-135M-Instruct on {machine['cpu']}: {mask.shape[0]} completions sampled, "
          f"{int(mask.sum())} tokens (mean length {mask.sum(1).mean():.1f}, "
          f"{int(np.asarray(rollout.finished).sum())} ended by the stop token)", flush=True)
    results = {}
    for dtype in args.dtypes.split(","):
        base = dataclasses.replace(cfg, dtype=dtype)
        f32 = score(base, params, rollout)
        bf16 = score(dataclasses.replace(base, unembed_dtype="bfloat16"), params, rollout)
        results[dtype] = errors(f32, bf16, mask, args.eps)
    rows = [[d, f"{r['tokens']:,}", f"{r['max_abs']:.2e}", f"{r['mean_abs']:.2e}", f"{r['p999_abs']:.2e}",
             f"{r['mean']:+.1e}", f"{r['max_ratio_error']:.2e} ({r['max_ratio_error_over_eps']:.1%} of ε)",
             f"{r['max_sequence_ratio_error']:.2e}"] for d, r in results.items()]
    print(common.markdown_table(["model.dtype", "tokens", r"max \|Δ log π\|", r"mean \|Δ\|", r"99.9th pct \|Δ\|",
                                 "mean Δ", rf"max \|ρ − 1\| (ε = {args.eps})", r"max \|seq. ratio − 1\|"], rows))
    out = {"benchmark": "logprob_precision", "args": vars(args), "machine": machine, "results": results,
           "completions": int(mask.shape[0]), "seconds": time.time() - start}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=common.jsonable))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
