"""Export a training run's policy as an HF folder that transformers, vLLM or our own loader read.

    grpo-export runs/my_run --out exported/my_run            # the latest checkpoint
    grpo-export runs/my_run --out exported/step-200 --step 200

(`grpo-export` is installed with the package; `python experiments/export.py` is the same.)

The run dir is what every training script writes (grpo_jax.checkpoints.run_files): config.json,
tokenizer.model and checkpoints/. A LoRA run's checkpoints hold adapters only: they are
merged into the run's base (its run.pretrained model, or its random init) as
W + (α/r)·A·B, after the base is checked against the fingerprint the checkpoint recorded
(another base is refused in one line). The folder holds config.json, float32 safetensors,
the tokenizer as transformers reads it, encoding as the run did (BOS, the dummy-prefix "▁",
special ids) with the chat template the run's prompts were written in (tokenizer.json +
tokenizer_config.json; a run that trained its own sentencepiece model also keeps its
tokenizer.model, which grpo-evaluate reads) and grpo_jax_export.json (run, step, LoRA base, the
run's task and data section). `grpo-evaluate --model <out>` evaluates the export on the run's
task and held-out questions unless told otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import jax

from grpo_jax import cli
from grpo_jax.parallel import distributed
from grpo_jax.model import pretrained
from grpo_jax.checkpoints import run_files
from grpo_jax.cli import runs
from grpo_jax.text.bpe_tokenizer import BPETokenizer
from grpo_jax.config import MeshConfig
from grpo_jax.errors import CheckpointError, ConfigError
from grpo_jax.parallel.sharding import make_mesh

PROVENANCE_FILE = pretrained.EXPORT_RECORD
# Files whose presence means `--out` already holds an exported model.
_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo-export", description=__doc__.split("\n", 1)[0],
                                formatter_class=cli.HelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("run_dir", help="a training run dir (config.json + checkpoints/)")
    p.add_argument("--out", required=True, help="folder to write the HF model into")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the latest)")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="split the safetensors into files of at most this size (default 5)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    return p


def main(argv=None) -> dict:
    """Write the export; returns its provenance record."""
    args = build_parser().parse_args(argv)
    distributed.initialize()
    cfg = runs.run_config(args.run_dir)
    if cfg is None:
        raise ConfigError(f"{args.run_dir} is not a training run dir (no {run_files.CONFIG_FILE})")
    out = Path(args.out)
    taken = [f for f in _MODEL_FILES if (out / f).exists()]
    if taken and not args.overwrite:
        raise ConfigError(f"--out {out} already holds a model ({', '.join(taken)}); "
                          "pass --overwrite to replace it, or choose another folder")
    if args.max_shard_gb <= 0:
        raise ConfigError(f"--max-shard-gb must be > 0, got {args.max_shard_gb}")
    mesh = make_mesh(MeshConfig(), jax.local_devices())
    # The task only trains a tokenizer when the run has none; open_run refuses that case.
    run = runs.open_run(cfg, None, mesh)
    step = run.steps[-1] if args.step is None else args.step
    if step not in run.steps:
        raise CheckpointError(f"{args.run_dir} has no checkpoint step {step}; saved steps: {run.steps}")
    params = run.params(step, mesh)
    run.close()
    cfg, tokenizer, pointer = run.cfg, run.tokenizer, run.pointer
    pretrained.export_hf(out, cfg.model, params, tokenizer, max_shard_bytes=int(args.max_shard_gb * 1e9))
    # A gs:// run dir is already absolute (os.path.abspath would glue it to the cwd).
    source = args.run_dir if "://" in args.run_dir else os.path.abspath(args.run_dir)
    record = {"run_dir": source, "step": step,
              "tokenizer": "bpe" if isinstance(tokenizer, BPETokenizer) else "sentencepiece",
              "max_new_tokens": cfg.rl.max_new_tokens,
              # grpo-evaluate --model <out> evaluates the run's task and held-out set by default.
              "task": run_files.read_task(args.run_dir, cfg), "data": dataclasses.asdict(cfg.data),
              "lora": None if pointer is None else {"rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha,
                                                    "targets": cfg.model.lora_targets, "base": pointer}}
    if distributed.is_main_process():
        (out / PROVENANCE_FILE).write_text(json.dumps(record, indent=2))
        merged = "" if pointer is None else f", LoRA adapters merged into {pointer['path'] or 'its random init'}"
        print(f"exported step {step} of {args.run_dir}{merged} to {out}")
    return record


def console_main() -> None:
    """The `grpo-export` entry point: library errors as one line, exit 2 (grpo_jax.cli)."""
    cli.run(main, prog="grpo-export")
