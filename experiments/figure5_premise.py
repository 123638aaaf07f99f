"""Figure 5's premise, measured before any method runs: in a candidate regime, how often the
SFT model is right, and how often a group's outcome and step rewards vary.

Outcome supervision only has a gradient where a question's G samples do not all earn the
same reward; process supervision has one wherever their step rewards differ. The paper's
claim that process beats outcome supervision is testable where the first is rare and the
second common, so a design picks its regime by these figures:

    python experiments/figure5_premise.py                       # the testbed (--regime modular)
    python experiments/figure5_premise.py --regime arithmetic data.num_operands=6 data.min_carries=3 \\
        data.slip=carry_habit data.wrong_step_prob=0.9

For the regime's SFT model (trained once, cached in <out>/sft, as every CPU
ablation trains it), --group samples of each of --questions training questions at rl.temperature,
scored by the task's rules: the share of samples that are right, of questions whose
outcome rewards vary, of step lines that are right, and of questions whose step rewards
vary; the correlation between a sample's summed step reward and its outcome (a design
needs it positive: step rewards that point away from right answers train away from them);
and the shortcut baselines of the regime's held-out set (`grpo_jax.tasks.shortcuts`). Prints them
and writes <out>/premise.json. Options are config keys (as in the
other ablations); the testbed's knobs are data.modulus, data.num_operands and
data.num_subtractions, carrying arithmetic's (`--regime arithmetic`) data.num_operands,
data.min_carries and data.slip; both take data.wrong_step_prob and data.format_reward (0 by
default here: the reward is correctness only).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

REGIME_DEFAULTS = ["data.format_reward=0", "rl.max_new_tokens=64", "model.max_seq_len=96"]


def premise(outcomes: np.ndarray, steps: list[list[list[float]]]) -> dict:
    """The premise's figures from rewards of Q questions x G samples.

    outcomes: [Q, G] outcome rewards (1 = right); steps[q][g]: the step rewards of sample g
    of question q (one per step line). A question's step rewards vary when its G samples'
    step-reward lists are not all equal."""
    q, g = outcomes.shape
    step_values = [r for question in steps for sample in question for r in sample]
    summed = np.array([[sum(sample) for sample in question] for question in steps], np.float64)
    return {
        "questions": q, "group_size": g,
        "right_fraction": float(np.mean(outcomes == 1.0)),
        "outcome_varying_fraction": float(np.mean(outcomes.min(axis=1) != outcomes.max(axis=1))),
        "step_right_fraction": float(np.mean(step_values)) if step_values else 0.0,
        "step_varying_fraction": float(np.mean([len({tuple(s) for s in question}) > 1 for question in steps])),
        "step_outcome_correlation": correlation(summed.ravel(), outcomes.ravel()),
    }


def correlation(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; 0.0 when either side is constant (no linear relation to show)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.std() == 0 or y.std() == 0:
        return 0.0
    return float(np.corrcoef(x, y)[0, 1])


def sample_groups(cfg, params, task, tok, mesh, examples, group: int, seed: int) -> list[list[str]]:
    """``group`` completions of each example from ``params``, sampled as the run's rollout
    samples (rl.temperature, top-k, top-p, decode engine)."""
    import jax

    from grpo_jax import sampler
    from grpo_jax.parallel.sharding import to_host
    from grpo_jax.text.tokenizer import encode_prompt

    run_sampler = sampler.Sampler.for_run(cfg, mesh, tok)  # the rollout's settings
    ro = run_sampler.sample(run_sampler.copy(params), [encode_prompt(tok, e.prompt) for e in examples],
                            key=jax.random.key(seed), group_size=group)
    ro = jax.tree.map(to_host, ro)
    texts = [tok.decode(ro.completion_ids(r, tok.stop_ids)) for r in range(len(examples) * group)]
    return [texts[i * group:(i + 1) * group] for i in range(len(examples))]


def main(argv=None) -> dict:
    import common  # experiments/common.py (imports jax: only once a run starts)

    from grpo_jax import config as config_lib
    from grpo_jax.tasks.shortcuts import shortcut_baselines

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--questions", type=int, default=128, help="training questions sampled (default 128)")
    p.add_argument("--group", type=int, default=16, help="samples per question, G (default 16)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--out", default="runs/figure5_premise", help="output directory (its sft/ is reused)")
    p.add_argument("--regime", choices=["arithmetic", *common.STUDY_REGIMES], default="modular",
                   help="defaults under the overrides: the arithmetic regime above, or a study regime of "
                        "experiments/common.py (modular: the testbed)")
    args = p.parse_args(argv)
    defaults = REGIME_DEFAULTS if args.regime == "arithmetic" else common.STUDY_REGIMES[args.regime]
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}"] + defaults)
    root = cfg.run.run_dir
    task = common.make_task(cfg.data.task, cfg.data)
    tok, cfg = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    params, mesh = common.sft_start(cfg, task, tok, root, args)
    examples = task.examples("train", args.questions, 9_000_000 + args.seed)
    groups = sample_groups(cfg, params, task, tok, mesh, examples, args.group, args.seed)
    outcomes = np.array([[1.0 if task.is_correct(task.extract_answer(c), ex) else 0.0 for c in texts]
                         for ex, texts in zip(examples, groups)])
    steps = [[[r for _, r in task.step_rewards(c, ex)] for c in texts] for ex, texts in zip(examples, groups)]
    held_out = shortcut_baselines(task, task.examples("test", cfg.data.eval_size, cfg.data.seed))
    knobs = ("num_operands", "modulus", "num_subtractions") if cfg.data.task == "modular" else (
        "num_operands", "max_digits", "min_carries", "slip")
    result = {**premise(outcomes, steps), "held_out_shortcuts": held_out.to_dict(), "regime": {
        k: getattr(cfg.data, k) for k in ("task",) + knobs + ("wrong_step_prob", "format_reward")},
        "temperature": cfg.rl.temperature, "max_new_tokens": cfg.rl.max_new_tokens, "sft_steps": args.sft_steps,
        "sft_until": common.sft_report(root), "run_seed": cfg.run.seed}
    if hasattr(task, "locally_right"):  # lines whose own lookup is right, whatever value they start from
        counts = [task.locally_right(c, ex) for ex, texts in zip(examples, groups) for c in texts]
        result["lines_locally_right_fraction"] = sum(r for r, _ in counts) / max(1, sum(t for _, t in counts))
        print(f"[premise] sampled step lines locally right {result['lines_locally_right_fraction']:.3f}")
    print(f"[premise] {result['regime']}, T = {cfg.rl.temperature}, {args.questions} questions x G = {args.group}")
    print(f"[premise] samples right {result['right_fraction']:.3f}; outcome rewards vary in "
          f"{result['outcome_varying_fraction']:.3f} of questions; step lines right "
          f"{result['step_right_fraction']:.3f}; step rewards vary in {result['step_varying_fraction']:.3f}")
    print(f"[premise] correlation of summed step reward with outcome {result['step_outcome_correlation']:+.3f}")
    print(f"[premise] held-out set: {held_out.num_questions} questions ({held_out.distinct_questions} distinct), "
          f"{held_out.line()}; every rule: {', '.join(f'{k} {v:.3f}' for k, v in held_out.scores.items())}")
    print(f"[premise] wrote {common.write_json(os.path.join(root, 'premise.json'), result)}")
    return result


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
