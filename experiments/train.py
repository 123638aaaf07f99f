"""The generic training CLI (`grpo-train` once the package is installed); see grpo_jax/cli/train.py.

    python experiments/train.py --preset cpu-tiny rl.algorithm=sft run.steps=200 run.run_dir=runs/sft
"""

from grpo_jax import cli
from grpo_jax.cli.train import main

if __name__ == "__main__":
    cli.run(main)
