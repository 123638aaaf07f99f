"""Plain next-token training of the trunk a reward model starts from (`pretrain_trunk`),
with the policy's chunked log-probs and SFT loss (no [B, T, V] logits array)."""
from __future__ import annotations

import functools
import random
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax.model import transformer as model_lib
from grpo_jax.config import ModelConfig, OptimizerConfig
from grpo_jax.model.logprobs import token_logprobs
from grpo_jax.rl.losses import aggregate, sft_loss
from grpo_jax.rl.optimizer import make_optimizer
from grpo_jax.rl.reward_models.scorer import Encoded, bucket, pad_batch
from grpo_jax.rl.reward_models.training import Stream, progress_bar
from grpo_jax.text.tokenizer import Tokenizer


def pretrain_trunk(
    cfg_model: ModelConfig,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    init_params: Any = None,
    progress: bool = True,
) -> tuple[Any, list[dict[str, float]]]:
    """Next-token training on documents: the base model a reward model starts from.

    The paper trains its reward models from DeepSeekMath-Base, a model that already does
    the arithmetic the reward model has to check. A reward model trained from a random
    trunk sees one bit per sample and must discover arithmetic from it (a three-way
    relation between a, b and c): the tiny CPU model stays at chance for thousands of
    steps. Next-token training on worked solutions gives it those features in a few
    hundred. Minimises mean −log π(x_t | x_<t) over the real tokens of ``[bos] text [eos]``.
    Returns (params without a value head, per-step metrics).
    """
    texts = list(texts)
    if not texts:
        raise ValueError("pretrain_trunk: no texts")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
    enc = [Encoded(tuple(tokenizer.encode(t, add_bos=True)[-cfg_model.max_seq_len + 1:]
                         + [tokenizer.eos_id]), ()) for t in texts]
    length = bucket(max(len(e.tokens) for e in enc), cfg_model.max_seq_len)
    stream = Stream(range(len(enc)), random.Random(f"pretrain_trunk/{seed}"))
    params = (model_lib.init_params(cfg_model, jax.random.key(seed)) if init_params is None
              else jax.tree.map(jnp.array, dict(init_params)))
    tx, schedule = make_optimizer(OptimizerConfig(peak_lr=lr, warmup_steps=min(10, steps // 10)), steps)
    opt_state = tx.init(params)
    lrs = np.asarray(jax.vmap(schedule)(jnp.arange(steps)))

    def nll(p, tokens, mask):
        hidden, _ = model_lib.forward_hidden(cfg_model, p, tokens[:, :-1], mask[:, :-1])
        unembed, vocab_major = model_lib.unembedding(cfg_model, p)
        logp = token_logprobs(hidden, unembed, tokens[:, 1:], vocab_major=vocab_major)
        return aggregate(sft_loss(logp), mask[:, 1:], "token_mean")

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_fn(p, s, tokens, mask):
        value, grads = jax.value_and_grad(nll)(p, tokens, mask)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    out: list[dict[str, float]] = []
    bar = progress_bar(progress, steps, "trunk (next-token)")
    try:
        for step in range(steps):
            batch = pad_batch([enc[i] for i in stream.take(batch_size)], batch_size, length, 1,
                              tokenizer.pad_id)
            params, opt_state, value = step_fn(params, opt_state, batch["tokens"], batch["mask"])
            out.append({"step": step, "loss": float(value), "lr": float(lrs[step])})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{out[-1]['loss']:.4f}")
    finally:
        if bar is not None:
            bar.close()
    return params, out
