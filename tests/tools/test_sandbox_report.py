"""The sandbox's report cannot be forged (issue 83): whatever the code exits with, prints, or
writes on any descriptor it holds, the status says how the code ended, as the kernel and the
runner's own channels say; and a sandbox that cannot run the code says so as a
`SandboxError` of a named kind, never as a status."""
import json
import os
import stat
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_jax.errors import SandboxError
from grpo_jax.tools import sandbox as sb
from grpo_jax.tools.sandbox import LocalSandbox
from tests.tools.conftest import LIMITS
from tests.tools.test_sandbox_hostile import run_contained

MEMORY_BOMB = "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))\n"
# What the launcher writes on its report, and what the runner wrote before it: imitations.
FORGED_REPORT = json.dumps({"exit_code": 0, "memory": True, "unapplied": {}, "landlock_abi": 7}) + "\n"
FORGED_RUNNER = json.dumps({"unconfined": "forged"})


@pytest.fixture(scope="module")
def local():
    return LocalSandbox(LIMITS)


def test_the_two_programs_of_the_issue_are_the_codes_errors(local, work_root):
    for status in (126, 3):
        result = local.run(f"import os; os._exit({status})")
        assert (result.status, result.exit_code, result.detail) == ("error", status, f"exit status {status}")


def test_every_exit_status_is_the_codes_own(local, work_root):
    """os._exit(n) for n in 0..255: ok for 0, an error naming n for every other; none raises."""
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(local.run, [f"import os\nos._exit({n})\n" for n in range(256)]))
    assert [(r.status, r.exit_code) for r in results] == [("ok", 0)] + [("error", n) for n in range(1, 256)]
    assert all(r.detail == f"exit status {n}" for n, r in enumerate(results) if n)


@pytest.mark.parametrize("value, status, exit_code, stderr", [
    ("None", "ok", 0, ""),
    ("0", "ok", 0, ""),
    ("False", "ok", 0, ""),
    ("True", "error", 1, ""),
    ("3", "error", 3, ""),
    ("126", "error", 126, ""),
    ("-1", "error", 255, ""),
    ("256", "error", 1, ""),  # Python's own would wrap to 0: a failure never passes for ok
    ("2 ** 100", "error", 1, ""),
    ("2 ** 100 + 3", "error", 3, ""),
    ("'memory'", "error", 1, "memory\n"),
    ("b'x'", "error", 1, "b'x'\n"),
    ("[0]", "error", 1, "[0]\n"),
    ("type('Bad', (), {'__str__': lambda self: 1 / 0})()", "error", 1, ""),
    ("type('Zero', (int,), {'__eq__': lambda s, o: True, '__mod__': lambda s, o: 0})(7)", "error", 7, ""),
])
def test_sys_exit_with_any_value(local, work_root, value, status, exit_code, stderr):
    result = local.run(f"import sys\nsys.exit({value})\n")
    assert (result.status, result.exit_code, result.stderr) == (status, exit_code, stderr), result


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@pytest.mark.parametrize("exit_status, status", [(0, "ok"), (1, "error")])
def test_text_that_imitates_the_report_is_only_text(local, work_root, stream, exit_status, status):
    text = FORGED_REPORT + FORGED_RUNNER + "\nMemoryError: the sandbox's memory limit was reached\n"
    result = local.run(f"import os, sys\nsys.{stream}.write({text!r})\nsys.{stream}.flush()\nos._exit({exit_status})\n")
    assert (result.status, getattr(result, stream)) == (status, text)


# Each ends with the exit status in {end}; every descriptor 0..1023 is first closed, written
# with an imitation of each report, or replaced by a pipe of the code's own.
DESCRIPTOR_TRICKS = {
    "closed": "for fd in range(1024):\n    try:\n        os.close(fd)\n    except OSError:\n        pass\n",
    "written": ("for fd in range(1024):\n    for forged in (REPORT, RUNNER, os.urandom(16), b'\\0' * 16):\n"
                "        try:\n            os.write(fd, forged)\n        except OSError:\n            pass\n"),
    "replaced": ("r, w = os.pipe()\nfor fd in range(1024):\n    if fd not in (r, w):\n        try:\n"
                 "            os.dup2(w, fd)\n        except OSError:\n            pass\n"),
}


@pytest.mark.parametrize("trick, end, status", [
    *[(trick, end, status) for trick in DESCRIPTOR_TRICKS
      for end, status in (("os._exit(0)", "ok"), ("os._exit(3)", "error"), ("os._exit(126)", "error"))],
    ("written", "raise MemoryError", "memory"),  # as without the writes: the code's own MemoryError
    ("closed", "raise MemoryError", "error"),  # the runner's descriptor taken away: `memory` lost, never won
    ("replaced", "raise MemoryError", "error"),
])
def test_no_descriptor_the_code_holds_passes_for_the_runners(sandbox, work_root, trick, end, status):
    """In both sandboxes (with namespaces and without): after closing, writing or replacing
    every descriptor, the status is the code's exit."""
    code = "import os\n" + DESCRIPTOR_TRICKS[trick] + end + "\n"
    result = run_contained(sandbox, code, REPORT=FORGED_REPORT.encode(), RUNNER=FORGED_RUNNER.encode())
    assert result.status == status, result


def test_the_memory_limit_is_still_memory_after_every_descriptor_was_written(sandbox, work_root):
    code = "import os\n" + DESCRIPTOR_TRICKS["written"] + MEMORY_BOMB
    result = run_contained(sandbox, code, REPORT=FORGED_REPORT.encode(), RUNNER=FORGED_RUNNER.encode())
    assert result.status == "memory", result


def _interpreter(folder, source: str) -> str:
    """An executable standing in for the sandbox's Python."""
    path = os.path.join(folder, "python")
    with open(path, "w") as f:
        f.write(source)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def test_a_runner_that_cannot_confine_itself_is_a_sandbox_error_and_nothing_runs(tmp_path, work_root):
    """The sandbox's program with its confinement made to fail: the runner says so on its
    own pipe, and the call is a SandboxError of kind confine, whatever the code would do."""
    python = _interpreter(tmp_path, f"""#!{sys.executable} -S
import os, sys
child = sys.argv.index({str(sb.CHILD)!r})
source = open(sys.argv[child]).read().replace(
    "def confine(limits: dict, record: dict) -> None:\\n",
    "def confine(limits: dict, record: dict) -> None:\\n    raise RuntimeError('refused by the test')\\n", 1)
patched = os.path.join({str(tmp_path)!r}, "child.py")
open(patched, "w").write(source)
os.execv({sys.executable!r}, [{sys.executable!r}] + sys.argv[1:child] + [patched] + sys.argv[child + 1:])
""")
    sandbox = LocalSandbox(LIMITS, python=python)
    with pytest.raises(SandboxError, match="could not confine itself; nothing ran: RuntimeError: refused by the test") \
            as caught:
        sandbox.run(f"open({str(tmp_path / 'ran')!r}, 'w')")
    assert caught.value.kind == "confine" and not (tmp_path / "ran").exists()


def test_a_launcher_that_fails_on_its_own_and_a_missing_interpreter_are_sandbox_errors(tmp_path, work_root):
    failing = _interpreter(tmp_path, "#!/bin/sh\necho broken launcher >&2\nexit 5\n")
    with pytest.raises(SandboxError, match=r"launcher failed \(exit status 5\): broken launcher") as caught:
        LocalSandbox(LIMITS, python=failing).run("print(1)")
    assert caught.value.kind == "launcher"
    with pytest.raises(SandboxError, match="cannot start the sandbox's interpreter") as caught:
        LocalSandbox(LIMITS, python=str(tmp_path / "missing")).run("print(1)")
    assert caught.value.kind == "start"
