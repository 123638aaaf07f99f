"""Do stale rollouts cost learning? GRPO with `rl.async_steps` = k against k = 0 on the testbed.

The design, written before the runs: docs/studies/async_staleness/design.md. Every arm starts from the
same SFT model (cached in `<out>/sft`, as every CPU ablation trains it) and runs the same
number of updates on the same question stream per seed; only k differs: with k > 0 the batch
trained at step t was sampled by the weights of step t − k, and the loss takes the sampler's
log-probs as π_old, so the ratio and its clip correct the staleness.

    python experiments/async_staleness.py --sft-until 0.95 --sft-steps 4000 --seeds 0 1 2 \\
        --out runs/async_staleness
    python experiments/async_staleness.py run.steps=2 --seeds 0 --out runs/async_smoke   # smoke

Resumable: each (k, seed) writes `<out>/k<k>/seed<N>.json` when done and is read, not rerun;
an unfinished one resumes from its last checkpoint (every 10 steps). Seeds run in order (every
k's seed 0 first), so a study cut short holds paired seeds. Writes `<out>/summary.json` (every
seed's final accuracy, the paired gaps k − 0 with their verdicts, the staleness and the ratio's
spread each arm trained with) and `<out>/async_staleness.png`.
"""

from __future__ import annotations

import argparse
import os

# The arms: rl.async_steps of each. 0 is today's on-policy loop.
STALENESS = (0, 1, 2)
# "Costs nothing": the paired gap's whole 95% interval within +-EQUIVALENCE (docs/studies/async_staleness/design.md).
EQUIVALENCE = 0.05
# The study's run lengths on top of the testbed's regime (experiments/common.py).
RUN = ["run.steps=60", "run.eval_every=10", "run.checkpoint_every=10", "rl.algorithm=grpo",
       "rl.supervision=outcome"]


def verdict_on_cost(low: float, high: float, margin: float = EQUIVALENCE) -> str:
    """The design's reading of a paired gap's 95% interval [low, high] (stale − on-policy):
    'costs' when it lies below 0, 'costs nothing' when it lies within ±margin, else 'not resolved'."""
    if high < 0:
        return "costs"
    if -margin <= low and high <= margin:
        return "costs nothing"
    return "not resolved"


def seed_json(root: str, k: int, seed: int) -> str:
    return os.path.join(root, f"k{k}", f"seed{seed}.json")


def mean_of(history, key: str) -> float | None:
    values = [h[key] for h in history if key in h]
    return sum(values) / len(values) if values else None


def main(argv=None):
    import common  # experiments/common.py (imports jax: only once a run starts)

    from grpo_jax import config as config_lib
    from grpo_jax.eval.plots import plot_runs
    from grpo_jax.tasks.shortcuts import clears
    from grpo_jax.eval.stats import format_interval, t_interval

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of every arm (default 0 1 2)")
    p.add_argument("--staleness", type=int, nargs="+", default=list(STALENESS),
                   help="the arms' rl.async_steps (default 0 1 2; 0 must be among them: it is the control)")
    p.add_argument("--out", default="runs/async_staleness", help="output directory")
    args = p.parse_intermixed_args(argv)  # overrides go before --seeds, which takes a list
    if 0 not in args.staleness:
        p.error(f"--staleness must include 0, the on-policy control; got {args.staleness}")
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}", *common.STUDY_REGIMES["modular"], *RUN])
    root = cfg.run.run_dir
    cfg, task, tok, params, mesh, eval_examples, shortcuts, start = common.study_start(cfg, args, "async")
    steps = [0] + list(range(cfg.run.eval_every, cfg.run.steps + 1, cfg.run.eval_every))

    for seed in args.seeds:
        for k in args.staleness:
            path = seed_json(root, k, seed)
            if os.path.exists(path):
                continue
            print(f"[async] rl.async_steps={k} seed {seed}")
            history, _ = common.run_rl(cfg, task, tok, params, mesh, root, f"k{k}", [f"rl.async_steps={k}"],
                                       seed=seed, eval_examples=eval_examples, progress=not args.no_progress)
            common.write_json(path, {
                "async_steps": k, "seed": seed, "steps": steps,
                "eval_accuracy": [start] + common.curve(history, "eval_accuracy", steps[1:]),
                "staleness_mean": mean_of(history, "staleness"),
                "ratio_deviation_mean": mean_of(history, "ratio_deviation_mean"),
                "ratio_deviation_max": max((h["ratio_deviation_max"] for h in history
                                            if "ratio_deviation_max" in h), default=None),
                "history": history})

    runs = {k: {s: common.read_json(seed_json(root, k, s)) for s in args.seeds} for k in args.staleness}
    finals = {k: {s: r["eval_accuracy"][-1] for s, r in by_seed.items()} for k, by_seed in runs.items()}
    bar = shortcuts.best[1]
    comparisons = {}
    for k in args.staleness:
        if k == 0:
            continue
        gaps = [finals[k][s] - finals[0][s] for s in args.seeds]
        mean, low, high = t_interval(gaps)
        comparisons[f"k={k} - k=0"] = {"gaps": gaps, "mean": mean, "low": low, "high": high,
                                        "verdict": verdict_on_cost(low, high) if len(gaps) > 1 else "not resolved"}
    summary = {
        "start_accuracy": start, "steps": steps, "seeds": args.seeds, "equivalence_margin": EQUIVALENCE,
        "final_accuracy": {f"k={k}": v for k, v in finals.items()}, "comparisons": comparisons,
        "clears_best_shortcut_by_10_points_every_seed": {f"k={k}": clears(v, bar) for k, v in finals.items()},
        "staleness_mean": {f"k={k}": {s: r["staleness_mean"] for s, r in by.items()} for k, by in runs.items()},
        "ratio_deviation_mean": {f"k={k}": {s: r["ratio_deviation_mean"] for s, r in by.items()}
                                 for k, by in runs.items()},
        "ratio_deviation_max": {f"k={k}": {s: r["ratio_deviation_max"] for s, r in by.items()}
                                for k, by in runs.items()},
        "shortcuts": shortcuts.to_dict(), "config": cfg.to_dict()}
    common.write_json(os.path.join(root, "summary.json"), summary)
    png = plot_runs({f"rl.async_steps={k}": [runs[k][s]["eval_accuracy"] for s in args.seeds]
                     for k in args.staleness}, steps, os.path.join(root, "async_staleness.png"),
                    ylabel="held-out greedy accuracy",
                    title="GRPO with stale rollouts on the testbed\nmean and 95% interval over seeds")
    print(f"[async] SFT start {start:.3f}; {len(eval_examples)} held-out questions, {shortcuts.line()}")
    for k in args.staleness:
        print(f"[async] rl.async_steps={k}: final {format_interval(list(finals[k].values()))} (seeds "
              f"{', '.join(f'{finals[k][s]:.3f}' for s in args.seeds)}); over the best shortcut {bar:.3f} by "
              f"10 points in every seed: {'yes' if summary['clears_best_shortcut_by_10_points_every_seed'][f'k={k}'] else 'no'}")
    for name, c in comparisons.items():
        print(f"[async] {name} = {c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] (n={len(c['gaps'])}): "
              f"{c['verdict']} (margin ±{EQUIVALENCE})")
    print(f"[async] wrote {png} and {os.path.join(root, 'summary.json')}")
    return summary


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
