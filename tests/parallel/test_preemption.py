"""Preemption: a SIGTERM at any moment of a run saves the step the run stands at (a step
still sampling is dropped, one whose update has begun is finished), and the same command
(here: a new Trainer on the same run dir) goes on exactly as an uninterrupted run.

Real signals, sent by this process to itself (`os.kill`) from hooks on the Trainer, so each
arrives at a chosen moment: while a step's batch is made, just before its update, or while a
checkpoint is being written; the steps are drawn by a seeded generator. Python runs the
handler as soon as `os.kill` returns, so the tests are deterministic. The multi-process case
(the signal sent to one of two processes forming one mesh) is in tests/parallel/test_multihost.py, the
launch scripts' side in tests/launch/test_dry_run.py.
"""

import json
import os
import random
import re
import signal

import jax
import numpy as np
import pytest

from grpo_jax.checkpoints import checkpointing
from grpo_jax.parallel import preemption
from grpo_jax.errors import CheckpointError
from grpo_jax.rl.metrics import read_jsonl
from grpo_jax.parallel.preemption import Preempted
from tests.rl.test_trainer import _cfg, _read_only, _trainer, tok  # noqa: F401 (tok: the fixture)

TIMINGS = ("sample_time_s", "score_time_s", "update_time_s")


@pytest.fixture(autouse=True)
def _one_train_step_per_config(monkeypatch):
    """Each segment of a test stands for a new process, but tracing and compiling its train
    step again (a pure function of the config and mesh, holding no state) would only cost
    time: the Trainers of one config share one."""
    from grpo_jax.rl import programs

    made, train_step = {}, programs.train_step

    def shared(cfg, mesh):
        settings = cfg.to_dict()
        del settings["run"]["run_dir"]  # the uninterrupted run's and the stopped one's differ only there
        key = (json.dumps(settings, sort_keys=True), mesh)
        if key not in made:
            made[key] = train_step(cfg, mesh)
        return made[key]

    monkeypatch.setattr(programs, "train_step", shared)


@pytest.fixture(autouse=True)
def _forget_signals():
    """Each segment of a test stands for a new process: none inherits a caught signal."""
    preemption.clear()
    yield
    preemption.clear()


def _sigterm():
    os.kill(os.getpid(), signal.SIGTERM)


def stops_at(phase: str, at: int) -> int:
    """Where a SIGTERM during `phase` of step `at` stops the run: a step whose batch is being
    made is dropped (its update has not touched the state), one whose update has begun is
    finished."""
    return at - 1 if phase == "sample" else at


def interrupt(trainer, phase: str, at: int, *, again: bool = False) -> None:
    """SIGTERM this process during step `at` (counted from 1): while its batch is made
    ('sample': the rollout, or the SFT data), just before its update ('update'), or while
    its checkpoint is being written ('save': a scheduled save, in flight in Orbax's
    threads). ``again``: one more SIGTERM while the step the run stops at is being saved."""
    make_batch, on_mesh, save = trainer.make_batch, trainer._on_mesh, trainer.ckpt.save
    orbax = trainer.ckpt._mngr
    wait = orbax.wait_until_finished
    stop, saving = stops_at(phase, at), []

    def make_batch_hook(step, key):
        if phase == "sample" and step + 1 == at:
            _sigterm()
        return make_batch(step, key)

    def on_mesh_hook(batch):
        if phase == "update" and trainer.next_step + 1 == at:
            _sigterm()
        return on_mesh(batch)

    def save_hook(step, *args, **kw):
        saving.append(step)
        return save(step, *args, **kw)

    def wait_hook():
        if saving and saving[-1] == stop:
            for _ in range((phase == "save") + again):
                _sigterm()
        saving.clear()
        return wait()

    trainer.make_batch, trainer._on_mesh, trainer.ckpt.save = make_batch_hook, on_mesh_hook, save_hook
    orbax.wait_until_finished = wait_hook


def _saved_steps(run_dir):
    ckpt = checkpointing.Checkpointer(os.path.join(run_dir, "checkpoints"))
    try:
        return ckpt.all_steps()
    finally:
        ckpt.close()


def _comparable(history):
    return [{k: v for k, v in h.items() if k not in TIMINGS} for h in history]


def run_with_signals(cfg, tok, moments, caplog, sampler_calls=None):
    """Run `cfg` from scratch, stopped by a SIGTERM at each of `moments` ((phase, step,
    again) in step order) and started again with the same config after each stop; return
    the metrics of every step, in order, as the segments ran them. `sampler_calls`: a list
    the sampler's calls are appended to, when the rollout takes several (rl.sample_prompts)."""
    history = []
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    per_step = cfg.data.batch_size // cfg.rl.sample_prompts if cfg.rl.sample_prompts else 1
    for phase, at, again in moments:
        if sampler_calls is not None:
            sampler_calls.clear()
        trainer = _trainer(cfg, tok)
        interrupt(trainer, phase, at, again=again)
        caplog.clear()
        with caplog.at_level("WARNING", logger="grpo_jax"):
            with pytest.raises(Preempted) as stopped:
                trainer.train()
        trainer.close()
        history += trainer.history
        stop, where = stops_at(phase, at), f"SIGTERM {phase} of step {at}"
        # Caught only while training (this test process is still alive), then put back.
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers, where
        assert stopped.value.step == stop and stopped.value.code == preemption.EXIT_CODE, where
        assert [h["step"] for h in trainer.history][-1:] == ([stop] if stop else []), where
        said = [r.getMessage() for r in caplog.records if r.name == "grpo_jax.rl.trainer"]
        if stop:  # the step the run stood at is saved, not only the scheduled save before it
            assert _saved_steps(cfg.run.run_dir)[-1] == stop, where
            assert said == [f"SIGTERM: saved checkpoint step {stop} in {cfg.run.run_dir}/checkpoints and "
                            f"stopped; the same command resumes from step {stop}"], where
        else:
            assert _saved_steps(cfg.run.run_dir) == [], where
            assert said == ["SIGTERM: stopped before the first step; nothing to save"], where
        if sampler_calls is not None and phase == "sample":
            # The rollout stopped after its first call: a preemption waits for one call, not all.
            assert len(sampler_calls) == per_step * len(trainer.history) + 1, (where, sampler_calls)
        if again:  # the second signal waited for the save
            assert any("SIGTERM again" in r.getMessage() for r in caplog.records), where
        preemption.clear()  # the next segment is a new process
    last = _trainer(cfg, tok)
    assert last.start_step == stops_at(*moments[-1][:2])
    history += last.train()
    last.close()
    return history, last


def _uninterrupted(cfg, tok):
    trainer = _trainer(cfg, tok)
    history = trainer.train()
    trainer.close()
    return history, trainer


def _moments(rng, plan):
    """(phase, step, again) for each (phase, candidate steps, again) of `plan`: the step
    drawn by `rng` (seeded: the same moments every run)."""
    return [(phase, rng.choice(steps), again) for phase, steps, again in plan]


@pytest.mark.parametrize("algorithm, steps, every, plan", [
    # GRPO, sampling its 4 questions in 2 calls: a signal while sampling step 2 or 3 (saved:
    # 1 or 2, where no save is scheduled; the second call is not made), then one during step
    # 3's scheduled save, with a second signal while it is in flight.
    ("grpo", 6, 3, [("sample", [2, 3], False), ("save", [3], True)]),
    # SFT: a signal before the first step is done (nothing to save), one just before an update
    # (that step is finished and saved) with a second while it is saved, one during the last
    # step's save (saved once; the run is complete).
    ("sft", 4, 2, [("sample", [1], False), ("update", [1, 3], True), ("save", [4], False)]),
])
def test_sigterm_saves_where_the_run_stands_and_resumes_exactly(tmp_path, tok, caplog, monkeypatch, algorithm,
                                                                steps, every, plan):
    from grpo_jax.sampler import host

    moments = _moments(random.Random(63), plan)
    over = (f"rl.algorithm={algorithm}", f"run.steps={steps}", f"run.checkpoint_every={every}")
    if algorithm != "sft":
        over += ("rl.sample_prompts=2",)
    want, whole = _uninterrupted(_cfg(tmp_path / "whole", tok, *over), tok)
    calls, sample_call = [], host._sample_call
    monkeypatch.setattr(host, "_sample_call", lambda *a, **kw: (calls.append(1), sample_call(*a, **kw))[1])
    cfg = _cfg(tmp_path / "stopped", tok, *over)
    got, last = run_with_signals(cfg, tok, moments, caplog, calls if algorithm != "sft" else None)
    assert [h["step"] for h in got] == list(range(1, steps + 1)), moments
    assert _comparable(got) == _comparable(want), moments  # exactly: same data, RNG and state
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), last.params, whole.params)
    assert [r["step"] for r in read_jsonl(tmp_path / "stopped" / "metrics.jsonl")] == list(range(1, steps + 1))
    saved = _saved_steps(cfg.run.run_dir)
    assert saved == sorted(set(saved)) and steps in saved  # each step saved once, the last one too


def test_a_save_that_fails_while_stopping_says_so_and_keeps_the_previous_step(tmp_path, tok):
    trainer = _trainer(_cfg(tmp_path, tok, "run.steps=6", "run.checkpoint_every=2"), tok)
    trainer.train(steps=2)  # step 2 saved
    interrupt(trainer, "update", 3)
    ckpts = tmp_path / "checkpoints"
    with _read_only(ckpts):
        with pytest.raises(CheckpointError) as failed:
            trainer.train()
    message = str(failed.value)
    assert "\n" not in message, message
    assert re.fullmatch(
        f"stopping on SIGTERM: could not save checkpoint step 3 in {re.escape(str(ckpts))} .*, then run the "
        "same command again to resume from step 2, the newest saved step [(]intact[)]", message), message
    assert trainer.history[-1]["step"] == 3  # nothing trained past the failed save
    # The previous checkpoint is whole: it restores, as the next run of the command will.
    step, tree, meta = trainer.ckpt.restore(checkpointing.abstract_like(trainer.checkpoint_tree()))
    trainer.close()
    assert step == meta["step"] == 2 and _saved_steps(tmp_path) == [2]
