"""Train an outcome (ORM) or process (PRM) reward model on a synthetic task (data.task:
arithmetic by default, or modular, the testbed).

1. generate the task and train a sentencepiece tokenizer on its text;
2. train a base model: next-token training on correct worked solutions (the paper starts
   its reward models from DeepSeekMath-Base; a random trunk would have to discover
   arithmetic from one bit per sample) — skip with --trunk-steps 0;
3. label worked solutions whose steps are wrong with probability data.wrong_step_prob by
   the task's rules (outcome: final answer right; process: each step's arithmetic);
4. train the reward model (Bradley-Terry or pointwise for an ORM, per-step BCE for a PRM),
   with a joint next-token loss on the correct samples (--lm-weight) and a score that adds
   a learned multiple of the trunk's log-likelihood of the completion (--no-likelihood: the
   value head alone); docs/reward_models.md says why. The model then checks answers: its
   trunk answers each question greedily, and completions that agree with it rank first, its
   own score ordering them within each side (--no-answer-check: its own score alone). With
   --validation-fraction, that share of the training questions is held back and the model
   kept is the one of the best validation pairwise accuracy (every --eval-every steps), not
   the last step's;
5. evaluate on held-out questions (the task's test split) and write into run.run_dir:
   reward_model/ (checkpoint + tokenizer, `RewardModel.load`), metrics.json
   (held-out accuracy, baselines, config) and history.json (per-step losses). A model whose
   held-out pairwise accuracy is below 0.7, whose own score (without the answer check; a PRM's
   minimum over steps, what process supervision rewards) ranks below 0.7 while the check lifts
   the output score, or whose answer check ranks worse than its own score, is reported with a
   warning line. metrics.json names both: held_out_pairwise_accuracy is the checked output
   score's, held_out_pairwise_without_answer_check the own score's.

    python experiments/train_reward_model.py --kind outcome
    python experiments/train_reward_model.py --kind process run.steps=800 run.run_dir=runs/prm
    python experiments/train_reward_model.py --kind outcome --loss pointwise optimizer.peak_lr=1e-3
    python experiments/train_reward_model.py --kind process data.task=modular data.modulus=13 \
        data.num_operands=6 data.num_subtractions=2 data.wrong_step_prob=0.6 \
        model.max_seq_len=96     # the testbed (the script's data.num_operands=3 would not be)

    python experiments/train_reward_model.py --evaluate runs/reward_model/reward_model \
        --held-out-samples policy_samples.jsonl   # a saved model on other labelled samples

Step 3 reads labelled samples from files instead with --train-samples / --held-out-samples
(JSON lines, `reward_models.write_samples`): e.g. samples of an SFT model labelled by the
rule, as experiments/figure5_sparse.py makes them. --tokenizer reuses a policy's
sentencepiece model instead of training one. Either way the tokenizer is saved with the model,
and the model reads text with it in RL (`rl.reward_model`), whatever the policy's.

Config keys read: model.*, optimizer.* (the reward model's AdamW), run.steps (reward-model
steps), run.seed, run.run_dir, data.task and its knobs (`grpo_jax.cli.runs.make_task`: arithmetic
data.num_operands, data.max_digits, data.min_carries, data.slip, data.format_reward; modular
data.modulus, data.num_operands, data.num_subtractions), data.wrong_step_prob.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time


import numpy as np

from grpo_jax import config as config_lib
from grpo_jax.rl import reward_models as rm_lib
from grpo_jax.rl.reward_models.checks import answer_check_warning, own_score_warning, ranking_warning
from grpo_jax.cli.runs import make_task
from grpo_jax.tasks.arithmetic import ArithmeticTask
from grpo_jax.tasks.modular import ModularTask
from grpo_jax.text.tokenizer import SentencePieceTokenizer, train_sentencepiece

# Read here: model.*, optimizer.* (the reward model's AdamW), data.task and its knobs,
# data.wrong_step_prob, run.run_dir, run.steps (reward-model steps), run.seed.
# The recipe of docs/reward_models.md: a 4-layer trunk trained as a language model to its floor,
# then the reward model with a joint next-token loss and the likelihood-aware score.
DEFAULTS = [
    "run.run_dir=runs/reward_model", "run.steps=1500", "optimizer.peak_lr=1e-3",
    "optimizer.warmup_steps=50", "data.num_operands=3", "data.max_digits=1", "data.wrong_step_prob=0.5",
    "model.embed_dim=64", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
    "model.head_dim=16", "model.mlp_dim=128", "model.max_seq_len=48",
]


ARITHMETIC_OPERATIONS = "+"

# Base models trained in this process, by everything that determines one: an ORM and a PRM of
# the same run.seed (experiments/figure5_sparse.py trains both for each draw) share a trunk
# instead of training the same one twice.
_TRUNKS: dict[str, tuple] = {}


def build_task(data, operations: str | None = None):
    """The task of the config's data section (`grpo_jax.cli.runs.make_task`), with --operations
    for the arithmetic task, the one task that has them as a knob outside the config."""
    if operations is not None and data.task != "arithmetic":
        raise ValueError(f"--operations applies to the arithmetic task only, not data.task={data.task}")
    if data.task != "arithmetic":
        return make_task(data.task, data)
    return ArithmeticTask(num_operands=data.num_operands, max_digits=data.max_digits,
                          operations=operations or ARITHMETIC_OPERATIONS, slip=data.slip,
                          format_reward=data.format_reward, min_carries=data.min_carries)


def task_description(task) -> dict:
    """The task's name and knobs, as metrics.json records them."""
    lo, hi = task.num_operands
    out = {"name": task.name, "num_operands": lo if lo == hi else [lo, hi]}
    if task.name == "modular":
        return out | {"modulus": task.modulus, "num_subtractions": task.num_subtractions}
    return out | {"max_digits": task.max_digits, "operations": task.operations, "min_carries": task.min_carries}


def held_out_metrics(model, held_out) -> dict:
    """A reward model's accuracies on labelled samples, as metrics.json records them: pairwise
    with its 95% bootstrap interval over questions (`pairwise_interval`); with an answer
    check, also its own score's pairwise accuracy without it and how often the trunk's greedy
    answer is right, which is what the check leans on."""
    prompts, completions = [s.prompt for s in held_out], [s.completion for s in held_out]
    scores = model.score(prompts, completions)
    out = {"held_out_pairwise_accuracy": rm_lib.pairwise_from_scores(held_out, scores),
           "held_out_pairwise_interval": list(rm_lib.pairwise_interval(held_out, scores))}
    if model.answer_check is not None:
        out["held_out_pairwise_without_answer_check"] = rm_lib.pairwise_from_scores(
            held_out, model.score(prompts, completions, check=False))
        # A question's right answer is that of its right samples: questions without one are left out.
        right = {s.prompt: model.answer_check.extract(s.completion) for s in held_out if s.correct}
        asked = sorted(right)
        out["trunk_greedy_accuracy"] = float(np.mean([a == right[p] for p, a in
                                                      zip(asked, model.greedy_answers(asked))]))
        out["trunk_greedy_questions"] = len(asked)
    if model.kind == "outcome":
        if model.transform == "sigmoid":
            out["held_out_outcome_accuracy"] = rm_lib.outcome_accuracy(model, held_out)
        out["pairwise_chance"] = 0.5
    else:
        out["held_out_step_accuracy"], out["majority_baseline"] = rm_lib.step_accuracy(model, held_out)
    return out


def evaluate(path: str, held_out_path: str) -> dict:
    """--evaluate: a saved reward model's accuracies on a labelled samples file, printed."""
    model = rm_lib.RewardModel.load(path)
    held_out = rm_lib.read_samples(held_out_path)
    out = {"kind": model.kind, "held_out_samples": len(held_out),
           "held_out_fraction_correct": float(np.mean([s.correct for s in held_out])),
           **held_out_metrics(model, held_out)}
    print(f"[reward model] {path} on {held_out_path}: "
          f"{json.dumps({k: _rounded(v) for k, v in out.items()})}")
    for warning in warnings(out):
        print(f"[reward model] {warning}")
    return out


def _rounded(v):
    """A metric as printed: floats (alone or in a list) to 4 places."""
    if isinstance(v, float):
        return round(v, 4)
    return [_rounded(x) for x in v] if isinstance(v, list) else v


def warnings(metrics: dict) -> list[str]:
    """The lines a trained or evaluated model's held-out metrics call for (`checks`)."""
    found = [ranking_warning(metrics["held_out_pairwise_accuracy"])]
    if "held_out_pairwise_without_answer_check" in metrics:
        # Without a check the score above is the own score, and ranking_warning has spoken for it.
        found.append(own_score_warning(metrics["held_out_pairwise_without_answer_check"],
                                       checked=metrics["held_out_pairwise_accuracy"]))
        found.append(answer_check_warning(metrics["held_out_pairwise_accuracy"],
                                          metrics["held_out_pairwise_without_answer_check"],
                                          metrics["trunk_greedy_accuracy"]))
    return [w for w in found if w]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    p.add_argument("--kind", choices=rm_lib.KINDS, default="outcome", help="ORM or PRM (default outcome)")
    p.add_argument("--loss", choices=rm_lib.LOSSES, default=None,
                   help="ORM: pairwise (Bradley-Terry, default) or pointwise; a PRM is always pointwise")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (pairwise: half as many pairs)")
    p.add_argument("--trunk-steps", type=int, default=1500, help="next-token steps for the base model (0: random trunk)")
    p.add_argument("--trunk-lr", type=float, default=3e-3, help="base-model peak learning rate")
    p.add_argument("--operations", default=None,
                   help=f"the arithmetic task's operators (a string over +-*/; default {ARITHMETIC_OPERATIONS})")
    p.add_argument("--train-prompts", type=int, default=2000, help="training questions")
    p.add_argument("--eval-prompts", type=int, default=64,
                   help="held-out questions (test split; 3-operand 1-digit + has 79 distinct ones)")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="labelled solutions per question")
    p.add_argument("--tokenizer-vocab", type=int, default=32, help="sentencepiece vocabulary size")
    p.add_argument("--tokenizer", default=None, help="a sentencepiece model file to use instead of training one")
    p.add_argument("--train-samples", default=None,
                   help="labelled samples to train on (JSON lines) instead of synthetic solutions")
    p.add_argument("--held-out-samples", default=None,
                   help="labelled held-out samples (JSON lines) to evaluate on; needed with --train-samples "
                        "(alone: train on synthetic solutions, evaluate on these, e.g. a policy's samples)")
    p.add_argument("--synthetic-prompts", type=int, default=0,
                   help="with --train-samples: also train on the task's worked solutions of this many training "
                        "questions x --samples-per-prompt, labelled by its rule (validation stays on the file's)")
    p.add_argument("--lookup-error-prob", type=float, default=0.0,
                   help="modular task: also make each line's value a uniformly drawn wrong one with this "
                        "probability in the synthetic solutions (the SFT policy's other error; default 0, "
                        "the slips alone)")
    p.add_argument("--evaluate", default=None, metavar="REWARD_MODEL",
                   help="train nothing: print a saved reward model's accuracies on --held-out-samples")
    p.add_argument("--validation-fraction", type=float, default=0.0,
                   help="fraction of the training questions held back to pick the best evaluation's model "
                        "(default 0: train on all, keep the last step's model; docs/reward_models.md has why)")
    p.add_argument("--eval-every", type=int, default=100, help="steps between validation evaluations")
    p.add_argument("--read", choices=rm_lib.READS, default="end",
                   help="PRM: where the head reads a step, its newline (end) or the token before it (value)")
    p.add_argument("--lm-weight", type=float, default=1.0,
                   help="weight of a joint next-token loss on the correct samples (0: none)")
    p.add_argument("--no-likelihood", dest="likelihood", action="store_false",
                   help="score with the value head alone, without the trunk's log-likelihood of the completion")
    p.add_argument("--no-answer-check", dest="answer_check", action="store_false",
                   help="score with the model's own score alone, without checking answers against its trunk's "
                        "greedy answer")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    return p


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # overrides may sit between options
    if args.evaluate:
        if args.held_out_samples is None:
            parser.error("--evaluate needs --held-out-samples (the labelled samples to evaluate on)")
        return evaluate(args.evaluate, args.held_out_samples)
    if args.train_samples is not None and args.held_out_samples is None:
        parser.error("--train-samples needs --held-out-samples (samples of other questions to evaluate on)")
    if not 0.0 <= args.validation_fraction < 1.0:
        parser.error(f"--validation-fraction must be in [0, 1), got {args.validation_fraction}")
    if args.synthetic_prompts and not args.train_samples:
        parser.error("--synthetic-prompts adds to --train-samples (without it, --train-prompts sets the synthetic data)")
    if args.synthetic_prompts < 0:
        parser.error(f"--synthetic-prompts must be >= 0, got {args.synthetic_prompts}")
    if args.eval_every < 1:
        parser.error(f"--eval-every must be >= 1, got {args.eval_every}")
    if not 0.0 <= args.lookup_error_prob <= 1.0:
        parser.error(f"--lookup-error-prob must be in [0, 1], got {args.lookup_error_prob}")
    if args.lookup_error_prob and args.train_samples and not args.synthetic_prompts and args.held_out_samples:
        parser.error("--lookup-error-prob shapes synthetic solutions, and --train-samples with --held-out-samples "
                     "leaves none: add --synthetic-prompts, or drop it")
    cfg = config_lib.apply_overrides(config_lib.get_preset(args.preset), DEFAULTS + args.overrides)
    run_dir, seed = cfg.run.run_dir, cfg.run.seed
    os.makedirs(run_dir, exist_ok=True)
    progress = not args.no_progress
    t0 = time.perf_counter()

    cfg.data.validate()
    try:
        task = build_task(cfg.data, args.operations)
    except ValueError as err:
        parser.error(str(err))
    if args.tokenizer:
        tokenizer = SentencePieceTokenizer.load(args.tokenizer)
    else:
        tokenizer = train_sentencepiece(task.text_corpus(500, seed=seed), vocab_size=args.tokenizer_vocab)
    cfg = cfg.replace(model={"vocab_size": tokenizer.vocab_size})
    for section in (cfg.model, cfg.optimizer, cfg.data, cfg.run):  # rl.* is not used here
        section.validate()
    # Passed only when set: other tasks' sft_text has no such keyword.
    sft_kwargs = {"lookup_error_prob": args.lookup_error_prob} if args.lookup_error_prob else {}
    if sft_kwargs and not isinstance(task, ModularTask):
        parser.error(f"--lookup-error-prob needs data.task=modular, got {cfg.data.task}")
    print(f"[reward model] {args.kind}; tokenizer {tokenizer.vocab_size} pieces; task {task_description(task)}")

    trunk, trunk_reused = None, False
    if args.trunk_steps > 0:
        key = json.dumps([dataclasses.asdict(cfg.model), dataclasses.asdict(cfg.data), args.trunk_steps,
                          args.trunk_lr, args.batch_size, args.train_prompts, seed, args.operations,
                          args.tokenizer, args.tokenizer_vocab], sort_keys=True)
        trunk_reused = key in _TRUNKS
        if not trunk_reused:
            docs = [ex.prompt + sol for ex, sol in task.sft_examples("train", args.train_prompts, seed)]
            _TRUNKS[key] = rm_lib.pretrain_trunk(
                cfg.model, tokenizer, docs, steps=args.trunk_steps, batch_size=args.batch_size,
                lr=args.trunk_lr, seed=seed, progress=progress)
        trunk, trunk_history = _TRUNKS[key]
        print(f"[reward model] base model next-token loss {trunk_history[0]['loss']:.3f} -> "
              f"{np.mean([h['loss'] for h in trunk_history[-20:]]):.3f}"
              + (" (trained earlier in this process, reused)" if trunk_reused else ""))

    if args.train_samples:
        train = rm_lib.read_samples(args.train_samples)
    else:
        train = rm_lib.labelled_samples(task, "train", args.train_prompts, seed,
                                        samples_per_prompt=args.samples_per_prompt,
                                        wrong_step_prob=cfg.data.wrong_step_prob, **sft_kwargs)
    if args.held_out_samples:
        held_out = rm_lib.read_samples(args.held_out_samples)
    else:
        held_out = rm_lib.labelled_samples(task, "test", args.eval_prompts, seed + 1,
                                           samples_per_prompt=args.samples_per_prompt,
                                           wrong_step_prob=cfg.data.wrong_step_prob, **sft_kwargs)
    validation = None
    if args.validation_fraction > 0:
        train, validation = rm_lib.split_by_prompt(train, args.validation_fraction, seed)
        if not rm_lib.has_same_prompt_pair(validation):
            parser.error(f"the validation questions ({args.validation_fraction} of the training ones) have no "
                         f"question with both a right and a wrong sample: raise --validation-fraction, or set it to "
                         f"0 to keep the last step's model")
    if args.train_samples and args.synthetic_prompts:
        train += rm_lib.labelled_samples(task, "train", args.synthetic_prompts, seed,
                                         samples_per_prompt=args.samples_per_prompt,
                                         wrong_step_prob=cfg.data.wrong_step_prob, **sft_kwargs)
    model, history = rm_lib.train_reward_model(
        cfg.model, tokenizer, train, kind=args.kind, loss=args.loss, steps=cfg.run.steps,
        batch_size=args.batch_size, seed=seed, init_params=trunk, optimizer=cfg.optimizer,
        progress=progress, read=args.read, lm_weight=args.lm_weight, likelihood=args.likelihood,
        validation=validation, eval_every=args.eval_every, answer_task=task if args.answer_check else None)

    if validation:
        evals = [(h["validation_pairwise"], h["step"] + 1) for h in history if "validation_pairwise" in h]
        print(f"[reward model] kept step {model.trained_steps} of {cfg.run.steps}: validation pairwise "
              f"{max(evals)[0]:.3f} on {len(validation)} samples (last step {evals[-1][0]:.3f})")
    metrics = {"kind": model.kind, "loss": model.loss, "task": task_description(task), "steps": cfg.run.steps,
               "trunk_steps": args.trunk_steps, "trunk_reused": trunk_reused, "train_samples": len(train),
               "validation_samples": len(validation or ()), "kept_step": model.trained_steps,
               "held_out_samples": len(held_out),
               "held_out_fraction_correct": float(np.mean([s.correct for s in held_out])),
               "final_train_loss": float(np.mean([h["loss"] for h in history[-20:]]))}
    metrics |= held_out_metrics(model, held_out)
    metrics["ranks"] = ranking_warning(metrics["held_out_pairwise_accuracy"]) is None
    metrics["seconds"] = time.perf_counter() - t0
    metrics["config"] = cfg.to_dict()
    metrics["args"] = vars(args)

    model.save(os.path.join(run_dir, "reward_model"))
    with open(os.path.join(run_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2, sort_keys=True)
    with open(os.path.join(run_dir, "history.json"), "w") as f:
        json.dump(history, f)
    shown = {k: _rounded(v) for k, v in metrics.items() if k not in ("config", "args")}
    print(f"[reward model] {json.dumps(shown)}")
    for warning in warnings(metrics):
        print(f"[reward model] {warning}")
    print(f"[reward model] wrote {run_dir}/reward_model, metrics.json, history.json "
          f"(use it in RL with rl.reward_model={os.path.join(run_dir, 'reward_model')})")
    return metrics


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
