"""math-verify as a second checker (grpo_jax.eval.math_verify_check): it runs in a worker process
with a hard time limit, survives the reward-safety strings, and its disagreement report on
the GSM8K and MATH fixtures is the one docs/math_verify.md shows."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from grpo_jax.cli import evaluate as evaluate_cli
from grpo_jax.eval.math_verify_check import MathVerify, second_opinion

from tests.tasks.test_rewards import HOSTILE

pytest.importorskip("math_verify")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checker():
    with MathVerify(timeout_s=10.0) as mv:  # no case here should come near it
        yield mv


@pytest.fixture(scope="module")
def report_script():
    spec = importlib.util.spec_from_file_location("math_verify_report", ROOT / "experiments" / "math_verify_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verdicts(checker):
    assert checker.is_correct("so $x = \\boxed{\\frac{3}{2}}$", "1.5")
    assert checker.is_correct("Adding them, the answer is 72.", "72")
    assert not checker.is_correct("$\\boxed{\\frac{3}{5}}$", "\\frac{3}{4}")
    assert not checker.is_correct("no answer here", "5")


def test_a_runaway_answer_is_killed_and_the_next_one_answered(tmp_path):
    """A power tower sympy would expand for ever: the worker is killed at the time limit,
    the answer counts as wrong, and a fresh worker answers the next request."""
    with MathVerify(timeout_s=10.0) as mv:
        assert mv.is_correct("$\\boxed{5}$", "5")
        mv.timeout_s = 0.5
        assert not mv.is_correct("$\\boxed{9^{9^{9^{9}}}}$", "1")
        assert mv.timeouts == 1
        mv.timeout_s = 10.0  # a fresh worker's first answer, on a slow machine
        assert mv.is_correct("$\\boxed{5}$", "5")


# Reward-safety strings of tests/tasks/test_rewards.py: code, towers of powers sympy would expand,
# a division by zero, and one longer than MAX_CHARS (refused before the worker). (The whole
# list takes a minute here: most strings run into the time limit, each costing a fresh worker.)
RUNAWAY = [t for t in HOSTILE if t in (
    "__import__('os').system('echo pwned')", "9**9**9**9", "\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}",
    "\\boxed{\\frac{1}{0}}")] + [HOSTILE[10]]


def test_hostile_strings_never_reach_this_process(tmp_path):
    """Runaway and hostile completions: every one gets a bool (wrong), nothing they say runs,
    and the checker still answers afterwards."""
    assert len(RUNAWAY) == 5
    marker = tmp_path / "pwned"
    injections = [f"__import__('os').system('touch {marker}')", f"$\\boxed{{__import__('os').system('touch {marker}')}}$"]
    with MathVerify(timeout_s=0.5) as mv:
        for text in [*RUNAWAY, *injections]:
            assert mv.is_correct(text, "5") is False, text[:40]
        assert not marker.exists()
        mv.timeout_s = 10.0  # a fresh worker's first answer, on a slow machine
        assert mv.is_correct("$\\boxed{5}$", "5")


def test_fixture_report_counts_and_docs(checker, report_script):
    """The disagreement counts on the fixtures (math-verify==0.9.0, pinned): GSM8K agrees
    everywhere; on MATH math-verify also accepts an unboxed final answer, which the reward
    does not (the prompt asks for \\boxed{}); by hand, unsimplified answers (sin²+cos², log₂8).
    docs/math_verify.md holds this report."""
    sections = report_script.report(checker)
    counts = {title: rep.counts for title, rep in sections.items()}
    assert counts == {
        "GSM8K fixture": {"both_correct": 32, "both_wrong": 8, "ours_only": 0, "math_verify_only": 0},
        "MATH fixture": {"both_correct": 13, "both_wrong": 6, "ours_only": 0, "math_verify_only": 6},
        "Hand-written MATH-style answers": {"both_correct": 12, "both_wrong": 2, "ours_only": 0,
                                            "math_verify_only": 3},
    }
    assert {c["label"] for c in sections["MATH fixture"].cases} == {
        f"math {p} unboxed" for p in ("test/algebra/8", "test/prealgebra/14", "train/algebra/11", "train/algebra/27",
                                      "train/algebra/3", "train/number_theory/5")}
    assert [c["label"] for c in sections["Hand-written MATH-style answers"].cases] == [
        "identity", "log", "unboxed sentence"]
    doc = (ROOT / "docs" / "math_verify.md").read_text()
    assert doc.split(report_script.BEGIN, 1)[1].strip() == report_script.markdown(sections).strip()


def test_second_opinion_on_an_evaluation(checker, tmp_path):
    """grpo-evaluate --math-verify's file: both checkers' greedy accuracy and disagreements."""
    records = [
        {"index": 0, "reference": "72", "greedy_completion": "so the answer is 72", "greedy_correct": False,
         "completions": ["#### 72", "#### 71"], "correct": [True, False]},
        {"index": 1, "reference": "5", "greedy_completion": "#### 5", "greedy_correct": True,
         "completions": [], "correct": []},
    ]
    (tmp_path / "shard-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = second_opinion(str(tmp_path), checker)
    assert out["greedy_accuracy"] == {"ours": 0.5, "math_verify": 1.0}
    assert out["counts"] == {"both_correct": 2, "both_wrong": 1, "ours_only": 0, "math_verify_only": 1}
    assert [c["label"] for c in out["cases"]] == ["0 greedy"]
    assert json.loads((tmp_path / "math_verify.json").read_text()) == out


def test_with_tools_the_second_opinion_reads_the_models_own_text(checker, tmp_path):
    """A completion whose tool printed the reference in \\boxed{}: not the model's answer."""
    output = "\n```output\n\\boxed{5}\n```\n"
    record = {"index": 0, "reference": "5", "greedy_completion": "```python\nprint(5)\n```" + output + "Done.",
              "greedy_own_text": "```python\nprint(5)\n```\nDone.", "greedy_correct": False,
              "completions": ["```python\nprint(5)\n```" + output + "So \\boxed{5}."],
              "own_texts": ["```python\nprint(5)\n```\nSo \\boxed{5}."], "correct": [True]}
    assert checker.is_correct(record["greedy_completion"], "5")  # the whole text would be read as right
    (tmp_path / "shard-00000-of-00001.jsonl").write_text(json.dumps(record) + "\n")
    out = second_opinion(str(tmp_path), checker)
    assert out["counts"] == {"both_correct": 1, "both_wrong": 1, "ours_only": 0, "math_verify_only": 0}


def test_countdown_is_refused():
    from grpo_jax.errors import ConfigError
    with pytest.raises(ConfigError, match="--math-verify checks math answers"):
        evaluate_cli.main(["--model", "unused", "--task", "countdown", "--limit", "1", "--math-verify"])
