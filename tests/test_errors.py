"""User errors: one `<prog>: error:` line, exit 2, nothing written to an existing run dir."""
import os
import subprocess
import sys

import pytest

from grpo_jax.checkpoints import checkpointing
from grpo_jax import config, errors
from grpo_jax.model import pretrained
from grpo_jax.parallel import sharding


def test_error_family_keeps_old_names():
    assert config.ConfigError is errors.ConfigError
    assert sharding.MeshError is errors.MeshError
    assert pretrained.PretrainedError is errors.PretrainedError
    for cls in (errors.ConfigError, errors.MeshError, errors.DataError, errors.PretrainedError,
                errors.CheckpointError, errors.RewardModelError, errors.SandboxError):
        assert issubclass(cls, errors.GrpoJaxError)


def test_unknown_names_are_config_errors_and_still_key_errors():
    from grpo_jax.tasks import get_task

    with pytest.raises(KeyError) as err:  # what callers of these lookups caught before
        get_task("nope")
    assert isinstance(err.value, errors.ConfigError)
    assert str(err.value).startswith("unknown task 'nope'; available:")  # not KeyError's quoted repr


def test_config_differences_names_the_field_and_allows_resumable_ones():
    saved = {"model": {"num_layers": 2, "remat": "none"}, "rl": {"algorithm": "grpo"},
             "run": {"steps": 10}}
    requested = {"model": {"num_layers": 3, "remat": "full"}, "rl": {"algorithm": "grpo"},
                 "run": {"steps": 20}}
    assert checkpointing.config_differences(saved, requested) == [("model.num_layers", 2, 3)]


def test_config_differences_also_compares_named_fields_and_sections():
    """A cached run (an experiment's SFT start) must match in more than the model."""
    saved = {"model": {"num_layers": 2}, "rl": {"algorithm": "sft"}, "run": {"steps": 10, "seed": 0},
             "optimizer": {"peak_lr": 1e-3, "schedule": "multistep"}, "data": {"slip": "carry", "eval_size": 8}}
    requested = {"model": {"num_layers": 2}, "rl": {"algorithm": "sft"}, "run": {"steps": 10, "seed": 1},
                 "optimizer": {"peak_lr": 2e-3, "schedule": "multistep"}, "data": {"slip": "carry", "eval_size": 9}}
    also = ("optimizer", "run.seed", "data.slip")
    assert checkpointing.config_differences(saved, requested, also) == [
        ("optimizer.peak_lr", 1e-3, 2e-3), ("run.seed", 0, 1)]  # data.eval_size is not compared
    assert checkpointing.config_differences(saved, requested) == []


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_prints_one_line_and_exits_2(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("from grpo_jax import cli, errors\n"
                      "def main():\n    raise errors.MeshError('mesh asks for 3 devices')\n"
                      "cli.run(main)\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "GRPO_JAX_DEBUG": ""}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert out.stderr == "prog.py: error: mesh asks for 3 devices\n"
    out = subprocess.run([sys.executable, str(script), "--debug"], capture_output=True, text=True,
                         env=env)
    assert out.returncode != 0 and "Traceback" in out.stderr
