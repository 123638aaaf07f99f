"""The package installs as a library: `pip install .` finds every subpackage, the console
entry point works, and no script reaches the repo root through sys.path."""
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import setuptools
import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_every_folder_of_the_library_is_a_package_the_wheel_includes():
    # setuptools only packs folders with an __init__.py: a new subfolder without one would
    # import from a clone and be missing from the wheel.
    with_code = {str(p.parent.relative_to(REPO)).replace(os.sep, ".")
                 for p in (REPO / "grpo_jax").rglob("*.py")}
    found = set(setuptools.find_packages(str(REPO), include=["grpo_jax*"]))
    assert with_code == found and "grpo_jax.tasks" in found and "grpo_jax.data" in found


def test_wheel_dependencies_are_requirements_txt():
    # pyproject.toml reads its dependencies from requirements.txt: one list of pins.
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'dependencies\s*=\s*\{\s*file\s*=\s*\["requirements.txt"\]\s*\}', text)
    pins = [line for line in (REPO / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert all(not p.startswith("-") for p in pins), "setuptools cannot read pip options"


def test_grpo_train_entry_point_resolves_a_config():
    exe = Path(sys.executable).with_name("grpo-train")
    out = subprocess.run([str(exe), "--preset", "cpu-tiny", "--print-config", "rl.group_size=3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rl"]["group_size"] == 3


def _scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_entry_point_names_a_console_main():
    # The wheel's scripts call the named function with no arguments: it must exist and go
    # through grpo_jax.cli.run (console_main), not a main(argv) that returns a value.
    scripts = _scripts()
    assert set(scripts) == {"grpo-train", "grpo-evaluate", "grpo-export"}
    for target in scripts.values():
        module, attr = target.split(":")
        assert attr == "console_main" and callable(getattr(importlib.import_module(module), attr))


def test_grpo_evaluate_entry_point_reports_errors_under_its_name(tmp_path):
    # Run the pyproject target the way the installed script does (the venv's script may
    # predate this entry point); a bad --task fails before any model is loaded.
    module, attr = _scripts()["grpo-evaluate"].split(":")
    out = subprocess.run([sys.executable, "-c", f"from {module} import {attr}; {attr}()", "--model", "smollm2-135m",
                          "--task", "nope", "--no-progress", "--out", str(tmp_path / "eval")],
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2
    assert out.stderr.startswith("grpo-evaluate: error: unknown task 'nope'"), out.stderr


def test_no_script_edits_sys_path():
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in REPO.rglob("*.py")
                 if not any(part.startswith(".venv") for part in p.parts)  # .venv, .venv-tunix
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"sys\.path\.(insert|append)", line)]
    assert offenders == []
