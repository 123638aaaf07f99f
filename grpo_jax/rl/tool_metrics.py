"""A step's tool statistics, and when a broken sandbox back-end stops the run (issue 83).

A call the sandbox could not run at all is its row's ``error`` (`PythonTool.run`), so one bad
call never stops a run. A back-end that fails every call would still turn training into
learning from error lines: the run stops once the share of a step's calls that failed at the
back-end reached ``rl.tool_backend_stop_share`` for ``rl.tool_backend_stop_steps`` steps in a
row (`failing_streak`), with one line naming the kinds (`broken_backend`).
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

import numpy as np

from grpo_jax.errors import SandboxError
from grpo_jax.tools.sandbox import ExecutionResult

FAILURES = "tools/backend_failures"
SHARE = "tools/backend_failure_share"


def tool_metrics(runs: Sequence[Sequence[ExecutionResult]], tool_mask) -> dict[str, float]:
    """The step's metrics of its rows' tool runs: ``tool_calls`` and ``tool_tokens`` per
    completion, ``tool_failures`` (the share of runs not ``ok``), and of the runs the
    back-end could not run: their count, their share of the runs (0 without runs) and their
    count per kind (``tools/backend_failures/<kind>``, the kinds seen only)."""
    every = [run for row in runs for run in row]
    kinds = Counter(run.backend_failure for run in every if run.backend_failure)
    failed = sum(kinds.values())
    return {"tool_calls": float(np.mean([len(row) for row in runs])),
            "tool_failures": float(np.mean([run.status != "ok" for run in every])) if every else 0.0,
            "tool_tokens": float(np.asarray(tool_mask).sum(axis=1).mean()),
            FAILURES: float(failed), SHARE: failed / len(every) if every else 0.0,
            **{f"{FAILURES}/{kind}": float(n) for kind, n in sorted(kinds.items())}}


def failing_streak(streak: int, metrics: Mapping[str, float], stop_share: float) -> int:
    """Steps in a row, up to this one, whose back-end failure share reached ``stop_share``
    (a step without tool runs breaks the streak: it tells nothing of the back-end)."""
    return streak + 1 if metrics.get(SHARE, 0.0) >= stop_share else 0


def broken_backend(metrics: Mapping[str, float], streak: int, stop_share: float, step: int) -> SandboxError:
    """The one-line error that stops a run at ``step``: the streak, the threshold and the
    kinds of the last step's failures."""
    kinds = ", ".join(f"{key.rsplit('/', 1)[1]} x{int(n)}" for key, n in metrics.items()
                      if key.startswith(FAILURES + "/"))
    return SandboxError(f"the sandbox back-end could not run {stop_share:.0%} or more of the tool calls of "
                        f"{streak} steps in a row (rl.tool_backend_stop_share, rl.tool_backend_stop_steps); "
                        f"step {step}: {metrics[SHARE]:.0%} ({kinds}). The back-end is broken, not the code: check it "
                        "(the local sandbox: grpo_jax.tools.capabilities())", "broken")
