"""The Python tool of tool-integrated reasoning: where a code block starts and ends in the
model's text, and the text its output is given back as.

The format is the paper's (DeepSeekMath §2.2, tool-integrated solutions): the model writes

    ```python
    print(17 * 23)
    ```

the sandbox runs the block, and the completion goes on after

    ```output
    391
    ```

A run that did not end well says so on the output's last line, ``[status: detail]`` (e.g.
``[timeout: wall time 5 s]``, ``[error: ZeroDivisionError: division by zero]``), so a reward
reads it from the completion like any other text (`statuses`).
"""

from __future__ import annotations

import dataclasses
import re
import time

from grpo_jax.errors import SandboxError
from grpo_jax.tools.sandbox import ExecutionResult, LocalSandbox, Sandbox

OUTPUT_OPEN = "```output\n"
STATUS_LINE = re.compile(r"^\[(timeout|error|memory|output_limit|killed): [^\]\n]*\]$", re.M)


@dataclasses.dataclass(frozen=True)
class PythonTool:
    """``sandbox`` runs the code; ``open`` and ``close`` delimit a block in the model's text;
    ``max_output_chars`` bounds the output given back (its first characters; the sandbox's
    own output limit bounds what is read at all)."""

    sandbox: Sandbox = dataclasses.field(default_factory=LocalSandbox)
    open: str = "```python\n"
    close: str = "```"
    max_output_chars: int = 512

    def __post_init__(self):
        if not self.open or not self.close or self.max_output_chars < 1:
            raise ValueError("PythonTool needs non-empty open and close markers and max_output_chars >= 1")

    def code(self, turn: str) -> str | None:
        """The code of the first complete block in ``turn`` (the model's text since the last
        output), or None while no block is closed."""
        start = turn.find(self.open)
        if start < 0:
            return None
        end = turn.find(self.close, start + len(self.open))
        return None if end < 0 else turn[start + len(self.open):end]

    def run(self, code: str) -> ExecutionResult:
        """``code`` run in the sandbox. A sandbox that cannot run it (`SandboxError`, or any
        exception of a back-end: a remote service's timeout or 5xx) fails this call only:
        its ``error``, the back-end's words as the detail, the kind in ``backend_failure``
        (the SandboxError's, else the exception's class), so the row and the rollout go on."""
        start = time.monotonic()
        try:
            return self.sandbox.run(code)
        except Exception as e:  # noqa: BLE001 -- one call's failure; a broken back-end is caught by its count
            kind = e.kind if isinstance(e, SandboxError) else type(e).__name__
            return ExecutionResult("error", "", "", None, f"sandbox back-end failed ({kind}): {e}",
                                   time.monotonic() - start, backend_failure=kind)

    def output(self, result: ExecutionResult) -> str:
        """The text appended after a block: stdout (its first ``max_output_chars``; a line of
        it that looks like a status line gets a leading space), and for a run that did not end
        well a last line ``[status: detail]`` (for an error, the exception's line from stderr)."""
        # A line of the code's own that reads as a status line is moved off the line's start:
        # only the tool's last line may say how the run ended (`statuses`).
        text = STATUS_LINE.sub(lambda line: " " + line[0], result.stdout[: self.max_output_chars])
        if result.status != "ok":
            lines = result.stderr.strip().splitlines()
            why = lines[-1] if result.status == "error" and lines else result.detail
            why = " ".join(why.replace("]", ")").split())[:200]  # one line, whatever a back-end said
            text = (text + "\n" if text and not text.endswith("\n") else text) + f"[{result.status}: {why}]"
        return f"\n{OUTPUT_OPEN}{text.rstrip(chr(10))}\n```\n"


def statuses(text: str) -> list[str]:
    """The statuses of the failed runs in the tool's outputs (``timeout``, ``error``, ...),
    in order: what a reward reads to penalise, say, code that timed out. Read them from the
    tool's text only (`grpo_jax.eval.evaluation.tool_text`): on a whole completion, a status
    line the model wrote itself would count as the tool's."""
    return STATUS_LINE.findall(text)
