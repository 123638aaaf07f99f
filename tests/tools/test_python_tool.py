"""The tool-integrated format: which text is a code block, and the output text given back
(a status line a reward reads for a run that did not end well)."""
import pytest

from grpo_jax.tools import ExecutionResult, PythonTool, statuses

TOOL = PythonTool(sandbox=None, max_output_chars=8)


@pytest.mark.parametrize("turn, code", [
    ("no code at all", None),
    ("Let me see.\n```", None),  # a fence that may open a block
    ("```python\nx = 1\n", None),  # open, not closed yet
    ("So:\n```python\nprint(2 + 2)\n```", "print(2 + 2)\n"),
    ("```python\na\n```\n```python\nb\n```", "a\n"),  # the first complete block
])
def test_code_is_the_first_complete_block(turn, code):
    assert TOOL.code(turn) == code


@pytest.mark.parametrize("result, text", [
    (ExecutionResult("ok", "4\n", ""), "\n```output\n4\n```\n"),
    (ExecutionResult("ok", "123456789012", ""), "\n```output\n12345678\n```\n"),  # max_output_chars
    (ExecutionResult("error", "partial", "Traceback ...\nZeroDivisionError: division by zero\n", 1),
     "\n```output\npartial\n[error: ZeroDivisionError: division by zero]\n```\n"),
    (ExecutionResult("timeout", "", "", None, "wall time 5 s"), "\n```output\n[timeout: wall time 5 s]\n```\n"),
    (ExecutionResult("killed", "", "", None, "SIGSEGV"), "\n```output\n[killed: SIGSEGV]\n```\n"),
    # a "]" of the code's cannot end the status line early
    (ExecutionResult("error", "", "KeyError: ']'\n", 1), "\n```output\n[error: KeyError: ')']\n```\n"),
])
def test_output_text_and_status_line(result, text):
    assert TOOL.output(result) == text


def test_statuses_read_the_failed_runs_of_a_completion():
    completion = ("```python\nx\n```" + TOOL.output(ExecutionResult("error", "", "NameError: x\n", 1)) +
                  "```python\nwhile 1: pass\n```" + TOOL.output(ExecutionResult("timeout", "", "", None, "wall time 5 s")) +
                  "```python\nprint(1)\n```" + TOOL.output(ExecutionResult("ok", "1\n", "")) + "The answer is 1.")
    assert statuses(completion) == ["error", "timeout"]


def test_markers_are_checked():
    with pytest.raises(ValueError, match="non-empty open and close markers"):
        PythonTool(sandbox=None, close="")
