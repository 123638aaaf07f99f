"""The tool-integrated evaluation (`grpo-evaluate --tools python`) with a scripted model whose
text is fixed: every code block really runs in the sandbox, so each status, each count of the
summary and each answer is known by hand. The answer is the last \\boxed{} of the model's own
text, never of a tool's output."""
import dataclasses
import json

import numpy as np
import pytest

from grpo_jax.eval import evaluate_run, evaluation
from grpo_jax.sampler import SamplingParams
from grpo_jax.sampler.host import Rollout
from grpo_jax.sampler.turns import ToolUse
from grpo_jax.tasks import Example
from grpo_jax.tasks.gsm8k import Gsm8kTask
from grpo_jax.tasks.math_task import MathTask
from grpo_jax.tools import LocalSandbox, PythonTool, SandboxLimits

from tests.sampler.test_turns import EOS, Chars, Scripted

# the infinite loop ends at 1 s of CPU time; the wall-time limit only guards a loaded machine
SANDBOX = LocalSandbox(SandboxLimits(wall_seconds=30, cpu_seconds=1, memory_bytes=192 << 20))
MAX_CALLS = 2


@dataclasses.dataclass(frozen=True)
class EvalScripted(Scripted):
    """`Scripted` with `Sampler.evaluation`: the same text at any temperature."""

    def evaluation(self, temperature=0.0, top_p=1.0):
        return dataclasses.replace(self, settings=self.settings.evaluation(temperature, top_p))


def block(code: str) -> str:
    return f"```python\n{code}\n```"


# (the model's turns, one per tool output, reference answer); the prompt of question p is "P<p>:"
QUESTIONS = [
    ((block("print(6 * 7)"), " So \\boxed{42}."), "42"),                       # ok; right
    # the code prints a box (chr(92) is the backslash: the code's text holds none); the model boxes nothing
    ((block("print(chr(92) + 'boxed{7}')"), " The answer is 7."), "7"),        # ok; no answer
    ((block("print(1 / 0)"), block("while True:\n    pass"), block("print(3)") + " \\boxed{3}"), "3"),  # error,
    # timeout, then a third block after the last call: only text; right
    (("No code: \\boxed{5}.",), "5"),                                          # no call; right
    ((block("x = bytearray(1 << 34)"), " \\boxed{1}"), "2"),                   # memory; wrong
]


def examples():
    return [Example(prompt=f"P{p}:", answer=f"#### {ref}", meta={"final_answer": ref, "question": f"q{p}"})
            for p, (_, ref) in enumerate(QUESTIONS)]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_eval")
    sampler = EvalScripted(tuple(turns for turns, _ in QUESTIONS),
                           SamplingParams(max_new_tokens=256, stop_tokens=(EOS,)))
    tools = ToolUse.build(PythonTool(SANDBOX), Chars(), MAX_CALLS)
    settings = evaluate_run.EvalSettings(num_samples=1, chunk_rows=16)
    args = (sampler, None, Chars(), Gsm8kTask(), examples(), str(out), settings)
    evaluate_run.evaluate_shard(*args, meta={"model": "scripted"}, progress=False, tools=tools)
    # rerun with the same settings: settings.json compares equal (the sandbox's tuples as
    # JSON lists), nothing is sampled again
    again = evaluate_run.evaluate_shard(*args, meta={"model": "scripted"}, progress=False, tools=tools)
    assert again["questions"] == 0
    summary = evaluate_run.merge_and_summarize(str(out))
    records = [json.loads(line) for line in (out / "shard-00000-of-00001.jsonl").read_text().splitlines()]
    return out, records, summary


def test_each_run_is_recorded_with_its_status(evaluated):
    _, records, _ = evaluated
    want = [["ok"], ["ok"], ["error", "timeout"], [], ["memory"]]
    assert [[c["status"] for c in r["greedy_tool_calls"]] for r in records] == want
    assert [[[c["status"] for c in runs] for runs in r["tool_calls"]] for r in records] == [[w] for w in want]
    # the completion holds the tool's output as the model read it
    assert "```output\n42\n```" in records[0]["greedy_completion"]
    assert "[error: ZeroDivisionError: division by zero]" in records[2]["greedy_completion"]
    assert records[2]["greedy_completion"].count("```output") == 2  # the third block was not run


def test_the_answer_is_the_last_box_of_the_models_own_text(evaluated):
    _, records, summary = evaluated
    assert [r["greedy_answer"] for r in records] == ["42", None, "3", "5", "1"]
    assert [r["greedy_correct"] for r in records] == [True, False, True, True, False]
    assert [r["answers"] for r in records] == [[a] for a in ["42", None, "3", "5", "1"]]
    # question 1: the only box is in the tool's output, which the answer is never read from
    # (read from the whole completion it would be 7, the reference)
    assert "\\boxed{7}" in records[1]["greedy_completion"]
    assert evaluation.final_answer(Gsm8kTask(), records[1]["greedy_completion"]) == "7"
    assert summary["greedy"]["accuracy"] == pytest.approx(3 / 5)


def test_summary_counts_equal_the_hand_count(evaluated):
    out, _, summary = evaluated
    greedy = {"completions": 5, "calls": 5, "calls_mean": 1.0, "calls_histogram": {"0": 1, "1": 3, "2": 1},
              "with_call": 0.8, "statuses": {"ok": 2, "error": 1, "timeout": 1, "memory": 1, "output_limit": 0,
                                              "killed": 0}, "failures": 3}
    # the scripted model writes the same text at any temperature: the sample's counts are the same
    assert summary["tools"] == {"greedy": greedy, "samples": greedy}
    assert json.loads((out / "summary.json").read_text())["tools"] == summary["tools"]
    settings = json.loads((out / "settings.json").read_text())
    assert (settings["tools"], settings["max_tool_calls"]) == ("python", MAX_CALLS)
    assert settings["sandbox"]["kind"] == "LocalSandbox" and settings["sandbox"]["wall_seconds"] == 30
    table = evaluate_run.format_summary(summary)
    assert ("tool calls    greedy: 1.00 per question, 80.0% of questions with >= 1; questions with 0, 1, ... "
            "calls: 0: 1, 1: 3, 2: 1") in table
    assert ("sandbox       greedy: 5 runs, ok 2, failed 3 (error 1, timeout 1, memory 1, output_limit 0, "
            "killed 0)") in table
    assert "sandbox       samples: 5 runs, ok 2, failed 3" in table


def test_own_text_drops_the_tools_tokens_and_the_stop_token():
    tok = Chars()
    text = "ab```" + "\n```output\n\\boxed{9}\n```\n" + "cd"
    ids = tok.encode(text) + [EOS, 0, 0]
    tool = np.zeros(len(ids), bool)
    tool[5:5 + len("\n```output\n\\boxed{9}\n```\n")] = True
    mask = np.arange(len(ids)) < len(ids) - 2
    rollout = Rollout(prompt_tokens=np.ones((1, 1), np.int32), prompt_mask=np.ones((1, 1), bool),
                      tokens=np.asarray([ids], np.int32), mask=mask[None], logprobs=np.zeros((1, len(ids))),
                      lengths=np.asarray([mask.sum()]), finished=np.asarray([True]), tool_mask=tool[None])
    assert evaluation.own_text(rollout, 0, tok) == "ab```\ncd"
    assert evaluation.own_text(rollout.replace(tool_mask=None), 0, tok) == text


@pytest.mark.parametrize("task, text, answer", [
    (Gsm8kTask(), "x = 12\nprint(x)\nSo the total is \\boxed{1,234}.", "1234"),
    (Gsm8kTask(), "#### 12 and 13", None),  # no box: no answer, whatever else the text says
    (MathTask(), "\\boxed{1} then \\boxed{\\frac12}", "0.5"),  # MATH's canonical form of 1/2
])
def test_final_answer_reads_the_last_box_with_the_tasks_extractor(task, text, answer):
    assert evaluation.final_answer(task, text) == answer
