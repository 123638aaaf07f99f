"""Checkpoint folders as the damage tests see them: cut every file short, read every byte."""
import os


def damage(folder):
    """Every file under `folder` cut to half its size: a full disk, a copy cut short."""
    for root, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(root, f)
            os.truncate(path, os.path.getsize(path) // 2)


def files(folder) -> dict:
    """Relative path -> bytes of every file under `folder`."""
    out = {}
    for root, _, names in os.walk(folder):
        for f in names:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), folder)] = fh.read()
    return out
