"""The paper's Figure 6 at CPU scale: iterative GRPO with a reward model retrained between iterations.

Algorithm 1 of the paper: for each iteration, π_ref ← π_θ; run M GRPO steps scored by the
reward model r_φ; then sample from the new policy, label the samples with the rule (the
oracle), and continue training r_φ on them with a replay buffer that mixes 10% historical
data into every batch. Iteration 0 is plain GRPO with the initial reward model.

The baseline is GRPO against the iteration-0 reward model, never retrained, for the same
total number of steps: the gap between the two curves is what retraining buys. Short
iterations matter at this scale: a fixed reward model is exploited within a few dozen steps.

    python experiments/iterative_grpo.py --iterations 5 run.steps=20
"""

from __future__ import annotations

import argparse
import os

import common
import jax

from grpo_jax import config as config_lib
from grpo_jax import sampling
from grpo_jax.evaluation import evaluate
from grpo_jax.plots import plot_runs
from grpo_jax.reward_models import (ReplayBuffer, label_completions, labelled_samples,
                                    pairwise_accuracy, train_reward_model)
from grpo_jax.sharding import to_host
from grpo_jax.tokenizer import encode_prompt
from grpo_jax.batching import completion_ids
from grpo_jax.evaluation import evaluate


def policy_samples(cfg, params, task, tok, mesh, *, num_prompts: int, per_prompt: int, seed: int,
                   split: str = "train"):
    """Fresh policy samples on `split` questions, labelled by the task's rule (the oracle)."""
    examples = task.examples(split, num_prompts, 7_000_000 + seed)
    ro = sampling.sample(cfg.model, params, [encode_prompt(tok, e.prompt) for e in examples],
                         key=jax.random.key(seed), group_size=per_prompt,
                         max_new_tokens=cfg.rl.max_new_tokens, temperature=1.0,
                         stop_tokens=tok.stop_ids, pad_id=tok.pad_id, mesh=mesh)
    ro = jax.tree.map(to_host, ro)
    texts = [tok.decode(completion_ids(ro, r, tok.stop_ids)) for r in range(len(examples) * per_prompt)]
    return label_completions(task, [e for e in examples for _ in range(per_prompt)], texts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--iterations", type=int, default=5, help="RL iterations of run.steps each")
    p.add_argument("--rm-steps", type=int, default=300, help="reward-model steps at iteration 0")
    p.add_argument("--rm-continue-steps", type=int, default=200, help="reward-model steps per later iteration")
    p.add_argument("--rm-prompts", type=int, default=256, help="new questions sampled per RM update")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the fixed-reward-model baseline run")
    p.add_argument("--replay-fraction", type=float, default=0.1, help="historical share of RM batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/iterative_grpo", help="output directory")
    args = p.parse_args(argv)
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}", "run.steps=20", "run.eval_every=10"])
    if args.iterations < 1:
        p.error(f"--iterations must be >= 1, got {args.iterations}")
    root = cfg.run.run_dir
    task = common.make_task(cfg)
    tok = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    policy, mesh = common.sft_start(cfg, task, tok, root, args)
    sft_policy = policy  # the baseline's start (a Trainer copies what it is given)
    eval_examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    held_out = labelled_samples(task, "validation", 64, args.seed, wrong_step_prob=0.5)

    # Iteration 0's reward model: trained from the SFT policy on SFT-style labelled samples.
    buffer = ReplayBuffer(seed=args.seed)
    first = labelled_samples(task, "train", 512, args.seed, wrong_step_prob=0.5)
    rm, _ = train_reward_model(cfg.model, tok, first, kind="outcome", steps=args.rm_steps,
                               init_params=policy, seed=args.seed, progress=not args.no_progress)
    buffer.add(first)
    fixed_rm = rm
    acc0 = evaluate(cfg, policy, task, tok, eval_examples, key=jax.random.key(1), mesh=mesh)["accuracy"]
    steps, accuracy, rm_acc, boundaries = [0], [acc0], [pairwise_accuracy(rm, held_out)], []

    def on_policy_accuracy(it: int) -> float:
        """How well r_φ ranks the current policy's own samples (what GRPO optimises against):
        same-question (correct, wrong) pairs from fresh samples on validation questions."""
        probe = policy_samples(cfg, policy, task, tok, mesh, num_prompts=64, per_prompt=8,
                               seed=10_000 + it, split="validation")
        return pairwise_accuracy(rm, probe)

    rm_on_policy = [on_policy_accuracy(0)]
    for it in range(args.iterations):
        print(f"[iterative] iteration {it}: reward-model pairwise accuracy {rm_acc[-1]:.3f} on held-out "
              f"SFT-style samples, {rm_on_policy[-1]:.3f} on the policy's own samples")
        history, trainer = common.run_rl(cfg, task, tok, policy, mesh, root, f"iter{it}", ["rl.algorithm=grpo"],
                                         seed=args.seed, eval_examples=eval_examples,
                                         progress=not args.no_progress, reward_model=rm)
        policy = trainer.params  # the next iteration's π_ref is this policy (a fresh Trainer copies it)
        offset = steps[-1]
        for h in history:
            if "eval_accuracy" in h:
                steps.append(offset + h["step"])
                accuracy.append(h["eval_accuracy"])
        boundaries.append(steps[-1])
        if it + 1 < args.iterations:
            new = policy_samples(cfg, policy, task, tok, mesh, num_prompts=args.rm_prompts, per_prompt=4,
                                 seed=args.seed * 100 + it)
            rm, _ = train_reward_model(cfg.model, tok, new, kind="outcome", steps=args.rm_continue_steps,
                                       init_params=rm, replay=buffer, replay_fraction=args.replay_fraction,
                                       seed=args.seed + it + 1, progress=not args.no_progress)
            buffer.add(new)
            rm_acc.append(pairwise_accuracy(rm, held_out))
            rm_on_policy.append(on_policy_accuracy(it + 1))
    policy_end = on_policy_accuracy(args.iterations)  # the last RM against the final policy
    curves = {"iterative GRPO (RM retrained)": [accuracy]}
    baseline = None
    if not args.no_baseline:
        total = args.iterations * cfg.run.steps
        history, _ = common.run_rl(cfg, task, tok, sft_policy, mesh, root, "fixed_rm",
                                   ["rl.algorithm=grpo", f"run.steps={total}"], seed=args.seed,
                                   eval_examples=eval_examples, progress=not args.no_progress,
                                   reward_model=fixed_rm)
        baseline = [acc0] + common.curve(history, "eval_accuracy", steps[1:])
        curves["GRPO, fixed RM"] = [baseline]
    common.write_json(os.path.join(root, "curves.json"),
                      {"steps": steps, "eval_accuracy": accuracy, "iteration_ends": boundaries,
                       "fixed_rm_eval_accuracy": baseline,
                       "reward_model_pairwise_accuracy": rm_acc,
                       "reward_model_on_policy_pairwise_accuracy": rm_on_policy,
                       "reward_model_on_final_policy_pairwise_accuracy": policy_end,
                       "config": cfg.to_dict()})
    png = plot_runs(curves, steps, os.path.join(root, "figure6.png"), ylabel="held-out greedy accuracy",
                    title=f"Iterative GRPO, {args.iterations} iterations of {cfg.run.steps} steps")
    print(f"[iterative] accuracy {accuracy[0]:.3f} → " + " → ".join(
        f"{accuracy[steps.index(b)]:.3f}" for b in boundaries) +
          (f"; fixed RM: {baseline[-1]:.3f}" if baseline else "") +
          f"; the last reward model ranks the final policy's samples at {policy_end:.3f}; wrote {png}")


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
