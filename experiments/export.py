"""Export a training run's policy as an HF folder (`grpo-export` once the package is
installed); see grpo_jax/cli/export.py.

    python experiments/export.py runs/my_run --out exported/my_run
"""

from grpo_jax import cli
from grpo_jax.cli.export import main

if __name__ == "__main__":
    cli.run(main)
