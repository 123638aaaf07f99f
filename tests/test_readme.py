"""The README as a front door: short, its links resolve, and the commands it names still parse.

Links: every relative link of README.md and docs/**/*.md points at a file of the repository,
and a ``#anchor`` at a heading of that file (GitHub's heading ids). Commands: every
``python experiments|launch|benchmarks/X.py`` and ``grpo-*`` command the README names
answers ``--help`` with exit 0 and a usage line, each run as ``__main__`` (a script) or
through its pyproject.toml entry point (a console command), in one child interpreter on CPU.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 300

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
_SCRIPT = re.compile(r"\bpython ((?:experiments|launch|benchmarks)/\w+\.py)\b")
_CONSOLE = re.compile(r"(?:^\s*|`)(grpo-[a-z]+)\b", re.M)


def _documents() -> list[Path]:
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def heading_ids(markdown: str) -> set[str]:
    """GitHub's ids for the headings of ``markdown``: lower case, punctuation dropped
    (letters, digits, ``_`` and ``-`` kept), spaces as ``-``; a repeated id gets ``-1``, ``-2``."""
    ids, seen = set(), {}
    for title in _HEADING.findall(_FENCE.sub("", markdown)):
        base = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        ids.add(base if n == 0 else f"{base}-{n}")
    return ids


def relative_links(doc: Path) -> list[str]:
    """Targets of the markdown links and images of ``doc`` outside code blocks, except URLs."""
    text = _FENCE.sub("", doc.read_text())
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_heading_ids_follow_github():
    text = "# A title\n## Will it fit? Compiling (`make tpu-check`)\n## A title\n```\n# not a heading\n```\n"
    assert heading_ids(text) == {"a-title", "will-it-fit-compiling-make-tpu-check", "a-title-1"}


def test_readme_fits_on_a_few_screens():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def broken_links(doc: Path) -> list[str]:
    """The relative links of ``doc`` whose file is missing, or whose ``#anchor`` names no
    heading of the markdown file it points at."""
    broken = []
    for target in relative_links(doc):
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.is_file():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in heading_ids(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


def test_broken_links_finds_missing_files_and_headings(tmp_path):
    (tmp_path / "b.md").write_text("# Real heading\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](b.md#real-heading) [url](https://x.org/y) ![img](b.md) [self](#top)\n"
                   "# Top\n[gone](c.md) [no anchor](b.md#nope)\n```\n[in code](d.md)\n```\n")
    assert [b.split(":")[0] for b in broken_links(doc)] == ["c.md", "b.md#nope"]


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    assert not broken_links(doc)


def readme_commands() -> list[str]:
    """The scripts (``experiments/X.py``) and console commands (``grpo-X``) README.md names."""
    text = README.read_text()
    return sorted(set(_SCRIPT.findall(text))) + sorted(set(_CONSOLE.findall(text)))


def test_readme_names_the_entry_points():
    names = readme_commands()
    assert {"experiments/quickstart.py", "experiments/custom_task.py", "launch/compile.py",
            "grpo-train", "grpo-evaluate"} <= set(names), names


def _console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


# Runs each named command's `--help` in turn in one fresh interpreter, as `python X.py` or
# the console script would (`__main__`, the script's folder first on sys.path, its folder's
# helper modules imported afresh), so jax and the package are imported once rather than
# once per command. Prints one JSON line per command as it finishes.
_DRIVER = r"""
import contextlib, importlib, io, json, runpy, sys
scripts, folders = json.loads(sys.argv[1]), tuple(json.loads(sys.argv[2]))
path0 = list(sys.path)
for command, target in scripts.items():
    out, code = io.StringIO(), None
    for name in [m for m, mod in sys.modules.items()
                 if (getattr(mod, "__file__", None) or "").startswith(folders)]:
        del sys.modules[name]
    try:
        with contextlib.redirect_stdout(out):
            if command.endswith(".py"):
                sys.argv, sys.path[:] = [target, "--help"], [target.rsplit("/", 1)[0]] + path0
                runpy.run_path(target, run_name="__main__")
            else:
                module, func = target.split(":")
                sys.argv, sys.path[:] = [command, "--help"], list(path0)
                getattr(importlib.import_module(module), func)()
    except SystemExit as e:
        code = e.code
    print(json.dumps({"command": command, "exit": code, "stdout": out.getvalue()[:300]}), flush=True)
"""


def help_outcomes(commands: list[str]) -> dict[str, dict]:
    """``command --help`` of each command (README's spelling): its exit code and stdout."""
    console = _console_scripts()
    targets = {c: str(REPO / c) if c.endswith(".py") else console[c] for c in commands}
    folders = sorted({str((REPO / c).parent) + os.sep for c in commands if c.endswith(".py")})
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(targets), json.dumps(folders)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    outcomes = {o["command"]: o for o in lines}
    assert len(outcomes) == len(commands), (f"stopped after {list(outcomes)[-1:]}", done.stderr[-2000:])
    return outcomes


def test_every_readme_command_answers_help():
    outcomes = help_outcomes(readme_commands())
    failed = {c: o for c, o in outcomes.items()
              if o["exit"] not in (0, None) or "usage:" not in o["stdout"].lower()}
    assert not failed, failed


def test_help_outcomes_report_a_command_that_fails(tmp_path):
    """The check can fail: a script whose --help exits 2 is reported with its code."""
    bad = tmp_path / "broken.py"
    bad.write_text("import sys\nprint('usage: broken.py')\nsys.exit(2)\n")
    assert help_outcomes([str(bad)])[str(bad)]["exit"] == 2
