"""CPU quickstart: the whole loop end to end in minutes (what `make demo` runs).

On the testbed (`--task modular`, the default; grpo_jax/tasks/modular.py): chains of 6
operands modulo 13 with 2 subtractions, whose 512 held-out questions no shortcut rule
answers more than 10% of the time.

1. generate the task and train a sentencepiece tokenizer on it;
2. SFT the tiny model on worked solutions that read each "-" as "+" 60% of the time, until
   its greedy step lines are right table lookups 95% of the time (at most --sft-steps): an
   imperfect start that knows the tables, often gets the signs wrong, and is sometimes right;
3. evaluate greedy accuracy on the held-out questions, beside the best shortcut's score;
4. run GRPO (outcome supervision) from the SFT model;
5. evaluate again, save a checkpoint, write summary.json (with the best shortcut and whether
   the final accuracy clears it by 10 points) and a PNG of reward/accuracy.

`--task arithmetic` runs the earlier quickstart (1-digit, 3-operand carrying arithmetic, whose
best shortcut is 0.75: docs/studies/arithmetic_history/results.md).

    python experiments/quickstart.py                          # defaults (see experiments/common.py)
    python experiments/quickstart.py --seeds 0 1 2 3 4        # docs/studies/testbed/results.md, the seeds
    python experiments/quickstart.py --task arithmetic --sft-steps 800 rl.group_size=8

Each seed (`run.seed`: the model's initialisation, SFT and GRPO randomness; the questions stay
those of `data.seed`) runs in `<run.run_dir>/seed<N>`; with several seeds, `summary.json` in
`run.run_dir` holds them all and the gain's 95% t-interval, and `seeds.png` their curves.
`python experiments/evaluate.py --model runs/quickstart/seed0/grpo` evaluates the GRPO
checkpoint on the run's own held-out questions (the run dir says how: grpo_jax.checkpoints.run_files).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import common
import jax

from grpo_jax import config as config_lib
from grpo_jax.eval.evaluation import evaluate
from grpo_jax.sampler import Sampler
from grpo_jax.tasks.shortcuts import LEARNING_MARGIN, clears, shortcut_baselines
from grpo_jax.eval.plots import plot_history, plot_runs
from grpo_jax.eval.stats import format_interval
from grpo_jax.rl.trainer import Trainer


# On top of common.CPU_DEFAULTS, per --task. Arithmetic: a solution of the SFT corpus drops all
# its carries or none (`carry_habit`): with per-step slips a right 2-digit intermediate is rarely
# followed by a right next step in the corpus, so once GRPO teaches the first carry the SFT model
# cannot do the step after it, and whether a seed learns it was a matter of luck
# (docs/studies/testbed/results.md, Quickstart).
# Modular: 60 GRPO steps, the pilot's choice (docs/studies/testbed/design.md).
QUICKSTART_DEFAULTS = {"modular": common.MODULAR_DEFAULTS + ["run.steps=60", "run.eval_every=20",
                                                             "run.checkpoint_every=60"],
                       "arithmetic": ["data.slip=carry_habit"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed values, one run each (default 0)")
    p.add_argument("--task", choices=sorted(QUICKSTART_DEFAULTS), default="modular",
                   help="the testbed (modular, default) or the earlier carrying arithmetic")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    common.resolve_sft_args(args, args.task)
    base = common.load_cfg(args, ["run.run_dir=runs/quickstart"] + QUICKSTART_DEFAULTS[args.task])
    runs = [run_seed(args, config_lib.apply_overrides(base, [
        f"run.seed={seed}", f"run.run_dir={os.path.join(base.run.run_dir, f'seed{seed}')}"]).validate())
        for seed in args.seeds]
    if len(runs) == 1:
        return runs[0]
    gains = [r["accuracy_after"] - r["accuracy_before"] for r in runs]
    bar = runs[0]["shortcuts"]["best_score"]
    learned = clears([r["accuracy_after"] for r in runs], bar)
    summary = {"seeds": args.seeds, "gain": gains, "best_shortcut": bar,
               "clears_best_shortcut_every_seed": learned, "runs": runs}
    common.write_json(os.path.join(base.run.run_dir, "summary.json"), summary)
    # One line per seed, not a mean: the demo's claim is about every seed.
    steps = [h["step"] for h in runs[0]["eval_history"]]
    png = plot_runs({f"seed {r['seed']}": [[h["accuracy"] for h in r["eval_history"]]] for r in runs}, steps,
                    os.path.join(base.run.run_dir, "seeds.png"), ylabel="held-out greedy accuracy",
                    title=f"GRPO after SFT, {len(runs)} seeds: gain {format_interval(gains, digits=2)}")
    print(f"[quickstart] gain in held-out greedy accuracy over seeds {args.seeds}: "
          f"{format_interval(gains)}; per seed {', '.join(f'{g:+.3f}' for g in gains)}; plot {png}")
    margins = [r["accuracy_after"] - r["shortcuts"]["best_score"] for r in runs]
    print(f"[quickstart] final accuracy − best shortcut per seed: {', '.join(f'{m:+.3f}' for m in margins)} "
          f"(learning claimed where >= +{LEARNING_MARGIN:.3f} in every seed: {'yes' if learned else 'no'})")
    return summary


def run_seed(args, cfg) -> dict:
    """SFT, evaluate, GRPO, evaluate for one seed; writes its summary.json and curves.png."""
    t_start = time.perf_counter()
    root = cfg.run.run_dir
    task = common.make_task(cfg.data.task, cfg.data)
    tokenizer, cfg = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    eval_examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    shortcuts = shortcut_baselines(task, eval_examples)
    print(f"[quickstart] tokenizer: {tokenizer.vocab_size} pieces; eval set: {len(eval_examples)} held-out questions, "
          f"{shortcuts.line()}")

    sft_params, mesh = common.sft_start(cfg, task, tokenizer, root, args)
    before = evaluate(Sampler.for_run(cfg, mesh, tokenizer), sft_params, task, tokenizer, eval_examples,
                      key=jax.random.key(1))
    sft = common.sft_report(root)
    sft_steps = sft["steps"] if sft else args.sft_steps
    if sft and not sft["reached"]:
        print(f"[quickstart] warning: SFT stopped at its cap of {sft['cap']} steps before its step lines were "
              f"right lookups {sft['until']:.0%} of the time: RL starts from a policy that has not learned the task's "
              "tables")
    print(f"[quickstart] after SFT ({sft_steps} steps): held-out greedy accuracy {before['accuracy']:.3f}")

    cfg = common.rl_config(cfg, root, "grpo", ["rl.algorithm=grpo"])
    grpo = Trainer(cfg, task=task, tokenizer=tokenizer, params=sft_params, mesh=mesh,
                   eval_examples=eval_examples, progress=not args.no_progress)
    history = common.train_and_close(grpo)
    after = evaluate(Sampler.for_run(cfg, mesh, tokenizer), grpo.params, task, tokenizer, eval_examples,
                     key=jax.random.key(1))

    summary = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "shortcuts": shortcuts.to_dict(),
        "best_shortcut": shortcuts.best[1],
        "clears_best_shortcut": clears([after["accuracy"]], shortcuts.best[1]),
        "task": task.name,
        "seed": cfg.run.seed,
        "eval_history": [{"step": 0, "accuracy": before["accuracy"]}] + [
            {"step": h["step"], "accuracy": h["eval_accuracy"]} for h in history if "eval_accuracy" in h],
        "steps": cfg.run.steps,
        "sft_steps": sft_steps,
        "sft_until": sft,
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "run_dir": os.path.abspath(root),
        "checkpoint_dir": os.path.abspath(os.path.join(cfg.run.run_dir, "checkpoints")),
        "config": cfg.to_dict(),
    }
    common.write_json(os.path.join(root, "summary.json"), summary)
    png = plot_history([{"step": 0, "eval_accuracy": before["accuracy"]}] + history,
                       ["reward_mean", "eval_accuracy", "kl"], os.path.join(root, "curves.png"),
                       title=f"GRPO on {task.name}: held-out greedy accuracy {before['accuracy']:.2f} → "
                             f"{after['accuracy']:.2f} (best shortcut {shortcuts.best[1]:.2f})")
    print(f"[quickstart] seed {cfg.run.seed}: held-out accuracy {before['accuracy']:.3f} → {after['accuracy']:.3f} "
          f"(best shortcut {shortcuts.best[1]:.3f}; cleared by {100 * LEARNING_MARGIN:.0f} points: "
          f"{'yes' if summary['clears_best_shortcut'] else 'no'}) in {summary['wall_time_s']:.0f} s")
    print(f"[quickstart] summary:    {os.path.join(root, 'summary.json')}\n[quickstart] plot:       {png}\n"
          f"[quickstart] checkpoint: {summary['checkpoint_dir']}")
    return summary


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
