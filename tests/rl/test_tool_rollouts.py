"""The trainer with rl.max_tool_calls > 0: GRPO steps on multi-turn rollouts whose tool
tokens are context but no loss; a task without a tool is refused before anything runs; a
sandbox back-end that fails some calls fails those rows only, one that fails every call
stops the run with one line (issue 83)."""

import dataclasses
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.config import ConfigError
from grpo_jax.errors import SandboxError
from grpo_jax.model.transformer import init_params
from grpo_jax.rl.trainer import Trainer
from grpo_jax.tools import LocalSandbox, PythonTool, SandboxLimits
from tests.rl.test_trainer import SevensTask, _cfg, tok  # noqa: F401 (tok: the module's tokenizer fixture)


class SevensWithTool(SevensTask):
    # "7" opens a block, ":" closes it: markers `_writes_markers` plants in the random model.
    tool = PythonTool(LocalSandbox(SandboxLimits(wall_seconds=3, memory_bytes=192 << 20)), open="7", close=":")


def _writes_markers(params, tok):
    """The random model planted to write the tool's markers at most positions, so its rollouts
    call the tool whatever the key draws: every token's embedding gets a first coordinate of
    1, which the residual stream carries to the final norm, and the tokens holding "7" or ":"
    (their rows of the tied unembedding) read it three times as strongly."""
    markers = [i for i in range(tok.vocab_size) if any(c in tok.decode([i]) for c in "7:")]
    assert markers, "the tokenizer has no token holding the markers"
    return {**params, "embedding": params["embedding"].at[:, 0].set(1.0).at[jnp.array(markers), 0].set(3.0)}


def test_a_task_without_a_tool_is_refused(tmp_path, tok):
    cfg = _cfg(tmp_path, tok, "rl.max_tool_calls=1")
    with pytest.raises(ConfigError, match="rl.max_tool_calls=1 but task 'sevens' has no tool"):
        Trainer(cfg, task=SevensTask(), tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                progress=False)


def test_grpo_trains_on_rollouts_that_call_the_tool(tmp_path, tok):
    # _cfg's 8 new tokens keep every context in the smallest prompt bucket: fewer sampler programs
    cfg = _cfg(tmp_path, tok, "run.steps=2", "rl.max_tool_calls=2", "run.checkpoint_every=0", "rl.beta=0.04")
    trainer = Trainer(cfg, task=SevensWithTool(), tokenizer=tok,
                      params=_writes_markers(init_params(cfg.model, jax.random.key(0)), tok), progress=False)
    history = trainer.train()
    trainer.close()
    rows = cfg.data.batch_size * cfg.rl.group_size
    assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history)
    assert sum(h["tool_calls"] for h in history) > 0 and sum(h["tool_tokens"] for h in history) > 0
    for h in history:  # the step counts the model's tokens only: the tool's are not trained on
        assert h["tokens"] == pytest.approx(rows * (h["completion_length"] - h["tool_tokens"]))


def test_rl_tool_workers_sizes_the_runs_sandbox_pool(tmp_path, tok):
    from grpo_jax.sampler.turns import default_workers

    for setting, workers in (("rl.tool_workers=3", 3), ("rl.tool_workers=0", default_workers())):
        cfg = _cfg(tmp_path / setting, tok, "rl.max_tool_calls=1", setting)
        trainer = Trainer(cfg, task=SevensWithTool(), tokenizer=tok,
                          params=init_params(cfg.model, jax.random.key(0)), progress=False)
        assert trainer.tool_use.workers == workers
        trainer.close()
    with pytest.raises(ConfigError, match="rl.tool_workers must be >= 0"):
        _cfg(tmp_path, tok, "rl.tool_workers=-1")


class FailingBackend:
    """A sandbox back-end that fails (as a remote service's 503) on ``fail_per_10`` of each ten
    calls, spread out (call i fails where i * fail_per_10 mod 10 < fail_per_10: calls 0, 4 and
    7 of ten for 3), and runs the others in the local sandbox; it counts what it did."""

    def __init__(self, fail_per_10: int):
        self.fail_per_10, self.calls, self.failed = fail_per_10, 0, 0
        self.lock = threading.Lock()
        self.local = SevensWithTool.tool.sandbox

    def run(self, code):
        with self.lock:
            fail = self.calls * self.fail_per_10 % 10 < self.fail_per_10
            self.calls, self.failed = self.calls + 1, self.failed + fail
        if fail:
            raise SandboxError("HTTP 503 Service Unavailable from the test's service", "remote")
        return self.local.run(code)


def _with_backend(backend):
    tool = dataclasses.replace(SevensWithTool.tool, sandbox=backend)
    return type("SevensWithFailingTool", (SevensTask,), {"tool": tool})()


def test_a_backend_failing_on_30_percent_of_calls_fails_those_rows_and_the_run_finishes(tmp_path, tok):
    backend = FailingBackend(3)
    cfg = _cfg(tmp_path, tok, "run.steps=3", "rl.max_tool_calls=2", "run.checkpoint_every=0")
    trainer = Trainer(cfg, task=_with_backend(backend), tokenizer=tok,
                      params=_writes_markers(init_params(cfg.model, jax.random.key(0)), tok), progress=False)
    history = trainer.train()
    trainer.close()
    assert len(history) == 3 and all(np.isfinite(h["loss"]) for h in history)
    rows = cfg.data.batch_size * cfg.rl.group_size
    assert sum(round(h["tool_calls"] * rows) for h in history) == backend.calls
    assert sum(h["tools/backend_failures"] for h in history) == backend.failed == \
        sum(h.get("tools/backend_failures/remote", 0) for h in history)
    assert 0 < backend.failed < backend.calls and backend.failed == sum(i * 3 % 10 < 3 for i in range(backend.calls))
    for h in history:
        calls = round(h["tool_calls"] * rows)
        assert h["tools/backend_failure_share"] == (h["tools/backend_failures"] / calls if calls else 0.0)
        assert h["tool_failures"] >= h["tools/backend_failure_share"]  # a back-end failure is an error run
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["tools/backend_failures"] for m in logged] == [h["tools/backend_failures"] for h in history]


def test_a_backend_failing_on_every_call_stops_the_run_with_one_line(tmp_path, tok):
    backend = FailingBackend(10)
    cfg = _cfg(tmp_path, tok, "run.steps=6", "rl.max_tool_calls=2", "run.checkpoint_every=0")
    trainer = Trainer(cfg, task=_with_backend(backend), tokenizer=tok,
                      params=_writes_markers(init_params(cfg.model, jax.random.key(0)), tok), progress=False)
    with pytest.raises(SandboxError) as caught:
        trainer.train()
    trainer.close()
    message = str(caught.value)
    assert caught.value.kind == "broken" and "\n" not in message
    assert message.startswith("the sandbox back-end could not run 100% or more of the tool calls of 2 steps in a row")
    assert f"step {len(trainer.history)}: 100% (remote x{int(trainer.history[-1]['tools/backend_failures'])})" in message
    # it stopped at the second failing step in a row: each step before it with calls failed them all
    shares = [h["tools/backend_failure_share"] for h in trainer.history]
    assert shares[-2:] == [1.0, 1.0] and all(s in (0.0, 1.0) for s in shares)
    assert backend.failed == backend.calls > 0


def test_the_stop_threshold_is_a_share_of_a_steps_calls_for_some_steps_in_a_row(tmp_path, tok):
    from grpo_jax.rl.tool_metrics import failing_streak

    share = lambda s: {"tools/backend_failure_share": s}
    streak = 0
    for step_share, expected in ((1.0, 1), (0.0, 0), (0.5, 1), (0.49, 0), (0.7, 1), (0.6, 2)):
        streak = failing_streak(streak, share(step_share), 0.5)
        assert streak == expected
    assert failing_streak(3, {}, 1.0) == 0  # a step without tool runs says nothing of the back-end
    for bad, message in (("rl.tool_backend_stop_share=0", r"must be in \(0, 1\]"),
                         ("rl.tool_backend_stop_share=1.5", r"must be in \(0, 1\]"),
                         ("rl.tool_backend_stop_steps=0", "rl.tool_backend_stop_steps must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            _cfg(tmp_path, tok, bad)
