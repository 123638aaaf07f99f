"""experiments/tools_learning.py: a tiny study end to end (its seed files, the sandbox calls
of each arm, resume), and the design's verdicts on hand-made seed files."""
import json
import math
import sys

import pytest

from tests.cli.test_evaluate import script

T975_DF2 = 4.302652729911275  # two-sided 95% Student t, 2 degrees of freedom (printed tables)
TINY = ["run.steps=2", "run.eval_every=2", "run.checkpoint_every=2", "data.eval_size=8", "data.batch_size=2",
        "rl.group_size=4", "model.embed_dim=32", "model.num_layers=1", "model.mlp_dim=64",
        "--seeds", "0", "--sft-steps", "4", "--sft-until", "0", "--sft-batch", "8", "--no-progress"]


@pytest.fixture
def study(monkeypatch):
    monkeypatch.setitem(sys.modules, "common", script("common"))  # the script's sibling
    return script("tools_learning")


def test_a_tiny_study_writes_its_seeds_calls_the_sandbox_in_the_tool_arm_only_and_resumes(study, monkeypatch,
                                                                                         tmp_path):
    """Cut at the tool arm's last evaluation, then run again: the evaluations made before the
    cut are kept, the trainer resumes from its checkpoint, and every sandbox call is counted
    once; a third run finds every seed finished."""
    from grpo_jax.tools import LocalSandbox, PythonTool, SandboxLimits

    common = sys.modules["common"]
    make_task = common.make_task
    calls = []

    class Counting(LocalSandbox):
        def run(self, code):
            calls.append(code)
            return super().run(code)

    def task_with_markers_a_random_model_writes(name, data):
        # "1" opens a block and "2" closes it: an untrained policy calls the tool often
        task = make_task(name, data)
        task.tool = PythonTool(Counting(SandboxLimits(wall_seconds=3, memory_bytes=192 << 20)), open="1", close="2")
        return task

    class Cut(Exception):
        pass

    measure, measured = study.held_out_with_tools, []

    def cut_at_step_4(*a, **k):
        measured.append(1)
        if len(measured) == 4:  # the start's two (one per arm), the tool arm's step 2, then its step 4: cut
            raise Cut
        return measure(*a, **k)

    monkeypatch.setattr(common, "make_task", task_with_markers_a_random_model_writes)
    monkeypatch.setattr(study, "held_out_with_tools", cut_at_step_4)
    out = tmp_path / "study"
    argv = TINY + ["run.steps=4", "--out", str(out)]
    with pytest.raises(Cut):
        study.main(argv)
    kept = json.loads((out / "grpo_tool" / "seed0.evals.json").read_text())
    assert sorted(kept) == ["0", "2"] and not (out / "grpo_tool" / "seed0.json").exists()
    summary = study.main(argv)
    assert len(measured) == 7  # after the cut: the tool arm's step 4, the other arm's steps 2 and 4
    start = json.loads((out / "start.json").read_text())
    tool, plain = (json.loads((out / study.slug(arm) / "seed0.json").read_text()) for arm in (study.TOOL,
                                                                                              study.NO_TOOL))
    for run in (tool, plain):
        assert run["steps"] == [0, 2, 4] and run["seed"] == 0 and run["tool_prob"] == 0.25
        for key in ("accuracy", "call_rate", "block_rate", "sandbox_calls", "statuses", "accuracy_with_call",
                    "accuracy_without_call"):
            assert len(run[key]) == 3, key
        assert all(0 <= a <= 1 for a in run["accuracy"] + run["call_rate"])
        # every step logged once: the resumed trainer trained none of them twice
        assert [h["step"] for h in run["history"]] == sorted({h["step"] for h in run["history"]})
        assert len(run["history"]) == 4 and len(run["training_tool_failures"]) == 4
    assert tool["accuracy"][0] == start[study.TOOL]["accuracy"] and plain["call_rate"][0] == 0.0
    assert tool["accuracy"][1] == kept["2"]["accuracy"] and tool["statuses"][1] == kept["2"]["statuses"]
    # every sandbox call the study made is one the tool arm's files count; the other arm made none
    assert plain["sandbox_calls"] == [0, 0, 0] and plain["training_sandbox_calls"] == 0
    assert plain["call_rate"] == [0.0, 0.0, 0.0] and plain["statuses"] == [{}, {}, {}]
    counted = sum(tool["sandbox_calls"]) + tool["training_sandbox_calls"]
    assert counted > 0 and len(calls) == counted
    assert sum(tool["statuses"][-1].values()) == tool["sandbox_calls"][-1]
    assert set(summary) >= {"T1", "T2", "learning", "final_accuracy", "call_rate", "start"}
    assert summary["T1"]["seeds"] == [0] and summary["T1"]["verdict"] == "not resolved"  # one seed
    assert (out / "summary.json").exists() and (out / "tools_learning_call_rate.png").stat().st_size > 0
    # a second run reads the finished seeds and the start's measurement: nothing trains, nothing runs code
    monkeypatch.setattr(study, "run_seed", lambda *a, **k: pytest.fail("a finished seed was run again"))
    before = len(calls)
    again = study.main(argv)
    assert len(calls) == before and again["final_accuracy"] == summary["final_accuracy"]


def test_pending_skips_finished_seeds_seed_by_seed(study, tmp_path):
    (tmp_path / "grpo_tool").mkdir()
    (tmp_path / "grpo_tool" / "seed0.json").write_text("{}")
    (tmp_path / "grpo_tool" / "seed1.evals.json").write_text("{}")  # evaluations of a cut seed: not finished
    assert study.pending(str(tmp_path), list(study.ARMS), [0, 1]) == [
        (study.NO_TOOL, 0), (study.TOOL, 1), (study.NO_TOOL, 1)]


def _run(accuracy, call_rate):
    return {"accuracy": [0.1, accuracy], "call_rate": [0.2, call_rate]}


def test_verdicts_on_hand_made_seed_files(study):
    start = {study.TOOL: {"call_rate": 0.25}, study.NO_TOOL: {"call_rate": 0.0}}
    runs = {study.TOOL: {0: _run(0.9, 0.9), 1: _run(0.85, 0.5), 2: _run(0.8, 0.3)},
            study.NO_TOOL: {0: _run(0.6, 0.0), 1: _run(0.6, 0.0), 2: _run(0.6, 0.0)}}
    got = study.verdicts(runs, start, bar=0.092)
    half = T975_DF2 * 0.05 / math.sqrt(3)  # gaps 0.3, 0.25, 0.2: sd 0.05
    t1 = got["T1"]
    assert t1["seeds"] == [0, 1, 2] and t1["gaps"] == pytest.approx([0.3, 0.25, 0.2])
    assert (t1["mean"], t1["low"], t1["high"]) == pytest.approx((0.25, 0.25 - half, 0.25 + half))
    assert t1["verdict"] == "reproduces"
    assert got["T2"]["holds"] and got["T2"]["final_call_rate"] == {0: 0.9, 1: 0.5, 2: 0.3}
    assert got["learning"] == {study.TOOL: True, study.NO_TOOL: True} and got["learning_bar"] == pytest.approx(0.192)
    # one seed whose call rate ends at or below the start's breaks T2; one under 0.192 breaks learning
    runs[study.TOOL][2] = _run(0.19, 0.25)
    got = study.verdicts(runs, start, bar=0.092)
    assert not got["T2"]["holds"] and got["learning"][study.TOOL] is False
    assert got["T1"]["verdict"] == "not resolved"  # gaps 0.3, 0.25, -0.41: the interval holds 0
    worse = {study.TOOL: {s: _run(0.3, 0.9) for s in range(3)},
             study.NO_TOOL: {s: _run(0.6 + 0.01 * s, 0.0) for s in range(3)}}
    assert study.verdicts(worse, start, bar=0.092)["T1"]["verdict"] == "contradicts"
    assert "T1" not in study.verdicts({study.TOOL: runs[study.TOOL]}, start, bar=0.092)  # no pairs


def test_the_design_settings_and_pilot_knobs(study, monkeypatch, tmp_path):
    seen = {}

    def stop(task, cfg, *a, **k):
        seen["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(sys.modules["common"], "tokenizer_for", stop)
    with pytest.raises(SystemExit):
        study.main(["--out", str(tmp_path)])
    cfg = seen["cfg"]
    assert (cfg.run.steps, cfg.data.batch_size, cfg.rl.group_size, cfg.optimizer.peak_lr, cfg.rl.beta) == \
        (60, 16, 16, 3e-4, 0.04)
    assert (cfg.data.eval_size, cfg.run.eval_every, cfg.data.tool_prob, cfg.data.modulus) == (512, 10, 0.25, 13)
    with pytest.raises(SystemExit):
        study.main(["--out", str(tmp_path), "--eval-size", "256", "--eval-every", "20", "--tool-prob", "0.5"])
    assert (seen["cfg"].data.eval_size, seen["cfg"].run.eval_every, seen["cfg"].data.tool_prob) == (256, 20, 0.5)
    with pytest.raises(SystemExit) as e:  # a value the design does not allow is refused by the parser
        study.main(["--out", str(tmp_path), "--eval-size", "100"])
    assert e.value.code == 2


def test_one_arm_runs_alone(study, monkeypatch, tmp_path):
    ran = []
    common = sys.modules["common"]
    monkeypatch.setattr(common, "sft_start", lambda *a, **k: (None, None))
    monkeypatch.setattr(study, "start_measure", lambda *a, **k: {arm: {"accuracy": 0.0, "call_rate": 0.0,
                                                                       "accuracy_with_call": None,
                                                                       "accuracy_without_call": 0.0}
                                                                 for arm in study.ARMS})
    monkeypatch.setattr(study, "run_seed", lambda cfg, task, tok, params, mesh, examples, root, arm, seed, *a:
                        ran.append((arm, seed)))
    monkeypatch.setattr(study, "summarize", lambda root, arms, seeds, *a: arms)
    arms = study.main(["data.eval_size=8", "--arms", "grpo_no_tool", "--seeds", "3", "--out", str(tmp_path),
                       "--no-progress"])
    assert arms == [study.NO_TOOL] and ran == [(study.NO_TOOL, 3)]
