"""Evaluate a pretrained model on a benchmark: greedy top-1, Pass@K and Maj@K with 95% intervals.

    grpo-evaluate --model smollm2-135m --task gsm8k_synth --limit 50
    grpo-evaluate --model /ckpt/deepseek-math-7b-rl --task gsm8k \\
        --manual-dir /data/gsm8k --k 64 --temperature 0.7 --max-new-tokens 1024

(`grpo-evaluate` is installed with the package; `python experiments/evaluate.py` is the same.)

--model: a GGUF file, an HF folder (config.json + safetensors), a converted folder, or
"smollm2-135m". --task: gsm8k, math, arithmetic, countdown, gsm8k_synth, or a user's task as
"module:Class". For gsm8k and math the default prompt is the DeepSeekMath chain-of-thought
format (the task's `paper_prompt`) in the model's chat template; other tasks use their own.

Writes <out>/shard-*.jsonl (one line per question: prompt, completions, extracted answers,
correctness), <out>/settings.json and <out>/summary.json. A killed evaluation continues
where it stopped when rerun with the same arguments. Multi-host (or --shard i/n by hand):
each process scores its shard of questions on its own devices; process 0 merges
(--merge-only merges shards written by separate runs).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax

from grpo_jax import cli, distributed, evaluate_run, pretrained
from grpo_jax.config import MeshConfig
from grpo_jax.errors import ConfigError, PretrainedError
from grpo_jax.sharding import make_mesh
from grpo_jax.tasks import get_task, register_task
from grpo_jax.tasks.dataset_task import DatasetTask

PAPER_TASKS = ("gsm8k", "math", "gsm8k_synth")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF file, HF folder, converted folder or smollm2-135m")
    p.add_argument("--task", required=True, help="gsm8k, math, arithmetic, countdown, gsm8k_synth or module:Class")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=-1, help="first N questions of the split (-1: all)")
    p.add_argument("--k", type=int, default=1, help="samples per question (Pass@K / Maj@K for K <= k; 0: greedy only)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--prompt", choices=evaluate_run.PROMPT_STYLES, default=None,
                   help="paper: the DeepSeekMath CoT format (default for gsm8k/math); task: the task's prompt")
    p.add_argument("--chunk-rows", type=int, default=0,
                   help="sampled rows per sampler call (default 8 per local device, at least --k)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="TFDS data dir (gsm8k/math)")
    p.add_argument("--manual-dir", default=None, help="folder with the official GSM8K/MATH files")
    p.add_argument("--out", default="", help="output folder (default runs/eval/<model>-<task>-<split>)")
    p.add_argument("--shard", default="", help="i/n: score only shard i of n (default: this process of all)")
    p.add_argument("--merge-only", action="store_true", help="merge the shards in --out and print the summary")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_shard(text: str) -> tuple[int, int]:
    if not text:
        return jax.process_index(), jax.process_count()
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard expects i/n (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise ConfigError(f"--shard {text}: need 0 <= i < n")
    return i, n


def make_task(args):
    kwargs = {}
    if args.task in ("gsm8k", "math"):
        kwargs = {"data_dir": args.data_dir, "manual_dir": args.manual_dir}
    name = args.task
    if ":" in name:
        register_task(name, name)
    return get_task(name, **kwargs)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    distributed.initialize()
    out = args.out or os.path.join("runs", "eval", "-".join(
        os.path.basename(os.path.normpath(x)) for x in (args.model, args.task.replace(":", "."), args.split)))
    if not args.merge_only:
        shard, num_shards = parse_shard(args.shard)
        task = make_task(args)
        if args.limit < 0 and not isinstance(task, DatasetTask):
            raise ConfigError(f"--task {args.task} generates its questions, so there is no 'all' of "
                              "them: give --limit N")
        examples = task.examples(args.split, args.limit, args.seed)
        # Each host samples its own questions on its own devices: no collective across hosts.
        mesh = make_mesh(MeshConfig(), jax.local_devices())
        t0 = time.perf_counter()
        cfg, params, tokenizer = pretrained.load(args.model, mesh=mesh)
        if tokenizer is None:
            raise PretrainedError(f"--model {args.model}: no tokenizer found next to the weights")
        load_s = time.perf_counter() - t0
        settings = evaluate_run.EvalSettings(
            num_samples=args.k, temperature=args.temperature, top_p=args.top_p,
            max_new_tokens=args.max_new_tokens, seed=args.seed,
            chunk_rows=args.chunk_rows or max(args.k, 8 * jax.local_device_count()),
            prompt=args.prompt or ("paper" if args.task in PAPER_TASKS else "task"))
        meta = {"model": args.model, "task": args.task, "split": args.split, "limit": args.limit}
        times = evaluate_run.evaluate_shard(cfg, params, tokenizer, task, examples, out, settings,
                                            shard=shard, num_shards=num_shards, mesh=mesh, meta=meta,
                                            progress=not args.no_progress)
        print(f"shard {shard}/{num_shards}: {times['questions']} questions; load {load_s:.1f}s, "
              f"sample {times['sample']:.1f}s, score {times['score']:.1f}s", file=sys.stderr)
        distributed.barrier("evaluate")
        if args.shard or not distributed.is_main_process():
            return {}
        timing = {"load": load_s, "sample": times["sample"], "score": times["score"]}
    else:
        timing = None
    summary = evaluate_run.merge_and_summarize(out, timing=timing)
    print(evaluate_run.format_summary(summary))
    print(f"wrote {os.path.join(out, 'summary.json')}")
    return summary


def console_main() -> None:
    """The `grpo-evaluate` entry point: library errors as one line, exit 2 (grpo_jax.cli)."""
    cli.run(main, prog="grpo-evaluate")
