"""What the Figure 5 arms' final policies answer: right, or what a shortcut would answer.

For seed ``--seed`` of every arm of a finished `experiments/figure5_sparse.py` study, the
final checkpoint answers the study's held-out questions greedily; printed per arm: the
accuracy, the share of answers whose units digit is right (it needs no carrying), and the
share of answers equal to each shortcut rule's guess (`grpo_jax.tasks.shortcuts`, fitted on the
training split). An accuracy that sits on a rule's score with answers that match that rule
is the rule, not carrying.

    python experiments/figure5_answers.py --out runs/figure5_sparse --seed 0
"""

from __future__ import annotations

import argparse
import os


def main(argv=None) -> dict:
    import common
    import figure5_sparse as f5
    import jax

    from grpo_jax.checkpoints import checkpointing
    from grpo_jax.model import transformer as model
    from grpo_jax import config as config_lib
    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.sampler import Sampler
    from grpo_jax.parallel.sharding import mesh_from_shape
    from grpo_jax.tasks.shortcuts import fit_examples

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--out", default="runs/figure5_sparse", help="the study's output directory")
    p.add_argument("--seed", type=int, default=0, help="which seed's final checkpoints")
    args = p.parse_args(argv)
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}"] + f5.SPARSE_REGIME)
    task = common.make_task("arithmetic", cfg.data)
    tok, cfg = common.tokenizer_for(task, cfg, args.out, args.tokenizer_vocab)
    examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    rules = task.shortcuts(fit_examples(task))
    mesh = mesh_from_shape((1, 1, 1))
    abstract = checkpointing.abstract_like(model.param_shapes(cfg.model), model.param_shardings(cfg.model, mesh))
    out = {}
    for arm in f5.ARMS:
        ckpt = checkpointing.Checkpointer(os.path.join(args.out, f5.slug(arm), f"seed{args.seed}", "checkpoints"))
        step = ckpt.latest_step()
        params = None if step is None else ckpt.restore_params(abstract, step)
        ckpt.close()
        if params is None:
            continue
        ev = evaluate(Sampler.for_run(cfg, mesh, tok), params, task, tok, examples, key=jax.random.key(1), texts=True)
        answers = [task.extract_answer(t) for t in ev["texts"]]
        n = len(examples)
        units = sum(a is not None and int(a) % 10 == int(ex.answer) % 10 for a, ex in zip(answers, examples)) / n
        match = {name: sum(a is not None and a == guess(ex) for a, ex in zip(answers, examples)) / n
                 for name, guess in rules.items()}
        out[arm] = {"step": step, "accuracy": ev["accuracy"], "units_digit_right": units, "answer_is_rule": match}
        print(f"[answers] {arm:13s} step {step}: accuracy {ev['accuracy']:.3f}; units digit right {units:.3f}; "
              f"answer equals: " + ", ".join(f"{k} {v:.3f}" for k, v in match.items()))
    common.write_json(os.path.join(args.out, f"answers_seed{args.seed}.json"), out)
    return out


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
