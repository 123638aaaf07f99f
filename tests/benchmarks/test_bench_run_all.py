"""run_all's --merge: a partial re-run replaces its benchmarks' results in a saved run,
records when and at which commit, and refuses another CPU model or mode."""

import argparse
import json
import pytest

@pytest.fixture
def run_all(benchmark_module):
    return benchmark_module("run_all")


def _machine(cpu="AMD EPYC", date="2026-11-24T04:57:17+00:00", commit="aaaaaaa"):
    return {"date": date, "cpu": cpu, "cpu_flags": "avx512f", "cores": 2, "memory_bytes": 2**34,
            "platform": "Linux", "python": "3.11", "git_commit": commit, "load_average": (1.0, 1.0, 1.0),
            "wall_seconds": 600.0,
            "versions": {k: "1" for k in ("jax", "jaxlib", "flax", "optax", "numpy", "torch",
                                          "transformers", "accelerate", "trl")}}


def _run(name, results, seconds=60.0):
    return {"name": name, "script": f"bench_{name}.py", "command": f"python benchmarks/bench_{name}.py",
            "returncode": 0, "ok": True, "seconds": seconds, "load_start": (1.0,), "load_end": (1.5,),
            "payload": {"results": results, "details": {"of": name}, "markdown": f"## {name}\n\ntable of {name}"}}


def _saved(run_all, tmp_path):
    """A full run's results.json, written by run_all itself."""
    runs = [_run("rollout", {"decode_ratio_batch": 32, "decode_tokens_per_s_ours_b32": 300.0,
                             "decode_tokens_per_s_transformers_b32": 100.0}),
            _run("grpo_step", {"grpo_step_seconds_ours": 20.0, "grpo_step_seconds_trl": 30.0,
                               "grpo_step_speedup_vs_trl": 1.5})]
    args = argparse.Namespace(quick=False, out_dir=str(tmp_path))
    run_all.write_outputs(runs, args, _machine(), 0.0, tmp_path)
    return json.loads((tmp_path / "results.json").read_text())


def test_merge_replaces_the_rerun_benchmarks_and_keeps_the_others(run_all, tmp_path):
    saved = _saved(run_all, tmp_path)
    new = _run("grpo_step", {"grpo_step_seconds_ours": 12.0, "grpo_step_seconds_trl": 30.0,
                             "grpo_step_speedup_vs_trl": 2.5}, seconds=99.0)
    machine = _machine(date="2026-11-25T09:00:00+00:00", commit="bbbbbbb")
    run_all.check_mergeable(saved, machine, quick=False)
    runs, record = run_all.merged(saved, [new], machine)
    assert [r["name"] for r in runs] == ["rollout", "grpo_step"]
    assert runs[1]["seconds"] == 99.0 and runs[0]["payload"]["markdown"] == "## rollout\n\ntable of rollout"
    assert record["date"] == saved["machine"]["date"]  # the first run's record stays
    assert record["merged"] == [{"benchmarks": ["grpo_step"], "date": machine["date"],
                                 "git_commit": "bbbbbbb", "cpu": "AMD EPYC", "load_average": (1.0, 1.0, 1.0)}]

    out = tmp_path / "merged"
    out.mkdir()
    args = argparse.Namespace(quick=False, out_dir=str(out))
    run_all.write_outputs(runs, args, record, 0.0, out, base_results=saved["results"])
    written = json.loads((out / "results.json").read_text())
    assert written["results"]["grpo_step_seconds_ours"] == 12.0  # the re-run's value
    assert written["results"]["decode_tokens_per_s_ours_b32"] == 300.0  # the first run's value
    text = (out / "RESULTS.md").read_text()
    assert "git aaaaaaa" in text and "on 2026-11-25T09:00:00+00:00 at git bbbbbbb (AMD EPYC): grpo_step" in text
    assert "table of rollout" in text and "table of grpo_step" in text
    # each run's own results are kept: merging again restores them per run, in run order
    again_runs, again = run_all.merged(written, [new], machine)
    assert len(again["merged"]) == 2
    assert again_runs[0]["payload"]["results"]["decode_tokens_per_s_ours_b32"] == 300.0


def test_merge_refuses_another_cpu_or_mode(run_all, tmp_path):
    saved = _saved(run_all, tmp_path)
    with pytest.raises(run_all.ConfigError, match="Intel Xeon"):
        run_all.check_mergeable(saved, _machine(cpu="Intel Xeon"), quick=False)
    with pytest.raises(run_all.ConfigError, match="full, this run is quick"):
        run_all.check_mergeable(saved, _machine(), quick=True)


def test_merge_needs_only_and_an_existing_file(run_all, tmp_path):
    with pytest.raises(SystemExit):
        run_all.main(["--merge", str(tmp_path / "results.json")])
    with pytest.raises(run_all.ConfigError, match="does not exist"):
        run_all.main(["--only", "memory", "--merge", str(tmp_path / "missing.json"), "--out-dir", str(tmp_path)])


def test_summary_takes_the_worst_per_token_gain_of_ours_only(run_all):
    results = {"prefill_per_token_gain_b32_over_b8_ours": 1.04, "decode_per_token_gain_b32_over_b8_ours": 1.9,
               "prefill_per_token_gain_b64_over_b32_ours": 0.98, "decode_per_token_gain_b64_over_b32_ours": 1.1,
               "prefill_per_token_gain_b64_over_b32_transformers": 0.7}
    rows, targets = run_all.summary_rows(results)
    assert results["per_token_gain_worst_ours"] == 0.98
    assert targets["per_token_gain_worst_ours"] == {"target": ">= 1.0", "value": 0.98, "met": False}
    row = next(r for r in rows if r[0].startswith("Rollout per-token speed"))
    assert row[3] == "0.98×" and row[-1] == "**MISSED**"
    results["prefill_per_token_gain_b64_over_b32_ours"] = 1.01
    _, targets = run_all.summary_rows(results)
    assert targets["per_token_gain_worst_ours"]["met"] and targets["per_token_gain_worst_ours"]["value"] == 1.01
