"""Which code produced a report: a fingerprint of the source files it ran.

The TPU check's reports (``launch/compile.py --json``) are committed and shown in tables long
after they were written; a row computed by older code must not pass for today's. Each report
records the fingerprint of the project modules loaded when it was written and their paths
(``loaded_files``); ``launch/compile_matrix.py`` recomputes it over the same paths and calls a
row stale when they differ.

The fingerprint hashes each file's syntax tree without docstrings, so comments, docstrings and
formatting change nothing, and any change to what the code does changes it (including ones
that leave the compiled programs as they were: stale means "re-run to know", not "wrong").
"""

from __future__ import annotations

import ast
import hashlib
import sys
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[2]


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def source_hash(path: Path) -> str:
    """sha256 of a Python file's syntax tree without docstrings (nor comments)."""
    tree = _without_docstrings(ast.parse(path.read_text(), filename=str(path)))
    return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()


def loaded_files(extra: Iterable[str] = ()) -> list[str]:
    """Paths (relative to the checkout, sorted) of the ``grpo_jax`` modules this process has
    imported, and ``extra`` ones (the script that writes the report)."""
    package = ROOT / "grpo_jax"
    paths = set(extra)
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().is_relative_to(package):
            paths.add(str(Path(file).resolve().relative_to(ROOT)))
    return sorted(paths)


def fingerprint(files: Iterable[str]) -> str | None:
    """One sha256 over ``files`` (paths relative to the checkout) and their ``source_hash``;
    None when one of them no longer exists."""
    digest = hashlib.sha256()
    for rel in sorted(files):
        path = ROOT / rel
        if not path.is_file():
            return None
        digest.update(f"{rel}\0{source_hash(path)}\n".encode())
    return digest.hexdigest()


def record(extra: Iterable[str] = ()) -> dict:
    """{"files": loaded_files(extra), "fingerprint": their fingerprint}: what a report keeps."""
    files = loaded_files(extra)
    return {"files": files, "fingerprint": fingerprint(files)}


def is_current(code: dict | None) -> bool | None:
    """Whether a report's ``record()`` still matches the checkout: True, False (stale), or
    None when the report holds no record (written before reports kept one)."""
    if not code:
        return None
    return fingerprint(code["files"]) == code["fingerprint"]
