"""The slot engine's tool rollout across two processes (tests/parallel/slot_tools_worker.py):
each process runs the blocks of the rows its devices hold, the outputs are gathered so that
every process appends the same tokens at the same step, and the rows, tool columns and tool
runs equal the one-process rollout on the same mesh shape."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.parallel import slot_tools_worker as worker
from tests.parallel.test_multihost import NUM_PROCESSES, ROOT, _free_port, _worker_env, wait_workers

pytestmark = pytest.mark.multihost


def test_two_processes_each_run_their_rows_blocks_and_draw_the_one_process_rollout(tmp_path):
    from grpo_jax.parallel.sharding import mesh_from_shape

    port, procs, logs = _free_port(), [], []
    for i in range(NUM_PROCESSES):
        logs.append(str(tmp_path / f"worker{i}.log"))
        with open(logs[-1], "w") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", worker.__name__, str(tmp_path / "out")], cwd=ROOT,
                                          env=_worker_env(i, port), stdout=out, stderr=subprocess.STDOUT))
    wait_workers(procs, logs)
    got = [json.load(open(tmp_path / "out" / f"result_{i}.json")) for i in range(NUM_PROCESSES)]
    want = worker.record(*worker.rollout(mesh_from_shape(worker.MESH)))
    calls = sum(map(len, want["runs"]))
    assert calls >= 4 and want["blocks_run_here"] == calls  # one process runs every block
    for g in got:
        for field in ("tokens", "tool_mask", "lengths", "runs"):
            assert g[field] == want[field], field
        np.testing.assert_allclose(g["logprobs"], want["logprobs"], atol=1e-5)
    # each process ran its own rows' blocks: together every block once, each some
    assert sum(g["blocks_run_here"] for g in got) == calls and all(g["blocks_run_here"] for g in got)
