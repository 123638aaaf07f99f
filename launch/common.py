"""What the Cloud TPU launch scripts share: settings, gcloud command builders, a runner.

Every builder returns an argv list, never a shell string: the runner hands it to
`subprocess.run` without `shell=True`, and `--dry-run` prints it with `shlex.join`, so
what is printed is exactly what would run (and can be pasted into a terminal). The only
shell involved is the remote one that `gcloud ... ssh --command` starts on each worker.

Only the standard library, `grpo_jax.parallel.slices` and `grpo_jax.parallel.preemption`'s exit code (neither
imports jax) are used, so the scripts work on a laptop that has gcloud but not jax.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TextIO

from grpo_jax.parallel.preemption import EXIT_CODE
from grpo_jax.parallel.slices import default_runtime_version, get_slice

REPO_ROOT = Path(__file__).resolve().parent.parent
REMOTE_DIR = "grpo_jax"  # the repo's folder in the home directory of every worker
RUN_DIR_KEY = "run.run_dir"  # config override the trainer resumes from
# What a run exits with once it has saved the step a SIGTERM/SIGINT stopped it at (EX_TEMPFAIL);
# the same command resumes it.
PREEMPTED_EXIT_CODE = EXIT_CODE
SLICE_KEY = "mesh.slice"  # config override that picks the preset's training mesh
CHECKPOINT_EVERY_KEY = "run.checkpoint_every"  # set to 1 on Spot / preemptible VMs (run.py)
DEFAULT_TARBALL = os.path.join(tempfile.gettempdir(), "grpo_jax-src.tar.gz")
# jax 0.10 needs Python >= 3.11; the TPU VM images ship Ubuntu 22.04's Python 3.10, so by
# default setup installs uv with the system pip and lets it fetch a standalone Python.
DEFAULT_PYTHON_VERSION = "3.11"
VM_REQUIREMENTS = "launch/requirements-vm.txt"  # relative to the repo, installed by setup

_GCLOUD_TPU = ["gcloud", "compute", "tpus"]
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class LaunchError(RuntimeError):
    """A launch step failed; the message says which command and what to do."""


# ----------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class TpuSettings:
    """Where the TPU lives and how it is provisioned.

    With ``queued`` the TPU is requested through a queued resource named ``name`` whose
    single node is also called ``name``, so every `tpu-vm ssh/scp` command is the same
    either way.
    """

    name: str
    zone: str
    project: str
    accelerator_type: str = ""
    runtime_version: str = ""
    spot: bool = False
    preemptible: bool = False
    queued: bool = False

    def __post_init__(self):
        if not _NAME_RE.fullmatch(self.name):
            raise LaunchError(f"bad TPU name {self.name!r}")
        if not self.zone or not self.project:
            raise LaunchError("--zone and --project are required (or set GRPO_TPU_ZONE / "
                              "GRPO_TPU_PROJECT)")
        if self.spot and self.preemptible:
            raise LaunchError("choose one of --spot and --preemptible")
        if self.queued and self.preemptible:
            # `queued-resources create` has --spot but no --preemptible.
            raise LaunchError("queued resources cannot be --preemptible; use --spot")

    def require_shape(self) -> None:
        """Creating needs an accelerator type and runtime; ssh/scp/delete do not."""
        if not self.accelerator_type or not self.runtime_version:
            raise LaunchError("creating a TPU needs --slice (or --accelerator-type and "
                              "--runtime-version)")


@dataclass(frozen=True)
class SourceSettings:
    """How the code reaches the workers and which Python the venv uses.

    ``repo_url`` empty: ship ``git archive`` of the local ``ref`` (committed files only).
    ``repo_url`` set: each worker fetches it at ``ref`` into its folder (git init the first time).
    ``python`` empty: a uv-managed Python ``python_version``; else ``python -m venv``.
    """

    repo_url: str = ""
    ref: str = ""
    tarball: str = DEFAULT_TARBALL
    python: str = ""
    python_version: str = DEFAULT_PYTHON_VERSION


# ----------------------------------------------------------------------------- gcloud commands

def _where(s: TpuSettings) -> list[str]:
    return [f"--zone={s.zone}", f"--project={s.project}"]


def create_command(s: TpuSettings) -> list[str]:
    """Create the TPU VM now, or queue a request for it (``s.queued``)."""
    s.require_shape()
    if s.queued:
        argv = _GCLOUD_TPU + ["queued-resources", "create", s.name, *_where(s),
                              f"--node-id={s.name}", f"--accelerator-type={s.accelerator_type}",
                              f"--runtime-version={s.runtime_version}"]
    else:
        argv = _GCLOUD_TPU + ["tpu-vm", "create", s.name, *_where(s),
                              f"--accelerator-type={s.accelerator_type}",
                              f"--version={s.runtime_version}"]
    if s.spot:
        argv.append("--spot")
    if s.preemptible:
        argv.append("--preemptible")
    return argv


def delete_command(s: TpuSettings) -> list[str]:
    """Delete the TPU VM, or the queued resource together with its node (``--force``)."""
    if s.queued:
        return _GCLOUD_TPU + ["queued-resources", "delete", s.name, *_where(s), "--force",
                              "--quiet"]
    return _GCLOUD_TPU + ["tpu-vm", "delete", s.name, *_where(s), "--quiet"]


def state_command(s: TpuSettings) -> list[str]:
    """Print just the state: READY / PREEMPTED / ... (VM) or ACTIVE / SUSPENDED / ... (queued)."""
    if s.queued:
        return _GCLOUD_TPU + ["queued-resources", "describe", s.name, *_where(s),
                              "--format", "value(state.state)"]
    return _GCLOUD_TPU + ["tpu-vm", "describe", s.name, *_where(s), "--format", "value(state)"]


def healthy_state(s: TpuSettings) -> str:
    return "ACTIVE" if s.queued else "READY"


def ssh_command(s: TpuSettings, remote: str, worker: str = "all") -> list[str]:
    """Run the shell command ``remote`` on one worker or (default) on all at once."""
    return _GCLOUD_TPU + ["tpu-vm", "ssh", s.name, *_where(s), f"--worker={worker}",
                          "--command", remote]


def scp_command(s: TpuSettings, local: str, remote: str, worker: str = "all") -> list[str]:
    """Copy the local file ``local`` to ``remote`` (relative to home) on the workers."""
    return _GCLOUD_TPU + ["tpu-vm", "scp", local, f"{s.name}:{remote}", *_where(s),
                          f"--worker={worker}"]


# ----------------------------------------------------------------------------- setup commands

def dquote(text: str) -> str:
    """Double-quote for the remote shell. Used instead of shlex.quote inside remote
    commands so that the printed command (itself single-quoted) stays readable."""
    return '"' + re.sub(r'(["$`\\])', r"\\\1", text) + '"'


def pinned_version(package: str, requirements: Path = REPO_ROOT / "requirements.txt") -> str:
    """The ``==`` pin of ``package`` in requirements.txt (jax[tpu] must match the jax pin)."""
    for line in requirements.read_text().splitlines():
        match = re.fullmatch(rf"\s*{re.escape(package)}\s*==\s*([^\s#;]+).*", line)
        if match:
            return match.group(1)
    raise LaunchError(f"{requirements} has no '{package}==' pin")


def install_remote_command(src: SourceSettings, jax_version: str) -> str:
    """Create the venv once (kept across re-runs), install the pinned requirements, what a
    VM needs beyond them (VM_REQUIREMENTS: gcsfs for a gs:// run dir) and jax[tpu] at the
    same jax version (it adds libtpu), then grpo_jax itself, editable and without
    re-resolving the pins, so the experiment scripts import it."""
    if src.python:
        make_venv = f"{shlex.quote(src.python)} -m venv .venv"
    else:
        make_venv = ("python3 -m pip install --user --quiet uv && python3 -m uv venv --seed "
                     f"--python {shlex.quote(src.python_version)} .venv")
    return (f"cd {REMOTE_DIR} && if [ ! -x .venv/bin/python ]; then {make_venv}; fi && "
            f".venv/bin/pip install --quiet -r requirements.txt -r {VM_REQUIREMENTS} "
            f"{dquote(f'jax[tpu]=={jax_version}')} && .venv/bin/pip install --quiet --no-deps -e .")


def setup_commands(s: TpuSettings, src: SourceSettings) -> list[list[str]]:
    """Ship the code to every worker and install it, as a list of argv lists."""
    steps: list[list[str]] = []
    if src.repo_url:
        url, ref = shlex.quote(src.repo_url), shlex.quote(src.ref or "main")
        # init + fetch rather than clone: the folder may already hold staged/ (launch/stage.py),
        # and git clone refuses a folder that is not empty.
        fetch = (f"mkdir -p {REMOTE_DIR} && cd {REMOTE_DIR} && if [ ! -d .git ]; then git init -q && "
                 f"git remote add origin {url}; fi && git fetch --depth=1 origin {ref} && "
                 "git checkout --force FETCH_HEAD")
        steps.append(ssh_command(s, fetch))
    else:
        remote_tar = f"{REMOTE_DIR}.tar.gz"
        steps.append(["git", "-C", str(REPO_ROOT), "archive", "--format=tar.gz",
                      f"--output={src.tarball}", src.ref or "HEAD"])
        steps.append(scp_command(s, src.tarball, remote_tar))
        steps.append(ssh_command(
            s, f"mkdir -p {REMOTE_DIR} && tar -xzf {remote_tar} -C {REMOTE_DIR} && "
               f"rm {remote_tar}"))
    steps.append(ssh_command(s, install_remote_command(src, pinned_version("jax"))))
    return steps


# ----------------------------------------------------------------------------- staging

STAGED = "staged"  # below ~/grpo_jax, the folder every run starts in


def staged_paths(sources: Sequence[str]) -> list[str]:
    """Where each gs:// source lands, relative to ~/grpo_jax: staged/<last part of its path>."""
    out = []
    for source in sources:
        path = source.removeprefix("gs://").rstrip("/")
        if not source.startswith("gs://") or "/" not in path:
            raise LaunchError(f"{source}: staging copies a folder or file inside a bucket, gs://BUCKET/PATH "
                              "(copy a local one there first: gcloud storage cp -r PATH gs://BUCKET/)")
        out.append(f"{STAGED}/{path.rsplit('/', 1)[-1]}")
    if len(set(out)) != len(out):
        raise LaunchError(f"two sources would land in the same folder: {out}")
    return out


def stage_command(s: TpuSettings, sources: Sequence[str]) -> list[str]:
    """Copy every gs:// source into ~/grpo_jax/staged/ on all workers; files already there
    are kept (--no-clobber), so staging again after an interrupted copy finishes it."""
    staged_paths(sources)  # refuses what is not gs://BUCKET/PATH
    copies = " && ".join(f"gcloud storage cp -r --no-clobber {shlex.quote(x.rstrip('/'))} {STAGED}/"
                         for x in sources)
    return ssh_command(s, f"mkdir -p {REMOTE_DIR}/{STAGED} && cd {REMOTE_DIR} && {copies}")


# ----------------------------------------------------------------------------- run commands

@dataclass(frozen=True)
class Job:
    """One experiment run: the script, its arguments, and the name of its log/pid files.

    The same run name always maps to the same files (and, through ``run.run_dir``, the same
    checkpoints), which is what makes re-invoking `run.py` safe.
    """

    script: str
    args: tuple[str, ...]
    run_name: str

    def __post_init__(self):
        if not _NAME_RE.fullmatch(self.run_name):
            raise LaunchError(f"run name {self.run_name!r} may only use letters, digits, . _ -")

    def path(self, ext: str) -> str:
        return f"logs/{self.run_name}.{ext}"


def start_remote_command(job: Job) -> str:
    """Start the job detached on a worker, unless it is already running there.

    `setsid` makes the job its own process group (so --stop can kill python and its
    children with one signal) and detaches it from the ssh session, so closing the laptop
    does not stop training. Its exit code lands in logs/NAME.exit for the follower.

    A preemption (or --stop) sends SIGTERM to the whole group: the shell traps it, so it
    outlives python, which saves its step and exits PREEMPTED_EXIT_CODE, and records that
    code (an untrapped shell would die first and leave no exit code). Python starts with the
    default handlers: a trap set to a command is not inherited, unlike an ignored signal.
    """
    log, pid, code = job.path("log"), job.path("pid"), job.path("exit")
    python = shlex.join(["env", "PYTHONUNBUFFERED=1", ".venv/bin/python", job.script,
                         *job.args])
    body = f"trap : TERM INT; {python}; echo $? > {code}"
    return (f"cd {REMOTE_DIR} && mkdir -p logs && "
            f"if [ -f {pid} ] && kill -0 $(cat {pid}) 2>/dev/null; "
            f"then echo {dquote(f'run {job.run_name} is already running')}; "
            f"else rm -f {code}; setsid nohup sh -c {dquote(body)} "
            f"> {log} 2>&1 < /dev/null & echo $! > {pid}; fi")


def follow_remote_command(job: Job) -> str:
    """Stream the log until the job ends (`tail --pid`), then exit with the job's code."""
    log, pid, code = job.path("log"), job.path("pid"), job.path("exit")
    return (f"cd {REMOTE_DIR} && tail -n 200 --pid=$(cat {pid}) -f {log}; "
            f"exit $(cat {code} 2>/dev/null || echo 1)")


def stop_remote_command(job: Job, grace_seconds: int) -> str:
    """SIGTERM the job's process group, give it up to `grace_seconds` to save the step it is
    in (it exits PREEMPTED_EXIT_CODE once saved), then SIGKILL what is left (a half-dead
    process would keep the TPU busy for the next run)."""
    pid = job.path("pid")
    return (f"cd {REMOTE_DIR} && if [ -f {pid} ]; then p=$(cat {pid}); "
            f"if kill -TERM -- -$p 2>/dev/null; then i=0; "
            f"while [ $i -lt {int(grace_seconds)} ] && kill -0 -- -$p 2>/dev/null; "
            f"do sleep 1; i=$((i+1)); done; fi; "
            f"kill -KILL -- -$p 2>/dev/null; fi; true")


# ----------------------------------------------------------------------------- runner

class Runner:
    """Prints each command; runs it unless ``dry_run``.

    Dry runs print to stdout, one command per line and nothing else, so the output is a
    script. Real runs echo ``+ command`` to stderr (like `set -x`) and then run it.
    """

    def __init__(self, dry_run: bool, out: TextIO | None = None):
        self.dry_run = dry_run
        self.out = out or sys.stdout

    def _show(self, argv: Sequence[str]) -> None:
        line = shlex.join(argv)
        if self.dry_run:
            print(line, file=self.out, flush=True)
        else:
            print(f"+ {line}", file=sys.stderr, flush=True)

    def run(self, argv: Sequence[str]) -> int:
        """Run and return the exit code (0 in a dry run)."""
        self._show(argv)
        if self.dry_run:
            return 0
        try:
            return subprocess.run(list(argv), check=False).returncode
        except FileNotFoundError:
            raise LaunchError(f"{argv[0]!r} is not on PATH (gcloud comes with the Google Cloud "
                              "CLI: https://cloud.google.com/sdk/docs/install)") from None

    def check(self, argv: Sequence[str]) -> None:
        """Run and raise LaunchError on a non-zero exit."""
        code = self.run(argv)
        if code:
            raise LaunchError(f"command failed with exit code {code}: {shlex.join(argv)}")

    def query(self, argv: Sequence[str], dry_run_answer: str) -> str:
        """Run and return stripped stdout ('' on failure); a dry run answers for it."""
        self._show(argv)
        if self.dry_run:
            return dry_run_answer
        try:
            done = subprocess.run(list(argv), check=False, capture_output=True, text=True)
        except FileNotFoundError:
            raise LaunchError(f"{argv[0]!r} is not on PATH") from None
        return done.stdout.strip() if done.returncode == 0 else ""


def note(message: str) -> None:
    """Human-readable progress goes to stderr so a dry run's stdout stays pure commands."""
    print(f"[launch] {message}", file=sys.stderr, flush=True)


def wait_until_healthy(runner: Runner, s: TpuSettings, poll_seconds: float = 30.0,
                       timeout_seconds: float | None = None) -> None:
    """Poll the TPU (or queued resource) until it is READY (ACTIVE); fail on FAILED."""
    want, start = healthy_state(s), time.monotonic()
    while True:
        state = runner.query(state_command(s), dry_run_answer=want)
        if state == want:
            return
        if state in ("FAILED", "SUSPENDED"):
            raise LaunchError(f"{s.name} is {state}; delete it and create it again")
        if timeout_seconds is not None and time.monotonic() - start > timeout_seconds:
            raise LaunchError(f"{s.name} still {state or 'missing'} after {timeout_seconds:.0f}s")
        note(f"{s.name} is {state or 'not there yet'}; waiting for {want}")
        time.sleep(poll_seconds)


# ----------------------------------------------------------------------------- argparse

def add_tpu_arguments(parser: argparse.ArgumentParser, *, shape: bool = True) -> None:
    """The flags every script shares. ``shape`` adds --slice and the provisioning flags."""
    g = parser.add_argument_group("TPU")
    g.add_argument("--name", default=os.environ.get("GRPO_TPU_NAME", "grpo-jax"),
                   help="TPU VM (and queued resource) name (env GRPO_TPU_NAME; default "
                        "%(default)s)")
    g.add_argument("--zone", default=os.environ.get("GRPO_TPU_ZONE", ""),
                   help="zone with the slice's TPU family, e.g. us-west4-a (v5e) or us-east5-a (v5p) "
                        "(env GRPO_TPU_ZONE)")
    g.add_argument("--project", default=os.environ.get("GRPO_TPU_PROJECT", ""),
                   help="Google Cloud project id (env GRPO_TPU_PROJECT)")
    g.add_argument("--queued", action="store_true",
                   help="the TPU was (or is to be) requested as a queued resource")
    if shape:
        g.add_argument("--slice", type=_slice_name,
                       help="slice preset from grpo_jax.parallel.slices: v4-8, v4-32, v5litepod-8 "
                            "(or v5e-8), v5litepod-16/64/256, v5p-8, v5p-128, v6e-8, v6e-256")
        g.add_argument("--accelerator-type",
                       help="any gcloud accelerator type (default: the preset's)")
        g.add_argument("--runtime-version",
                       help="TPU software version (default: the preset's / family's)")
        kind = g.add_mutually_exclusive_group()
        kind.add_argument("--spot", action="store_true",
                          help="Spot VM: much cheaper, can be preempted at any time")
        kind.add_argument("--preemptible", action="store_true",
                          help="preemptible VM (older form of spot; not with --queued)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the exact commands, one per line, and run nothing")


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """How setup gets the code onto the workers and builds the venv."""
    g = parser.add_argument_group("code and environment")
    g.add_argument("--repo-url", default="",
                   help="git URL every worker clones; default: ship `git archive` of the "
                        "local checkout (committed files only)")
    g.add_argument("--ref", default="",
                   help="commit/branch to ship (default HEAD) or to clone (default main)")
    g.add_argument("--tarball", default=DEFAULT_TARBALL,
                   help="local path for the git archive (default %(default)s)")
    g.add_argument("--python", default="",
                   help="build the venv with `PYTHON -m venv` (needs Python >= 3.11 on the "
                        "image) instead of a uv-managed Python")
    g.add_argument("--python-version", default=DEFAULT_PYTHON_VERSION,
                   help="Python that uv installs for the venv (default %(default)s)")


def _slice_name(value: str) -> str:
    try:
        return get_slice(value).name
    except KeyError as err:
        raise argparse.ArgumentTypeError(err.args[0]) from None


def settings_from_args(args: argparse.Namespace) -> TpuSettings:
    accelerator = getattr(args, "accelerator_type", None) or ""
    runtime = getattr(args, "runtime_version", None) or ""
    preset_name = getattr(args, "slice", None)
    if preset_name:
        preset = get_slice(preset_name)
        accelerator = accelerator or preset.accelerator_type
        runtime = runtime or preset.runtime_version
    elif accelerator and not runtime:
        try:
            runtime = default_runtime_version(accelerator)
        except KeyError as err:
            raise LaunchError(err.args[0]) from None
    return TpuSettings(name=args.name, zone=args.zone, project=args.project,
                       accelerator_type=accelerator, runtime_version=runtime,
                       spot=getattr(args, "spot", False),
                       preemptible=getattr(args, "preemptible", False), queued=args.queued)


def source_from_args(args: argparse.Namespace) -> SourceSettings:
    return SourceSettings(repo_url=args.repo_url, ref=args.ref, tarball=args.tarball,
                          python=args.python, python_version=args.python_version)


def main_guard(main) -> None:
    """Run ``main()`` through `grpo_jax.cli.run`: library errors and LaunchError alike end as
    one `<prog>: error: ...` line and exit 2."""
    from grpo_jax import cli

    try:
        cli.run(main)
    except LaunchError as err:
        print(f"{os.path.basename(sys.argv[0])}: error: {' '.join(str(err).split())}", file=sys.stderr)
        sys.exit(2)
