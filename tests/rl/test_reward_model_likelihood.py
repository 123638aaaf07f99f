"""The likelihood-aware score: value head + a learned scale x the trunk's log-likelihood of the
completion so far; the PRM's read position; save / load of both."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.config import ModelConfig
from grpo_jax.model import transformer as model_lib
from grpo_jax.rl.reward_models import RewardModel
from grpo_jax.rl.reward_models.scorer import (LIKELIHOOD_SCALE, add_likelihood_scale, encode, pad_batch,
                                              read_ends, token_values)
from grpo_jax.text.tokenizer import train_sentencepiece


@pytest.fixture(scope="module")
def tok():
    return train_sentencepiece([f"Q: {i}+{i % 7}=?\n{i}+{i % 7}={2 * i % 13}\nA: {i}\n" for i in range(200)],
                               vocab_size=32)


@pytest.fixture(scope="module")
def cfg(tok):
    return ModelConfig(vocab_size=tok.vocab_size, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=16, mlp_dim=64, max_seq_len=48)


def test_the_score_adds_the_scaled_completion_log_likelihood(tok, cfg):
    """values = value head + s * C_t, C_t = sum of log-softmax(logits)[next token] over the
    completion's tokens up to t, computed here from the full logits with numpy."""
    params = add_likelihood_scale(model_lib.init_params(cfg, jax.random.key(0), value_head=True), 0.7)
    pairs = [("Q: 3+3=?\n", "3+3=6\nA: 6\n"), ("Q: 12+5=?\n", "12+5=4\n")]
    enc = [encode(tok, p, c, (), cfg.max_seq_len) for p, c in pairs]
    batch = pad_batch(enc, 2, 32, 1, tok.pad_id)
    got = np.asarray(token_values(cfg, params, batch["tokens"], batch["mask"], batch["start"]))
    head = np.asarray(token_values(cfg, {k: v for k, v in params.items() if k != LIKELIHOOD_SCALE},
                                   batch["tokens"], batch["mask"], batch["start"]))
    logits = np.asarray(model_lib.forward_logits(cfg, params, batch["tokens"], batch["mask"]), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for i, (e, (p, _)) in enumerate(zip(enc, pairs)):
        assert e.start == len(tok.encode(p, add_bos=True))
        n = len(e.tokens)
        c = 0.0
        for t in range(n):
            if t >= e.start:
                c += logp[i, t - 1, e.tokens[t]]
            np.testing.assert_allclose(got[i, t], head[i, t] + 0.7 * c, rtol=2e-5, atol=2e-5)


def test_read_value_moves_a_step_end_off_its_newline():
    text = "1+2=3\n3-1=2\n\nA: 2"
    assert read_ends(text, [6, 12, 17], "end") == [6, 12, 17]
    assert read_ends(text, [6, 12, 17], "value") == [5, 11, 17]  # the last step has no newline
    assert read_ends("\n\n", [1, 2], "value") == [1, 2]  # a blank line stays where it is


def test_save_load_keeps_the_scale_and_the_read(tok, cfg, tmp_path):
    params = add_likelihood_scale(model_lib.init_params(cfg, jax.random.key(1), value_head=True), -0.3)
    model = RewardModel(cfg, params, tok, "process", read="value", trained_steps=5)
    model.save(tmp_path / "prm")
    again = RewardModel.load(tmp_path / "prm")
    assert again.read == "value" and float(again.params[LIKELIHOOD_SCALE]) == pytest.approx(-0.3)
    prompts, comps = ["Q: 3+3=?\n"] * 2, ["3+3=6\nA: 6\n", "3+3=7\nA: 7\n"]
    assert again.step_scores(prompts, comps) == model.step_scores(prompts, comps)
    plain = RewardModel(cfg, {k: v for k, v in params.items() if k != LIKELIHOOD_SCALE}, tok, "process")
    assert plain.step_scores(prompts, comps) != model.step_scores(prompts, comps)
