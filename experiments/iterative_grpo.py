"""The paper's Figure 6 at CPU scale: iterative GRPO with a reward model retrained between iterations.

Algorithm 1 of the paper: for each iteration, π_ref ← π_θ; run M GRPO steps scored by the
reward model r_φ; then sample from the new policy, label the samples with the rule (the
oracle), and continue training r_φ on them with a replay buffer that mixes 10% historical
data into every batch. Iteration 0 is plain GRPO with the initial reward model.

One policy run spans all iterations: the step counter, the question stream (a function of
`data.seed` and the step), the sampling RNG (`run.seed` folded with the step), the optimizer
state and the learning-rate schedule all continue from iteration k to k+1; only π_ref and
r_φ change at an iteration boundary. The optimizer state carries over because Algorithm 1
continues training one policy (it resets the reference, not the optimiser), and a fresh
Adam with a fresh warmup at every boundary would differ from the baseline in more than the
reward model. The baseline is GRPO against the iteration-0 reward model, never retrained,
with the same seed: the same questions in the same order, the same number of updates and
the same RNG stream, so the paired gap per seed is what retraining buys.

    python experiments/iterative_grpo.py --iterations 3 run.steps=20 --out runs/figure6_testbed
        # the testbed (--regime modular, the default): docs/studies/figure6_testbed/design.md
    python experiments/iterative_grpo.py --regime arithmetic --seeds 0 1 2 --iterations 5 run.steps=20
        # the earlier study on carrying arithmetic (docs/studies/arithmetic_history/results.md)

`run.steps` is the number of steps per iteration. Each finished seed is cached in
`<out>/seed<N>.json`; adding a seed re-runs only the new one.
"""

from __future__ import annotations

import argparse
import json
import os

import common
import jax

from grpo_jax import config as config_lib
from grpo_jax import sampler
from grpo_jax.errors import CheckpointError
from grpo_jax.eval.plots import plot_runs
from grpo_jax.rl.reward_models import (ReplayBuffer, RewardModel, label_completions, labelled_samples,
                                       pairwise_accuracy, read_samples, train_reward_model)
from grpo_jax.parallel.sharding import to_host
from grpo_jax.tasks.shortcuts import clears
from grpo_jax.eval.stats import format_interval
from grpo_jax.text.tokenizer import encode_prompt
from grpo_jax.rl.trainer import Trainer


def policy_samples(cfg, params, task, tok, mesh, *, num_prompts: int, per_prompt: int, seed: int,
                   split: str = "train"):
    """Fresh policy samples on `split` questions, labelled by the task's rule (the oracle)."""
    examples = task.examples(split, num_prompts, 7_000_000 + seed)
    run_sampler = sampler.Sampler.for_run(cfg, mesh, tok)  # the rollout's settings
    ro = run_sampler.sample(run_sampler.copy(params), [encode_prompt(tok, e.prompt) for e in examples],
                            key=jax.random.key(seed), group_size=per_prompt)
    ro = jax.tree.map(to_host, ro)
    texts = [tok.decode(ro.completion_ids(r, tok.stop_ids)) for r in range(len(examples) * per_prompt)]
    return label_completions(task, [e for e in examples for _ in range(per_prompt)], texts)


def run_seed(args, cfg, task, tok, sft_policy, mesh, eval_examples, acc0: float, seed: int) -> dict:
    """Iterative GRPO and its fixed-reward-model baseline for one seed; returns the curves."""
    root = os.path.join(cfg.run.run_dir, f"seed{seed}")
    for arm in ("iterative", "fixed_rm"):
        ckpts = os.path.join(root, arm, "checkpoints")
        if os.path.isdir(ckpts) and os.listdir(ckpts):
            raise CheckpointError(f"{ckpts} holds checkpoints of an unfinished run of seed "
                                  f"{seed}; the retrained reward models are not checkpointed, so it cannot resume. "
                                  f"Delete {root} to rerun seed {seed}.")
    progress, m = not args.no_progress, cfg.run.steps
    total = args.iterations * m
    held_out = (read_samples(args.rm_held_out) if args.rm_held_out else
                labelled_samples(task, "validation", 64, seed, wrong_step_prob=0.5))
    buffer = ReplayBuffer(seed=seed)
    if args.reward_model:  # iteration 0's reward model trained elsewhere, on --rm-samples
        rm = RewardModel.load(args.reward_model.format(draw=seed % args.rm_draws), tok)
        if args.rm_no_answer_check:
            rm = rm.with_answer_check(None)
        first = read_samples(args.rm_samples)
    else:  # trained here from the SFT policy on SFT-style labelled samples
        first = labelled_samples(task, "train", 512, seed, wrong_step_prob=0.5)
        rm, _ = train_reward_model(cfg.model, tok, first, kind="outcome", steps=args.rm_steps,
                                   init_params=sft_policy, seed=seed, progress=progress)
    buffer.add(first)
    fixed_rm = rm

    def arm_config(name):
        return common.rl_config(cfg, root, name, ["rl.algorithm=grpo", f"run.steps={total}", f"run.seed={seed}"])

    def on_policy_accuracy(policy, it: int) -> float:
        """How well r_φ ranks the current policy's own samples (what GRPO optimises against):
        same-question (correct, wrong) pairs from fresh samples on validation questions."""
        probe = policy_samples(cfg, policy, task, tok, mesh, num_prompts=64, per_prompt=8,
                               seed=10_000 * (seed + 1) + it, split="validation")
        return pairwise_accuracy(rm, probe)

    trainer = Trainer(arm_config("iterative"), task=task, tokenizer=tok, params=sft_policy, mesh=mesh,
                      reward_model=rm, eval_examples=eval_examples, progress=progress, resume=False)
    rm_acc, rm_on_policy = [pairwise_accuracy(rm, held_out)], [on_policy_accuracy(sft_policy, 0)]
    for it in range(args.iterations):
        print(f"[iterative] seed {seed} iteration {it}: reward-model pairwise accuracy {rm_acc[-1]:.3f} on "
              f"held-out SFT-style samples, {rm_on_policy[-1]:.3f} on the policy's own samples")
        if it > 0:  # Algorithm 1, line 3: π_ref ← π_θ; r_φ is the one retrained after iteration it-1
            trainer.reset_reference()
            trainer.reward_model = rm
        trainer.train(steps=(it + 1) * m)
        if it + 1 < args.iterations:
            new = policy_samples(cfg, trainer.params, task, tok, mesh, num_prompts=args.rm_prompts, per_prompt=4,
                                 seed=seed * 100 + it)
            rm, _ = train_reward_model(rm.cfg, tok, new, kind="outcome", steps=args.rm_continue_steps,
                                       init_params=rm, replay=buffer, replay_fraction=args.replay_fraction,
                                       seed=seed * 100 + it + 1, progress=progress, lr=args.rm_lr,
                                       batch_size=args.rm_batch, lm_weight=args.rm_lm_weight)
            buffer.add(new)
            rm_acc.append(pairwise_accuracy(rm, held_out))
            rm_on_policy.append(on_policy_accuracy(trainer.params, it + 1))
    policy_end = on_policy_accuracy(trainer.params, args.iterations)  # the last RM against the final policy
    history = trainer.history
    trainer.close()
    steps = [0] + list(range(cfg.run.eval_every, total + 1, cfg.run.eval_every))
    result = {"seed": seed, "steps": steps, "iteration_ends": [m * (i + 1) for i in range(args.iterations)],
              "iterative": [acc0] + common.curve(history, "eval_accuracy", steps[1:]),
              "reward_model": args.reward_model.format(draw=seed % args.rm_draws) if args.reward_model else None,
              "reward_model_answer_check": fixed_rm.answer_check is not None,
              "reward_model_pairwise_accuracy": rm_acc,
              "reward_model_on_policy_pairwise_accuracy": rm_on_policy,
              "reward_model_on_final_policy_pairwise_accuracy": policy_end}
    if not args.no_baseline:
        base = Trainer(arm_config("fixed_rm"), task=task, tokenizer=tok, params=sft_policy, mesh=mesh,
                       reward_model=fixed_rm, eval_examples=eval_examples, progress=progress, resume=False)
        history = base.train()
        base.close()
        result["fixed_rm"] = [acc0] + common.curve(history, "eval_accuracy", steps[1:])
    common.write_json(os.path.join(cfg.run.run_dir, f"seed{seed}.json"), result)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--iterations", type=int, default=5, help="RL iterations of run.steps each")
    p.add_argument("--rm-steps", type=int, default=300, help="reward-model steps at iteration 0")
    p.add_argument("--rm-continue-steps", type=int, default=200, help="reward-model steps per later iteration")
    p.add_argument("--rm-prompts", type=int, default=256, help="new questions sampled per RM update")
    p.add_argument("--rm-lr", type=float, default=3e-4, help="peak learning rate of each RM update")
    p.add_argument("--rm-batch", type=int, default=16, help="sequences per RM update step")
    p.add_argument("--rm-lm-weight", type=float, default=0.0,
                   help="joint next-token loss weight of each RM update (the recipe of docs/reward_models.md: 1)")
    p.add_argument("--reward-model", default=None,
                   help="iteration 0's reward model, a saved RewardModel folder (e.g. one of "
                        "experiments/figure5_sparse.py's; '{draw}' in it becomes seed %% --rm-draws), instead "
                        "of one trained here from the SFT policy (--rm-steps); needs --rm-samples")
    p.add_argument("--rm-no-answer-check", action="store_true",
                   help="score with --reward-model's own score, leaving out its answer check (a model that has one)")
    p.add_argument("--rm-draws", type=int, default=1, help="draws '{draw}' in --reward-model ranges over")
    p.add_argument("--rm-samples", default=None,
                   help="the labelled samples (JSON lines) --reward-model was trained on: the replay buffer's start")
    p.add_argument("--rm-held-out", default=None,
                   help="labelled held-out samples (JSON lines) the reward model's pairwise accuracy is measured "
                        "on at every iteration (default: 64 validation questions x 4 SFT-style samples)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the fixed-reward-model baseline run")
    p.add_argument("--replay-fraction", type=float, default=0.1, help="historical share of RM batches")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--out", default="runs/iterative_grpo", help="output directory")
    p.add_argument("--regime", choices=["arithmetic", *common.STUDY_REGIMES], default="modular",
                   help="carrying arithmetic (the history's runs), or a study regime of experiments/common.py "
                        "(modular: the testbed)")
    args = p.parse_intermixed_args(argv)  # overrides may sit before --seeds, which takes a list
    regime = common.STUDY_REGIMES.get(args.regime, [])
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}", "run.steps=20", "run.eval_every=10", *regime])
    if args.iterations < 1:
        p.error(f"--iterations must be >= 1, got {args.iterations}")
    if (args.reward_model is None) != (args.rm_samples is None):
        p.error("--reward-model and --rm-samples go together (the replay buffer starts with the samples it was "
                "trained on)")
    if args.rm_no_answer_check and args.reward_model is None:
        p.error("--rm-no-answer-check needs --reward-model (a reward model trained here has no answer check)")
    if args.rm_draws < 1:
        p.error(f"--rm-draws must be >= 1, got {args.rm_draws}")
    if not cfg.run.eval_every or cfg.run.steps % cfg.run.eval_every:
        p.error(f"run.steps (steps per iteration, {cfg.run.steps}) must be a multiple of run.eval_every "
                f"({cfg.run.eval_every}) so both arms are evaluated at every iteration boundary")
    root = cfg.run.run_dir
    cfg, task, tok, sft_policy, mesh, eval_examples, shortcuts, acc0 = common.study_start(cfg, args, "iterative")
    results = []
    for seed in args.seeds:
        cached = os.path.join(root, f"seed{seed}.json")
        if os.path.exists(cached):
            with open(cached) as f:
                results.append(json.load(f))
            print(f"[iterative] seed {seed}: restored from {cached}")
        else:
            results.append(run_seed(args, cfg, task, tok, sft_policy, mesh, eval_examples, acc0, seed))
    steps = results[0]["steps"]
    curves = {"iterative GRPO (RM retrained)": [r["iterative"] for r in results]}
    if not args.no_baseline:
        curves["GRPO, fixed RM"] = [r["fixed_rm"] for r in results]
    common.write_json(os.path.join(root, "curves.json"),
                      {"steps": steps, "seeds": args.seeds, "start_accuracy": acc0,
                       "eval_accuracy": curves, "per_seed": results, "shortcuts": shortcuts.to_dict(),
                       "config": cfg.to_dict()})
    png = plot_runs(curves, steps, os.path.join(root, "figure6.png"), ylabel="held-out greedy accuracy",
                    title=f"Iterative GRPO, {args.iterations} iterations of {cfg.run.steps} steps "
                          f"(mean, 95% interval)")
    finals = {name: [run[-1] for run in runs] for name, runs in curves.items()}
    bar = shortcuts.best[1]
    line = " | ".join(f"{name}: {format_interval(v)}, over the best shortcut {bar:.3f} by 10 points in every "
                      f"seed: {'yes' if clears(v, bar) else 'no'}" for name, v in finals.items())
    if not args.no_baseline:
        gaps = [a - b for a, b in zip(*finals.values())]
        line += f" | paired gap {format_interval(gaps)}"
    print(f"[iterative] start {acc0:.3f}; final held-out accuracy, mean [95% interval]: {line}; wrote {png}")


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
