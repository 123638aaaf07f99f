"""Hostile programs: each one contained, this process (the trainer) alive, its files
untouched, no process left behind, and a status that says what happened.

Every case runs in the sandbox as it is here and again with the namespaces refused
(conftest.sandbox), so Landlock and the seccomp filter are shown to hold on their own. A case
that holds only under some mechanism is marked `needs` (conftest.MECHANISMS): where the
kernel refuses it, the sandbox must say so, and the case skips.
"""
import hashlib
import inspect
import os
import platform
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from grpo_jax.tools.sandbox import LocalSandbox, capabilities
from tests.tools.conftest import LIMITS, MECHANISMS, descendants, measure, refusal, refusing_interpreter

SECRET = "grpo-sandbox-test-secret-" + uuid.uuid4().hex


@pytest.fixture
def checkpoints(tmp_path):
    """A run's checkpoint folder, as the code might find it."""
    folder = tmp_path / "run" / "checkpoints"
    (folder / "100").mkdir(parents=True)
    (folder / "100" / "params.msgpack").write_bytes(b"weights" * 100)
    (folder / "latest").write_text("100")
    return folder


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest()
                                         if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def run_contained(sandbox, code: str, **names):
    """Run ``code`` with ``names`` bound at its top (as literals), and check what every case
    must: no sandbox process outlives the call, and the call ends within its limits."""
    before = descendants()
    prelude = "".join(f"{k} = {v!r}\n" for k, v in names.items())
    start = time.monotonic()
    result = sandbox.run(prelude + code)
    assert time.monotonic() - start < LIMITS.wall_seconds + 2
    assert descendants() <= before, "a sandbox process outlived its call"
    return result


# Each probe of `capabilities`: the mechanisms that refuse it, and the words of the sandbox's
# warning where none does. One new process is within RLIMIT_NPROC: only seccomp refuses it.
PROBES = {
    "network": (lambda c: "network" in c.namespaces or c.seccomp or c.landlock_abi >= 4, "network ("),
    "files": (MECHANISMS["landlock"].holds, "(no Landlock"),
    "write": (MECHANISMS["landlock"].holds, "(no Landlock"),
    "processes": (MECHANISMS["seccomp"].holds, "(no seccomp"),
    "signals": (MECHANISMS["signal isolation"].holds, "signals to the trainer ("),
    "environment": (lambda c: True, None),
    "rlimits": (lambda c: True, None),
}


def test_what_the_sandbox_enforces_here(sandbox, measured, record_property):
    """Measured, not assumed: each probe of `capabilities` is refused exactly where the
    mechanisms the sandbox applied refuse it, and the warning names every probe that got
    through. Printed and recorded, so a run on a new machine shows what held there."""
    found = {p.name: p for p in capabilities(sandbox)}
    print(f"sandbox: {measured.confinement}; could not enforce: {measured.warning or 'nothing'}")
    record_property("sandbox", str(measured.confinement))
    assert set(found) == set(PROBES)
    for name, (holds, words) in PROBES.items():
        assert found[name].enforced == holds(measured.confinement), (name, found[name], measured)
        assert found[name].enforced or words in measured.warning, (name, measured.warning)


@pytest.mark.needs("seccomp")
def test_fork_bomb(sandbox, work_root):
    result = run_contained(sandbox, "import os\nwhile True:\n    os.fork()\n")
    assert result.status == "error" and "PermissionError" in result.stderr


@pytest.mark.needs("exec refusal")
def test_fork_bomb_through_a_shell(sandbox, work_root):
    result = run_contained(sandbox, "import subprocess\nsubprocess.run(['/bin/sh', '-c', ':(){ :|:& };:'])\n")
    assert result.status == "error" and "PermissionError" in result.stderr


def test_thread_bomb(sandbox, work_root):
    """Threads stop at RLIMIT_NPROC (or, for uid 0, which the kernel exempts, at the address
    space); the interpreter then waits for the started ones (a second each) and ends."""
    code = "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(1,)).start()\n"
    result = run_contained(sandbox, code)
    assert result.status == "error" and "can't start new thread" in result.stderr, result


@pytest.mark.parametrize("code", ["chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))\n",
                                  "x = 'x' * (1 << 40)\n"])
def test_memory_bomb(sandbox, work_root, code):
    result = run_contained(sandbox, code)
    assert result.status == "memory", result


@pytest.mark.parametrize("code", ["while True:\n    pass\n", "import time\ntime.sleep(3600)\n",
                                  "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"])
def test_infinite_loop(sandbox, work_root, code):
    result = run_contained(sandbox, code)
    assert result.status == "timeout", result



@pytest.mark.needs("seccomp")
def test_socket_connections(sandbox, work_root, tmp_path):
    """TCP and UDP to this machine, and a unix socket file of the trainer's: none gets through."""
    with socket.create_server(("127.0.0.1", 0)) as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, \
            socket.socket(socket.AF_UNIX) as unix:
        udp.bind(("127.0.0.1", 0))
        unix.bind(str(tmp_path / "trainer.sock"))
        unix.listen()
        code = ("import socket\n"
                "for attempt in (lambda: socket.create_connection(('127.0.0.1', TCP), timeout=1),\n"
                "                lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', UDP)),\n"
                "                lambda: socket.socket(socket.AF_UNIX).connect(UNIX)):\n"
                "    try:\n        attempt()\n        print('CONNECTED')\n"
                "    except OSError as e:\n        print(type(e).__name__)\n")
        result = run_contained(sandbox, code, TCP=tcp.getsockname()[1], UDP=udp.getsockname()[1],
                               UNIX=str(tmp_path / "trainer.sock"))
        for s in (tcp, udp, unix):
            s.setblocking(False)
        with pytest.raises(BlockingIOError):
            tcp.accept()
        with pytest.raises(BlockingIOError):
            udp.recv(16)
        with pytest.raises(BlockingIOError):
            unix.accept()
    assert result.status == "ok" and "CONNECTED" not in result.stdout
    assert result.stdout.count("PermissionError") == 3


@pytest.mark.needs("landlock", "seccomp")
def test_writing_into_home_and_the_checkpoint_folder(sandbox, work_root, checkpoints):
    home_file = Path.home() / f".grpo-sandbox-hostile-{uuid.uuid4().hex}"
    before = snapshot(checkpoints)
    code = ("import os, shutil\n"
            "attempts = [lambda: open(HOME_FILE, 'w').write('x'),\n"
            "            lambda: open(CKPT + '/latest', 'w').write('0'),\n"
            "            lambda: open(CKPT + '/100/params.msgpack', 'r+b').write(b'poison'),\n"
            "            lambda: open(CKPT + '/new', 'x'),\n"
            "            lambda: os.remove(CKPT + '/latest'),\n"
            "            lambda: os.rename(CKPT + '/100', CKPT + '/101'),\n"
            "            lambda: shutil.rmtree(CKPT),\n"
            "            lambda: os.chmod(CKPT + '/latest', 0),\n"
            "            lambda: os.utime(CKPT + '/latest', (0, 0)),\n"
            "            lambda: os.setxattr(CKPT + '/latest', 'user.x', b'1'),\n"
            "            lambda: os.truncate(CKPT + '/latest', 0),\n"
            "            lambda: os.link(CKPT + '/latest', 'stolen'),\n"
            "            lambda: (os.symlink(CKPT + '/latest', 'via'), open('via', 'w').write('0'))]\n"
            "for attempt in attempts:\n"
            "    try:\n        attempt()\n        print('WROTE')\n"
            "    except OSError as e:\n        print(type(e).__name__)\n")
    try:
        result = run_contained(sandbox, code, HOME_FILE=str(home_file), CKPT=str(checkpoints))
        assert not home_file.exists()
    finally:
        home_file.unlink(missing_ok=True)
    assert snapshot(checkpoints) == before
    assert result.status == "ok" and "WROTE" not in result.stdout
    assert len(result.stdout.split()) == 13


@pytest.mark.needs("landlock")
def test_no_secret_in_the_environment(sandbox, work_root, monkeypatch):
    monkeypatch.setenv("GRPO_SANDBOX_TEST_TOKEN", SECRET)
    code = ("import os\nprint(dict(os.environ))\n"
            "for path in ('/proc/self/environ', '/proc/1/environ', f'/proc/{PARENT}/environ', f'/proc/{os.getppid()}/environ'):\n"
            "    try:\n        print(open(path, 'rb').read())\n"
            "    except OSError as e:\n        print(type(e).__name__)\n")
    result = run_contained(sandbox, code, PARENT=os.getpid())
    assert result.status == "ok"
    assert SECRET not in result.stdout + result.stderr and "GRPO_SANDBOX_TEST_TOKEN" not in result.stdout
    assert "XLA_FLAGS" not in result.stdout  # conftest's variables are the trainer's too


@pytest.mark.needs("landlock")
def test_reading_the_trainers_files(sandbox, work_root, tmp_path):
    (tmp_path / "api_key.txt").write_text(SECRET)
    code = ("import os\n"
            "for attempt in (lambda: open(KEY).read(), lambda: os.listdir(FOLDER), lambda: open(THIS).read(),\n"
            "                lambda: open('/etc/passwd').read(), lambda: os.listdir('/')):\n"
            "    try:\n        print(attempt())\n"
            "    except OSError as e:\n        print(type(e).__name__)\n")
    result = run_contained(sandbox, code, KEY=str(tmp_path / "api_key.txt"), FOLDER=str(tmp_path), THIS=__file__)
    assert result.status == "ok" and result.stdout.split() == ["PermissionError"] * 5
    assert SECRET not in result.stdout


@pytest.mark.needs("signal isolation")
def test_signalling_the_trainer(sandbox, work_root):
    """SIGTERM and SIGKILL at this process, its group, every process it may signal, and a
    second process of the trainer's: all of them survive."""
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        code = ("import os, signal\n"
                "for sig in (signal.SIGTERM, signal.SIGKILL):\n"
                "    for attempt in (lambda: os.kill(PARENT, sig), lambda: os.kill(os.getppid(), sig),\n"
                "                    lambda: os.killpg(os.getpgid(PARENT), sig), lambda: os.kill(OTHER, sig),\n"
                "                    lambda: os.kill(-1, sig), lambda: os.killpg(OTHER, sig)):\n"
                "        try:\n            attempt()\n        except OSError as e:\n            print(type(e).__name__)\n"
                "print('done')\n")
        result = run_contained(sandbox, code, PARENT=os.getpid(), OTHER=other.pid)
        time.sleep(0.1)
        assert other.poll() is None, "a process of the trainer's was killed"
    finally:
        other.kill()
        other.wait()
    assert result.status in ("ok", "killed"), result  # it may kill itself (kill(-1) in its namespace)


def test_a_gigabyte_of_output(sandbox, work_root):
    for stream in ("stdout", "stderr"):
        code = f"import sys\nfor _ in range(1 << 14):\n    sys.{stream}.write('x' * (1 << 16))\n"
        result = run_contained(sandbox, code)
        assert result.status == "output_limit", result.detail
        assert len(result.stdout) + len(result.stderr) <= LIMITS.output_bytes


def test_one_enormous_line(sandbox, work_root):
    result = run_contained(sandbox, "print('x' * (32 << 20), end='')\n")
    assert result.status == "output_limit"


@pytest.mark.parametrize("code, status, stdout", [
    ("print('a')\nimport sys\nsys.exit(0)\nprint('b')\n", "ok", "a\n"),
    ("print('a')\nimport os\nos._exit(0)\n", "ok", "a\n"),
    ("raise SystemExit('bye')\n", "error", ""),
    ("import sys\nsys.exit = lambda *a: None\nraise ValueError('still an error')\n", "error", ""),
    # the report's descriptor is closed before the code runs: a forged report reaches no one
    ("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"exit_code\": 0, \"unapplied\": {}}\\n')\n"
     "    except OSError:\n        pass\nraise RuntimeError\n", "error", ""),
])
def test_exit_tricks(sandbox, work_root, code, status, stdout):
    result = run_contained(sandbox, code)
    assert (result.status, result.stdout) == (status, stdout), result


@pytest.mark.needs("landlock", "seccomp")
def test_ctypes(sandbox, work_root, checkpoints):
    before = snapshot(checkpoints)
    crash = run_contained(sandbox, "import ctypes\nctypes.string_at(0)\n")
    assert crash.status == "killed" and crash.detail == "SIGSEGV"
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.kill(PARENT, 9), libc.syscall(62 if X86 else 129, PARENT, 9), libc.unshare(0x10000000),\n"
            "      libc.open(CKPT.encode() + b'/latest', 1), libc.fork())\n")
    result = run_contained(sandbox, code, PARENT=os.getpid(), CKPT=str(checkpoints), X86=platform.machine() == "x86_64")
    assert result.status == "ok" and result.stdout.split() == ["-1"] * 5, result
    assert snapshot(checkpoints) == before


@pytest.mark.needs("landlock", "seccomp")
def test_del_at_interpreter_exit(sandbox, work_root, checkpoints):
    before = snapshot(checkpoints)
    code = ("import os, signal, atexit\n"
            "class Last:\n"
            "    def __del__(self):\n"
            "        for attempt in (lambda: open(CKPT + '/late', 'w'), lambda: os.kill(PARENT, signal.SIGKILL)):\n"
            "            try:\n                attempt()\n            except OSError as e:\n                print(type(e).__name__)\n"
            "        print('del ran')\n"
            "keep = Last()\n")
    result = run_contained(sandbox, code, CKPT=str(checkpoints), PARENT=os.getpid())
    assert result.status == "ok" and result.stdout.split() == ["PermissionError", "PermissionError", "del", "ran"]
    assert snapshot(checkpoints) == before
    hang = run_contained(sandbox, "import atexit\ndef spin():\n    while True:\n        pass\natexit.register(spin)\n")
    assert hang.status == "timeout"


# The cases that skip where the kernel refuses the sandbox these syscalls (a machine that
# enforces every mechanism, simulated by conftest.refusing_interpreter).
REFUSED = {
    ("landlock_create_ruleset",): {"test_writing_into_home_and_the_checkpoint_folder", "test_no_secret_in_the_environment",
                                   "test_reading_the_trainers_files", "test_ctypes", "test_del_at_interpreter_exit"},
    ("seccomp",): {"test_fork_bomb", "test_socket_connections", "test_writing_into_home_and_the_checkpoint_folder",
                   "test_ctypes", "test_del_at_interpreter_exit"},
    ("unshare", "landlock_create_ruleset", "seccomp"): {
        "test_fork_bomb", "test_fork_bomb_through_a_shell", "test_socket_connections",
        "test_writing_into_home_and_the_checkpoint_folder", "test_no_secret_in_the_environment",
        "test_reading_the_trainers_files", "test_signalling_the_trainer", "test_ctypes", "test_del_at_interpreter_exit"},
}


@pytest.mark.needs("namespaces", "landlock", "seccomp")
@pytest.mark.parametrize("syscalls", list(REFUSED))
def test_where_the_kernel_refuses_a_mechanism_the_cases_that_need_it_skip(syscalls, tmp_path, work_root):
    """The skip logic on a refused machine: measured as the suite measures, each case that
    needs a missing mechanism skips naming it (`refusal` checks the warning says so too);
    every other case runs."""
    measured = measure(LocalSandbox(LIMITS, python=refusing_interpreter(str(tmp_path), *syscalls)))
    cases = {name: case for name, case in globals().items()
             if name.startswith("test_") and "sandbox" in inspect.signature(case).parameters}
    needs = {name: mark.args for name, case in cases.items() for mark in getattr(case, "pytestmark", [])
             if mark.name == "needs"}
    reasons = {name: refusal(args, measured) for name, args in needs.items()}
    assert {name for name, reason in reasons.items() if reason} == REFUSED[syscalls]
    for name in REFUSED[syscalls]:
        missing = [MECHANISMS[n].words for n in needs[name] if not MECHANISMS[n].holds(measured.confinement)]
        assert reasons[name].startswith(f"needs {' and '.join(missing)}, which the kernel refused"), reasons[name]
