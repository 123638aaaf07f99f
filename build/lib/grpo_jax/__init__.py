"""grpo_jax: GRPO, PPO and the DeepSeekMath unified RL paradigm in JAX/Flax."""

__version__ = "0.1.0"
