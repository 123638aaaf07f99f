"""docs/walkthrough.md, walked: every command it shows, in order, as far as this machine can.

Part A (your own task on SmolLM2-135M, CPU) runs as written in a scratch folder that sees the
repository's experiments/ and launch/, with fewer steps, samples and questions (``FEWER``). Part B (the
paper's recipe on a v5p slice) runs every launch script with ``--dry-run`` and an empty PATH
(nothing reaches gcloud), and the compile check on the ``cpu-tiny`` preset for one v5p host
(``ON_CPU``), not the 7B preset on v5p-128; run.py's ``--check`` stays in its dry run, which prints
that same compile command and runs nothing. Lines that are not this project's commands are
skipped by name (``NOT_OURS``). A command, script or flag the document names that stops
existing fails here. Also: every experiment script's --help offers --preset, except the tools
launch/run.py passes no config (its NO_CONFIG), whose --help does not.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import LAUNCH, import_script
from tests.xla_flags import FAST_COMPILE
from tests.test_readme import help_outcomes

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "walkthrough.md"
BIN = Path(sys.executable).parent

# Part A at one step of two samples per question: each pair is (as the document writes it, as
# the test runs it). What is checked is that each command runs and leaves its files, which one
# step's checkpoint shows as well as twenty; a group of 2 still has advantages to compute.
FEWER = [("run.steps=20", "run.steps=1"), ("rl.group_size=4", "rl.group_size=2"),
         ("data.eval_size=16", "data.eval_size=4"), ("--limit 16", "--limit 4")]
# Part A's commands compile SmolLM2's programs once each and run them for a step or a few
# questions, and no number they print is checked: the suite's fast-compile flags
# (tests/xla_flags.py) spend less time in the compiler than they lose in running.
# Part B's compile check (run.py --check too): the cpu-tiny preset, one layer and a few rows,
# on one v5p host; the 7B preset on v5p-128 compiles for tens of minutes here.
TINY = "model.num_layers=1 data.batch_size=2 rl.group_size=2 data.eval_size=2 rl.max_new_tokens=8"
ON_CPU = [("--preset deepseekmath-rl-7b-v5p-128", f"--preset cpu-tiny {TINY}"), ("--slice v5p-128", "--slice v5p-8")]
# The compile check's prompt rows of 16 tokens, not 256: the same programs, a quarter less compile.
SHORT_PROMPTS = ["--prompt-len", "16"]
# Lines that are not this project's commands: the clone itself (we are in one), activating
# the venv the suite already runs in, and gcloud's own commands.
NOT_OURS = ("git clone ", "source .venv/bin/activate", "gcloud ")


def sections() -> dict[str, str]:
    text = DOC.read_text()
    a = text.index("## A. ")
    b = text.index("## B. ")
    end = text.index("## The data files")
    return {"A": text[a:b], "B": text[b:end]}


def commands(section: str) -> list[str]:
    """The commands of the ```bash blocks of ``section``, in order, continuation lines joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip():
                out.append(" ".join(command.split()))
    return out


def task_module(section: str) -> str:
    return re.search(r"Save this as `mytask.py`.*?```python\n(.*?)```", section, re.S).group(1)


def rewrite(command: str, pairs) -> str:
    for written, run in pairs:
        command = command.replace(written, run)
    return command


def run(command: str, cwd: Path, env: dict, timeout: int = 900):
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_document_shows_every_step_in_order():
    a, b = (commands(s) for s in sections().values())
    assert [c.split()[0] for c in a if not c.startswith(NOT_OURS)] == [
        "make", "python", "export", "grpo-train", "grpo-evaluate", "grpo-export", "grpo-evaluate"]
    steps = [" ".join(c.split()[:3]) for c in b if c.startswith("python launch/")]
    assert steps == ["python launch/compile.py --slice", "python launch/create.py --slice",
                     "python launch/stage.py gs://my-bucket/models/deepseek-math-7b-instruct",
                     "python launch/setup.py", "python launch/run.py train", "python launch/run.py train",
                     "python launch/run.py train", "python launch/run.py evaluate", "python launch/run.py export",
                     "python launch/delete.py --queued"]
    for written, _ in FEWER:
        assert written in sections()["A"], f"the test shortens {written!r}, which the document no longer has"
    for written, _ in ON_CPU:
        assert written in sections()["B"], f"the test replaces {written!r}, which the document no longer has"


def test_every_folder_part_a_writes_is_gitignored():
    """The runs and the exported model (538 MB for SmolLM2) stay out of `git status`."""
    written = re.findall(r"(?:--out |run\.run_dir=)([\w.-]+)/", " ".join(commands(sections()["A"])))
    assert sorted(set(written)) == ["exported", "runs"]
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert [f for f in sorted(set(written)) if f"{f}/" not in ignored and f"/{f}/" not in ignored] == []


def test_part_a_runs_as_written(tmp_path):
    """Clone to evaluated export: the scratch folder is the user's clone (experiments/ and the
    Makefile linked in), mytask.py is the document's, and every command must exit 0."""
    for name in ("experiments", "launch", "Makefile", "requirements.txt", "pyproject.toml"):
        (tmp_path / name).symlink_to(REPO / name)
    section = sections()["A"]
    (tmp_path / "mytask.py").write_text(task_module(section))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}  # a user's one CPU device
    env.update(PATH=f"{BIN}{os.pathsep}{env['PATH']}", JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    outputs = {}
    for command in commands(section):
        if command.startswith(NOT_OURS):
            continue
        if command.startswith("export "):
            for assignment in shlex.split(command)[1:]:
                key, value = assignment.split("=", 1)
                env[key] = value
            continue
        if command == "make install":  # the suite's venv is this project installed: make must know the target
            command = f"make -n install VENV={BIN.parent}"
        done = run(rewrite(command, FEWER), tmp_path, env)
        assert done.returncode == 0, (command, done.stdout[-1500:], done.stderr[-3000:])
        outputs[command.split()[0] + str(len(outputs))] = done.stdout
    assert (tmp_path / "runs" / "mytask" / "checkpoints" / "1").is_dir()
    assert (tmp_path / "exported" / "mytask" / "config.json").is_file()
    # The run recorded your task under the name that rebuilds it; both evaluations asked it.
    assert '"task": "mytask:task"' in (tmp_path / "runs" / "mytask" / "task.json").read_text()
    summaries = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("runs/eval/**/summary.json"))
    assert summaries == ["runs/eval/mytask-export/summary.json", "runs/eval/mytask-test/step-1/summary.json"]


def test_part_b_dry_runs_and_compiles_cpu_tiny(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_TPU_")}
    env["PATH"] = ""  # a dry run that tried to run gcloud or git would fail
    printed, compiled = [], []
    for command in commands(sections()["B"]):
        if command.startswith(NOT_OURS):
            continue
        if command.startswith("export "):
            env.update(a.split("=", 1) for a in shlex.split(command)[1:])
            continue
        argv = shlex.split(rewrite(command, ON_CPU))
        assert argv[0] == "python", command
        argv[0] = sys.executable
        if argv[1] == "launch/compile.py":
            compiled.append(shlex.join(argv[1:]))
            argv += SHORT_PROMPTS
        else:
            # --dry-run before any `--`: the rest belongs to the experiment.
            at = argv.index("--") if "--" in argv else len(argv)
            argv.insert(at, "--dry-run")
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, (command, done.stdout[-1500:], done.stderr[-3000:])
        printed += done.stdout.splitlines()
    gcloud = [line for line in printed if line.startswith("gcloud ")]
    assert all("--zone=us-east5-a --project=my-project" in line for line in gcloud), gcloud
    run_line = next(line for line in gcloud if "experiments/train.py" in line)
    # Spot saves every step, the staged folders are the run's, and checkpoints go to the bucket.
    for part in ("run.checkpoint_every=1", "run.pretrained=staged/deepseek-math-7b-instruct",
                 "data.data_dir=staged/gsm8k", "run.run_dir=gs://my-bucket/grpo_jax/train"):
        assert part in run_line, part
    assert any("gcloud storage cp -r --no-clobber gs://my-bucket/data/gsm8k staged/" in line for line in gcloud)
    # run.py --check, dry: the compile it would start is printed, not run, and it is the check the
    # document's first step ran, on the run's own overrides.
    checks = [line for line in printed if " launch/compile.py " in line]
    assert checks == [shlex.join([sys.executable, *compiled[0].split(), "run.pretrained=staged/deepseek-math-7b-instruct",
                                  "data.data_dir=staged/gsm8k"])], checks


def test_every_experiment_offers_preset_except_the_tools_without_a_config(monkeypatch):
    NO_CONFIG = import_script(monkeypatch, LAUNCH, "run").NO_CONFIG
    scripts = sorted(p for p in (REPO / "experiments").glob("*.py") if p.stem != "common")
    outcomes = help_outcomes([str(p.relative_to(REPO)) for p in scripts])
    offers = {Path(c).stem for c, o in outcomes.items() if o["exit"] in (0, None) and "--preset" in o["stdout"]}
    assert offers == {p.stem for p in scripts} - NO_CONFIG, sorted(offers ^ ({p.stem for p in scripts} - NO_CONFIG))
