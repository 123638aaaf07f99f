"""launch/compile_matrix.py --table: the matrix from the reports already written, nothing compiled."""

import json

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
    assert f"| {preset} | {slice_name} | yes | shared | 1.00 / 2.50 / 3.25 | 25% | 12.3 | 5.0 | 42% |" in out


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
    assert "| 400.2 | 119.7 | 20% |" in capsys.readouterr().out
