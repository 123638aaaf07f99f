"""grpo_jax.cli.run: an entry point's argparse errors as one named ConfigError."""
import argparse
import sys

import pytest

from grpo_jax import cli
from grpo_jax.config import add_config_args
from grpo_jax.errors import ConfigError


def parse_like_an_experiment():
    """The parser of the experiments that run several seeds (gsm8k_grpo.py, tools_learning.py)."""
    p = argparse.ArgumentParser()
    add_config_args(p)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    return p.parse_args()


def run_with(monkeypatch, *argv):
    monkeypatch.setenv("GRPO_JAX_DEBUG", "1")  # raise the error here instead of exiting 2
    monkeypatch.setattr(sys, "argv", ["experiment.py", *argv])
    parsed = {}
    with pytest.raises(SystemExit) as done:
        cli.run(lambda: parsed.update(vars(parse_like_an_experiment())))
    assert done.value.code == 0
    return parsed


def test_an_override_after_a_seed_list_is_named_with_the_way_to_write_it(monkeypatch):
    with pytest.raises(ConfigError, match=r"invalid int value: 'rl\.algorithm=online_rft' \(a section\.field=value "
                                          r"override was read as one of a list option's values: put the overrides "
                                          r"before the option, or end its list with --"):
        run_with(monkeypatch, "--seeds", "0", "1", "rl.algorithm=online_rft")
    # Both ways the message offers parse as meant.
    for argv in (["rl.algorithm=online_rft", "--seeds", "0", "1"], ["--seeds", "0", "1", "--", "rl.algorithm=online_rft"]):
        assert run_with(monkeypatch, *argv) == {"preset": "cpu-tiny", "overrides": ["rl.algorithm=online_rft"],
                                                "seeds": [0, 1]}


def test_a_bad_seed_is_not_taken_for_an_override(monkeypatch):
    with pytest.raises(ConfigError) as err:
        run_with(monkeypatch, "--seeds", "0", "one")
    assert str(err.value) == "argument --seeds: invalid int value: 'one'"
