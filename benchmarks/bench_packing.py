"""Packed vs padded train step (``rl.pack``): one GRPO update on SmolLM2-135M shapes, with
completions shorter than their bucket, as a real rollout's are.

    python benchmarks/bench_packing.py [--rows 32] [--prompt-len 64] [--completion-len 256] [--fill 1.0] [--reps 3]

The batch: R rows, prompts of U(prompt_len / 2, prompt_len) tokens left-padded to prompt_len,
completions of U(completion_len / 8, fill x completion_len) tokens right-padded to completion_len
(seeded; random weights of the `smollm2-135m` preset's shape, float32, `model.remat=none`,
4 micro-batches). Both steps run the same update (tests/model/test_packing.py checks they give the
same loss and gradient); packed, the forward passes run over the packed rows
(`packing.rows_per_block`) instead of R. Timed interleaved after a warm-up rep that
compiles; medians with the spread. The table names the CPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import common  # sets JAX_PLATFORMS=cpu and OMP_WAIT_POLICY before jax loads

import jax
import numpy as np


def make_batch(rows: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0, fill: float = 1.0):
    from grpo_jax.rl.batching import make_batch as make

    rng = np.random.default_rng(seed)
    n = rng.integers(prompt_len // 2, prompt_len + 1, rows)
    lengths = rng.integers(max(1, completion_len // 8), int(fill * completion_len) + 1, rows)
    pmask = np.arange(prompt_len)[None] >= (prompt_len - n)[:, None]
    cmask = np.arange(completion_len)[None] < lengths[:, None]
    return make(np.where(pmask, rng.integers(1, vocab, (rows, prompt_len)), 0), pmask,
                np.where(cmask, rng.integers(1, vocab, (rows, completion_len)), 0), cmask,
                rewards=rng.normal(size=rows).astype(np.float32))


def main() -> None:
    ap = common.base_parser(__doc__)
    ap.add_argument("--rows", type=int, default=32, help="sequences per update (default 32)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt bucket (default 64)")
    ap.add_argument("--completion-len", type=int, default=256, help="completion bucket (default 256)")
    ap.add_argument("--fill", type=float, default=1.0,
                    help="longest completion as a share of the bucket (default 1.0)")
    args = ap.parse_args()
    reps = common.reps_of(args, full=3, quick=1)
    if args.quick:
        args.rows, args.completion_len = 8, 64

    from grpo_jax.model import transformer as model, packing
    from grpo_jax.rl import optimizer
    from grpo_jax.parallel import sharding
    from grpo_jax.rl import train_step as ts
    from grpo_jax.config import apply_overrides, smollm2_135m

    base = apply_overrides(smollm2_135m(), ["model.remat=none", "rl.group_size=4", "rl.num_micro_batches=4",
                                            f"rl.max_new_tokens={args.completion_len}"])
    batch = make_batch(args.rows, args.prompt_len, args.completion_len, base.model.vocab_size, fill=args.fill)
    params = model.init_params(base.model, jax.random.key(0))
    mesh = sharding.mesh_from_shape((1, 1, 1))
    runners, info = {}, {}
    for name, pack in (("padded", False), ("packed", True)):
        cfg = base.replace(rl={"pack": pack})
        tx, _ = optimizer.make_optimizer(cfg.optimizer, 1000)
        step = ts.make_train_step(cfg, tx, mesh)
        state = {"s": ts.init_train_state(cfg, jax.tree.map(np.array, params), tx)}
        placed = sharding.shard_batch(batch, mesh) if not pack else step.packed(batch)

        def run(step=step, state=state, placed=placed) -> float:
            start = time.perf_counter()
            state["s"], metrics = step(state["s"], placed)
            jax.block_until_ready(metrics)
            return time.perf_counter() - start

        runners[name] = run
        forward_rows = args.rows if not pack else packing.rows_per_block(batch, 4, 1, 1) * 4
        info[name] = forward_rows
    stats = common.interleaved(runners, reps)
    real = int(np.asarray(batch.mask).sum() + np.asarray(batch.prompt_mask).sum())
    width = args.prompt_len + args.completion_len
    machine = common.machine_info()
    print(f"{machine['cpu']}, {args.rows} rows x ({args.prompt_len} + {args.completion_len}) positions, "
          f"completions up to {args.fill:g} of the bucket, {real} real tokens ({real / (args.rows * width):.0%} "
          f"of the padded positions), {reps} reps")
    rows = [(name, info[name], f"{info[name] * width / real:.2f}", common.spread(stats[name]),
             f"{stats['padded']['median'] / stats[name]['median']:.2f}x") for name in runners]
    print(common.markdown_table(["step", "forward rows", "positions / real tokens", "seconds (median, spread)",
                                 "speed-up"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(common.jsonable(
            {"machine": machine, "args": vars(args), "forward_rows": info, "seconds": stats}), indent=1))


if __name__ == "__main__":
    main()
