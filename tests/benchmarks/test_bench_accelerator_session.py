"""accelerator_session.sh: the calls it makes, the files it leaves and its exit status, with a
stand-in interpreter (PYTHON) that records its arguments; the benchmark itself is
test_bench_accelerator.py's (a real TINY=1 run takes minutes on 2 cores)."""

import json
import os
import subprocess
import sys

import pytest

from tests.scripts import BENCHMARKS

STUB = """import json, os, pathlib, sys
args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[0] != "-c":
    pathlib.Path(args[args.index("--json") + 1]).write_text("{}")
    print("a bench call")
    sys.exit(1 if os.environ.get("STUB_FAIL", "-") in args else 0)
"""
GPU_OPTIONS = "model.unembed_dtype=bfloat16 model.attention={} model.remat=dots"


def session(tmp_path, **env):
    """(exit status, the bench calls' arguments, the files left in OUT)."""
    stub, log, out = tmp_path / "python", tmp_path / "calls.jsonl", tmp_path / "out"
    stub.write_text(f"#!{sys.executable}\n{STUB}")
    stub.chmod(0o755)
    full_env = {**os.environ, "PYTHON": str(stub), "STUB_LOG": str(log), "OUT": str(out), **env}
    proc = subprocess.run(["bash", str(BENCHMARKS / "accelerator_session.sh")], cwd=BENCHMARKS.parent,
                          env=full_env, capture_output=True, text=True, timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0][0] == "-c"  # the versions in env.txt
    return proc.returncode, calls[1:], sorted(p.name for p in out.iterdir())


def flag(call, name):
    return call[call.index(name) + 1]


def variants(call):
    return [call[i + 1] for i, a in enumerate(call) if a == "--variant"]


def test_the_gpu_session_measures_the_7b_shape_first_then_the_1_5b_table_again(tmp_path):
    code, (large, small, slots), files = session(tmp_path)
    assert code == 0
    assert files == ["env.txt", "large.json", "large.log", "slots.json", "slots.log", "small.json",
                     "small.log"]  # the tool returns 8
    # the slot engine beside the static one, on the rows the GPU machine can make (no SmolLM2 weights)
    assert slots[0] == "benchmarks/bench_slots.py" and "--skip-smollm2" in slots
    for call in (large, small):
        assert call[0] == "benchmarks/bench_accelerator.py" and "--profile" in call and "--tiny" not in call
    assert large[large.index("--preset"):large.index("--preset") + 7] == [
        "--preset", "deepseekmath-rl-7b", "model.num_layers=8", "--group", "16", "--micro-batches", "16"]
    assert variants(large) == [GPU_OPTIONS.format("cudnn")]
    assert flag(small, "--preset") == "qwen2.5-1.5b"
    assert variants(small) == ["model.unembed_dtype=bfloat16", "model.unembed_dtype=bfloat16 model.attention=cudnn",
                               GPU_OPTIONS.format("cudnn")]
    # One 600 s command: the three budgets and a margin for the versions and the reports.
    script = (BENCHMARKS / "accelerator_session.sh").read_text()
    slots_budget = float(script.split("BUDGET_SLOTS=${BUDGET_SLOTS:-")[2].split("}")[0])
    assert float(flag(large, "--budget")) + float(flag(small, "--budget")) + slots_budget <= 560


def test_the_dry_run_takes_tiny_shapes_and_the_models_attention(tmp_path):
    code, (large, small, _), _ = session(tmp_path, TINY="1")
    assert code == 0
    assert all("--tiny" in call and flag(call, "--preset") == "cpu-tiny" for call in (large, small))
    assert "model.num_layers=1" in large
    assert variants(large) == [GPU_OPTIONS.format("xla")]
    assert variants(small)[-1] == GPU_OPTIONS.format("xla")


@pytest.mark.parametrize("failing", ["deepseekmath-rl-7b", "qwen2.5-1.5b"])
def test_a_failed_call_fails_the_session_after_the_other_ran(tmp_path, failing):
    code, calls, files = session(tmp_path, STUB_FAIL=failing)
    assert code == 1 and len(calls) == 3 and "small.json" in files and "slots.json" in files
