"""Sandboxes for the tests: the local one with small limits, and the same one started by an
interpreter that the kernel refuses some syscalls (a seccomp filter installed before it
execs Python), so each protection is also tested where another one is missing."""
import os
import platform
import stat
import sys
import tempfile

import pytest

from grpo_jax.tools.sandbox import LocalSandbox, SandboxLimits

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
assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
'''


def refusing_interpreter(folder, *syscalls: str) -> str:
    """An executable that runs this Python with ``syscalls`` answering EPERM ("seccomp": the
    prctl that installs a seccomp filter)."""
    if platform.machine() not in SYSCALLS:
        pytest.skip(f"no syscall table for {platform.machine()}")
    path = os.path.join(folder, "python-refusing-" + "-".join(syscalls))
    with open(path, "w") as f:
        f.write(REFUSING.format(python=sys.executable, numbers=[SYSCALLS[platform.machine()][s] for s in syscalls]))
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


@pytest.fixture(scope="module", params=["namespaces", "no_namespaces"])
def sandbox(request, tmp_path_factory):
    """The local sandbox as it runs here, and without any namespace (unshare refused): the
    Landlock and seccomp layers must hold on their own."""
    if request.param == "namespaces":
        return LocalSandbox(LIMITS)
    return LocalSandbox(LIMITS, python=refusing_interpreter(tmp_path_factory.mktemp("bin"), "unshare"))


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
