"""The tool-integrated format: which text is a code block, and the output text given back
(a status line a reward reads for a run that did not end well)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.errors import SandboxError
from grpo_jax.tools import STATUSES, ExecutionResult, PythonTool, statuses

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
    # a back-end's words on several lines: one status line
    (ExecutionResult("error", "", "", None, "sandbox back-end failed (launcher): a\nb]\n", backend_failure="launcher"),
     "\n```output\n[error: sandbox back-end failed (launcher): a b)]\n```\n"),
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


@pytest.mark.parametrize("stdout, text", [
    ("[memory: x]\n", "\n```output\n [memory: x]\n```\n"),
    ("ok\n[error: 5 s]\n", "\n```output\nok\n [error: 5 s]\n```\n"),
    ("[error: ]" + "x" * 20, "\n```output\n[error: ]xxxxxxx\n```\n"),
    ("1234567[error: ]", "\n```output\n1234567[error: ]\n```\n"),  # not at a line's start
    ("123456\n[error: ]ab", "\n```output\n123456\n [error: ]\n```\n"),  # cut to look like one
])
def test_the_codes_own_status_lines_never_count(stdout, text):
    tool = PythonTool(sandbox=None, max_output_chars=16)
    assert tool.output(ExecutionResult("ok", stdout, "")) == text and statuses(text) == []


class Raising:
    """A back-end that raises ``error`` on every call."""

    def __init__(self, error):
        self.error = error

    def run(self, code):
        raise self.error


@pytest.mark.parametrize("error, kind", [
    (SandboxError("the sandbox's process could not confine itself; nothing ran: x", "confine"), "confine"),
    (SandboxError("cannot start the sandbox's interpreter /x: [Errno 2]", "start"), "start"),
    (TimeoutError("timed out"), "TimeoutError"),  # a remote service's, raised as is
    (RuntimeError("HTTP 502"), "RuntimeError"),
])
def test_a_backend_failure_is_the_calls_error_with_its_kind(error, kind):
    result = PythonTool(Raising(error)).run("print(1)")
    assert (result.status, result.stdout, result.stderr, result.backend_failure) == ("error", "", "", kind)
    assert result.detail == f"sandbox back-end failed ({kind}): {error}"
    assert statuses(PythonTool(Raising(error)).output(result)) == ["error"]


# Text a model writes around the markers: fences whole and cut, other languages' fences,
# status lines, and any other characters.
PIECES = st.one_of(st.sampled_from(["```python\n", "```", "``", "`", "```output\n", "\n", "```py\n", "[error: x]",
                                    "\\boxed{1}"]), st.text(max_size=6))
HOSTILE = settings(max_examples=200, derandomize=True, database=None, deadline=None)


@HOSTILE
@given(st.lists(PIECES, max_size=12).map("".join))
def test_the_code_of_any_text_is_its_first_complete_block(turn):
    code, open_at = TOOL.code(turn), turn.find(TOOL.open)
    if code is None:
        assert open_at < 0 or TOOL.close not in turn[open_at + len(TOOL.open):]
    else:
        assert turn.startswith(TOOL.open + code + TOOL.close, open_at) and TOOL.close not in code


@HOSTILE
@given(st.sampled_from(STATUSES), st.text(max_size=40), st.text(max_size=40), st.text(max_size=40))
def test_any_result_gives_back_one_output_block_with_exactly_its_status(status, stdout, stderr, detail):
    result = ExecutionResult(status, stdout, stderr, None, detail)
    text = TOOL.output(result)
    assert text.startswith("\n```output\n") and text.endswith("\n```\n")
    assert statuses(text) == ([] if status == "ok" else [status])
    assert len(text) <= len("\n```output\n") + 2 * TOOL.max_output_chars + len(f"\n[{status}: ]\n```\n") + 200
