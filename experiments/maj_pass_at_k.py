"""The paper's Figure 7 at CPU scale: Maj@K and Pass@K for K = 1…64 before and after GRPO.

The paper's reading: RL improves Maj@K but not Pass@K — it makes the output distribution
more robust (sharper around answers the model could already reach) rather than teaching
fundamentally new abilities. This script measures both from `--samples` samples per
held-out question at temperature `rl.temperature`, with the unbiased Pass@K estimator.

`--regime modular` (the default: the testbed, docs/studies/figure7_testbed/design.md) trains nothing: it reads the
quickstart's runs (`python experiments/quickstart.py --seeds 0 1 2 3 4`, under `--runs`,
default runs/quickstart) and evaluates each seed's SFT model (before RL) and GRPO model
(after RL) on the run's 512 held-out questions, with the GRPO run's sampler. Each (seed,
stage) writes `<out>/seed<N>_<stage>.json` and is read, not remeasured, on a second call;
`<out>/summary.json` holds the paired differences (after − before) with 95% intervals.

    python experiments/maj_pass_at_k.py --regime modular --runs runs/quickstart --seeds 0 1 2 3 4 \\
        --samples 64 --out runs/figure7_testbed

`--regime arithmetic` is the earlier study on carrying arithmetic: one SFT start,
GRPO seeds trained here (docs/studies/arithmetic_history/results.md):

    python experiments/maj_pass_at_k.py --regime arithmetic --samples 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

from grpo_jax import config as config_lib
from grpo_jax.tasks.shortcuts import clears
from grpo_jax.eval.stats import format_interval, paired_verdict

STAGES = ("sft", "grpo")  # before RL, after RL: the quickstart's run dirs under seed<N>
KS = (1, 2, 4, 8, 16, 32, 64)
# Paired contrasts of the design (docs/studies/figure7_testbed/design.md): ΔMaj@K, ΔPass@K, and
# ΔMaj@K − ΔPass@K, at these K.
TEST_KS = (1, 8, 64)
# What a difference's 95% interval says (`paired_verdict`'s verdicts, read for a difference
# whose predicted sign differs by test: the docs say which reading reproduces the paper).
READS = {"reproduces": "above 0", "contradicts": "below 0", "not resolved": "includes 0"}


def build_parser() -> argparse.ArgumentParser:
    import common  # experiments/common.py (imports jax)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--regime", choices=["arithmetic", *common.STUDY_REGIMES], default="modular",
                   help="carrying arithmetic (SFT and GRPO trained here), or a study regime whose "
                        "quickstart runs under --runs are evaluated")
    p.add_argument("--samples", type=int, default=64, help="samples per question (largest K)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="GRPO seeds (arithmetic, default 0 1 2) or quickstart seeds (modular, default 0 1 2 3 4)")
    p.add_argument("--runs", default="runs/quickstart",
                   help="--regime modular: the quickstart's run.run_dir, holding seed<N>/sft and seed<N>/grpo")
    p.add_argument("--questions", type=int, default=0,
                   help="--regime modular: the first N held-out questions only (0: all; for timing)")
    p.add_argument("--chunk", type=int, default=64,
                   help="--regime modular: questions per sampling call (memory; the result does not depend on it)")
    p.add_argument("--out", default=None, help="output directory (default runs/maj_pass_at_k, "
                                               "runs/figure7_testbed for --regime modular)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.regime != "arithmetic":
        return testbed(args)
    args.seeds = [0, 1, 2] if args.seeds is None else args.seeds
    args.out = args.out or "runs/maj_pass_at_k"
    return arithmetic(args)


# --- the testbed: the quickstart's runs, evaluated ---------------------------------------------

def stage_path(out: str, seed: int, stage: str) -> str:
    return os.path.join(out, f"seed{seed}_{stage}.json")


def testbed(args) -> dict:
    import common

    seeds = [0, 1, 2, 3, 4] if args.seeds is None else args.seeds
    out = args.out or "runs/figure7_testbed"
    os.makedirs(out, exist_ok=True)
    ks = [k for k in KS if k <= args.samples]
    results, mesh = {}, None
    for seed in seeds:
        for stage in STAGES:
            path = stage_path(out, seed, stage)
            if os.path.exists(path):
                with open(path) as f:
                    results[(seed, stage)] = json.load(f)
                print(f"[figure7] seed {seed} {stage}: read {path}")
                continue
            if mesh is None:
                import jax

                from grpo_jax.config import MeshConfig
                from grpo_jax.parallel.sharding import make_mesh

                mesh = make_mesh(MeshConfig(), jax.local_devices())
            r = measure_stage(os.path.join(args.runs, f"seed{seed}"), stage, mesh, ks=ks, samples=args.samples,
                              questions=args.questions, chunk=args.chunk, progress=not args.no_progress)
            results[(seed, stage)] = r
            common.write_json(path, r)
            print(f"[figure7] seed {seed} {stage} (step {r['step']}): greedy {r['accuracy']:.3f}, "
                  + ", ".join(f"Maj@{k} {r[f'maj@{k}']:.3f} Pass@{k} {r[f'pass@{k}']:.3f}" for k in shown(ks))
                  + f" ({r['wall_s']:.0f} s) -> {path}")
    summary = summarize(results, seeds, ks)
    common.write_json(os.path.join(out, "summary.json"), summary)
    print(report(summary))
    if summary["seeds"]:
        png = plot_testbed(summary, os.path.join(out, "figure7_testbed.png"))
        print(f"[figure7] wrote {png}")
    return summary


def measure_stage(seed_dir: str, stage: str, mesh, *, ks, samples: int, questions: int = 0, chunk: int = 64,
                  progress: bool = True) -> dict:
    """Greedy accuracy, Pass@K and Maj@K of `seed_dir/stage`'s last checkpoint on the run's
    held-out questions, sampled with the GRPO run's sampler (its temperature and lengths) and
    the same key for every stage. Questions go `chunk` at a time; the metrics are means over
    questions, so the chunks' means weighted by their sizes are the whole set's."""
    import common
    import jax

    from grpo_jax.cli import runs
    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.sampler import Sampler

    t0 = time.perf_counter()
    grpo_cfg = runs.run_config(os.path.join(seed_dir, "grpo"))
    cfg = runs.run_config(os.path.join(seed_dir, stage))
    if grpo_cfg is None or cfg is None:
        raise FileNotFoundError(f"{seed_dir}: no quickstart run (need sft/ and grpo/ with config.json)")
    task = common.make_task(grpo_cfg.data.task, grpo_cfg.data)
    run = runs.open_run(cfg, task, mesh)
    step = run.steps[-1]  # SFT: where --sft-until stopped it, the start GRPO had; GRPO: its last step
    params = run.params(step, mesh)
    if run.cfg.model != grpo_cfg.model:
        raise ValueError(f"{seed_dir}/{stage}: its model differs from the GRPO run's")
    sampler = Sampler.for_run(grpo_cfg.replace(model=run.cfg.model), mesh, run.tokenizer)
    examples, shortcuts = common.held_out(task, grpo_cfg, "figure7")
    if questions:
        examples = examples[:questions]
    key = jax.random.key(7)
    parts = []
    for i in range(0, len(examples), chunk):
        part = examples[i:i + chunk]
        t = time.perf_counter()
        m = evaluate(sampler, params, task, run.tokenizer, part, key=jax.random.fold_in(key, i // chunk),
                     num_samples=samples, temperature=grpo_cfg.rl.temperature, ks=ks)
        parts.append((len(part), m))
        if progress:
            print(f"[figure7] {stage} questions {i}-{i + len(part) - 1}: {time.perf_counter() - t:.1f} s")
    run.close()
    out = combine(parts)
    out.update(seed=grpo_cfg.run.seed, stage=stage, run_dir=os.path.abspath(os.path.join(seed_dir, stage)),
               step=step, questions=len(examples), samples=samples, temperature=grpo_cfg.rl.temperature,
               max_new_tokens=grpo_cfg.rl.max_new_tokens, ks=list(ks), best_shortcut=shortcuts.best[1],
               shortcuts=shortcuts.to_dict(), quickstart_accuracy=quickstart_accuracy(seed_dir, stage),
               wall_s=round(time.perf_counter() - t0, 1))
    return out


def combine(parts) -> dict:
    """[(questions, metrics)] -> metrics of all the questions: each mean weighted by its count."""
    total = sum(n for n, _ in parts)
    keys = parts[0][1].keys()
    return {k: sum(n * m[k] for n, m in parts) / total for k in keys if isinstance(parts[0][1][k], (int, float))}


def quickstart_accuracy(seed_dir: str, stage: str) -> float | None:
    """The held-out greedy accuracy the quickstart reported for this stage (None without it)."""
    path = os.path.join(seed_dir, "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["accuracy_before" if stage == "sft" else "accuracy_after"]


def shown(ks) -> list[int]:
    """The Ks a printed line shows: 1, 8 and the largest, those measured."""
    return sorted({k for k in (1, 8, ks[-1]) if k in ks})


def uniform_pass_at_k(k: int, answers: int = 13) -> float:
    """Pass@K of a guesser that draws K answers uniformly from `answers` values."""
    return 1.0 - (1.0 - 1.0 / answers) ** k


def summarize(results: dict, seeds, ks) -> dict:
    """Per seed (both stages measured) the metrics; over seeds the paired differences after −
    before of Maj@K, Pass@K, and ΔMaj@K − ΔPass@K at TEST_KS, with `paired_verdict`."""
    done = [s for s in seeds if (s, "sft") in results and (s, "grpo") in results]
    per_seed = {s: {stage: {k: v for k, v in results[(s, stage)].items() if k != "shortcuts"} for stage in STAGES}
                for s in done}
    bar = results[(done[0], "grpo")]["best_shortcut"] if done else None
    tests = {}
    for k in [k for k in TEST_KS if k in ks]:
        d_maj = [results[(s, "grpo")][f"maj@{k}"] - results[(s, "sft")][f"maj@{k}"] for s in done]
        d_pass = [results[(s, "grpo")][f"pass@{k}"] - results[(s, "sft")][f"pass@{k}"] for s in done]
        for name, gaps in ((f"maj@{k}", d_maj), (f"pass@{k}", d_pass),
                           (f"maj@{k} - pass@{k}", [a - b for a, b in zip(d_maj, d_pass)])):
            if gaps and not (k == 1 and " - " in name):  # Maj@1 and Pass@1 are the same quantity
                mean, low, high, verdict = paired_verdict(gaps)
                tests[name] = {"gaps": gaps, "mean": mean, "low": low, "high": high, "interval": READS[verdict]}
    largest = ks[-1]
    maj_after = [results[(s, "grpo")][f"maj@{largest}"] for s in done]
    return {"seeds": done, "ks": list(ks), "best_shortcut": bar,
            "uniform_pass_at_k": {str(k): uniform_pass_at_k(k) for k in ks},
            "maj_after_clears_shortcut_every_seed": clears(maj_after, bar) if done else False,
            "tests": tests, "per_seed": per_seed}


def report(summary: dict) -> str:
    ks, lines = summary["ks"], []
    for s in summary["seeds"]:
        b, a = summary["per_seed"][s]["sft"], summary["per_seed"][s]["grpo"]
        lines.append(f"[figure7] seed {s}: " + "  ".join(
            f"{m}@{k} {b[f'{m}@{k}']:.3f}→{a[f'{m}@{k}']:.3f}" for m in ("maj", "pass") for k in shown(ks)))
    for name, t in summary["tests"].items():
        lines.append(f"[figure7] Δ{name} (after − before): {t['mean']:+.3f} [{t['low']:+.3f}, {t['high']:+.3f}] "
                     f"(n={len(t['gaps'])}): interval {t['interval']}")
    return "\n".join(lines)


def plot_testbed(summary: dict, path: str) -> str:
    from grpo_jax.eval.plots import plot_runs

    ks, seeds = summary["ks"], summary["seeds"]
    runs = summary["per_seed"]
    curves = {f"{m} {label}": [[runs[s][stage][f"{key}@{k}"] for k in ks] for s in seeds]
              for key, m in (("maj", "Maj@K"), ("pass", "Pass@K")) for stage, label in (("sft", "before RL"),
                                                                                    ("grpo", "after GRPO"))}
    curves["Pass@K of uniform guesses"] = [[summary["uniform_pass_at_k"][str(k)] for k in ks]]
    curves["best shortcut (one answer)"] = [[summary["best_shortcut"]] * len(ks)]
    return plot_runs(curves, ks, path, ylabel="accuracy on 512 held-out questions", xlabel="K", logx=True,
                     title="Maj@K and Pass@K before/after GRPO (testbed, mod 13)\nmean and 95% interval over seeds")


# --- carrying arithmetic: SFT and GRPO trained here ----------------------------------------------

def arithmetic(args):
    import common
    import jax

    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.eval.plots import plot_runs
    from grpo_jax.sampler import Sampler

    cfg = common.load_cfg(args, [f"run.run_dir={args.out}", "data.eval_size=64"])
    root = cfg.run.run_dir
    task = common.make_task("arithmetic", cfg.data)
    tok, cfg = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    params, mesh = common.sft_start(cfg, task, tok, root, args)
    eval_examples, shortcuts = common.held_out(task, cfg, "figure7")
    ks = [k for k in KS if k <= args.samples]

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
    return result


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
