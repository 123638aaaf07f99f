"""Sandboxes for the tests: the local one with small limits, and the same one started by an
interpreter that the kernel refuses some syscalls (a seccomp filter installed before it
execs Python), so each protection is also tested where another one is missing.

A machine may refuse the sandbox its namespaces, Landlock or seccomp (a container's seccomp
profile, AppArmor's rule on unprivileged user namespaces, an older kernel). A test that
holds only under some mechanism says so with ``@pytest.mark.needs(...)`` (`MECHANISMS`);
where the sandbox it tests measured that mechanism missing, the test checks that the
sandbox's one-line warning says so, then skips, naming the mechanism."""
import dataclasses
import os
import platform
import stat
import subprocess
import sys
import tempfile
import warnings
from typing import Callable

import pytest

from grpo_jax.tools.sandbox import Confinement, LocalSandbox, SandboxLimits, SandboxWarning

# Small enough that every hostile case ends within a few seconds and never strains the machine.
LIMITS = SandboxLimits(wall_seconds=3, cpu_seconds=2, memory_bytes=192 << 20, output_bytes=1 << 16,
                       file_bytes=1 << 20, open_files=32, threads=8)
# name: (number, the first argument it is refused for, None for any)
SYSCALLS = {"x86_64": {"unshare": (272, None), "landlock_create_ruleset": (444, None), "seccomp": (157, 22)},
            "aarch64": {"unshare": (97, None), "landlock_create_ruleset": (444, None), "seccomp": (167, 22)}}
REFUSING = '''#!{python} -S
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
def op(code, k, jt=0, jf=0):
    return struct.pack("=HBBI", code, jt, jf, k)
prog = []
for nr, arg in {numbers}:  # EPERM for the syscall (with that first argument)
    prog += [op(0x20, 0), op(0x15, nr, 0, 3 if arg is not None else 1)]
    if arg is not None:
        prog += [op(0x20, 16), op(0x15, arg, 0, 1)]
    prog += [op(0x06, 0x00050000 | 1)]
prog += [op(0x06, 0x7FFF0000)]
code = b"".join(prog)
buf = ctypes.create_string_buffer(code, len(code))
fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(buf))
if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) != 0:
    sys.exit({refused!r} + ": " + os.strerror(ctypes.get_errno()))
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
'''
FILTER_REFUSED = "the kernel refused the simulation's own seccomp filter"


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """A kernel mechanism some tests hold only under: ``words`` name it, ``holds`` reads it
    off a call's `Confinement`, ``warning`` is what the sandbox's warning says where it is
    missing (None: missing alone it leaves nothing unenforced, the other layers cover it, so
    the sandbox rightly warns of nothing)."""

    words: str
    holds: Callable[[Confinement], bool]
    warning: str | None


MECHANISMS = {
    "landlock": Mechanism("Landlock", lambda c: c.landlock_abi > 0, "(no Landlock"),
    "seccomp": Mechanism("a seccomp filter", lambda c: c.seccomp, "(no seccomp"),
    "signal isolation": Mechanism("a PID namespace, seccomp or Landlock ABI >= 6",
                                  lambda c: "PID" in c.namespaces or c.seccomp or c.landlock_abi >= 6,
                                  "signals to the trainer ("),
    # a shell: Landlock grants no execute right anywhere, seccomp refuses exec
    "exec refusal": Mechanism("Landlock or a seccomp filter", lambda c: c.landlock_abi > 0 or c.seccomp,
                              "(no seccomp"),
    "namespaces": Mechanism("network and PID namespaces", lambda c: {"network", "PID"} <= set(c.namespaces), None),
}


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a sandbox said on its first call: the mechanisms it ran under, its one warning."""

    confinement: Confinement
    warning: str  # "" where it could enforce everything


def measure(sandbox: LocalSandbox) -> Measured:
    """Run nothing in ``sandbox``, as its first call: the warning is said once per sandbox."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SandboxWarning)
        result = sandbox.run("pass")
    said = [str(w.message) for w in caught if issubclass(w.category, SandboxWarning)]
    assert result.status == "ok" and len(said) == bool(result.unenforced), (result, said)
    return Measured(result.confinement, "".join(said))


def refusal(needs, measured: Measured) -> str | None:
    """Why a test that holds only under the mechanisms ``needs`` cannot hold where
    ``measured`` was (None where it can), once the sandbox's warning is checked to say so."""
    missing = [MECHANISMS[name] for name in needs if not MECHANISMS[name].holds(measured.confinement)]
    for mechanism in missing:
        assert mechanism.warning is None or mechanism.warning in measured.warning, \
            f"{mechanism.words} missing ({measured.confinement}), and the sandbox's warning does not say so: " \
            f"{measured.warning!r}"
    if not missing:
        return None
    return (f"needs {' and '.join(m.words for m in missing)}, which the kernel refused the sandbox here "
            f"({measured.confinement})")


def refusing_interpreter(folder, *syscalls: str) -> str:
    """An executable that runs this Python with ``syscalls`` answering EPERM ("seccomp": the
    prctl that installs a seccomp filter). It refuses them with a seccomp filter of its own:
    where the machine refuses that, the sandbox's is refused too, and the test skips."""
    if platform.machine() not in SYSCALLS:
        pytest.skip(f"no syscall table for {platform.machine()}")
    path = os.path.join(folder, "python-refusing-" + "-".join(syscalls))
    with open(path, "w") as f:
        f.write(REFUSING.format(python=sys.executable, numbers=[SYSCALLS[platform.machine()][s] for s in syscalls],
                                refused=FILTER_REFUSED))
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    check = subprocess.run([path, "-c", ""], capture_output=True, text=True)
    if FILTER_REFUSED in check.stderr:
        reason = refusal(["seccomp"], measure(LocalSandbox(LIMITS)))
        assert reason, f"the simulation's seccomp filter was refused, the sandbox's was not: {check.stderr}"
        pytest.skip(f"refusing syscalls to the sandbox {reason}")
    assert check.returncode == 0, check.stderr
    return path


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*mechanisms): the test holds only where the sandbox it tests "
                                       "applies these mechanisms (tests/tools/conftest.py MECHANISMS)")


@pytest.fixture(scope="module", params=["namespaces", "no_namespaces"])
def sandbox(request, tmp_path_factory):
    """The local sandbox as it runs here, and without any namespace (unshare refused): the
    Landlock and seccomp layers must hold on their own."""
    if request.param == "namespaces":
        return LocalSandbox(LIMITS)
    return LocalSandbox(LIMITS, python=refusing_interpreter(tmp_path_factory.mktemp("bin"), "unshare"))


@pytest.fixture(scope="module")
def measured(sandbox) -> Measured:
    """What ``sandbox`` applies, measured once, by its first call."""
    return measure(sandbox)


@pytest.fixture(scope="session")
def native() -> Measured:
    """What the sandbox applies on this machine, measured once."""
    return measure(LocalSandbox(LIMITS))


@pytest.fixture(autouse=True)
def _skip_what_the_kernel_refused(request):
    """A test marked `needs` skips where the sandbox it tests (``sandbox``, else this
    machine's) lacks one of those mechanisms, after checking that the sandbox says so."""
    # requested first, before the test's own calls: a sandbox says its warning once
    measured = request.getfixturevalue("measured") if "sandbox" in request.fixturenames else None
    marker = request.node.get_closest_marker("needs")
    if marker is not None:
        reason = refusal(marker.args, measured or request.getfixturevalue("native"))
        if reason:
            pytest.skip(reason)


@pytest.fixture
def work_root(tmp_path, monkeypatch):
    """The folder the sandbox's work folders are made in (tempfile's), checked empty afterwards."""
    root = tmp_path / "sandbox-tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    assert os.listdir(root) == [], "a work folder was left behind"


def descendants() -> set[int]:
    """The processes descended from this one (no sandbox process may outlive its call)."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
    mine, found = {os.getpid()}, True
    while found:
        found = {p for p, pp in parents.items() if pp in mine and p not in mine}
        mine |= found
    return mine - {os.getpid()}
