"""Options that were once silently ignored or did something other than their name (issue 18).

Each test here failed before its fix. Everything runs on log-prob arrays or tiny configs.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import algorithms as alg
from grpo_jax.config import Config, RLConfig
from tests.random_batches import B, G, random_batch, random_logps


def _cfg(**rl) -> Config:
    return Config(rl=RLConfig(group_size=G, **rl))


def _lengths(batch):
    return np.asarray(batch.mask).sum(1).astype(np.float64)


def _group_adv(batch):
    r = np.asarray(batch.rewards, np.float64).reshape(-1, G)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)


# ----------------------------------------------------------------- fix 7

def test_truncated_sampling_uses_the_samplers_logprobs_as_pi_old():
    """top-k: at μ = 1 the ratio is π_θ / π_sampler (the sampler's renormalised log-probs),
    not 1. Unclipped (wide ε): d loss / d logp = −Â ρ / (|o| B)."""
    cfg, batch = _cfg(beta=0.0, top_k=5, eps_low=0.999, eps_high=1e6), random_batch(3)
    algo = alg.get_algorithm("grpo")
    logp = random_logps(4, batch)
    extras, _ = algo.extras_from_logprobs(batch, cfg)
    grad = jax.grad(lambda lp: algo.loss_from_logprobs(lp, batch, extras, cfg))(logp)
    rho = np.exp(np.asarray(logp, np.float64) - np.asarray(batch.sample_logprobs, np.float64))
    expected = np.where(batch.mask, -_group_adv(batch)[:, None] * rho / _lengths(batch)[:, None] / B, 0.0)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-6)
    assert np.abs(rho[np.asarray(batch.mask)] - 1).max() > 0.5  # the ratio is far from 1 here


# ----------------------------------------------------------------- fix 2

@pytest.mark.parametrize("mu,k,expected", [
    # 10 train steps, multistep (×0.316 from step 8, ×0.1 from step 9), no warmup
    (2, 1, [1.0] * 16 + [0.316] * 2 + [0.1] * 2),  # μ = 2: two updates per train step
    (1, 2, [1.0] * 4 + [0.316]),  # k = 2: one update per two train steps (steps 0,2,4,6,8)
    (1, 1, [1.0] * 8 + [0.316, 0.1]),
])
def test_schedule_counts_train_steps_for_any_mu_and_accumulation(mu, k, expected):
    """Drive the real optimiser with μ calls per train step; b1 = b2 = 0 Adam makes each
    applied update's size equal to the learning rate, so this measures the rate applied."""
    from grpo_jax.config import OptimizerConfig
    from grpo_jax.rl.optimizer import make_optimizer, updates_applied

    cfg = OptimizerConfig(peak_lr=1.0, warmup_steps=0, schedule="multistep", weight_decay=0.0,
                          grad_clip=0.0, b1=0.0, b2=0.0, eps=1e-12, grad_accum_steps=k)
    tx, lr = make_optimizer(cfg, 10, updates_per_step=mu)
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    applied = []
    for _ in range(10 * mu):
        u, state = tx.update({"w": jnp.ones(())}, state, params)
        if float(u["w"]) != 0.0:
            applied.append(-float(u["w"]))
    np.testing.assert_allclose(applied, expected, rtol=1e-5)
    assert updates_applied(cfg, 10, mu) == len(expected)
    np.testing.assert_allclose(float(lr(len(expected) - 1)), expected[-1], rtol=1e-6)


# ----------------------------------------------------------------- fix 4

def _tiny_model():
    from grpo_jax.config import ModelConfig
    from grpo_jax.model.transformer import init_params

    mcfg = ModelConfig(vocab_size=64, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=8, mlp_dim=32, max_seq_len=32)
    return mcfg, init_params(mcfg, jax.random.key(0))


@pytest.mark.parametrize("name,expected", [
    ("sft", 1.0), ("rft", 1.0), ("online_rft", 1.0), ("dpo", 1.0), ("ppo", 0.7), ("grpo", 0.7)])
def test_one_temperature_rule(name, expected):
    """Likelihood objectives at T = 1, importance-ratio objectives at rl.temperature."""
    hp = alg.RLHParams.from_config(RLConfig(temperature=0.7))
    assert float(alg.get_algorithm(name).logprob_temperature(hp)) == pytest.approx(expected)


def test_rft_is_sft_on_correct_outputs_at_any_temperature():
    """Eq. 10: with T = 0.7 sampling, RFT's loss equals SFT's on the correct outputs
    (same tokens, same model, same denominator)."""
    mcfg, params = _tiny_model()
    batch = random_batch(7)
    batch = batch.replace(tokens=np.asarray(batch.tokens) % 64)
    results = {}
    for name in ("sft", "rft"):
        cfg = _cfg(temperature=0.7).replace(model=mcfg)
        a = alg.get_algorithm(name)
        extras, _ = a.extras_from_logprobs(batch, cfg)
        num, den, _ = a.loss_parts(params, batch, extras, cfg)
        results[name] = float(num / den)
    correct = np.asarray(batch.correct)
    sft_only_correct = batch.replace(mask=np.asarray(batch.mask) & correct[:, None])
    cfg = _cfg(temperature=0.7).replace(model=mcfg)
    sft = alg.get_algorithm("sft")
    extras = alg.Extras(loss_mask=jnp.asarray(sft_only_correct.mask))
    num, _, _ = sft.loss_parts(params, sft_only_correct, extras, cfg)
    # RFT keeps incorrect outputs in the denominator with weight 0 (the B outputs)
    np.testing.assert_allclose(results["rft"], float(num) / B, rtol=1e-5)


# ----------------------------------------------------------------- fixes 1 and 5 (scoring)

class _CharTok:
    """One token per character (ids = ord), stop id 0."""
    stop_ids = (0,)

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def token_end_offsets(self, ids):
        return list(range(1, len(ids) + 1))


class _LineTask:
    """Each line is a step; a step's reward is 1 if the line is 'ok' else 0."""

    def extract_answer(self, text):
        return text

    def is_correct(self, answer, ex):
        return False

    def reward(self, text, ex):
        return -1.0

    def step_rewards(self, text, ex):
        out, pos = [], 0
        for line in text.split("\n"):
            pos += len(line) + 1
            out.append((min(pos, len(text)), 1.0 if line == "ok" else 0.0))
        return out


class _FakeRM:
    def __init__(self, kind):
        self.kind = kind

    def score(self, prompts, texts):
        return np.arange(len(texts), dtype=np.float32) + 10.0

    def step_scores(self, prompts, texts):
        return [[(len(t), 100.0 + i)] for i, t in enumerate(texts)]


def _rollout(texts, width=96):
    tokens = np.zeros((len(texts), width), np.int32)
    mask = np.zeros((len(texts), width), bool)
    for r, t in enumerate(texts):
        ids = [ord(c) for c in t] + [0]
        tokens[r, :len(ids)] = ids
        mask[r, :len(ids)] = True
    from grpo_jax.sampler import Rollout
    b = len(texts)
    return Rollout(prompt_tokens=np.zeros((b, 1), np.int32), prompt_mask=np.ones((b, 1), bool), tokens=tokens,
                   mask=mask, logprobs=np.zeros((b, width), np.float32), lengths=mask.sum(1),
                   finished=np.ones((b,), bool))


@pytest.mark.parametrize("kind", ["outcome", "process"])
@pytest.mark.parametrize("process", [False, True])
def test_a_reward_model_of_either_kind_reaches_the_rewards(kind, process):
    from grpo_jax.tasks import Example
    from grpo_jax.rl.batching import score_rollout

    texts = ["ok\nno", "ok"]
    scores = score_rollout(_LineTask(), _CharTok(), [Example(prompt="q", answer="a")],
                           _rollout(texts), 2, reward_model=_FakeRM(kind), process=process)
    np.testing.assert_array_equal(scores.rewards, [10.0, 11.0])  # never the rule's -1
    if process:  # the fake model's one step per output, ending on the last character
        np.testing.assert_array_equal(scores.step_rewards[:, 0], [100.0, 101.0])
        np.testing.assert_array_equal(scores.step_end[:, 0], [4, 1])
        assert scores.step_mask[:, 0].all() and not scores.step_mask[:, 1:].any()


def test_process_supervision_keeps_every_step():
    """20 steps, the wrong one last: all 20 kept (step axis bucketed to 32), none merged."""
    from grpo_jax.tasks import Example
    from grpo_jax.rl.batching import score_rollout

    long = "\n".join(["ok"] * 19 + ["no"])
    scores = score_rollout(_LineTask(), _CharTok(), [Example(prompt="q", answer="a")],
                           _rollout([long, "ok"]), 2, process=True)
    assert scores.step_rewards.shape == (2, 32)
    np.testing.assert_array_equal(scores.step_mask.sum(1), [20, 1])
    np.testing.assert_array_equal(scores.step_rewards[0, :20], [1.0] * 19 + [0.0])
    np.testing.assert_array_equal(scores.step_end[0, :20], np.arange(2, 60, 3)[:20].clip(max=58))


@pytest.mark.parametrize("algorithm", ["rft", "online_rft", "dpo", "sft"])
def test_reward_model_with_a_rule_reward_algorithm_is_refused(algorithm, tmp_path):
    from grpo_jax.config import ConfigError, apply_overrides, get_preset
    from grpo_jax.rl.trainer import Trainer

    cfg = apply_overrides(get_preset("cpu-tiny"), [f"rl.algorithm={algorithm}",
                                                   f"run.run_dir={tmp_path}"]).validate()
    with pytest.raises(ConfigError, match=f"rl.reward_model.*{algorithm}"):
        Trainer(cfg, task=_LineTask(), tokenizer=_CharTok(), params=None,
                reward_model=_FakeRM("outcome"), sft_data=lambda s: ([], []), progress=False)


# ----------------------------------------------------------------- fix 3

def test_value_model_learning_rate_is_its_own_setting():
    """rl.vf_coef is gone (Adam on a separate value model cancels it); the value model's
    step size is optimizer.value_lr_scale × peak_lr, applied by its own AdamW."""
    from grpo_jax.config import OptimizerConfig
    from grpo_jax.rl.optimizer import make_optimizer, value_optimizer_config

    assert not hasattr(RLConfig(), "vf_coef")
    cfg = OptimizerConfig(peak_lr=0.5, warmup_steps=0, schedule="constant", weight_decay=0.0,
                          grad_clip=0.0, b1=0.0, b2=0.0, eps=1e-12, value_lr_scale=0.1)
    tx, _ = make_optimizer(value_optimizer_config(cfg), 10)
    p = {"w": jnp.zeros(())}
    u, _ = tx.update({"w": jnp.ones(())}, tx.init(p), p)
    np.testing.assert_allclose(float(u["w"]), -0.05, rtol=1e-5)


# ----------------------------------------------------------------- issue 19 (b)

@pytest.mark.parametrize("field,a,b", [("beta", 0.04, 0.5), ("eps_low", 0.2, 0.1), ("eps_high", 0.2, 0.3),
                                       ("gamma", 1.0, 0.9), ("lam", 0.95, 0.5), ("dpo_beta", 0.1, 0.3),
                                       ("temperature", 1.0, 0.7), ("tis_cap", 2.0, 5.0),
                                       ("value_clip", 0.2, 0.1)])
def test_numbers_never_recompile(field, a, b):
    from grpo_jax.rl.train_step import static_config_key

    assert static_config_key(_cfg(**{field: a})) == static_config_key(_cfg(**{field: b}))


@pytest.mark.parametrize("field,value", [
    ("aggregation", "token_mean"), ("kl_estimator", "k1"), ("supervision", "process"),
    ("scale_by_std", False), ("whiten_advantages", False), ("value_clip", 0.0),
    ("skip_zero_variance_groups", True), ("mask_truncated", True), ("advantage_estimator", "rloo"),
    ("policy_loss", "gspo"), ("tis_cap", 2.0), ("top_k", 5)])
def test_modes_are_compiled_in(field, value):
    from grpo_jax.rl.train_step import static_config_key

    assert static_config_key(_cfg(**{field: value})) != static_config_key(_cfg())


def test_ppo_ratio_after_truncated_sampling_is_against_the_sampler():
    batch = random_batch(9)
    logp = random_logps(10, batch)
    for top_k, want in ((5, batch.sample_logprobs), (0, logp)):
        extras, _ = alg.get_algorithm("ppo").extras_from_logprobs(
            batch, _cfg(top_k=top_k), old_logp=logp, old_values=jnp.zeros_like(logp), ref_logp=logp)
        np.testing.assert_array_equal(np.asarray(extras.old_logp), np.asarray(want, np.float32))
