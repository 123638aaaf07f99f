"""launch/run.py --check: the compile check is launch/compile.py run as a command, so the script
needs no import path (issue 86: `launch.compile` was not importable from the script), and a dry
run prints that command instead of compiling (a 7B compile with libtpu installed)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import LAUNCH, import_script

REPO = Path(__file__).resolve().parents[2]
WHERE = ["--name", "pod", "--zone", "us-east5-a", "--project", "proj"]
RUN = ["train", "--slice", "v5p-8", "--check", *WHERE]
CONFIG = ["--preset", "cpu-tiny", "model.num_layers=1", "run.steps=3"]
COMPILE = ["launch/compile.py", "--slice", "v5p-8", "--preset", "cpu-tiny", "model.num_layers=1", "run.steps=3"]


def test_a_dry_run_as_users_type_it_prints_the_compile_first():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("GRPO_TPU_")}
    env["PATH"] = ""  # nothing may be started: no gcloud, no compile
    done = subprocess.run([sys.executable, "launch/run.py", *RUN, "--dry-run", "--", *CONFIG], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == " ".join([sys.executable, *COMPILE])
    assert [line.split()[:5] for line in lines[1:]] == [["gcloud", "compute", "tpus", "tpu-vm", "ssh"]] * 2


class Recorder:
    """A Runner that records what it is asked to run and answers with ``code``."""

    def __init__(self, code: int):
        self.code, self.ran = code, []

    def run(self, argv):
        self.ran.append(list(argv))
        return self.code


def test_a_dry_run_starts_no_process(monkeypatch, capsys):
    run = import_script(monkeypatch, LAUNCH, "run")

    def refuse(*args, **kwargs):
        raise AssertionError(f"a dry run started {args}")

    monkeypatch.setattr(run.common.subprocess, "run", refuse)
    monkeypatch.setattr(run.common.subprocess, "Popen", refuse)
    assert run.main([*RUN, "--dry-run", "--", *CONFIG]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[1:] == COMPILE


def test_check_runs_compile_py_and_refuses_to_launch_when_it_fails(monkeypatch):
    run = import_script(monkeypatch, LAUNCH, "run")
    args = run.parse_args([*RUN, "--", *CONFIG, "--no-progress"])  # options of the script are not the compile's
    fits = Recorder(0)
    run.check_fits(fits, args)
    assert fits.ran == [[sys.executable, *COMPILE]]
    with pytest.raises(run.LaunchError) as err:
        run.check_fits(Recorder(1), args)
    assert str(err.value) == ("--check: launch/compile.py exited 1 (its reason is above): the run does not fit "
                              "v5p-8 or cannot be compiled here (it needs libtpu: make install-test); nothing "
                              "was launched")


def test_check_needs_a_slice(monkeypatch):
    run = import_script(monkeypatch, LAUNCH, "run")
    with pytest.raises(run.LaunchError, match=r"^--check needs --slice \(the slice to compile for\)$"):
        run.check_fits(Recorder(0), run.parse_args(["train", "--check", *WHERE, "--", *CONFIG]))
