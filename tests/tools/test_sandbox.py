"""The sandbox's interface: statuses, output, the work folder, determinism, limits, and the
one line that names what the kernel did not allow (measured with an interpreter that is
refused those syscalls)."""
import os
import warnings

import pytest

from grpo_jax.errors import ConfigError, SandboxError
from grpo_jax.tools import sandbox as sb
from grpo_jax.tools.sandbox import LocalSandbox, SandboxLimits, SandboxWarning, capabilities, unenforced_protections
from tests.tools.conftest import LIMITS, refusing_interpreter


@pytest.fixture(scope="module")
def local():
    return LocalSandbox(LIMITS)


def test_ok_with_stdout_and_stderr(local, work_root):
    result = local.run("import sys\nprint('é', 6 * 7)\nprint('warn', file=sys.stderr)\n")
    assert (result.status, result.stdout, result.stderr, result.exit_code) == ("ok", "é 42\n", "warn\n", 0)


def test_an_error_shows_the_codes_traceback_only(local, work_root):
    result = local.run("x = 1\n\ndef f():\n    return 1 / 0\nf()\n")
    assert result.status == "error" and result.exit_code == 1
    assert 'File "<code>", line 5' in result.stderr and 'line 4, in f' in result.stderr
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "sandbox_child" not in result.stderr  # no frame of the runner
    syntax = local.run("def (:\n")
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr


def test_each_call_starts_in_an_empty_folder_that_is_removed(local, work_root):
    first = local.run("import os\nprint(os.listdir('.'))\nopen('notes.txt', 'w').write('x')\nos.mkdir('d')\n")
    second = local.run("import os\nprint(os.listdir('.'))\n")
    assert first.stdout == second.stdout == "[]\n"
    # work_root checks that nothing is left behind


def test_the_same_code_prints_the_same_output(local, work_root):
    """A fixed hash seed: the order of a set of strings does not change from call to call."""
    code = "print(list({'alpha', 'beta', 'gamma', 'delta', 'epsilon'}), hash('x'))\n"
    assert local.run(code).stdout == local.run(code).stdout


def test_standard_library_imports_work(local, work_root):
    code = ("import math, fractions, decimal, itertools, statistics, random, re, json, collections, functools\n"
            "print(math.comb(10, 3), fractions.Fraction(1, 3) + fractions.Fraction(1, 6), decimal.Decimal('0.1') * 3)\n")
    result = local.run(code)
    assert (result.status, result.stdout) == ("ok", "120 1/2 0.3\n"), result


@pytest.mark.needs("landlock")
def test_python_path_adds_a_readable_import_folder(tmp_path, work_root):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper.py").write_text("ANSWER = 42\n")
    (tmp_path / "secret.txt").write_text("no")
    sandbox = LocalSandbox(SandboxLimits(wall_seconds=5, python_path=(str(tmp_path / "lib"),)))
    result = sandbox.run(f"import helper\nprint(helper.ANSWER)\nopen({str(tmp_path / 'secret.txt')!r})\n")
    assert result.stdout == "42\n" and result.status == "error" and "PermissionError" in result.stderr


def test_limits_are_validated_once():
    with pytest.raises(ConfigError, match="wall_seconds must be > 0"):
        LocalSandbox(SandboxLimits(wall_seconds=0))
    with pytest.raises(ConfigError, match="at least 64 MiB"):
        LocalSandbox(SandboxLimits(memory_bytes=16 << 20))


def test_a_missing_interpreter_is_a_sandbox_error(work_root):
    with pytest.raises(SandboxError, match="cannot start the sandbox's interpreter /nonexistent/python"):
        LocalSandbox(LIMITS, python="/nonexistent/python").run("print(1)")


@pytest.mark.parametrize("record, expected", [
    ({"exit_code": 0}, ("ok", 0, "")),
    ({"exit_code": 1}, ("error", 1, "exit status 1")),
    ({"exit_code": 3}, ("error", 3, "exit status 3")),  # the code's own status: never the runner's word
    ({"exit_code": 126}, ("error", 126, "exit status 126")),
    ({"exit_code": 1, "memory": True}, ("memory", 1, "exit status 1")),  # the runner's token arrived
    ({"exit_code": 0, "memory": True}, ("ok", 0, "")),  # then the code's atexit exited 0
    ({"signal": 24, "cpu_seconds": 2.0}, ("timeout", None, "CPU time 2 s")),  # SIGXCPU
    # SIGKILL: the hard CPU limit (the code ignored SIGXCPU) when the CPU time is spent, else a kill
    ({"signal": 9, "cpu_seconds": 3.0}, ("timeout", None, "CPU time 2 s")),
    ({"signal": 9, "cpu_seconds": 0.1}, ("killed", None, "SIGKILL")),
    ({"signal": 11, "cpu_seconds": 0.1}, ("killed", None, "SIGSEGV")),
])
def test_the_status_of_how_the_code_ended(record, expected):
    assert sb.status_of(record, SandboxLimits(cpu_seconds=2)) == expected


def test_unenforced_protections_name_each_missing_layer():
    everything = {"landlock_abi": 6, "unapplied": {}, "network_namespace": True, "pid_namespace": True}
    assert unenforced_protections(everything) == ()
    nothing = {"landlock_abi": 0, "namespace_errors": ["Operation not permitted"],
               "unapplied": {"landlock": "no Landlock", "seccomp": "no filter written for riscv64",
                             "nproc": "the kernel exempts uid 0 from RLIMIT_NPROC"}}
    missing = unenforced_protections(nothing)
    assert [m.split(" (")[0] for m in missing] == ["network", "files outside the work folder", "processes",
                                                   "modes, owners and times of files outside the work folder",
                                                   "unix sockets of other programs", "signals to the trainer"]
    assert "Operation not permitted" in missing[0] and "riscv64" in missing[0]
    # seccomp alone covers network, processes and signals; Landlock files
    assert unenforced_protections({"landlock_abi": 1, "unapplied": {}}) == ()


def test_the_confinement_is_read_off_the_launchers_record():
    record = {"landlock_abi": 7, "user_namespace": False, "network_namespace": True, "pid_namespace": True,
              "unapplied": {"seccomp": "[Errno 1] seccomp", "nproc": "the kernel exempts uid 0 from RLIMIT_NPROC"}}
    assert sb.Confinement.of(record) == sb.Confinement(("network", "PID"), 7, False, True, False)
    refused = {"landlock_abi": 7, "unapplied": {"landlock": "[Errno 1] landlock_restrict_self", "capabilities": "x"}}
    assert sb.Confinement.of(refused) == sb.Confinement((), 0, True, False, True)
    assert str(sb.Confinement.of(record)) == ("network, PID namespaces; Landlock ABI 7; no seccomp; no capabilities; "
                                              "no RLIMIT_NPROC (uid 0)")


def test_what_the_kernel_refuses_is_said_once_in_one_line(tmp_path, work_root):
    """An interpreter refused Landlock: the sandbox still runs the code, says in one warning
    that files are not enforced, and capabilities() measures the hole."""
    sandbox = LocalSandbox(LIMITS, python=refusing_interpreter(str(tmp_path), "landlock_create_ruleset"))
    with pytest.warns(SandboxWarning) as caught:
        first = sandbox.run("print(1)")
        second = sandbox.run("print(2)")
    assert [str(w.message) for w in caught] == [
        "sandbox could not enforce: files outside the work folder (no Landlock: "
        "the kernel has no Landlock (or it is disabled))"]
    assert (first.stdout, second.stdout) == ("1\n", "2\n") and first.unenforced == second.unenforced
    found = {p.name: p for p in capabilities(sandbox)}
    assert not found["files"].enforced and not found["write"].enforced
    assert found["network"].enforced and found["processes"].enforced and found["signals"].enforced


@pytest.mark.needs("namespaces", "landlock")
def test_without_seccomp_the_gaps_are_named_and_the_work_folder_still_goes(tmp_path, work_root):
    """The seccomp filter refused: the namespaces and Landlock still hold the network, the
    files and the signals; what is lost is said, and a folder the code locked is removed."""
    sandbox = LocalSandbox(LIMITS, python=refusing_interpreter(str(tmp_path), "seccomp"))
    code = "import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a/b', 0)\nos.chmod('a', 0)\n"
    with pytest.warns(SandboxWarning):
        result = sandbox.run(code)
    assert result.status == "ok"
    lost = [m.split(" (")[0] for m in result.unenforced]
    assert lost == (["processes"] if os.getuid() == 0 else []) + [
        "modes, owners and times of files outside the work folder", "unix sockets of other programs"]
    found = {p.name: p for p in capabilities(sandbox)}
    assert found["network"].enforced and found["files"].enforced and found["signals"].enforced


def test_the_sandbox_warns_once_of_exactly_what_it_could_not_enforce(work_root):
    """Of nothing where the kernel allows every layer; elsewhere one line naming each gap."""
    sandbox = LocalSandbox(LIMITS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SandboxWarning)
        first, second = sandbox.run("pass"), sandbox.run("pass")
    assert first.unenforced == second.unenforced
    said = [str(w.message) for w in caught if issubclass(w.category, SandboxWarning)]
    assert said == ([f"sandbox could not enforce: {'; '.join(first.unenforced)}"] if first.unenforced else [])


def test_the_child_program_imports_nothing_but_the_standard_library():
    """It runs with no site-packages: an import of the library (or a third-party module)
    would fail there, and would give the code a way to read the library."""
    import ast
    import sys
    tree = ast.parse(sb.CHILD.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names <= set(sys.stdlib_module_names), names - set(sys.stdlib_module_names)
