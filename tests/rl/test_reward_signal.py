"""GRPO with no group of varying rewards learns nothing (issue 86): the Trainer says so once the
streak reaches reward_signal.NO_SIGNAL_STEPS, and says which path has a signal."""
import logging

import jax

from grpo_jax import config as config_lib
from grpo_jax.model.transformer import init_params
from grpo_jax.rl import reward_signal
from grpo_jax.rl.trainer import Trainer
from grpo_jax.tasks.custom import CustomTask
from grpo_jax.text.tokenizer import train_sentencepiece

PAIRS = [(f"{a}+{b}=", str(a + b)) for a in range(4) for b in range(4)]


def test_the_streak_counts_flat_steps_and_warns_once_when_it_reaches_the_limit():
    flat, varied = {"groups_varying_fraction": 0.0}, {"groups_varying_fraction": 0.25}
    streaks, streak = [], 0
    for metrics in [flat, flat, varied, *[flat] * 11, {"loss": 0.0}]:
        streak = reward_signal.flat_steps(streak, metrics)
        streaks.append(streak)
    assert streaks == [1, 2, 0, *range(1, 12), 0]
    warnings = [reward_signal.warning(s, done) for done, s in enumerate(streaks, 1)]
    assert [w for w in warnings if w] == [f"steps 4-13: {reward_signal.NO_SIGNAL}"]
    assert reward_signal.NO_SIGNAL == ("no group has varying rewards: GRPO has no signal; start from SFT "
                                       "(sft_then_rl) or a pretrained model")


def test_a_reward_that_never_varies_is_named_by_the_trainer(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(reward_signal, "NO_SIGNAL_STEPS", 2)
    tok = train_sentencepiece([p + a for p, a in PAIRS] * 5 + ["0123456789+=\n"], vocab_size=24)
    cfg = config_lib.load_config("cpu-tiny", [
        "model.embed_dim=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "model.mlp_dim=64", "model.max_seq_len=32", f"model.vocab_size={tok.vocab_size}", "rl.group_size=2",
        "rl.max_new_tokens=4", "data.batch_size=2", "run.steps=3", "run.eval_every=0", "run.checkpoint_every=100",
        f"run.run_dir={tmp_path}"])
    trainer = Trainer(cfg, task=CustomTask(PAIRS, lambda p, c, a: 0.0), tokenizer=tok,
                      params=init_params(cfg.model, jax.random.key(0)), eval_examples=[], progress=False)
    with caplog.at_level(logging.WARNING):
        history = trainer.train()
    trainer.close()
    assert [m["groups_varying_fraction"] for m in history] == [0.0, 0.0, 0.0]
    assert [r.getMessage() for r in caplog.records if "GRPO has no signal" in r.getMessage()] == [
        f"steps 1-2: {reward_signal.NO_SIGNAL}"]
