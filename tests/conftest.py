"""Test-wide setup: 8 fake CPU devices so every sharding test sees a pod-slice-like mesh,
and one persistent compilation cache shared by the run's processes.

XLA reads XLA_FLAGS once, when jax initialises its backend, and jax reads
JAX_COMPILATION_CACHE_DIR when it is imported, so both must be set before any test module
imports jax.
"""
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.scripts import BENCHMARKS, import_script
from tests.xla_flags import FAST_COMPILE

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + FAST_COMPILE
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Two xdist workers share two cores: torch's OpenMP pool of one thread per core spins
# against the other worker and stalls transformers' forward passes, so the
# reference libraries get one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_made_cache_dir = None


def pytest_configure(config):
    # Many tests compile the same programs in different processes (xdist workers, the
    # scripts the CLI tests launch); a cache shared through the environment compiles each
    # once per run (the suite 15:02 -> 13:01 on a 2-core AMD EPYC). It starts empty every
    # run, so no result depends on an earlier run's executables.
    global _made_cache_dir
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _made_cache_dir = tempfile.mkdtemp(prefix="grpo_jax_test_jit_cache_")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _made_cache_dir


def pytest_unconfigure(config):
    if _made_cache_dir is not None:
        shutil.rmtree(_made_cache_dir, ignore_errors=True)


# `make test` runs `pytest -n 2 --dist loadfile --no-loadscope-reorder`: xdist hands each
# worker whole files, in the order collected here. Its default order (most tests first) put
# these few-test files last, so that one worker was still compiling a 7B train step or
# walking the walk-through long after the other had finished. The slowest files start
# first, longest first (seconds summed per file in a suite run, benchmarks/NOTES.md), and
# the many short ones fill in behind them.
LONGEST_FIRST = [
    "tests/aot/test_aot.py",
    "tests/test_walkthrough.py",
    "tests/rl/test_reward_models.py",
    "tests/eval/test_evaluate_run.py",
    "tests/parallel/test_multihost.py",
    "tests/aot/test_aot_sharding.py",
    "tests/launch/test_compile_slots.py",
    "tests/experiments/test_tools_learning.py",
    "tests/experiments/test_custom_task.py",
    "tests/launch/test_compile_matrix.py",
    "tests/rl/test_trainer.py",
    "tests/cli/test_evaluate.py",
    "tests/test_notebooks.py",
    "tests/rl/test_reward_model_planted.py",
    "tests/cli/test_cli_errors.py",
    "tests/rl/test_async_steps.py",
    "tests/cli/test_resume_changes.py",
]


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable


@pytest.fixture
def benchmark_module(monkeypatch):
    """``importlib.import_module`` for the scripts of benchmarks/, with their own siblings
    (``common``: `tests.scripts.import_script`)."""
    return lambda name: import_script(monkeypatch, BENCHMARKS, name)
