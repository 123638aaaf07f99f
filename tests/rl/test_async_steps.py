"""rl.async_steps = k: the batch trained at step t was sampled with the weights of step
t - k, the loss takes the sampler's log-probs as π_θold, k = 0 is the synchronous loop, and a
run stopped with batches in flight resumes exactly."""

import os
import signal
import zlib

import jax
import numpy as np
import pytest

from grpo_jax.rl import algorithms
from grpo_jax.parallel import preemption
from grpo_jax.rl.batching import make_batch
from grpo_jax.config import ConfigError
from grpo_jax.parallel.preemption import Preempted
from tests.parallel.test_preemption import _comparable, _uninterrupted
from tests.rl.test_trainer import _cfg, _trainer, tok  # noqa: F401 (tok: the fixture)


def _fingerprint(params) -> int:
    """A content hash of a (tiny, float32) params tree, taken on the host."""
    return zlib.crc32(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(params)))


class _Recording:
    """Stands in for a trainer's sampler or train step: records what passes through, and
    delegates everything else."""

    def __init__(self, inner, calls):
        self._inner, self.calls = inner, calls

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Sampler(_Recording):
    def generate(self, weights, prompts, **kw):
        rollout = self._inner.generate(weights, prompts, **kw)
        self.calls.append((_fingerprint(weights), np.asarray(rollout.tokens), np.asarray(rollout.logprobs)))
        return rollout


class _Step(_Recording):
    def __call__(self, state, batch):
        self.calls.append((_fingerprint(state.params), batch))
        return self._inner(state, batch)


def test_the_batch_trained_at_step_t_was_sampled_with_the_weights_of_step_t_minus_k(tmp_path, tok):
    k, steps = 2, 3
    trainer = _trainer(_cfg(tmp_path, tok, f"rl.async_steps={k}", f"run.steps={steps}", "run.checkpoint_every=0"), tok)
    sampled, trained = [], []
    trainer.sampler, trainer.step_fn = _Sampler(trainer.sampler, sampled), _Step(trainer.step_fn, trained)
    history = trainer.train()
    trainer.close()
    assert len(sampled) == steps + k  # batches 0..k at the first step, then one a step
    for t, (weights_t, batch) in enumerate(trained):
        [(weights, logprobs)] = [(w, lp) for w, tokens, lp in sampled if np.array_equal(tokens, batch.tokens)]
        assert weights == trained[max(t - k, 0)][0], t
        np.testing.assert_array_equal(batch.sample_logprobs, logprobs)  # the behaviour log-probs are the sampler's
        assert history[t]["staleness"] == min(t, k)
    # The weights change every step, so a stale batch's ratio moves off 1; the first batch is on-policy.
    assert len({w for w, _ in trained}) == steps
    assert history[0]["ratio_deviation_max"] < 1e-5 < history[-1]["ratio_deviation_max"]


def test_k0_is_the_synchronous_loop_and_its_ratio_is_exactly_1(tmp_path, tok):
    """k = 0: each step trains the batch its own weights sampled (Algorithm 1, written out
    here), with the same metrics bit for bit, and ρ = π_θ/sg(π_θ) = 1 exactly at μ = 1."""
    over = ("run.steps=3", "run.checkpoint_every=0")
    trainer = _trainer(_cfg(tmp_path / "k0", tok, *over), tok)
    history = trainer.train()
    trainer.close()
    loop = _trainer(_cfg(tmp_path / "loop", tok, *over), tok)
    for step, h in enumerate(history):
        batch, info = loop.make_batch(step, jax.random.fold_in(loop.rng, step))
        loop.state, metrics = loop.step_fn(loop.state, loop._on_mesh(loop.step_fn.packed(batch)))
        assert {k: float(v) for k, v in metrics.items()} == {k: h[k] for k in metrics}, step
        assert info["reward_mean"] == h["reward_mean"] and "staleness" not in h
        assert h["ratio_deviation_max"] == 0.0 and h["ratio_deviation_mean"] == 0.0
    loop.close()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), trainer.params, loop.params)


def test_the_loss_takes_the_samplers_logprobs_as_the_old_policy(tmp_path, tok):
    """Without TIS π_θold is the sampler's at every μ (no recomputed forward); with TIS it is
    π_θ and the TIS weight carries π_θ/π_sampler."""
    rng = np.random.default_rng(0)
    rows, tc = 8, 4
    batch = make_batch(np.ones((rows, 2), np.int32), np.ones((rows, 2), bool), rng.integers(0, 9, (rows, tc)),
                       np.ones((rows, tc), bool), sample_logprobs=-rng.random((rows, tc), np.float32),
                       rewards=rng.random(rows, np.float32))
    grpo, ppo = algorithms.GRPO(), algorithms.PPO()
    stale = _cfg(tmp_path, tok, "rl.async_steps=1", "rl.num_updates=2")
    assert not grpo.needs_old_logprobs(stale) and ppo.needs_old_logprobs(stale)  # PPO: its KL reward reads π_θ
    recomputed = -np.ones((rows, tc), np.float32)
    for algo, kw in ((grpo, {}), (ppo, {"old_logp": recomputed, "old_values": np.zeros((rows, tc), np.float32)})):
        extras, _ = algo.extras_from_logprobs(batch, stale, group_size=4, ref_logp=recomputed, **kw)
        np.testing.assert_array_equal(extras.old_logp, batch.sample_logprobs)
    tis = _cfg(tmp_path, tok, "rl.async_steps=1", "rl.num_updates=2", "rl.tis_cap=2")
    assert grpo.needs_old_logprobs(tis)
    extras, _ = grpo.extras_from_logprobs(batch, tis, group_size=4, old_logp=recomputed, ref_logp=recomputed)
    np.testing.assert_array_equal(extras.old_logp, recomputed)
    synchronous = _cfg(tmp_path, tok, "rl.num_updates=2")
    extras, _ = grpo.extras_from_logprobs(batch, synchronous, group_size=4, old_logp=recomputed, ref_logp=recomputed)
    np.testing.assert_array_equal(extras.old_logp, recomputed)


def test_async_steps_is_refused_where_it_cannot_work(tmp_path, tok):
    with pytest.raises(ConfigError, match="rl.async_steps=1 needs rl.algorithm=ppo or grpo"):
        _cfg(tmp_path, tok, "rl.async_steps=1", "rl.algorithm=online_rft")
    with pytest.raises(ConfigError, match="rl.async_steps must be >= 0"):
        _cfg(tmp_path, tok, "rl.async_steps=-1")


def test_a_run_stopped_with_a_batch_in_flight_resumes_exactly(tmp_path, tok):
    """k = 1: a checkpoint holds the batch sampled by the weights before it; a resume from a
    scheduled save, and one from a SIGTERM's while batch t + 1 was being sampled, trains
    what an uninterrupted run trains."""
    over = ("rl.async_steps=1", "run.steps=4", "run.checkpoint_every=3", "rl.sample_prompts=2")
    want, whole = _uninterrupted(_cfg(tmp_path / "whole", tok, *over), tok)
    first = _trainer(_cfg(tmp_path / "part", tok, *over), tok)
    first.train(steps=3)  # "killed" after the checkpoint at step 3
    first.close()
    resumed = _trainer(_cfg(tmp_path / "part", tok, *over), tok)
    assert resumed.start_step == 3 and list(resumed.in_flight) == [3]
    assert _comparable(first.history + resumed.train()) == _comparable(want)
    resumed.close()
    stopped = _trainer(_cfg(tmp_path / "stopped", tok, *over), tok)
    make_batch = stopped.make_batch

    def signal_while_sampling(step, key):
        if step == 3:  # batch 3, sampled during the third step: stopped after its first call
            os.kill(os.getpid(), signal.SIGTERM)
        return make_batch(step, key)

    stopped.make_batch = signal_while_sampling
    with pytest.raises(Preempted) as stop:
        stopped.train()
    stopped.close()
    preemption.clear()
    assert stop.value.step == 2  # the third step's update never ran; step 2 is saved with batch 2
    again = _trainer(_cfg(tmp_path / "stopped", tok, *over), tok)
    assert again.start_step == 2 and list(again.in_flight) == [2]
    assert _comparable(stopped.history + again.train()) == _comparable(want)
    again.close()
    for params in (resumed.params, again.params):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params, whole.params)
