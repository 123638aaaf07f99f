"""The package installs as a library: `pip install .` finds every subpackage, the console
entry point works, and no script reaches the repo root through sys.path."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import setuptools

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


def test_no_script_edits_sys_path():
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in REPO.rglob("*.py")
                 if ".venv" not in p.parts
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"sys\.path\.(insert|append)", line)]
    assert offenders == []
