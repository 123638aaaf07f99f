"""Every published study's held-out set beside its shortcut baselines.

A held-out accuracy shows learning only where it clears what rules that skip the skill
score on the same questions (`grpo_jax.tasks.shortcuts`: the commonest training answer, and the
task's own rules fitted on its training split). This regenerates each study's held-out set
with the study's own defaults and prints, per study: the questions (and how many are
distinct), the best constant, the best shortcut and every rule's score; `--json` writes them.

    python experiments/shortcut_audit.py
    python experiments/shortcut_audit.py --json runs/shortcut_audit.json

No model runs: this takes seconds.
"""

from __future__ import annotations

import argparse
import json
import random

# study -> (the config overrides its script applies on top of common.CPU_DEFAULTS, or a
# task built otherwise: 'chat_arithmetic' / 'word_arithmetic' / 'custom_task').
STUDIES = {
    "quickstart (make demo)": ["data.slip=carry_habit"],
    "PPO vs GRPO": [],
    "Figure 7 (Maj@K vs Pass@K)": ["data.eval_size=64"],
    "Figure 6 (iterative RL)": [],
    "Figure 5, dense (ablation_supervision.py, removed)": ["data.num_operands=8"],
    "Figure 5, sparse, first design": ["data.num_operands=8", "data.min_carries=6"],
    "SmolLM2 chat arithmetic": "chat_arithmetic",
    "SmolLM2 word arithmetic (issue #84)": "word_arithmetic",
    "custom task (README)": "custom_task",
}


def held_out_set(study: str):
    """(task, held-out examples) of a study, as its script draws them."""
    import common
    import custom_task

    from grpo_jax import config as config_lib
    from grpo_jax.tasks import get_task
    from grpo_jax.tasks.custom import CustomTask
    from grpo_jax.tasks.shortcuts import numeric_rules

    spec = STUDIES[study]
    if spec == "chat_arithmetic":
        task = get_task("chat_arithmetic")
        return task, task.examples("test", 100, config_lib.DataConfig.seed)
    if spec == "word_arithmetic":  # experiments/smollm2_grpo.py --task word_arithmetic: 192 held out
        task = get_task("word_arithmetic")
        return task, task.examples("test", 192, config_lib.DataConfig.seed)
    if spec == "custom_task":
        # custom_task.py passes numeric_rules (its own name `shortcuts` is the module)
        task = CustomTask(custom_task.question, custom_task.reward, solution=custom_task.solution,
                          shortcuts=numeric_rules)
        return task, task.examples("test", config_lib.DataConfig.eval_size, config_lib.DataConfig.seed)
    cfg = config_lib.apply_overrides(config_lib.get_preset("cpu-tiny"), common.CPU_DEFAULTS + spec)
    task = common.make_task("arithmetic", cfg.data)
    return task, task.examples("test", cfg.data.eval_size, cfg.data.seed)


def audit(studies=STUDIES) -> dict[str, dict]:
    from grpo_jax.tasks.shortcuts import shortcut_baselines

    out = {}
    for study in studies:
        task, examples = held_out_set(study)
        out[study] = shortcut_baselines(task, examples).to_dict()
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="also write the table as JSON here")
    args = p.parse_args(argv)
    random.seed(0)
    table = audit()
    print(f"{'study':44s} {'questions':>9s} {'distinct':>8s} {'constant':>8s} {'best':>6s}  best rule")
    for study, row in table.items():
        print(f"{study:44s} {row['num_questions']:9d} {row['distinct_questions']:8d} "
              f"{row['scores']['constant']:8.3f} {row['best_score']:6.3f}  {row['best']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)
        print(f"wrote {args.json}")
    return table


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
