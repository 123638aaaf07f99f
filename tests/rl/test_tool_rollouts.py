"""The trainer with rl.max_tool_calls > 0: GRPO steps on multi-turn rollouts whose tool
tokens are context but no loss; a task without a tool is refused before anything runs."""

import jax
import numpy as np
import pytest

from grpo_jax.config import ConfigError
from grpo_jax.model.transformer import init_params
from grpo_jax.rl.trainer import Trainer
from grpo_jax.tools import LocalSandbox, PythonTool, SandboxLimits
from tests.rl.test_trainer import SevensTask, _cfg, tok  # noqa: F401 (tok: the module's tokenizer fixture)


class SevensWithTool(SevensTask):
    # Markers a random model writes often: "7" opens a block, ":" closes it.
    tool = PythonTool(LocalSandbox(SandboxLimits(wall_seconds=3, memory_bytes=192 << 20)), open="7", close=":")


def test_a_task_without_a_tool_is_refused(tmp_path, tok):
    cfg = _cfg(tmp_path, tok, "rl.max_tool_calls=1")
    with pytest.raises(ConfigError, match="rl.max_tool_calls=1 but task 'sevens' has no tool"):
        Trainer(cfg, task=SevensTask(), tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                progress=False)


def test_grpo_trains_on_rollouts_that_call_the_tool(tmp_path, tok):
    # _cfg's 8 new tokens keep every context in the smallest prompt bucket: fewer sampler programs
    cfg = _cfg(tmp_path, tok, "run.steps=2", "rl.max_tool_calls=2", "run.checkpoint_every=0", "rl.beta=0.04")
    trainer = Trainer(cfg, task=SevensWithTool(), tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                      progress=False)
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
