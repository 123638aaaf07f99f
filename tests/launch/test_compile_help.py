"""launch/compile.py --help: its whole description, which says that the check needs libtpu and how
to install it (issue 86: the help was cut to its first paragraph)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_help_shows_every_paragraph_and_how_to_get_libtpu():
    done = subprocess.run([sys.executable, "launch/compile.py", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    shown = " ".join(done.stdout.split())
    assert "Needs libtpu, the TPU compiler, on this machine: `make install-test` installs it" in shown
    # the last paragraph of the module's docstring, the split run's compile
    assert "max(rollout, update) + hand-off." in shown
