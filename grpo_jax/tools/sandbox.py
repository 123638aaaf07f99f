"""Run model-written Python where it can harm nothing: one interface, a local back-end.

`Sandbox` is the interface every caller uses: ``run(code) -> ExecutionResult``, whose
``status`` is one of `STATUSES`:

================  ===================================================================
``ok``            the code ran to the end (or exited with status 0)
``error``         an uncaught exception or a non-zero exit status; stderr says which
``timeout``       the wall-time or CPU-time limit was reached; the process was killed
``memory``        the memory limit was reached (an uncaught MemoryError)
``output_limit``  stdout and stderr together passed their limit; the process was killed
``killed``        the process died of a signal (a crash, say a ctypes NULL read)
================  ===================================================================

`LocalSandbox` runs each call in a fresh process (``sandbox_child``, started with no site
packages, an empty environment and a fresh temporary working folder that is removed
afterwards), in its own session, under rlimits on CPU time, address space, file size, open
files, threads (where the kernel counts them) and core dumps (none). The parent kills the
whole process group at the wall-time limit and stops reading, and kills, at the output limit:
output is counted as it arrives, never buffered whole. The process also confines itself
with what the kernel allows: user, network and PID namespaces, Landlock, a seccomp filter
and no capabilities (``sandbox_child`` says what each does). What the kernel refused is
in ``ExecutionResult.unenforced``, and said once, in one line, as a `SandboxWarning`.
`capabilities` measures which protections hold on this machine.

The status is never the code's word: the code's exit status only tells ``ok`` (0) from
``error``, and neither its stdout, its stderr nor any descriptor it holds can pass for the
launcher's report, which the parent reads on a pipe the code's process closed before the
code ran (``sandbox_child`` says how ``memory`` and a failure to confine reach it).

A remote service (SandboxFusion's HTTP API, say) fits behind the same interface: a class with
``run(code) -> ExecutionResult`` (docs/tools.md shows one); nothing here depends on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from grpo_jax.errors import ConfigError, SandboxError

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
CHILD = Path(__file__).with_name("sandbox_child.py")
# The whole environment of the code: no variable of the trainer's (tokens, keys, paths)
# reaches it, and a fixed hash seed keeps the output of the same code the same.
ENVIRONMENT = {"PYTHONHASHSEED": "0", "PYTHONUTF8": "1"}


class SandboxWarning(UserWarning):
    """A protection the kernel did not allow here (`ExecutionResult.unenforced`)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits. ``threads`` is RLIMIT_NPROC: the processes and threads of the call's
    user namespace (new processes are refused outright by the seccomp filter where it holds);
    where no user namespace could be made, the kernel counts every task of the user, the
    trainer's among them, so the code may start fewer threads, never more.
    ``python_path``: folders the code may import from and read (site-packages holding sympy,
    say); by default only the standard library."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 512 << 20
    output_bytes: int = 64 << 10  # stdout and stderr together
    file_bytes: int = 16 << 20  # the largest file the code may write
    open_files: int = 64
    threads: int = 16
    python_path: tuple[str, ...] = ()

    def validate(self) -> "SandboxLimits":
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "output_bytes", "file_bytes", "open_files",
                     "threads"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")
        if self.memory_bytes < 64 << 20:
            raise ConfigError(f"sandbox limit memory_bytes={self.memory_bytes}: Python itself needs about "
                              "32 MiB of address space; give it at least 64 MiB")
        if self.open_files < 8 or self.threads < 3:
            raise ConfigError("sandbox limits open_files >= 8 and threads >= 3 (the interpreter's own files, "
                              "the launcher and the runner)")
        return self


@dataclass(frozen=True)
class Confinement:
    """The kernel mechanisms a call's code ran under, as its launcher recorded them: the
    namespaces it entered (of "user", "network", "PID"), the Landlock ABI it restricted
    itself with (0: none), whether its seccomp filter was installed, its capabilities
    dropped, and RLIMIT_NPROC binding (the kernel exempts uid 0)."""

    namespaces: tuple[str, ...]
    landlock_abi: int
    seccomp: bool
    capabilities_dropped: bool
    nproc: bool

    @classmethod
    def of(cls, record: dict) -> "Confinement":
        unapplied = record.get("unapplied", {})
        entered = [(name, record.get(key, False)) for name, key in
                   (("user", "user_namespace"), ("network", "network_namespace"), ("PID", "pid_namespace"))]
        return cls(tuple(name for name, on in entered if on),
                   0 if "landlock" in unapplied else record.get("landlock_abi", 0), "seccomp" not in unapplied,
                   "capabilities" not in unapplied, "nproc" not in unapplied)

    def __str__(self) -> str:
        return "; ".join([f"{', '.join(self.namespaces) or 'no'} namespaces",
                          f"Landlock ABI {self.landlock_abi}" if self.landlock_abi else "no Landlock",
                          "seccomp" if self.seccomp else "no seccomp",
                          "no capabilities" if self.capabilities_dropped else "capabilities kept",
                          "RLIMIT_NPROC" if self.nproc else "no RLIMIT_NPROC (uid 0)"])


@dataclass(frozen=True)
class ExecutionResult:
    """What one call gives back. ``detail``: why the status, in words (the signal, the limit);
    ``unenforced``: the protections the kernel refused for this call, one phrase each;
    ``confinement``: the kernel mechanisms it ran under (None where the call was killed
    before its launcher reported, at the wall-time or output limit, or from a sandbox that
    does not say, a remote one); ``backend_failure``: where the sandbox could not run the
    code at all, the kind of its failure (`SandboxError.kind`; the status is then ``error``),
    else ""."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None = None
    detail: str = ""
    seconds: float = 0.0
    unenforced: tuple[str, ...] = ()
    confinement: Confinement | None = None
    backend_failure: str = ""


class Sandbox(Protocol):
    """The interface: run ``code`` (Python source) and say what happened. Never raises for
    anything the code does; raises `SandboxError` (its ``kind`` a word: ``start``,
    ``confine``, ``launcher``, ``remote``) when it cannot run this code at all. A rollout
    turns that into the call's ``error`` (`grpo_jax.sampler.turns`)."""

    def run(self, code: str) -> ExecutionResult: ...


def unenforced_protections(record: dict) -> tuple[str, ...]:
    """The protections missing from the launcher's record, one phrase each (why, in brackets)."""
    unapplied = record.get("unapplied", {})
    netns, pidns = record.get("network_namespace", False), record.get("pid_namespace", False)
    abi = record.get("landlock_abi", 0)
    landlock = abi > 0 and "landlock" not in unapplied
    seccomp = "seccomp" not in unapplied
    missing = []
    if not (netns or seccomp):
        missing.append(f"network (no network namespace: {', '.join(record.get('namespace_errors', []))}; "
                       f"no seccomp: {unapplied.get('seccomp')})")
    if not landlock:
        missing.append(f"files outside the work folder (no Landlock: {unapplied.get('landlock')})")
    if not (seccomp or "nproc" not in unapplied):
        missing.append(f"processes (no seccomp: {unapplied.get('seccomp')}; {unapplied.get('nproc')})")
    if not seccomp:  # Landlock does not cover chmod, chown, utime or xattrs
        missing.append(f"modes, owners and times of files outside the work folder (no seccomp: {unapplied['seccomp']})")
        # nor connecting to a socket file, which no network namespace isolates either
        missing.append(f"unix sockets of other programs (no seccomp: {unapplied['seccomp']})")
    if not (pidns or seccomp or landlock and abi >= 6):
        missing.append(f"signals to the trainer (no PID namespace, no seccomp, Landlock ABI {abi} < 6)")
    if "capabilities" in unapplied:
        missing.append(f"privileges (capabilities kept: {unapplied['capabilities']})")
    return tuple(missing)


class LocalSandbox:
    """The local back-end: a fresh confined process per `run` (see the module docstring).
    ``python`` is the interpreter that runs the code (this one by default)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable):
        self.limits = limits.validate()
        self.python = python
        self._warned = False

    def run(self, code: str) -> ExecutionResult:
        start = time.monotonic()
        work = tempfile.mkdtemp(prefix="grpo-sandbox-")
        report_r, report_w = os.pipe()
        limits = dataclasses.asdict(self.limits)
        limits["python_path"] = list(self.limits.python_path)
        argv = [self.python, "-s", "-S", "-B", "-P", "-u", str(CHILD), json.dumps(limits), str(report_w)]
        try:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        cwd=work, env=ENVIRONMENT, pass_fds=(report_w,), start_new_session=True)
            except OSError as e:
                raise SandboxError(f"cannot start the sandbox's interpreter {self.python}: {e}", "start") from e
            finally:
                os.close(report_w)
            try:
                result = self._collect(proc, code, report_r, start)
            finally:
                _kill_group(proc)
        finally:
            os.close(report_r)
            _remove(work)
        if result.unenforced and not self._warned:
            self._warned = True
            warnings.warn("sandbox could not enforce: " + "; ".join(result.unenforced), SandboxWarning, stacklevel=2)
        return result

    def _collect(self, proc: subprocess.Popen, code: str, report_r: int, start: float) -> ExecutionResult:
        """Feed the code, read stdout/stderr/the report until they close, the deadline passes or
        the output limit is reached; then the status."""
        try:
            proc.stdin.write(code.encode("utf-8", "surrogatepass"))
            proc.stdin.close()
        except BrokenPipeError:  # the launcher died before reading: its report says why
            pass
        deadline = start + self.limits.wall_seconds
        chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): [], report_r: []}
        left, stop = self.limits.output_bytes, ""
        with selectors.DefaultSelector() as sel:
            for fd in chunks:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map() and not stop:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    stop = "timeout"
                    break
                for key, _ in sel.select(remaining):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    if key.fd != report_r:
                        data, left = data[:left], left - len(data)
                        if left < 0:
                            stop = "output_limit"
                    chunks[key.fd].append(data)
        out, err = (b"".join(chunks[f.fileno()]).decode("utf-8", "replace") for f in (proc.stdout, proc.stderr))
        seconds = time.monotonic() - start
        if stop == "timeout":
            return ExecutionResult("timeout", out, err, None, f"wall time {self.limits.wall_seconds:g} s", seconds)
        if stop == "output_limit":
            return ExecutionResult("output_limit", out, err, None, f"output over {self.limits.output_bytes} bytes",
                                   seconds)
        report = b"".join(chunks[report_r])
        if not report:
            returncode = proc.wait()
            if returncode >= 0:  # it failed on its own before it could report: not the code's doing
                raise SandboxError(f"the sandbox's launcher failed (exit status {returncode}): {err.strip()[-500:]}",
                                   "launcher")
            # killed by a signal: where no PID namespace or seccomp holds, the code can reach its group
            return ExecutionResult("killed", out, err, None, f"launcher killed by {signal.Signals(-returncode).name}",
                                   seconds)
        record = json.loads(report)
        if "unconfined" in record:
            why = record["unconfined"].strip().splitlines()[-1:] or ["no reason given"]
            raise SandboxError(f"the sandbox's process could not confine itself; nothing ran: {why[0]}", "confine")
        status, exit_code, detail = status_of(record, self.limits)
        return ExecutionResult(status, out, err, exit_code, detail, seconds, unenforced_protections(record),
                               Confinement.of(record))


def status_of(record: dict, limits: SandboxLimits) -> tuple[str, int | None, str]:
    """(status, exit status, detail) of a call whose code's process ended, from the launcher's
    record of how it ended (a signal or an exit status, as the kernel says), the CPU time it
    used, and whether the runner's token said MemoryError. The exit status alone never says
    more than ok or error."""
    if "signal" in record:
        sig = record["signal"]
        # SIGXCPU at the soft CPU limit, SIGKILL at the hard one (code that ignores SIGXCPU)
        if sig == signal.SIGXCPU or sig == signal.SIGKILL and record["cpu_seconds"] >= limits.cpu_seconds:
            return "timeout", None, f"CPU time {limits.cpu_seconds} s"
        return "killed", None, signal.Signals(sig).name
    code = record["exit_code"]
    if code == 0:
        return "ok", 0, ""
    return "memory" if record.get("memory") else "error", code, f"exit status {code}"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the call's whole process group (the launcher leads it; the runner, where it is
    in a PID namespace, dies with the launcher), then reap the launcher."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for f in (proc.stdout, proc.stderr):
        f.close()


def _remove(work: str) -> None:
    """Remove the work folder, even where the code took its folders' permissions away (it
    can only where the seccomp filter, which refuses chmod, is missing)."""
    try:
        shutil.rmtree(work)
    except PermissionError:
        os.chmod(work, 0o700)
        for root, folders, _ in os.walk(work):  # top-down: each folder opened before it is listed
            for folder in folders:
                os.chmod(os.path.join(root, folder), 0o700)
        shutil.rmtree(work)


@dataclass(frozen=True)
class Protection:
    """One protection, measured: whether it held against the probe, and what the probe saw."""

    name: str
    enforced: bool
    how: str


# Each probe tries one forbidden thing and prints "name: held|BROKEN: what happened".
PROBE = '''
import os, socket
def attempt(name, fn):
    try:
        fn()
        print(f"{name}: BROKEN: it worked")
    except Exception as e:
        print(f"{name}: held: {type(e).__name__}: {e}")
def connect():
    socket.create_connection(("127.0.0.1", PORT), timeout=1).close()
def spawn():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
def write_outside():
    path = os.path.join(OUTSIDE, ".grpo-sandbox-probe")
    open(path, "x").close()
    os.remove(path)
attempt("network", connect)
attempt("files", lambda: open(READABLE).read())
attempt("write", write_outside)
attempt("processes", spawn)
attempt("signals", lambda: os.kill(PARENT, 0))
leaked = sorted(set(os.environ) & set(PARENT_VARIABLES))
print("environment:", f"BROKEN: {leaked}" if leaked else f"held: only {sorted(os.environ)}")
'''


def capabilities(sandbox: LocalSandbox | None = None) -> list[Protection]:
    """Measure the protections on this machine: run a probe that tries each forbidden thing
    (a TCP connection to a port this process listens on, reading a file of the library's,
    writing beside the work folder, a new process, a signal to this process, a variable of
    this environment) and report what held."""
    sandbox = sandbox or LocalSandbox(SandboxLimits(wall_seconds=30))
    with socket.create_server(("127.0.0.1", 0)) as server, warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)
        code = (f"OUTSIDE = {tempfile.gettempdir()!r}\nREADABLE = {os.path.abspath(__file__)!r}\n"
                f"PARENT = {os.getpid()}\nPORT = {server.getsockname()[1]}\n"
                f"PARENT_VARIABLES = {sorted(set(os.environ) - set(ENVIRONMENT))!r}\n"
                + PROBE)
        result = sandbox.run(code)
    if result.status != "ok":
        raise SandboxError(f"the capability probe ended with {result.status}: {result.stderr.strip()[-500:]}")
    found = []
    for line in result.stdout.splitlines():
        name, _, rest = line.partition(": ")
        verdict, _, how = rest.partition(": ")
        found.append(Protection(name, verdict == "held", how))
    limits = sandbox.limits
    found.append(Protection("rlimits", True, f"CPU {limits.cpu_seconds} s, address space {limits.memory_bytes} B, "
                                             f"file size {limits.file_bytes} B, {limits.open_files} files, no core"))
    return found
