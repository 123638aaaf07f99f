"""CPU quickstart: the whole loop end to end in minutes (what `make demo` runs).

1. generate the synthetic multi-step arithmetic task and train a sentencepiece tokenizer on it;
2. SFT the tiny model on worked solutions with deliberately wrong steps (an imperfect start);
3. evaluate greedy accuracy on held-out questions;
4. run GRPO (outcome supervision) from the SFT model;
5. evaluate again, save a checkpoint, write summary.json and a PNG of reward/accuracy.

    python experiments/quickstart.py                       # defaults (cpu-tiny preset)
    python experiments/quickstart.py rl.group_size=16 run.steps=40 --sft-steps 300
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from grpo_jax import config as config_lib  # noqa: E402
from grpo_jax.model import init_params  # noqa: E402
from grpo_jax.plots import plot_history  # noqa: E402
from grpo_jax.tasks import get_task  # noqa: E402
from grpo_jax.tokenizer import train_sentencepiece  # noqa: E402
from grpo_jax.trainer import Trainer, evaluate  # noqa: E402

QUICKSTART_DEFAULTS = [
    "run.run_dir=runs/quickstart", "run.steps=60", "run.eval_every=20", "run.checkpoint_every=60",
    "rl.group_size=8", "rl.max_new_tokens=48", "rl.beta=0.04", "rl.temperature=1.0",
    "data.batch_size=8", "data.eval_size=128", "data.num_operands=3", "data.max_digits=2",
    "optimizer.peak_lr=3e-4", "optimizer.warmup_steps=5", "optimizer.schedule=constant",
    "model.embed_dim=128", "model.num_layers=2", "model.mlp_dim=384", "model.max_seq_len=96",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    p.add_argument("--sft-steps", type=int, default=400, help="SFT steps before RL (default 400)")
    p.add_argument("--sft-lr", type=float, default=2e-3, help="SFT peak learning rate")
    p.add_argument("--sft-batch", type=int, default=32, help="SFT sequences per step")
    p.add_argument("--tokenizer-vocab", type=int, default=64, help="sentencepiece vocabulary size")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t_start = time.perf_counter()
    cfg = config_lib.apply_overrides(config_lib.get_preset(args.preset), QUICKSTART_DEFAULTS + args.overrides)
    run_dir = cfg.run.run_dir
    os.makedirs(run_dir, exist_ok=True)

    # 1. task + tokenizer
    task = get_task("arithmetic", num_operands=cfg.data.num_operands, max_digits=cfg.data.max_digits)
    tokenizer = train_sentencepiece(task.text_corpus(2000, seed=cfg.data.seed), vocab_size=args.tokenizer_vocab)
    tokenizer.save(os.path.join(run_dir, "tokenizer.model"))
    cfg.model.vocab_size = tokenizer.vocab_size
    cfg.validate()
    eval_examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    print(f"[quickstart] tokenizer: {tokenizer.vocab_size} pieces; eval set: {len(eval_examples)} held-out questions")

    # 2. SFT to an imperfect start
    sft_cfg = copy.deepcopy(cfg)
    sft_cfg.rl.algorithm = "sft"
    sft_cfg.run.run_dir = os.path.join(run_dir, "sft")
    sft_cfg.run.steps = args.sft_steps
    sft_cfg.run.eval_every = 0
    sft_cfg.run.checkpoint_every = args.sft_steps
    sft_cfg.optimizer.peak_lr = args.sft_lr
    sft_cfg.optimizer.schedule = "multistep"
    sft_cfg.optimizer.warmup_steps = 20
    sft_cfg.data.batch_size = args.sft_batch
    sft_cfg.validate()
    pairs = task.sft_examples("train", args.sft_steps * args.sft_batch, cfg.data.seed,
                              wrong_step_prob=cfg.data.wrong_step_prob)

    def sft_data(step):
        chunk = pairs[step * args.sft_batch:(step + 1) * args.sft_batch]
        return [ex.prompt for ex, _ in chunk], [sol for _, sol in chunk]

    params = init_params(cfg.model, jax.random.key(cfg.run.seed))
    sft = Trainer(sft_cfg, task=task, tokenizer=tokenizer, params=params, sft_data=sft_data,
                  eval_examples=eval_examples, progress=not args.no_progress)
    sft.train()
    sft_params = sft.params
    before = evaluate(cfg, sft_params, task, tokenizer, eval_examples, key=jax.random.key(1))
    print(f"[quickstart] after SFT: held-out greedy accuracy {before['accuracy']:.3f}")

    # 3. GRPO from the SFT model
    cfg.rl.algorithm = "grpo"
    cfg.run.run_dir = os.path.join(run_dir, "grpo")
    grpo = Trainer(cfg, task=task, tokenizer=tokenizer, params=sft_params, mesh=sft.mesh,
                   eval_examples=eval_examples, progress=not args.no_progress)
    history = grpo.train()
    after = evaluate(cfg, grpo.params, task, tokenizer, eval_examples, key=jax.random.key(1))
    grpo.close()
    sft.close()

    summary = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "steps": cfg.run.steps,
        "sft_steps": args.sft_steps,
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "run_dir": os.path.abspath(run_dir),
        "checkpoint_dir": os.path.abspath(os.path.join(cfg.run.run_dir, "checkpoints")),
        "config": cfg.to_dict(),
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    png = plot_history([{"step": 0, "eval_accuracy": before["accuracy"]}] + history,
                       ["reward_mean", "eval_accuracy", "kl"], os.path.join(run_dir, "curves.png"),
                       title=f"GRPO on arithmetic: greedy accuracy {before['accuracy']:.2f} → {after['accuracy']:.2f}")
    print(f"[quickstart] held-out accuracy {before['accuracy']:.3f} → {after['accuracy']:.3f} "
          f"in {summary['wall_time_s']:.0f} s")
    print(f"[quickstart] summary: {os.path.join(run_dir, 'summary.json')}\n[quickstart] plot:    {png}\n"
          f"[quickstart] checkpoint: {summary['checkpoint_dir']}")
    return summary


if __name__ == "__main__":
    main()
