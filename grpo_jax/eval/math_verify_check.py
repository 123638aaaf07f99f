"""Hugging Face's `math-verify` as a second answer checker, beside the project's own
(`grpo_jax.tasks.rewards`), and a report of where the two disagree.

    with MathVerify() as mv:
        mv.is_correct(completion, reference)      # True / False; False on a timeout
    report = disagreements(cases, mv)               # cases: (completion, reference, ours)

math-verify parses LaTeX with ANTLR and compares with sympy. Model output is untrusted
input, and sympy's parsing and simplification have no time bound (its own timeout is
`signal.alarm`, which works only in a main thread and cannot interrupt C bignum work), so
it never runs in this process: a worker process (`python -m grpo_jax.eval.math_verify_check`)
reads one JSON request per line and answers one per line, under an address-space limit;
a request not answered within `timeout_s` kills the worker (a new one starts for the next
request) and counts as not correct. The training reward stays the project's own bounded
checker; this one is for evaluation (`grpo-evaluate --math-verify`) and for measuring
where the project's checker calls right answers wrong.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from grpo_jax.errors import ConfigError

TIMEOUT_S = 5.0
WORKER_MEMORY_BYTES = 2 << 30
# A completion longer than this is not sent (rewards._too_long's rule for the project's checker).
MAX_CHARS = 20_000


class MathVerify:
    """A math-verify worker process; `is_correct` asks it, `close` (or the `with` block) ends it."""

    def __init__(self, timeout_s: float = TIMEOUT_S):
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self.timeouts = 0

    def __enter__(self) -> "MathVerify":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # stderr to a file, not a pipe: a worker logging a warning per unparsable answer would
        # fill a pipe no one reads and block, which would look like a timeout.
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen([sys.executable, "-m", "grpo_jax.eval.math_verify_check"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, env=env, text=True, bufsize=1)
        proc.log = log
        # The worker ends with this object (or with this process: its stdin closes) even
        # when no one calls close().
        weakref.finalize(self, MathVerify._kill, proc)
        ready = self._read(proc, 60.0)
        if ready is None or not ready.get("ready"):
            proc.kill()
            proc.wait()
            log.seek(0)
            err = log.read()
            self._kill(proc)
            detail = (ready or {}).get("error") or " ".join(err.split())[-300:] or "no answer"
            raise ConfigError(f"math-verify could not start ({detail}); install it with "
                              "pip install -r requirements.txt")
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen, timeout_s: float) -> dict | None:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = proc.stdout.readline()
        return json.loads(line) if line else None

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, getattr(proc, "log", None)):
            if stream is not None and not stream.closed:
                stream.close()

    def is_correct(self, completion: str, reference: str) -> bool:
        """math-verify's verdict on `completion` (any text: the answer is extracted from it,
        boxed or not) against `reference` (the final answer: a number or a LaTeX answer)."""
        if not isinstance(completion, str) or len(completion) > MAX_CHARS:
            return False
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        try:
            self._proc.stdin.write(json.dumps({"completion": completion, "reference": reference}) + "\n")
            self._proc.stdin.flush()
            reply = self._read(self._proc, self.timeout_s)
        except (BrokenPipeError, OSError, ValueError):
            reply = None
        if reply is None:  # timed out or died: a fresh worker answers the next request
            self.timeouts += 1
            self._kill(self._proc)
            self._proc = None
            return False
        return bool(reply.get("correct"))

    def close(self) -> None:
        if self._proc is not None:
            self._kill(self._proc)
            self._proc = None


def gold_text(reference: str) -> str:
    """A reference answer as math-verify reads a gold answer: LaTeX in $...$ (a number too)."""
    return f"${reference}$"


@dataclass
class Disagreements:
    """Counts of the four cells (ours x math-verify) and the cases where they differ."""

    counts: dict = field(default_factory=lambda: {"both_correct": 0, "both_wrong": 0,
                                                  "ours_only": 0, "math_verify_only": 0})
    cases: list = field(default_factory=list)
    timeouts: int = 0

    def to_dict(self) -> dict:
        return {"counts": self.counts, "timeouts": self.timeouts, "cases": self.cases}


def disagreements(cases: Iterable[tuple[str, str, bool]], checker: MathVerify, *,
                  labels: Sequence[str] | None = None) -> Disagreements:
    """Both checkers' verdicts on (completion, reference, ours) cases; `labels` name them."""
    out = Disagreements()
    before = checker.timeouts
    for i, (completion, reference, ours) in enumerate(cases):
        theirs = checker.is_correct(completion, reference)
        cell = ("both_correct" if theirs else "ours_only") if ours else ("math_verify_only" if theirs else "both_wrong")
        out.counts[cell] += 1
        if ours != theirs:
            out.cases.append({"label": labels[i] if labels else str(i), "completion": completion,
                              "reference": reference, "ours": bool(ours), "math_verify": theirs})
    out.timeouts = checker.timeouts - before
    return out


def format_report(title: str, report: Disagreements) -> str:
    """Markdown: the counts, then one row per disagreement."""
    c = report.counts
    lines = [f"### {title}", "",
             f"both correct {c['both_correct']}, both wrong {c['both_wrong']}, only ours correct "
             f"{c['ours_only']}, only math-verify correct {c['math_verify_only']}"
             f" (math-verify timeouts: {report.timeouts})", ""]
    if report.cases:
        lines += ["| case | completion (end) | reference | ours | math-verify |", "|---|---|---|---|---|"]
        for case in report.cases:
            tail = case["completion"][-60:].replace("\n", "\\n").replace("|", "\\|")
            ref = case["reference"].replace("|", "\\|")
            lines.append(f"| {case['label']} | `{tail}` | `{ref}` | {int(case['ours'])} | {int(case['math_verify'])} |")
        lines.append("")
    return "\n".join(lines)


def second_opinion(out_dir: str, checker: MathVerify) -> dict:
    """math-verify's verdicts on an evaluation's records (`<out_dir>/shard-*.jsonl`: every
    greedy and sampled completion against the question's reference), beside the project's
    (`greedy_correct`, `correct`); written to `<out_dir>/math_verify.json` and returned:
    the greedy accuracy by each checker and `Disagreements.to_dict()` over all completions.
    With tools, it reads the model's own text of each (`greedy_own_text`, `own_texts`), as
    the project's checker does: a \\boxed{} the code printed is not the model's answer."""
    import glob

    from grpo_jax.eval.evaluate_run import read_records

    records = [r for p in sorted(glob.glob(os.path.join(out_dir, "shard-*-of-*.jsonl"))) for r in read_records(p)]
    records.sort(key=lambda r: r["index"])
    cases, labels, greedy_mv = [], [], []
    for r in records:
        ref = str(r["reference"])
        cases.append((r.get("greedy_own_text", r["greedy_completion"]), ref, bool(r["greedy_correct"])))
        labels.append(f"{r['index']} greedy")
        for j, (c, ok) in enumerate(zip(r.get("own_texts", r["completions"]), r["correct"])):
            cases.append((c, ref, bool(ok)))
            labels.append(f"{r['index']} sample {j}")
    report = disagreements(cases, checker, labels=labels)
    greedy = [i for i, label in enumerate(labels) if label.endswith("greedy")]
    verdicts = {c["label"]: c["math_verify"] for c in report.cases}
    greedy_mv = [verdicts.get(labels[i], cases[i][2]) for i in greedy]
    n = max(1, len(records))
    summary = {"questions": len(records),
               "greedy_accuracy": {"ours": sum(cases[i][2] for i in greedy) / n, "math_verify": sum(greedy_mv) / n},
               **report.to_dict()}
    with open(os.path.join(out_dir, "math_verify.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, ensure_ascii=False)
    return summary


# ----------------------------------------------------------------------------- the worker

def _serve() -> None:
    """The worker's loop: a `{"ready": true}` line, then one verdict line per request line."""
    import resource

    # An answer that makes sympy build a huge number fails here with MemoryError instead of
    # taking the machine's memory; the parent's timeout bounds its time.
    try:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ValueError, OSError):
        pass
    try:
        from math_verify import parse, verify
    except ImportError as e:
        print(json.dumps({"ready": False, "error": f"cannot import math_verify: {e}"}), flush=True)
        return
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            gold = parse(gold_text(request["reference"]))
            answer = parse(request["completion"])
            correct = bool(gold) and bool(answer) and bool(verify(gold, answer))
            reply = {"correct": correct}
        except Exception as e:  # noqa: BLE001 (any failure on untrusted text is "not correct")
            reply = {"correct": False, "error": f"{type(e).__name__}: {e}"[:200]}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    _serve()
