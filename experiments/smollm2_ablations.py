"""The paper's ablations on SmolLM2 word arithmetic (issue #84): each arm's held-out curve and
every claim's verdict, from the seeds that have finished. It trains nothing.

The design, committed before the runs: docs/studies/smollm2_words/design.md. Each arm is one
`experiments/smollm2_grpo.py --task word_arithmetic` run dir (its seeds in seed<N>/summary.json);
the committed copies of the finished seeds sit in docs/studies/smollm2_words/data/:

    python experiments/smollm2_ablations.py --root docs/studies/smollm2_words/data \\
        --out docs/studies/smollm2_words                     # the committed seeds
    python experiments/smollm2_ablations.py --root runs --layout runs   # runs/smollm2_words_<arm>/

A claim "A beats B" is judged on the seeds both arms have, by the paired gap in held-out
greedy accuracy at the last step: its mean and 95% t-interval (`grpo_jax.eval.stats.paired_verdict`):
reproduces where the interval lies above 0, contradicts where below, not resolved otherwise.
Writes <out>/ablations.json and <out>/ablations.png (mean and 95% band per arm; the bar the
study set, the best shortcut + 10 points, as a flat line).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

from grpo_jax.errors import DataError

# arm -> (its folder under the committed data, its run dir under runs/)
ARMS = {
    "GRPO+OS": ("", "smollm2_words"),
    "Online RFT": ("online_rft", "smollm2_words_online_rft"),
    "RFT": ("rft", "smollm2_words_rft"),
    "GRPO+PS": ("grpo_ps", "smollm2_words_grpo_ps"),
}
# The paper's claims (DeepSeekMath Figure 5): (better, worse).
CLAIMS = {
    "(a) Online RFT beats RFT": ("Online RFT", "RFT"),
    "(c) GRPO+OS beats Online RFT": ("GRPO+OS", "Online RFT"),
    "(b) GRPO+PS beats GRPO+OS": ("GRPO+PS", "GRPO+OS"),
}
# The study's bar: the held-out set's best shortcut + 10 points (design.md).
BAR_MARGIN = 0.10


def arm_dir(root: str, arm: str, layout: str) -> str:
    data, runs = ARMS[arm]
    return os.path.join(root, data) if layout == "data" else os.path.join(root, runs)


def read_seeds(folder: str) -> dict[int, dict]:
    """{seed: summary} for every seed<N>/summary.json under ``folder`` (none: {}), with
    "shortcut_best": the held-out set's best shortcut as the seed's metrics.jsonl recorded it
    at its evaluations (None without the file)."""
    seeds = {}
    for path in sorted(glob.glob(os.path.join(folder, "seed*", "summary.json"))):
        match = re.fullmatch(r"seed(\d+)", os.path.basename(os.path.dirname(path)))
        if not match:
            continue
        try:
            with open(path) as f:
                summary = json.load(f)
            curve = {int(s): float(a) for s, a in summary["eval_accuracy_at_step"].items()}
            summary["eval_accuracy_at_step"] = curve
            float(summary["accuracy_after"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{path}: not a finished seed's summary ({type(e).__name__}: {e}); "
                            "expected eval_accuracy_at_step and accuracy_after") from None
        summary["shortcut_best"] = _shortcut_best(os.path.join(os.path.dirname(path), "metrics.jsonl"))
        seeds[int(match.group(1))] = summary
    return seeds


def _shortcut_best(metrics_path: str) -> float | None:
    if not os.path.exists(metrics_path):
        return None
    with open(metrics_path) as f:
        values = {round(r["eval_shortcut_best"], 6) for r in map(json.loads, f) if "eval_shortcut_best" in r}
    if len(values) > 1:
        raise DataError(f"{metrics_path}: evaluations on different held-out sets (best shortcut {sorted(values)})")
    return values.pop() if values else None


def check_same_budget(arms: dict[str, dict[int, dict]]) -> None:
    """Every seed of every arm must have run the same steps and evaluated at the same steps: the
    design's "same question stream and budget per arm"."""
    shapes = {(arm, seed): (s.get("steps"), tuple(sorted(s["eval_accuracy_at_step"])))
              for arm, seeds in arms.items() for seed, s in seeds.items()}
    if len(set(shapes.values())) > 1:
        listing = ", ".join(f"{arm} seed {seed}: steps {st}, evaluated at {list(ev)}"
                            for (arm, seed), (st, ev) in sorted(shapes.items()))
        raise DataError(f"the arms did not run the same budget ({listing})")


def judge(arms: dict[str, dict[int, dict]]) -> dict[str, dict]:
    """Each claim on the seeds both its arms have (none: left out): figure5_sparse's judge on
    the held-out accuracy at the last step."""
    from figure5_sparse import judge as judge_claims

    finals = {arm: {seed: s["accuracy_after"] for seed, s in seeds.items()} for arm, seeds in arms.items()}
    return judge_claims(finals, CLAIMS)


def shortcut_best(arms: dict[str, dict[int, dict]]) -> float | None:
    """The held-out set's best shortcut, as each seed's run recorded it (one value, or None)."""
    values = {s["shortcut_best"] for seeds in arms.values() for s in seeds.values()
              if s["shortcut_best"] is not None}
    if len(values) > 1:
        raise DataError(f"the seeds record different best shortcuts {sorted(values)}: not one held-out set")
    return values.pop() if values else None


def table(arms: dict[str, dict[int, dict]], verdicts: dict[str, dict]) -> str:
    lines = ["| arm | seeds | before | held-out accuracy at the last step, per seed |", "|---|---|---|---|"]
    for arm, seeds in arms.items():
        finals = ", ".join(f"{s}: {seeds[s]['accuracy_after']:.3f}" for s in sorted(seeds))
        before = {round(x["accuracy_before"], 6) for x in seeds.values()}
        lines.append(f"| {arm} | {len(seeds)} | {', '.join(f'{b:.3f}' for b in sorted(before))} | {finals} |")
    lines += ["", "| claim | seeds | paired gaps (points) | mean [95% interval] | verdict |", "|---|---|---|---|---|"]
    for claim, v in verdicts.items():
        gaps = ", ".join(f"{100 * g:+.1f}" for g in v["gaps"])
        lines.append(f"| {claim} | {', '.join(map(str, v['seeds']))} | {gaps} | "
                     f"{100 * v['mean']:+.1f} [{100 * v['low']:+.1f}, {100 * v['high']:+.1f}] | {v['verdict']} |")
    return "\n".join(lines)


def plot(arms: dict[str, dict[int, dict]], bar: float | None, path: str) -> str:
    from grpo_jax.eval.plots import plot_runs

    steps = sorted(next(iter(next(iter(arms.values())).values()))["eval_accuracy_at_step"])
    curves = {arm: [[s["eval_accuracy_at_step"][t] for t in steps] for _, s in sorted(seeds.items())]
              for arm, seeds in arms.items()}
    references = {} if bar is None else {f"bar: best shortcut + {100 * BAR_MARGIN:.0f} points": bar}
    return plot_runs(curves, steps, path, ylabel="held-out greedy accuracy (192 questions)",
                     title="SmolLM2-135M, word arithmetic: Figure 5's arms", references=references)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="docs/studies/smollm2_words/data",
                   help="the committed data folder (--layout data) or the runs folder (--layout runs)")
    p.add_argument("--layout", choices=("data", "runs"), default="data",
                   help="data: <root>/<arm>/seed<N> (GRPO+OS at <root>/seed<N>); runs: <root>/smollm2_words_<arm>/seed<N>")
    p.add_argument("--out", default="runs/smollm2_ablations", help="where ablations.json and ablations.png go")
    args = p.parse_args(argv)

    arms = {arm: seeds for arm in ARMS if (seeds := read_seeds(arm_dir(args.root, arm, args.layout)))}
    if not arms:
        p.error(f"no finished seed under {args.root} (layout {args.layout}): looked for "
                + ", ".join(os.path.join(arm_dir(args.root, a, args.layout), "seed<N>/summary.json") for a in ARMS))
    check_same_budget(arms)
    verdicts = judge(arms)
    best = shortcut_best(arms)
    os.makedirs(args.out, exist_ok=True)
    result = {"seeds": {arm: sorted(seeds) for arm, seeds in arms.items()},
              "accuracy_after": {arm: {s: x["accuracy_after"] for s, x in sorted(seeds.items())}
                                 for arm, seeds in arms.items()},
              "shortcut_best": best, "claims": verdicts,
              "plot": plot(arms, None if best is None else best + BAR_MARGIN, os.path.join(args.out, "ablations.png"))}
    with open(os.path.join(args.out, "ablations.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(table(arms, verdicts))
    print(f"[smollm2_ablations] wrote {os.path.join(args.out, 'ablations.json')} and {result['plot']}")
    return result


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
