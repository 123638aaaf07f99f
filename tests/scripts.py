"""Importing the repository's scripts (benchmarks/, launch/) in a test.

The scripts import their siblings by name, and benchmarks/, experiments/ and launch/ each have
a ``common``: whichever a test imported first stays in ``sys.modules``, and a script of another
folder would get it. `import_script` puts the folder first on sys.path and sets aside every
cached module named like one of the folder's files but loaded from elsewhere; the MonkeyPatch
it is given undoes both.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
LAUNCH = REPO / "launch"


def import_script(mp, folder: Path, name: str):
    """The module ``name`` of ``folder``, imported with its own siblings (``mp``: a
    `pytest.MonkeyPatch`)."""
    mp.syspath_prepend(str(folder))
    for sibling in folder.glob("*.py"):
        cached = sys.modules.get(sibling.stem)
        if cached is not None and Path(getattr(cached, "__file__", None) or "").parent != folder:
            mp.delitem(sys.modules, sibling.stem)
    return importlib.import_module(name)
