"""launch/compile_matrix.py --table: the matrix from the reports already written, nothing compiled."""

import json

import pytest

from launch import compile_matrix


def _report(peaks, rollout, update, mfu):
    programs = {name: {"peak_bytes": int(p * 1e9), "resident_bytes": 0}
                for name, p in zip(("sample_prefill", "sample_decode", "train_step"), peaks)}
    return {**programs, "summary": {"decode_engine": "shared", "min_headroom": 0.25, "rollout_seconds": rollout,
                                    "update_seconds": update, "mfu": mfu}}


def test_table_merges_the_reports_present_and_compiles_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(compile_matrix.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("--table must not compile")))
    preset, slice_name, extra, label = compile_matrix.MATRIX[0]
    path = compile_matrix.report_path(tmp_path, preset, slice_name, label)
    path.write_text(json.dumps(_report((1.0, 2.5, 3.25), 12.34, 5.0, 0.421)))
    assert compile_matrix.main(["--table", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "matrix.json").read_text())
    assert [(r["preset"], r["slice"], r["exit_code"]) for r in rows] == [(preset, slice_name, 0)]
    assert rows[0]["command"] == " ".join(["python", *compile_matrix.command(preset, slice_name, extra, label, tmp_path)])
    out = capsys.readouterr().out
    # no per-program bounds in this report: no expected values; no code record: not known current
    assert (f"| {preset} | {slice_name} | yes | shared | 1.00 / 2.50 / 3.25 | 25% | 12.3 / – | 5.0 / – | 42% / – "
            "| no record |") in out


def test_table_takes_a_rerun_rows_report_over_the_matrix_it_was_in(tmp_path, capsys):
    """A row re-run by hand (its command from matrix.json) replaces the older result that
    matrix.json still holds for it, the failure of an earlier attempt included."""
    preset, slice_name, extra, label = compile_matrix.MATRIX[1]
    old = {"preset": preset, "slice": slice_name, "label": label, "exit_code": 1, "wall_seconds": 7.0,
           "command": "python old", "error": "compile.py: error: sample_decode: does not fit"}
    (tmp_path / "matrix.json").write_text(json.dumps([old]))
    compile_matrix.report_path(tmp_path, preset, slice_name, label).write_text(
        json.dumps(_report((1.0, 2.0, 3.0), 400.2, 119.7, 0.2)))
    assert compile_matrix.main(["--table", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "matrix.json").read_text())
    assert row["exit_code"] == 0 and "error" not in row and row["results"]["summary"]["rollout_seconds"] == 400.2
    assert row["wall_seconds"] is None  # the re-run's wall time is not known here
    assert "| 400.2 / – | 119.7 / – | 20% / – |" in capsys.readouterr().out


def _full_report(code=None):
    """A report with per-program bounds on a v5e slice: decode memory-bound, update compute-bound."""
    prog = lambda secs, bound, calls: {"peak_bytes": 0, "resident_bytes": 0, "estimated_seconds": secs,
                                       "bound": bound, "calls_per_step": calls}
    report = {"sample_prefill": prog(0.5, "compute", 2), "sample_decode": prog(2.4, "memory", 2),
              "train_step": prog(5.8, "compute", 1),
              "summary": {"decode_engine": "shared", "min_headroom": 0.5, "topology": "v5e:2x4",
                          "rollout_seconds": 5.8, "update_seconds": 5.8, "mfu": 0.5}}
    if code is not None:
        report["code"] = code
    return report


def test_expected_times_divide_each_programs_bound_by_the_chips_efficiency(tmp_path, capsys):
    from grpo_jax.aot.tpu_specs import EFFICIENCY

    eff = EFFICIENCY["v5e"]
    exp = compile_matrix.expected(_full_report())
    rollout = 2 * 0.5 / eff.compute + 2 * 2.4 / eff.bandwidth
    assert exp["rollout"] == pytest.approx(rollout) and exp["update"] == pytest.approx(5.8 / eff.compute)
    # the same model FLOPs over a longer step
    assert exp["mfu"] == pytest.approx(0.5 * 11.6 / (rollout + 5.8 / eff.compute))
    assert exp["mfu"] < 0.5 and exp["rollout"] > 5.8


def test_a_report_is_current_until_the_code_that_wrote_it_changes(tmp_path, monkeypatch):
    from grpo_jax.aot import provenance

    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    (tmp_path / "pkg").mkdir()
    src = tmp_path / "pkg" / "mod.py"
    src.write_text('"""Doc."""\n\ndef f(x):\n    return x + 1  # one\n')
    code = {"files": ["pkg/mod.py"], "fingerprint": provenance.fingerprint(["pkg/mod.py"])}
    assert compile_matrix.code_status(_full_report(code)) == "current"
    src.write_text('"""Another doc."""\n\n\ndef f(x):\n    """Adds one."""\n    return x + 1  # comment\n')
    assert compile_matrix.code_status(_full_report(code)) == "current"  # docs and comments only
    src.write_text('def f(x):\n    return x + 2\n')
    assert compile_matrix.code_status(_full_report(code)) == "stale"
    src.unlink()
    assert compile_matrix.code_status(_full_report(code)) == "stale"
    assert compile_matrix.code_status(_full_report()) == "no record"


def test_stale_reruns_only_the_rows_older_code_wrote(tmp_path, monkeypatch):
    from grpo_jax.aot import provenance

    current = provenance.record()
    first, second = compile_matrix.MATRIX[0], compile_matrix.MATRIX[1]
    compile_matrix.report_path(tmp_path, first[0], first[1], first[3]).write_text(json.dumps(_full_report(current)))
    compile_matrix.report_path(tmp_path, second[0], second[1], second[3]).write_text(
        json.dumps(_full_report({**current, "fingerprint": "older"})))
    ran = []

    def run_one(preset, slice_name, extra, label, out):
        ran.append((preset, slice_name, label))
        return {"preset": preset, "slice": slice_name, "label": label, "exit_code": 0, "wall_seconds": 0.0,
                "command": "python", "results": _full_report(current)}

    monkeypatch.setattr(compile_matrix, "run_one", run_one)
    compile_matrix.main(["--stale", "--out", str(tmp_path)])
    assert (first[0], first[1], first[3]) not in ran and (second[0], second[1], second[3]) in ran
    assert len(ran) == len(compile_matrix.MATRIX) - 1  # every row without a report runs too


def _sync_7b_report(decode_bytes: float, weights_bytes: float):
    """A synchronous report of the 7B v5p-128 preset on 64 chips: no prefill cost, a decode
    that only reads HBM (the weights at every one of its 1023 steps and ``decode_bytes``
    more), 16 calls; an update of 100 s, compute-bound."""
    prog = lambda **kw: {"peak_bytes": int(1e9), "argument_bytes": int(1e8), "temp_bytes": int(1e8),
                         "resident_bytes": 0, "hbm_capacity_bytes": 95e9, "flops_per_chip": 0.0,
                         "bytes_per_chip": 0.0, "ici_bytes_per_chip": 0.0, **kw}
    return {"sample_prefill": prog(estimated_seconds=0.0, bound="memory", calls_per_step=16),
            "sample_decode": prog(bytes_per_chip=weights_bytes * 1023 + decode_bytes, bound="memory",
                                  estimated_seconds=(weights_bytes * 1023 + decode_bytes) / 2765e9, calls_per_step=16),
            "train_step": prog(estimated_seconds=100.0, bound="compute", calls_per_step=1),
            "summary": {"topology": "v5p:4x4x4", "chips": 64, "decode_engine": "shared", "min_headroom": 0.5,
                        "rollout_seconds": 16 * (weights_bytes * 1023 + decode_bytes) / 2765e9,
                        "update_seconds": 100.0, "mfu": 0.5}}


def test_overlap_scales_each_half_and_adds_the_hand_off_to_the_slower(tmp_path, capsys):
    """--overlap, no compile: 32 sampling chips keep 64 questions a call, so each replica
    decodes twice the rows (the KV read doubles, the weights' does not); 32 training chips
    take the update's micro-batches twice as often; the overlapped step is the slower half
    plus the hand-off of the bf16 policy, 8 replicas of tensor 4 fed by 32 chips."""
    from grpo_jax.model import transformer as model_lib
    from grpo_jax.parallel import split_mesh
    from grpo_jax.config import get_preset
    from grpo_jax.aot.tpu_specs import CHIPS, EFFICIENCY

    preset = "deepseekmath-rl-7b-v5p-128"
    policy = split_mesh.hand_off_bytes(model_lib.param_shapes(get_preset(preset).model), "bfloat16")
    weights, kv = policy / 4, 5e12
    compile_matrix.report_path(tmp_path, preset, "v5p-128", "").write_text(json.dumps(_sync_7b_report(kv, weights)))
    assert compile_matrix.main(["--overlap", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    eff = EFFICIENCY["v5p"]
    rollout = 16 * (weights * 1023 + 2 * kv) / 2765e9
    update = 100.0 * 64 / 32
    hand = split_mesh.hand_off_seconds(policy, 8, 4, 32, CHIPS["v5p"].ici_bandwidth)
    assert hand == pytest.approx(policy / 4 / 600e9)  # in per sampling chip = out per training chip
    step = max(rollout / eff.bandwidth, update / eff.compute) + hand / eff.bandwidth
    row = next(line for line in out.splitlines() if line.startswith("| v5p-128 | 32 / 32 | scaled |"))
    assert (f"| 64, 512 | {rollout:.1f} / {rollout / eff.bandwidth:.1f} | {update:.1f} / {update / eff.compute:.1f} | "
            f"{hand:.3f} / {hand / eff.bandwidth:.3f} ({policy / 1e9:.1f}) | {max(rollout, update) + hand:.1f} / {step:.1f} |"
            ) in row
    sync = 16 * (weights * 1023 + kv) / 2765e9 / eff.bandwidth + 100.0 / eff.compute
    # The shortest of the three splits, named with the synchronous step beside it.
    best = min(compile_matrix.scaled_split(_sync_7b_report(kv, weights), preset, "v5p-128", s)["overlapped"][1]
               for s in (32, 48, 56))
    assert f"v5p-128: shortest expected overlapped step {best:.1f} s" in out
    assert f"synchronous on every chip {sync:.1f} s" in out
    assert "no report of deepseekmath-rl-7b-v5litepod-256" in out


def test_overlap_never_picks_a_split_the_compiler_refuses(tmp_path, capsys):
    """v5litepod-256's splits are shown (scaled) but marked and never the pick: the TPU
    compiler runs no program on part of that slice (slices.SlicePreset.splittable)."""
    v5e = "deepseekmath-rl-7b-v5litepod-256"
    compile_matrix.report_path(tmp_path, v5e, "v5litepod-256", "").write_text(json.dumps(_sync_7b_report(5e12, 3e9)))
    assert compile_matrix.main(["--overlap", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| v5litepod-256 | ") and "in turn" not in line]
    assert len(rows) == 3 and all("the compiler refuses it" in row for row in rows)
    assert "v5litepod-256: no split" in out and "v5litepod-256: shortest" not in out
