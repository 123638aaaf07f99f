"""Evaluate a model on a benchmark (`grpo-evaluate` once the package is installed); see
grpo_jax/cli/evaluate.py.

    python experiments/evaluate.py --model smollm2-135m --task gsm8k_synth --limit 50
"""

from grpo_jax import cli
from grpo_jax.cli.evaluate import main

if __name__ == "__main__":
    cli.run(main)
