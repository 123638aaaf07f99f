"""CPU quickstart: the whole loop end to end in minutes (what `make demo` runs).

1. generate the synthetic multi-step arithmetic task and train a sentencepiece tokenizer on it;
2. SFT the tiny model on worked solutions that often drop a carry (an imperfect start whose
   greedy answers are wrong on carrying questions while its samples are often right);
3. evaluate greedy accuracy on held-out questions;
4. run GRPO (outcome supervision) from the SFT model;
5. evaluate again, save a checkpoint, write summary.json and a PNG of reward/accuracy.

    python experiments/quickstart.py                          # defaults (see experiments/common.py)
    python experiments/quickstart.py --sft-steps 800 rl.group_size=8 run.steps=200
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import common
import jax

from grpo_jax import config as config_lib
from grpo_jax.plots import plot_history
from grpo_jax.evaluation import evaluate
from grpo_jax.trainer import Trainer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    t_start = time.perf_counter()
    cfg = common.load_cfg(args, ["run.run_dir=runs/quickstart"])
    root = cfg.run.run_dir
    task = common.make_task(cfg)
    tokenizer = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    eval_examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    print(f"[quickstart] tokenizer: {tokenizer.vocab_size} pieces; eval set: {len(eval_examples)} held-out questions")

    sft_params, mesh = common.sft_start(cfg, task, tokenizer, root, args)
    before = evaluate(cfg, sft_params, task, tokenizer, eval_examples, key=jax.random.key(1), mesh=mesh)
    print(f"[quickstart] after SFT ({args.sft_steps} steps): held-out greedy accuracy {before['accuracy']:.3f}")

    cfg = common.rl_config(cfg, root, "grpo", ["rl.algorithm=grpo"])
    grpo = Trainer(cfg, task=task, tokenizer=tokenizer, params=sft_params, mesh=mesh,
                   eval_examples=eval_examples, progress=not args.no_progress)
    history = grpo.train()
    after = evaluate(cfg, grpo.params, task, tokenizer, eval_examples, key=jax.random.key(1), mesh=mesh)
    grpo.close()

    summary = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "steps": cfg.run.steps,
        "sft_steps": args.sft_steps,
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "run_dir": os.path.abspath(root),
        "checkpoint_dir": os.path.abspath(os.path.join(cfg.run.run_dir, "checkpoints")),
        "config": cfg.to_dict(),
    }
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    png = plot_history([{"step": 0, "eval_accuracy": before["accuracy"]}] + history,
                       ["reward_mean", "eval_accuracy", "kl"], os.path.join(root, "curves.png"),
                       title=f"GRPO on arithmetic: held-out greedy accuracy {before['accuracy']:.2f} → {after['accuracy']:.2f}")
    print(f"[quickstart] held-out accuracy {before['accuracy']:.3f} → {after['accuracy']:.3f} "
          f"in {summary['wall_time_s']:.0f} s")
    print(f"[quickstart] summary:    {os.path.join(root, 'summary.json')}\n[quickstart] plot:       {png}\n"
          f"[quickstart] checkpoint: {summary['checkpoint_dir']}")
    return summary


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
