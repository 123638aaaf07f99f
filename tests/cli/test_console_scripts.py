"""The console scripts (grpo-train, grpo-evaluate, grpo-export) as a user meets them: every
option's default in --help, and on a machine without an accelerator the CPU, as `make` runs
them, without libtpu's initialisation errors."""
import os
import subprocess
import sys

import pytest

from grpo_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _console_parsers():
    from grpo_jax.cli import evaluate as evaluate_cli, export as export_cli, train as train_cli
    return {"grpo-train": train_cli.build_parser(), "grpo-evaluate": evaluate_cli.build_parser(),
            "grpo-export": export_cli.build_parser()}


@pytest.mark.parametrize("prog", ["grpo-train", "grpo-evaluate", "grpo-export"])
def test_help_names_every_option_with_its_default(prog):
    import argparse as ap
    parser = _console_parsers()[prog]
    text = " ".join(parser.format_help().split())
    formatter = cli.HelpFormatter(prog)
    for action in parser._actions:
        if isinstance(action, ap._HelpAction) or not (action.option_strings or action.nargs == "*"):
            continue  # --help; a required positional (the run dir) has no default
        name = action.option_strings[0] if action.option_strings else action.metavar
        assert name in text, (prog, name)
        assert "default" in formatter._get_help_string(action).lower(), (prog, name)
    if prog == "grpo-evaluate":
        assert "--split SPLIT the task's split to evaluate (default: test)" in text
        assert "--no-progress no progress bar (default: False)" in text
    if prog == "grpo-export":
        assert "(default 5)" in text and "(default: the latest)" in text


@pytest.mark.parametrize("environ, files, expected", [
    ({}, [], "cpu"),
    ({"JAX_PLATFORMS": ""}, [], None),  # the user's choice, even an empty one
    ({"JAX_PLATFORMS": "tpu"}, [], None),
    ({}, ["accel0"], None),  # a TPU VM
    ({}, ["nvidia0"], None),  # a GPU machine
])
def test_entry_points_default_to_the_cpu_without_an_accelerator(tmp_path, environ, files, expected):
    for f in files:
        (tmp_path / f).write_text("")
    patterns = [str(tmp_path / "accel*"), str(tmp_path / "nvidia[0-9]*")]
    assert cli.default_jax_platform(environ, patterns) == expected


def test_an_entry_point_on_a_cpu_machine_prints_no_tpu_noise():
    """libtpu is installed in the test environment; an entry point started without
    JAX_PLATFORMS runs on the CPU and stderr stays empty (no libtpu initialisation errors)."""
    import glob
    if any(glob.glob(p) for p in cli._ACCELERATOR_FILES):
        pytest.skip("this machine has an accelerator")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", "import jax\nfrom grpo_jax import cli\n"
                          "cli.run(lambda: print(jax.devices()[0].platform))"],
                         capture_output=True, text=True, timeout=120, env={**env, "PYTHONPATH": ROOT})
    assert (out.returncode, out.stdout, out.stderr) == (0, "cpu\n", "")
