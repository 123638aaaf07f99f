"""The paper's Figure 5 at CPU scale: RFT vs Online RFT vs GRPO+OS vs GRPO+PS.

All four start from the same SFT model and see the same questions in the same order:
  RFT         offline samples of π_sft, gradient coefficient 1 on correct outputs
  Online RFT  the same rule, samples from the current policy
  GRPO+OS     group-relative advantages of the outcome reward
  GRPO+PS     process supervision: per-step rewards normalised over the group, summed to go
The default regime (docs/figure5_design.md, written before the runs): 7-step chains
(`data.num_operands=8`) on which the SFT model rarely completes a correct chain, so offline
samples stay scarce and most outcome-reward groups have zero variance. Held-out greedy
accuracy is evaluated every `run.eval_every` steps; each curve is the mean over `--seeds`
seeds with its 95% t-interval, and each claim is judged on the paired difference of final
accuracies (same seed = same questions).

    python experiments/ablation_supervision.py --seeds 0 1 2
    python experiments/ablation_supervision.py data.num_operands=3 rl.max_new_tokens=32   # the old, easy regime
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
from grpo_jax.sampler import Sampler
from grpo_jax.stats import format_interval, paired_verdict

# The regime of docs/figure5_design.md; command-line overrides still win.
HARD_REGIME = ["data.num_operands=8", "rl.max_new_tokens=64", "model.max_seq_len=96"]

# The paper's claims as (better, worse) pairs of methods.
CLAIMS = {"(a) online beats offline": ("Online RFT", "RFT"),
          "(b) process beats outcome": ("GRPO+PS", "GRPO+OS")}

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
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}", "run.eval_every=10"] + HARD_REGIME)
    root = cfg.run.run_dir
    task = common.make_task("arithmetic", cfg.data)
    tok, cfg = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    params, mesh = common.sft_start(cfg, task, tok, root, args)
    eval_examples, shortcuts = common.held_out(task, cfg, "ablation")
    start = evaluate(Sampler.for_run(cfg, mesh, tok), params, task, tok, eval_examples,
                     key=jax.random.key(1))["accuracy"]
    steps = [0] + list(range(cfg.run.eval_every, cfg.run.steps + 1, cfg.run.eval_every))
    curves, rewards = {}, {}
    for name in args.methods:
        curves[name], rewards[name] = [], []
        for seed in args.seeds:
            print(f"[ablation] {name} seed {seed}")
            history, _ = common.run_rl(cfg, task, tok, params, mesh, root, _slug(name),
                                       METHODS[name], seed=seed, eval_examples=eval_examples,
                                       progress=not args.no_progress)
            curves[name].append([start] + common.curve(history, "eval_accuracy", steps[1:]))
            rewards[name].append([h["reward_mean"] for h in history])
            common.write_json(os.path.join(root, _slug(name), f"seed{seed}.json"),
                              {"method": name, "seed": seed, "steps": steps, "eval_accuracy": curves[name][-1],
                               "history": history})
    finals = {name: [r[-1] for r in runs] for name, runs in curves.items()}
    common.write_json(os.path.join(root, "curves.json"),
                      {"steps": steps, "eval_accuracy": curves, "train_reward": rewards,
                       "seeds": args.seeds, "claims": claim_verdicts(finals),
                       "shortcuts": shortcuts.to_dict(), "config": cfg.to_dict()})
    png = plot_runs(curves, steps, os.path.join(root, "figure5.png"), ylabel="held-out greedy accuracy",
                    title=f"Figure 5 at CPU scale, {cfg.data.num_operands - 1}-step chains\n"
                          f"(mean and 95% interval over {len(args.seeds)} seeds)")
    for name, final in finals.items():
        print(f"[ablation] {name:11s} accuracy {start:.3f} → {format_interval(final)} "
              f"(seeds: {', '.join(f'{x:.3f}' for x in final)})")
    for claim, verdict in claim_verdicts(finals).items():
        print(f"[ablation] {claim}: {verdict}")
    print(f"[ablation] wrote {png}")


def _slug(name: str) -> str:
    return name.replace(" ", "_").replace("+", "_")


def claim_verdicts(finals: dict[str, list[float]]) -> dict[str, str]:
    """Each claim judged on the paired difference of final accuracies over seeds: reproduces
    when its 95% t-interval is above 0, contradicts when below, else not resolved."""
    out = {}
    for claim, (better, worse) in CLAIMS.items():
        if better not in finals or worse not in finals:
            continue
        gaps = [a - b for a, b in zip(finals[better], finals[worse])]
        verdict = paired_verdict(gaps)[3]
        out[claim] = f"{better} − {worse} = {format_interval(gaps)}: {verdict}"
    return out


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
