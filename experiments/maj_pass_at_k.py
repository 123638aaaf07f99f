"""The paper's Figure 7 at CPU scale: Maj@K and Pass@K for K = 1…64 before and after GRPO.

The paper's reading: RL improves Maj@K but not Pass@K — it makes the output distribution
more robust (sharper around answers the model could already reach) rather than teaching
fundamentally new abilities. This script measures both from `--samples` samples per
held-out question at temperature `rl.temperature`, with the unbiased Pass@K estimator.

    python experiments/maj_pass_at_k.py --samples 64
"""

from __future__ import annotations

import argparse
import os

import common
import jax

from grpo_jax import config as config_lib
from grpo_jax.plots import plot_runs
from grpo_jax.stats import format_interval
from grpo_jax.evaluation import evaluate
from grpo_jax.sampler import Sampler


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--samples", type=int, default=64, help="samples per question (largest K)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="GRPO seeds")
    p.add_argument("--out", default="runs/maj_pass_at_k", help="output directory")
    args = p.parse_args(argv)
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}", "data.eval_size=64"])
    root = cfg.run.run_dir
    task = common.make_task("arithmetic", cfg.data)
    tok, cfg = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    params, mesh = common.sft_start(cfg, task, tok, root, args)
    eval_examples, shortcuts = common.held_out(task, cfg, "figure7")
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= args.samples]

    def measure(pr):
        return evaluate(Sampler.for_run(cfg, mesh, tok), pr, task, tok, eval_examples, key=jax.random.key(7),
                        num_samples=args.samples, temperature=cfg.rl.temperature, ks=ks)

    before = measure(params)
    after = []
    for seed in args.seeds:
        _, trainer = common.run_rl(cfg, task, tok, params, mesh, root, "grpo", ["rl.algorithm=grpo"],
                                   seed=seed, eval_examples=eval_examples, progress=not args.no_progress)
        after.append(measure(trainer.params))
    result = {"ks": ks, "before": before, "after": after, "seeds": args.seeds, "shortcuts": shortcuts.to_dict(),
              "config": cfg.to_dict()}
    common.write_json(os.path.join(root, "curves.json"), result)
    curves = {
        "Maj@K before RL": [[before[f"maj@{k}"] for k in ks]],
        "Maj@K after GRPO": [[a[f"maj@{k}"] for k in ks] for a in after],
        "Pass@K before RL": [[before[f"pass@{k}"] for k in ks]],
        "Pass@K after GRPO": [[a[f"pass@{k}"] for k in ks] for a in after],
    }
    png = plot_runs(curves, ks, os.path.join(root, "figure7.png"), ylabel="accuracy", xlabel="K",
                    logx=True, title="Maj@K and Pass@K before/after GRPO (arithmetic)")
    for k in ks:  # after GRPO: mean and 95% t-interval over the seeds
        a_maj = format_interval([a[f"maj@{k}"] for a in after])
        a_pass = format_interval([a[f"pass@{k}"] for a in after])
        print(f"K={k:2d}  Maj@K {before[f'maj@{k}']:.3f} → {a_maj}   Pass@K {before[f'pass@{k}']:.3f} → {a_pass}")
    print(f"[maj/pass] wrote {png}")


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
