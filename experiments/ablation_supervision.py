"""The paper's Figure 5 at CPU scale: RFT vs Online RFT vs GRPO+OS vs GRPO+PS.

All four start from the same SFT model and see the same questions in the same order:
  RFT         offline samples of π_sft, gradient coefficient 1 on correct outputs
  Online RFT  the same rule, samples from the current policy
  GRPO+OS     group-relative advantages of the outcome reward
  GRPO+PS     process supervision: per-step rewards normalised over the group, summed to go
Held-out greedy accuracy is evaluated every `run.eval_every` steps; each curve is the mean
over `--seeds` seeds with a min–max band.

    python experiments/ablation_supervision.py --seeds 0 1 2
    python experiments/ablation_supervision.py --preset deepseekmath-rl-7b ...   # TPU scale
"""

from __future__ import annotations

import argparse
import os

import common
import jax

from grpo_jax import config as config_lib
from grpo_jax.plots import plot_runs
from grpo_jax.evaluation import evaluate

METHODS = {
    "RFT": ["rl.algorithm=rft"],
    "Online RFT": ["rl.algorithm=online_rft"],
    "GRPO+OS": ["rl.algorithm=grpo", "rl.supervision=outcome"],
    "GRPO+PS": ["rl.algorithm=grpo", "rl.supervision=process"],
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds (default 0 1 2)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--out", default="runs/ablation_supervision", help="output directory")
    args = p.parse_args(argv)
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}", "run.eval_every=10"])
    root = cfg.run.run_dir
    task = common.make_task(cfg)
    tok = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    params, mesh = common.sft_start(cfg, task, tok, root, args)
    eval_examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    start = evaluate(cfg, params, task, tok, eval_examples, key=jax.random.key(1), mesh=mesh)["accuracy"]
    steps = [0] + list(range(cfg.run.eval_every, cfg.run.steps + 1, cfg.run.eval_every))
    curves, rewards = {}, {}
    for name in args.methods:
        curves[name], rewards[name] = [], []
        for seed in args.seeds:
            print(f"[ablation] {name} seed {seed}")
            history, _ = common.run_rl(cfg, task, tok, params, mesh, root, name.replace(" ", "_").replace("+", "_"),
                                       METHODS[name], seed=seed, eval_examples=eval_examples,
                                       progress=not args.no_progress)
            curves[name].append([start] + common.curve(history, "eval_accuracy", steps[1:]))
            rewards[name].append([h["reward_mean"] for h in history])
    common.write_json(os.path.join(root, "curves.json"),
                      {"steps": steps, "eval_accuracy": curves, "train_reward": rewards,
                       "seeds": args.seeds, "config": cfg.to_dict()})
    png = plot_runs(curves, steps, os.path.join(root, "figure5.png"), ylabel="held-out greedy accuracy",
                    title="RFT vs Online RFT vs GRPO+OS vs GRPO+PS (arithmetic)")
    for name, runs in curves.items():
        final = [r[-1] for r in runs]
        print(f"[ablation] {name:11s} accuracy {start:.3f} → {sum(final) / len(final):.3f} "
              f"(seeds: {', '.join(f'{x:.3f}' for x in final)})")
    print(f"[ablation] wrote {png}")


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
