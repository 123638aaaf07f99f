"""The program a `LocalSandbox` runs: it confines itself, then runs the untrusted code.

Started by ``grpo_jax.tools.sandbox`` as ``python -s -S -B -P -u sandbox_child.py LIMITS REPORT_FD``
in a fresh session with an empty environment, its working directory a fresh temporary folder,
the code on stdin. It imports the standard library only (no site-packages: it must not depend
on, or be able to read, anything of the library's), and it is never imported by the library.

Two processes:

* the **launcher** reads the code, sets the rlimits, enters new user, network and PID
  namespaces where the kernel allows, forks, waits, and writes one JSON line on REPORT_FD:
  which protections it applied and how the code's process ended, as the kernel says (exit
  status or signal, CPU time). The code cannot write there: its process closes that
  descriptor first;
* the **runner** (PID 1 of the new PID namespace: when it exits the kernel kills whatever it
  started) leaves the launcher's session, limits its threads (RLIMIT_NPROC), drops every
  capability, restricts itself with
  Landlock (files: read the standard library, anything inside the working folder; TCP; signals
  and abstract sockets out of its domain) and a seccomp filter (no new processes, no exec, no
  socket, signals to itself only), then compiles and runs the code.

Each step that the kernel refuses is recorded, not fatal: the parent turns the record into one
line saying what could not be enforced. Only errors of our own making stop the launcher.

What the code does never passes for the runner's word. The code's exit status is only ever
the code's (0: ok, anything else: an error); the runner speaks on two pipes of its own:
before the code runs, what it applied or why it could not confine itself (that pipe is
closed before the code starts, so the code cannot write it); after a MemoryError, a token
the launcher drew at random (that pipe stays open, so the code could write it, but only
the token counts, and the code would have to dig it out of the runner's memory to claim
`memory`, which it can reach anyway by raising MemoryError).
"""

import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys
import traceback

EXIT_ERROR = 1  # an uncaught exception (the traceback is on stderr), as Python's own
TOKEN_BYTES = 16  # the launcher's random token, which the runner writes after a MemoryError

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
CLONE_THREAD = 0x00010000
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 24, 38, 22
SECCOMP_MODE_FILTER = 2

# Landlock (include/uapi/linux/landlock.h); the syscall numbers are the same on every architecture.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

# seccomp: (AUDIT_ARCH, {name: number}) for the architectures the filter knows. aarch64 has
# no fork/vfork syscalls (glibc forks through clone).
SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, dict(
        fork=57, vfork=58, clone=56, clone3=435, execve=59, execveat=322, socket=41, kill=62, tkill=200,
        tgkill=234, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, pidfd_open=434, pidfd_send_signal=424,
        ptrace=101, process_vm_readv=310, process_vm_writev=311, io_uring_setup=425,
        chmod=90, fchmod=91, fchmodat=268, fchmodat2=452, chown=92, fchown=93, lchown=94, fchownat=260,
        utime=132, utimes=235, futimesat=261, utimensat=280, truncate=76, setxattr=188, lsetxattr=189,
        fsetxattr=190, removexattr=197, lremovexattr=198, fremovexattr=199, setxattrat=463, removexattrat=466,
        unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161, bpf=321,
        perf_event_open=298, userfaultfd=323, add_key=248, request_key=249, keyctl=250)),
    "aarch64": (0xC00000B7, dict(
        clone=220, clone3=435, execve=221, execveat=281, socket=198, kill=129, tkill=130, tgkill=131,
        rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, pidfd_open=434, pidfd_send_signal=424, ptrace=117,
        process_vm_readv=270, process_vm_writev=271, io_uring_setup=425,
        fchmod=52, fchmodat=53, fchmodat2=452, fchown=55, fchownat=54, utimensat=88, truncate=45, setxattr=5,
        lsetxattr=6, fsetxattr=7, removexattr=14, lremovexattr=15, fremovexattr=16, setxattrat=463,
        removexattrat=466, unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, bpf=280,
        perf_event_open=241, userfaultfd=282, add_key=217, request_key=218, keyctl=219)),
}
# Refused outright (EPERM). Landlock does not cover a file's mode, owner, times or extended
# attributes, nor truncate(2) before its ABI 3: a checkpoint of the trainer's could be made
# unreadable by chmod alone. The namespace, mount, bpf, perf, userfaultfd and keyring calls
# are kernel surface no computation needs.
SECCOMP_REFUSED = (
    "fork", "vfork", "execve", "execveat", "socket", "tkill", "pidfd_open", "pidfd_send_signal", "ptrace",
    "process_vm_readv", "process_vm_writev", "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown",
    "lchown", "fchownat", "utime", "utimes", "futimesat", "utimensat", "truncate", "setxattr", "lsetxattr",
    "fsetxattr", "removexattr", "lremovexattr", "fremovexattr", "setxattrat", "removexattrat", "unshare", "setns",
    "mount", "umount2", "pivot_root", "chroot", "bpf", "perf_event_open", "userfaultfd", "add_key", "request_key",
    "keyctl")
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
EPERM, ENOSYS = 1, 38


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when it has none (or has it disabled)."""
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(abi), 0)


def landlock(abi: int, read_dirs: list[str], work_dir: str) -> None:
    """Allow reading files under ``read_dirs`` and everything under ``work_dir``; deny every
    other file access the ABI can name, TCP bind/connect (ABI >= 4), and signals and abstract
    unix sockets to processes outside this domain (ABI >= 6)."""
    fs = (1 << 13) - 1  # ABI 1: execute .. make_sym
    fs |= FS_REFER if abi >= 2 else 0
    fs |= FS_TRUNCATE if abi >= 3 else 0
    fs |= FS_IOCTL_DEV if abi >= 5 else 0
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    read = FS_READ_FILE | FS_READ_DIR
    for path, access in [(d, read) for d in read_dirs] + [(work_dir, fs & ~FS_EXECUTE)]:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = struct.pack("=Qi", access, fd)  # struct landlock_path_beneath_attr is packed
        if libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                        rule, ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
        os.close(fd)
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)


def seccomp() -> None:
    """A classic-BPF seccomp filter, the same whatever the uid or namespaces:

    * no new process: fork, vfork, clone without CLONE_THREAD (threads stay, bounded by
      RLIMIT_NPROC or the address space), no exec; clone3 answers ENOSYS so glibc falls back
      to clone, whose flags a filter can read;
    * no socket at all: no network where there is no network namespace, and no AF_UNIX
      socket either, since Landlock does not cover connecting to a socket file (the
      docker or a desktop session socket); socketpair stays (asyncio's self-pipe). No
      io_uring (its socket operations would pass by the filter);
    * signals only to this process (kill, tgkill, rt_(tg)sigqueueinfo whose first argument
      is our pid; no tkill, no pidfds), no ptrace, no access to another process's memory;
    * the rest of `SECCOMP_REFUSED`: metadata changes and kernel surface.
    """
    arch, nr = SECCOMP_ARCHES[platform.machine()]
    pid = os.getpid()  # fixed from here on: this process can make no other

    def op(code, k, jt=0, jf=0):
        return struct.pack("=HBBI", code, jt, jf, k)

    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    deny = RET_ERRNO | EPERM
    prog = [op(LD, 4), op(JEQ, arch, 1, 0), op(RET, RET_KILL_PROCESS), op(LD, 0)]
    if arch == 0xC000003E:  # x32 syscalls reach the x86_64 filter with bit 30 set
        prog += [op(JGE, 0x40000000, 0, 1), op(RET, RET_KILL_PROCESS)]
    refused = {name: deny for name in SECCOMP_REFUSED}
    refused.update(clone3=RET_ERRNO | ENOSYS, io_uring_setup=RET_ERRNO | ENOSYS)
    for name, action in refused.items():
        if name in nr:
            prog += [op(JEQ, nr[name], 0, 1), op(RET, action)]
    # Allowed on a condition on args[0], whose low 32 bits sit at offset 16 (little-endian).
    conditional = [("clone", JSET, CLONE_THREAD)]
    conditional += [(name, JEQ, pid) for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")]
    for name, test, k in conditional:
        prog += [op(JEQ, nr[name], 0, 4), op(LD, 16), op(test, k, 0, 1), op(RET, RET_ALLOW), op(RET, deny)]
    prog += [op(RET, RET_ALLOW)]
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(buf))  # struct sock_fprog
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp")


def drop_capabilities() -> None:
    """Empty the bounding set and the process's capability sets: a root launcher's runner
    keeps uid 0 but no privilege (no mount, module, raw network, ptrace, or DAC override)."""
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capset(header, bytes(24)) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def enter_namespaces(record: dict) -> None:
    """New user (where needed), network and PID namespaces; records which were entered."""
    uid, gid = os.getuid(), os.getgid()
    for flags, user in ((CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID, True), (CLONE_NEWNET | CLONE_NEWPID, False),
                        (CLONE_NEWUSER, True)):
        if libc.unshare(flags) == 0:
            break
        record.setdefault("namespace_errors", []).append(os.strerror(ctypes.get_errno()))
    else:
        return
    if user:  # map our own ids, so files made in the work folder belong to us
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    record["user_namespace"] = user
    record["network_namespace"] = bool(flags & CLONE_NEWNET)
    record["pid_namespace"] = bool(flags & CLONE_NEWPID)


def exit_status(code) -> int:
    """The exit status of ``sys.exit(code)``: 0 only for None, 0 or False; a failure never
    wraps to 0 (``sys.exit(256)`` exits 1, where Python's would exit 0); any other object is
    printed, as Python prints it, and exits 1."""
    if code is None:
        return 0
    if isinstance(code, int):  # bool too; int.__index__: an int subclass's own methods never run
        value = int.__index__(code)
        return 0 if value == 0 else value % 256 or 1
    try:
        sys.stderr.write(f"{code}\n")
    except BaseException:  # noqa: BLE001 -- a str() that raises, a closed stderr: still an error
        pass
    return EXIT_ERROR


def run_code(code: str, memory: int, token: bytes) -> int:
    """Runs in the confined process: the code as ``__main__``, its traceback without this
    file's frames; the exit status. After a MemoryError the ``token`` goes on ``memory``
    (the launcher's only sign of one: the exit status is the code's to choose)."""
    try:
        compiled = compile(code, "<code>", "exec")
        exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        try:
            os.write(memory, token)
        except OSError:  # the code closed or replaced the descriptor: reported as an error
            pass
        sys.stderr.write("MemoryError: the sandbox's memory limit was reached\n")
        return EXIT_ERROR
    except SystemExit as e:
        return exit_status(e.code)
    except BaseException as e:  # noqa: BLE001 -- every exception of the code is its result
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        return EXIT_ERROR
    return 0


def confine(limits: dict, record: dict) -> None:
    """The runner's steps before the code runs (in the forked child); each one the kernel
    refuses goes into ``record["unapplied"]``."""
    if record.get("pid_namespace"):
        os.setsid()  # out of the launcher's process group: kill(0, ...) reaches only this namespace
    # Here, not in the launcher: the kernel counts the user's tasks in its user namespace, and
    # where no new one could be made that is every task of the user on the machine (a
    # trainer's threads alone can pass the limit), so the launcher's fork of this process
    # would fail. Set here, it only ever leaves the code fewer threads than the limit.
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["threads"], limits["threads"]))
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher killed: so is this namespace
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    unapplied = record["unapplied"]
    try:
        drop_capabilities()
    except OSError as e:
        unapplied["capabilities"] = str(e)
    if record["landlock_abi"]:
        read_dirs = sorted({p for p in sys.path + limits["python_path"] if os.path.isdir(p)})
        try:
            landlock(record["landlock_abi"], read_dirs, os.getcwd())
        except OSError as e:
            unapplied["landlock"] = str(e)
    else:
        unapplied["landlock"] = "the kernel has no Landlock (or it is disabled)"
    if platform.machine() in SECCOMP_ARCHES:
        try:
            seccomp()
        except OSError as e:
            unapplied["seccomp"] = str(e)
    else:
        unapplied["seccomp"] = f"no filter written for {platform.machine()}"
    sys.path[:] = sys.path + limits["python_path"]


def tail(fd: int, size: int) -> bytes:
    """The last ``size`` bytes read from ``fd`` until its end, however much the code wrote
    there: the launcher holds no more, so the code cannot exhaust its memory."""
    kept = b""
    while chunk := os.read(fd, 65536):
        kept = (kept + chunk)[-size:]
    os.close(fd)
    return kept


def main() -> None:
    limits, report_fd = json.loads(sys.argv[1]), int(sys.argv[2])
    code = sys.stdin.read()
    record: dict = {"landlock_abi": landlock_abi(), "unapplied": {}}
    for name, value in (("RLIMIT_CORE", 0), ("RLIMIT_CPU", limits["cpu_seconds"]),
                        ("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_FSIZE", limits["file_bytes"]),
                        ("RLIMIT_NOFILE", limits["open_files"])):
        kind = getattr(resource, name)
        ceiling = resource.getrlimit(kind)[1]  # an unprivileged process cannot raise its hard limit
        value = value if ceiling == resource.RLIM_INFINITY else min(value, ceiling)
        hard = value + 1 if name == "RLIMIT_CPU" and value != ceiling else value  # SIGXCPU, then SIGKILL
        resource.setrlimit(kind, (value, hard))
    enter_namespaces(record)
    if os.getuid() == 0:
        record["unapplied"]["nproc"] = "the kernel exempts uid 0 from RLIMIT_NPROC"
    # The runner writes its own record here before the code runs, then closes it: the code
    # never holds a descriptor the launcher believes.
    confined_r, confined_w = os.pipe()
    memory_r, memory_w = os.pipe()
    token = os.urandom(TOKEN_BYTES)
    pid = os.fork()
    if pid == 0:
        os.close(report_fd)
        os.close(confined_r)
        os.close(memory_r)
        try:
            confine(limits, record)
        except BaseException:  # noqa: BLE001 -- never run the code half-confined
            os.write(confined_w, json.dumps({"unconfined": traceback.format_exc()}).encode())
            os._exit(EXIT_ERROR)
        os.write(confined_w, json.dumps({"unapplied": record["unapplied"]}).encode())
        os.close(confined_w)
        sys.exit(run_code(code, memory_w, token))
    os.close(confined_w)
    os.close(memory_w)
    with os.fdopen(confined_r, "rb") as f:
        runner = json.loads(f.read() or '{"unconfined": "the runner ended before it reported its confinement"}')
    record.update(runner)
    record["memory"] = tail(memory_r, len(token)) == token
    _, status, usage = os.wait4(pid, 0)
    record["cpu_seconds"] = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(status):
        record["signal"] = os.WTERMSIG(status)
    else:
        record["exit_code"] = os.WEXITSTATUS(status)
    os.write(report_fd, (json.dumps(record) + "\n").encode())


if __name__ == "__main__":
    main()
