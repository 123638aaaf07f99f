"""Multi-host training, tested with several JAX processes on localhost.

Two processes with 4 CPU devices each (`--xla_force_host_platform_device_count=4`) join
one runtime through a local coordinator (`grpo_jax.parallel.distributed.initialize`, configured by
GRPO_JAX_* variables) and form one 8-device mesh (1, 4, 2): the fsdp axis spans both
processes, so parameters, optimizer state and batches are split across them, and every
step needs cross-process collectives (XLA's CPU client does them with Gloo). Each process
runs tests/parallel/multihost_worker.py: `grpo_jax.cli.train.train()` doing GRPO steps
(sampler → host scoring → train step) with checkpoints from both processes.

The same run in this process (1 process, 8 devices, the same mesh shape) must give the
same metrics, and the 2-process checkpoints must restore here and resume training.

A SIGTERM sent to one process of a longer run (`multihost_worker.py --preempt`) must make
both save the same step and exit with `grpo_jax.parallel.preemption.EXIT_CODE`.

These tests are marked `multihost`; `pytest -m "not multihost"` skips them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.parallel import multihost_worker as worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "parallel", "multihost_worker.py")
NUM_PROCESSES, LOCAL_DEVICES = 2, 4
TIMEOUT_S = 600  # the whole 2-process run; it takes well under a minute on an idle 2-core CPU
# Both runs execute the same sharded programs on the same mesh shape; only the order in
# which partial sums are combined differs (Gloo across processes vs in-process), so the
# sampled tokens are identical and the metrics agree to float32 rounding (measured: at
# most ~1e-6 relative). Parameters after three Adam steps agree to ~1e-5 relative norm
# per array; single elements differ more (measured 3.5e-5 absolute, i.e. 0.35% of one
# step of size lr = 1e-2) because Adam divides each element's update by its own gradient
# RMS, which magnifies rounding where a gradient is close to zero.
RTOL, ATOL = 1e-4, 1e-6
PARAM_REL_NORM, PARAM_MAX_ABS = 1e-4, 2e-4  # the latter is 2% of one lr step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker_env(process_id: int, port: int) -> dict:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env.update(
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={LOCAL_DEVICES}".strip(),
        JAX_PLATFORMS="cpu",
        GRPO_JAX_COORDINATOR=f"localhost:{port}",
        GRPO_JAX_NUM_PROCESSES=str(NUM_PROCESSES),
        GRPO_JAX_PROCESS_ID=str(process_id),
    )
    return env


def start_workers(run_dir: str, log_dir: str, *args: str) -> tuple[list, list[str]]:
    """(processes, their log files): one worker per process id, `args` after RUN_DIR."""
    port = _free_port()
    logs = [os.path.join(log_dir, f"worker{i}.log") for i in range(NUM_PROCESSES)]
    procs = []
    for i, path in enumerate(logs):
        with open(path, "w") as out:
            procs.append(subprocess.Popen([sys.executable, WORKER, run_dir, *args], cwd=ROOT,
                                          env=_worker_env(i, port), stdout=out,
                                          stderr=subprocess.STDOUT))
    return procs, logs


def launch_workers(run_dir: str, log_dir: str) -> None:
    """Start the workers, wait (bounded), and fail with every worker's output if one fails."""
    wait_workers(*start_workers(run_dir, log_dir))


def wait_workers(procs, logs, expected: int = 0) -> None:
    """Wait (bounded) for the workers; fail with every worker's output unless all exit `expected`."""
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for p in procs:  # a failed worker leaves the other one waiting in a collective
        if p.poll() is None:
            p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if timed_out or any(c != expected for c in codes):
        report = []
        for i, path in enumerate(logs):
            with open(path) as f:
                text = "".join(line for line in f if not line.startswith("[Gloo]"))
            report.append(f"----- worker {i} (exit {codes[i]}) -----\n{text[-6000:]}")
        what = f"timed out after {TIMEOUT_S} s" if timed_out else f"exit codes {codes}"
        pytest.fail(f"multi-process run {what}\n" + "\n".join(report), pytrace=False)


def assert_metrics_close(got: list[dict], want: list[dict]) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g.keys(), w.keys())
        for k in g:
            np.testing.assert_allclose(g[k], w[k], rtol=RTOL, atol=ATOL, err_msg=f"step {g['step']}: {k}")


def assert_params_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        diff = got[k].astype(np.float64) - want[k]
        rel = np.linalg.norm(diff) / max(np.linalg.norm(want[k]), 1e-12)
        assert rel < PARAM_REL_NORM and np.abs(diff).max() < PARAM_MAX_ABS, (
            f"{k}: relative norm of the difference {rel:.2e}, max |difference| {np.abs(diff).max():.2e}")


# ============================================================================ fixtures

@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """(run_dir, [result of process 0, result of process 1], params) of the 2-process run."""
    base = tmp_path_factory.mktemp("two_processes")
    run_dir = str(base / "run")
    launch_workers(run_dir, str(base))
    results = []
    for i in range(NUM_PROCESSES):
        with open(os.path.join(run_dir, f"result_{i}.json")) as f:
            results.append(json.load(f))
    with np.load(os.path.join(run_dir, "params.npz")) as npz:
        params = dict(npz)
    return run_dir, results, params


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, two_process_run):
    """The same run in this process: 1 process, its 8 devices, the same tokenizer."""
    run_dir = str(tmp_path_factory.mktemp("one_process") / "run")
    os.makedirs(run_dir)
    shutil.copy(os.path.join(two_process_run[0], "tokenizer.model"), run_dir)
    return worker.run(run_dir)


# ============================================================================ tests

@pytest.mark.multihost
def test_two_processes_form_one_mesh_and_log_once(two_process_run):
    run_dir, results, _ = two_process_run
    for i, r in enumerate(results):
        assert (r["process_index"], r["process_count"]) == (i, NUM_PROCESSES)
        assert (r["device_count"], r["local_device_count"]) == (NUM_PROCESSES * LOCAL_DEVICES, LOCAL_DEVICES)
        assert r["mesh"] == dict(zip(("data", "fsdp", "tensor"), worker.MESH))
    # Metrics are replicated: both processes saw the same values.
    assert results[0]["history"] == results[1]["history"]
    assert [h["step"] for h in results[0]["history"]] == list(range(1, worker.STEPS + 1))
    h = results[0]["history"]
    assert all(m["adv_std"] > 0 and m["grad_norm"] > 0 for m in h)  # a non-trivial GRPO run
    assert "eval_accuracy" in h[-1]  # greedy evaluation (the sampler again) at the last step
    # Process 0 alone wrote the metrics (one line per step, not one per process).
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
    assert os.path.exists(os.path.join(run_dir, "tokenizer.model"))
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "3"]


@pytest.mark.multihost
def test_two_processes_match_one_process(two_process_run, one_process_run):
    _, results, params = two_process_run
    assert_metrics_close(worker.metrics_of(one_process_run.history), results[0]["history"])
    assert_params_close(worker.param_arrays(one_process_run.params), params)


@pytest.mark.multihost
def test_two_process_checkpoint_restores_in_one_process(two_process_run, one_process_run):
    from grpo_jax.checkpoints import checkpointing

    run_dir, _, params = two_process_run
    ckpt = checkpointing.Checkpointer(os.path.join(run_dir, "checkpoints"))
    try:
        step, tree, meta = ckpt.restore(checkpointing.abstract_like(one_process_run.checkpoint_tree()))
    finally:
        ckpt.close()
    assert step == meta["step"] == worker.STEPS
    restored = worker.param_arrays(tree["state"].params)
    for k in params:  # exactly the params the 2-process run ended with
        np.testing.assert_array_equal(restored[k], params[k], err_msg=k)
    # ... now on this process's mesh.
    leaf = tree["state"].params["embedding"]
    assert leaf.sharding == one_process_run.params["embedding"].sharding


@pytest.mark.multihost
def test_preempted_two_process_run_resumes_in_one_process(two_process_run, tmp_path):
    """A relaunch continues from the newest checkpoint, here with another process count."""
    run_dir, results, params = two_process_run
    resumed_dir = str(tmp_path / "run")
    shutil.copytree(run_dir, resumed_dir, ignore=shutil.ignore_patterns("result_*", "params.npz", "tb"))
    shutil.rmtree(os.path.join(resumed_dir, "checkpoints", "3"))  # "preempted" after step 2
    trainer = worker.run(resumed_dir)
    assert trainer.start_step == 2
    assert_metrics_close(worker.metrics_of(trainer.history), results[0]["history"][2:])
    assert_params_close(worker.param_arrays(trainer.params), params)
    with open(os.path.join(resumed_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
    # Launched again with nothing left to do: returns without training.
    assert worker.run(resumed_dir).history == []


@pytest.mark.multihost
def test_sigterm_to_one_process_saves_the_same_step_on_both(tmp_path):
    """Spot VMs are stopped one by one: the signal reaches one process, yet both must save the
    same step (a save is a collective) and stop. jax's preemption sync point agrees on it."""
    from grpo_jax.parallel.preemption import EXIT_CODE

    run_dir = str(tmp_path / "run")
    procs, logs = start_workers(run_dir, str(tmp_path), "--preempt")
    metrics, seen = os.path.join(run_dir, "metrics.jsonl"), 0
    deadline = time.monotonic() + TIMEOUT_S
    while not seen and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.1)  # until process 0 has logged a step: training is under way on both
        if os.path.exists(metrics):
            with open(metrics) as f:
                seen = sum(1 for line in f if line.strip())
    if seen:
        procs[1].send_signal(signal.SIGTERM)  # not the coordinator: the notice has to travel
    wait_workers(procs, logs, expected=EXIT_CODE)
    saved = []
    for i in range(NUM_PROCESSES):
        with open(os.path.join(run_dir, f"result_{i}.json")) as f:
            saved.append(json.load(f)["preempted_at"])
    step = saved[0]
    assert saved == [step] * NUM_PROCESSES, saved
    assert seen <= step < worker.PREEMPT_STEPS, (seen, step)  # the step under way or just after it
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == [str(step)]  # no scheduled save
    with open(metrics) as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, step + 1))
    for path in logs:
        with open(path) as f:
            assert f"saved checkpoint step {step} in {run_dir}/checkpoints and stopped" in f.read(), path


# ============================================================================ fast checks (no subprocess)

def test_initialize_is_a_no_op_for_one_process(monkeypatch):
    from grpo_jax.parallel import distributed

    for name in ("GRPO_JAX_COORDINATOR", "GRPO_JAX_NUM_PROCESSES", "GRPO_JAX_PROCESS_ID", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is False
    monkeypatch.setenv("GRPO_JAX_COORDINATOR", "localhost:1")
    monkeypatch.setenv("GRPO_JAX_NUM_PROCESSES", "1")
    assert distributed.initialize() is False
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.2")  # a single-host TPU VM
    assert distributed.on_tpu_pod() is False


def test_initialize_needs_a_process_id(monkeypatch):
    from grpo_jax.parallel import distributed

    monkeypatch.setenv("GRPO_JAX_COORDINATOR", "localhost:1")
    monkeypatch.setenv("GRPO_JAX_NUM_PROCESSES", "2")
    monkeypatch.delenv("GRPO_JAX_PROCESS_ID", raising=False)
    with pytest.raises(ValueError, match="GRPO_JAX_PROCESS_ID"):
        distributed.initialize()


def test_broadcast_bytes_with_one_process():
    from grpo_jax.parallel import distributed

    assert distributed.broadcast_bytes(b"\x00abc") == b"\x00abc"
    with pytest.raises(ValueError):
        distributed.broadcast_bytes(None)
    distributed.barrier("single")  # no-op


def test_train_cli_help_and_config_errors():
    script = os.path.join(ROOT, "experiments", "train.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--preset" in out.stdout and "section.field=value" in out.stdout
    out = subprocess.run([sys.executable, script, "--print-config", "rl.group_size=3", "--preset", "cpu-tiny",
                          "run.steps=7"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert (cfg["rl"]["group_size"], cfg["run"]["steps"]) == (3, 7)
    out = subprocess.run([sys.executable, script, "rl.no_such_field=1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown config key" in out.stderr
