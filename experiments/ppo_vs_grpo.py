"""PPO vs GRPO at CPU scale: reward curves and peak memory of the train step, side by side.

PPO trains a value model V_ψ (a copy of the policy trunk with a scalar head) with GAE
advantages; GRPO replaces it with the group baseline. The paper's argument for GRPO is
that the value model costs as much memory and compute as the policy; the peak bytes here
come from XLA's compiled memory analysis of each train step (arguments + temporaries; the
donated state aliases the outputs), at the same model size and batch.

    python experiments/ppo_vs_grpo.py --seeds 0 1
"""

from __future__ import annotations

import argparse
import os

import common
import jax

from grpo_jax import config as config_lib
from grpo_jax.eval.plots import plot_runs
from grpo_jax.eval.stats import format_interval
from grpo_jax.parallel.sharding import shard_batch

METHODS = {
    "GRPO": ["rl.algorithm=grpo"],
    "GRPO β=0": ["rl.algorithm=grpo", "rl.beta=0"],
    "PPO": ["rl.algorithm=ppo", "rl.lam=0.95", "rl.gamma=1.0"],
}


def peak_bytes(trainer) -> dict:
    batch, _ = trainer.make_batch(0, jax.random.key(0))
    mem = trainer.step_fn.compiled(trainer.state, shard_batch(batch, trainer.mesh)).memory_analysis()
    return {"argument_bytes": int(mem.argument_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
            "peak_bytes": int(mem.argument_size_in_bytes + mem.temp_size_in_bytes)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--out", default="runs/ppo_vs_grpo", help="output directory")
    args = p.parse_args(argv)
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}"])
    root = cfg.run.run_dir
    task = common.make_task("arithmetic", cfg.data)
    tok, cfg = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    params, mesh = common.sft_start(cfg, task, tok, root, args)
    eval_examples, shortcuts = common.held_out(task, cfg, "ppo_vs_grpo")
    rewards, memory, step_time = {}, {}, {}
    for name in args.methods:
        rewards[name] = []
        for seed in args.seeds:
            print(f"[ppo_vs_grpo] {name} seed {seed}")
            history, trainer = common.run_rl(cfg, task, tok, params, mesh, root, name.replace(" ", "_").replace("=", ""),
                                             METHODS[name], seed=seed, eval_examples=eval_examples,
                                             progress=not args.no_progress)
            rewards[name].append([h["reward_mean"] for h in history])
            step_time.setdefault(name, []).extend(h["update_time_s"] for h in history[1:])
        memory[name] = peak_bytes(trainer)
    steps = list(range(1, cfg.run.steps + 1))
    common.write_json(os.path.join(root, "curves.json"),
                      {"steps": steps, "train_reward": rewards, "memory": memory,
                       "median_update_time_s": {k: sorted(v)[len(v) // 2] for k, v in step_time.items()},
                       "seeds": args.seeds, "shortcuts": shortcuts.to_dict(), "config": cfg.to_dict()})
    png = plot_runs(rewards, steps, os.path.join(root, "ppo_vs_grpo.png"), ylabel="training reward (10-step moving average)",
                    title="PPO vs GRPO (arithmetic)",
                    bars={k: v["peak_bytes"] / 2**20 for k, v in memory.items()},
                    bar_label="train-step peak MiB (compiled)", smooth=10)
    print("| method | peak bytes (compiled) | vs PPO | median update s |\n|---|---|---|---|")
    for name in args.methods:
        ratio = memory[name]["peak_bytes"] / memory["PPO"]["peak_bytes"] if "PPO" in memory else float("nan")
        med = sorted(step_time[name])[len(step_time[name]) // 2]
        print(f"| {name} | {memory[name]['peak_bytes']:,} | {ratio:.2f} | {med:.2f} |")
    for name in args.methods:  # final 10-step mean training reward, 95% t-interval over seeds
        print(f"[ppo_vs_grpo] {name}: final reward {format_interval([sum(r[-10:]) / len(r[-10:]) for r in rewards[name]])}")
    print(f"[ppo_vs_grpo] wrote {png}")


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
