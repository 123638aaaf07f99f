#!/usr/bin/env python3
"""The train step's collectives for a TPU slice, compiled ahead of time on this CPU.

    python benchmarks/train_step_collectives.py --slice v5p-128 --preset deepseekmath-rl-7b \\
        data.batch_size=64 rl.num_micro_batches=16 [--hlo-out FILE | --hlo FILE]

Compiles only the train step (``aot.compile_train_step``; no sampler, no cost twins) and
prints, per collective kind, the instructions and their result bytes once per loop body
(as ``aot.collectives`` counts them) and executed per step (times the trips of the loops
around each, ``aot.collective_ops``), the largest instructions with their shapes and
loops, and the per-chip memory. ``--hlo FILE`` reads a saved optimized HLO instead of
compiling (the memory is then not known); ``--hlo-out FILE`` saves the compiled one.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for TPU; run nothing on it

from grpo_jax import aot  # noqa: E402  (after JAX_PLATFORMS)
from grpo_jax.rl import programs
from grpo_jax.config import add_config_args, config_from_args  # noqa: E402


def table(ops: list[dict]) -> list[str]:
    """Markdown rows: kind, instructions, bytes per loop body, bytes per step."""
    rows = ["| kind | instructions | MB (once per loop body) | GB per step (x loop trips) |",
            "|---|---:|---:|---:|"]
    for kind in sorted({op["kind"] for op in ops}):
        mine = [op for op in ops if op["kind"] == kind]
        once = sum(op["bytes"] for op in mine)
        per_step = sum(op["bytes"] * math.prod(op["loops"]) for op in mine)
        rows.append(f"| {kind} | {len(mine)} | {once / 1e6:,.0f} | {per_step / 1e9:,.1f} |")
    return rows


def largest(ops: list[dict], n: int) -> list[str]:
    ranked = sorted(ops, key=lambda op: op["bytes"] * math.prod(op["loops"]), reverse=True)[:n]
    return [f"{op['kind']:15s} {', '.join(op['shapes'])[:70]:70s} loops {op['loops']}: "
            f"{op['bytes'] / 1e6:,.0f} MB x {math.prod(op['loops'])}" for op in ranked]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slice", default="v5p-128")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--hlo", help="read this optimized HLO text instead of compiling")
    parser.add_argument("--hlo-out", help="save the compiled program's optimized HLO text here")
    parser.add_argument("--top", type=int, default=12, help="largest instructions to list")
    add_config_args(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if args.hlo:
        text = Path(args.hlo).read_text()
    else:
        mesh, _ = aot.topology_mesh(cfg, args.slice)
        rows = cfg.data.batch_size * programs.group_size(cfg)
        compiled, secs = aot.compile_train_step(cfg, mesh, rows, args.prompt_len)
        text = compiled.as_text()
        print(f"mesh {dict(mesh.shape)}, {rows} rows, {cfg.rl.num_micro_batches} micro-batches, "
              f"compiled in {secs:.0f} s")
        print({k: f"{v / 1e9:.2f} GB" for k, v in aot.memory(compiled).items()})
        if args.hlo_out:
            Path(args.hlo_out).write_text(text)
    ops = aot.collective_ops(text)
    print("\n".join(table(ops)))
    print("\n".join(largest(ops, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
