"""Which arithmetic steps a quickstart seed gets right, before and after GRPO.

Reads one seed of a finished `experiments/quickstart.py` run (its SFT and GRPO checkpoints)
and, on the held-out questions, scores every step of the worked solution by its kind:
position (first step, later steps) × carry / borrow / plain, counting a step only when
every step before it was right. Greedy (T = 0) and sampled (T = 1, `--samples` per
question); also the share of questions none of whose samples is right, where GRPO's group
baseline has no signal.

    python experiments/step_accuracy.py --seed 1 run.run_dir=runs/quickstart
    python experiments/step_accuracy.py --seed 1 run.run_dir=/tmp/qs data.slip=carry

Pass the same overrides as the quickstart run (the run's saved config is checked against them).
"""

from __future__ import annotations

import argparse
import collections
import os

import common
import jax
import numpy as np
import quickstart

from grpo_jax import config as config_lib
from grpo_jax import sampler
from grpo_jax.eval.evaluation import completion_texts
from grpo_jax.parallel.sharding import to_host
from grpo_jax.tasks.arithmetic import carry_slip, solution_steps
from grpo_jax.text.tokenizer import encode_prompt
from grpo_jax.rl.trainer import Trainer


def step_kind(a: int, op: str, b: int) -> str:
    if carry_slip(a, op, b) is None:
        return "plain"
    return "carry" if op == "+" else "borrow"


def score(task, examples, texts: list[str], per_question: int) -> tuple[dict, np.ndarray]:
    """({(position, kind): [right, seen]}, [questions] fraction of right answers)."""
    steps = collections.defaultdict(lambda: [0, 0])
    right = np.zeros(len(examples))
    for q, ex in enumerate(examples):
        for text in texts[q * per_question:(q + 1) * per_question]:
            right[q] += task.is_correct(task.extract_answer(text), ex) / per_question
            lines = text.split("\n")
            for j, (a, op, b, c) in enumerate(solution_steps(ex.meta["operands"], ex.meta["ops"])):
                ok = j < len(lines) and lines[j] == f"{a}{op}{b}={c}"
                cell = steps[("first" if j == 0 else "later", step_kind(a, op, b))]
                cell[0] += ok
                cell[1] += 1
                if not ok:
                    break
    return steps, right


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--seed", type=int, default=0, help="the quickstart seed to read")
    p.add_argument("--samples", type=int, default=32, help="samples per question at T = 1")
    args = p.parse_args(argv)
    base = common.load_cfg(args, ["run.run_dir=runs/quickstart"] + quickstart.QUICKSTART_DEFAULTS)
    root = os.path.join(base.run.run_dir, f"seed{args.seed}")
    if not os.path.isdir(os.path.join(root, "sft")):
        p.error(f"no quickstart run in {root}: run experiments/quickstart.py --seeds {args.seed} first")
    cfg = config_lib.apply_overrides(base, [f"run.seed={args.seed}", f"run.run_dir={root}"]).validate()
    task = common.make_task("arithmetic", cfg.data)
    tok, cfg = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    args.no_progress = True
    sft, mesh = common.sft_start(cfg, task, tok, root, args)  # restored, not retrained
    policies = {"after SFT": sft}
    if os.path.isdir(os.path.join(root, "grpo")):
        trainer = Trainer(common.rl_config(cfg, root, "grpo", ["rl.algorithm=grpo"]), task=task, tokenizer=tok,
                          params=sft, mesh=mesh, eval_examples=[], progress=False)
        trainer.train()  # a finished run: restores its last checkpoint
        policies["after GRPO"] = trainer.params
        trainer.close()
    examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    prompts = [encode_prompt(tok, e.prompt) for e in examples]
    out = {}
    run_sampler = sampler.Sampler.for_run(cfg, mesh, tok)
    for name, params in policies.items():
        for temperature, g in ((0.0, 1), (1.0, args.samples)):
            at = run_sampler.evaluation(temperature)  # the run's engine and lengths, untruncated
            ro = at.sample(at.copy(params), prompts, key=jax.random.key(5), group_size=g)
            steps, right = score(task, examples, completion_texts(jax.tree.map(to_host, ro), tok), g)
            cells = {f"{pos} {kind}": (r / n, n) for (pos, kind), (r, n) in sorted(steps.items())}
            out[f"{name}, T={temperature:g}"] = {"accuracy": float(right.mean()),
                                                 "no_right_sample": float(np.mean(right == 0)), "steps": cells}
            print(f"[steps] seed {args.seed} {name}, T={temperature:g}: accuracy {right.mean():.3f}"
                  + (f", questions with no right sample {np.mean(right == 0):.3f}" if g > 1 else "")
                  + "; step right-rate (steps seen): "
                  + ", ".join(f"{k} {v:.2f} ({n})" for k, (v, n) in cells.items()))
    common.write_json(os.path.join(root, "step_accuracy.json"), out)
    return out


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
