#!/usr/bin/env python3
"""Run an experiment on every worker of a TPU VM at once, stream its log, stop it.

    python launch/run.py quickstart --name grpo-jax --zone Z --project P
    python launch/run.py gsm8k_grpo --slice v5litepod-16 --bucket my-bucket --spot \\
        --max-restarts 20 -- --preset deepseekmath-rl-7b rl.group_size=64
    python launch/run.py gsm8k_grpo --logs      # re-attach to the log
    python launch/run.py gsm8k_grpo --stop      # kill it on all workers

The experiment (`experiments/NAME.py`, which must be in this checkout) starts detached under `nohup` on every worker
(multi-host JAX needs the same program on all hosts), writing ~/grpo_jax/logs/RUN.log;
then worker 0's log is streamed with `tail -f` until the run ends. Closing the terminal
does not stop the run; re-invoking the same command re-attaches instead of starting a
second copy.

Preemption: with --bucket (or --run-dir gs://...) the run's checkpoints live in GCS via
the `run.run_dir=` override, and the trainer resumes from the latest one. The SIGTERM a
Spot/preemptible VM gets makes the trainer save the step it is in (on every worker) and
exit 75, when the save fits the notice (about 30 s): a 7B step does not (docs/tpu.md#preemption),
so --spot and --preemptible also add run.checkpoint_every=1 unless you set it, and a preemption
loses at most the step in progress. With --max-restarts N, when the run stops because the TPU was preempted, run.py
deletes and re-creates the TPU (same flags as create.py), re-runs setup and starts the
same command again, which resumes at that step, up to N times. Without it, just invoke
run.py again after re-creating the TPU yourself. `--stop` sends the same SIGTERM (the
run saves its step; it is not restarted).

Arguments after the experiment name go to the experiment; put `--` before them if any
starts with a dash (e.g. `-- --preset deepseekmath-rl-7b`). Training scripts get the
run.run_dir, mesh.slice and run.checkpoint_every overrides above; the tools that take no
config (NO_CONFIG: evaluate, export, ...) get their arguments as given. Your own task
(`data.task=module:name`) is imported on every worker from the script's folder
(experiments/), so its file must be there and committed before launch/setup.py.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from pathlib import Path

import common  # launch/common.py: the script's folder is on sys.path
from common import Job, LaunchError, Runner, note
from grpo_jax.parallel.slices import get_slice

_OVERRIDE_RE = re.compile(r"[A-Za-z_][\w]*\.[\w.]+=.*")
# Experiments that take no config (no --preset, no section.field=value): they get no
# run.run_dir / mesh.slice / run.checkpoint_every overrides. tests/test_walkthrough.py checks
# this set against every script's --help.
NO_CONFIG = frozenset({"evaluate", "export", "fetch_smollm2", "math_verify_report", "reward_model_ceilings",
                       "reward_model_recipes", "shortcut_audit", "smollm2_ablations", "word_arithmetic_candidates"})


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment",
                        help="experiments/NAME.py, given as NAME or as the path")
    parser.add_argument("experiment_args", nargs="*", metavar="ARG",
                        help="passed to the experiment, e.g. section.field=value overrides")
    g = parser.add_argument_group("run")
    g.add_argument("--run-name", default="",
                   help="names the log files and the run dir (default: the experiment name)")
    g.add_argument("--bucket", default="",
                   help="GCS bucket: adds run.run_dir=gs://BUCKET/grpo_jax/RUN_NAME")
    g.add_argument("--run-dir", default="",
                   help="explicit run.run_dir (use gs://... on multi-host or Spot TPUs)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--detach", action="store_true",
                      help="start the run and return without streaming the log")
    mode.add_argument("--logs", action="store_true",
                      help="only stream the log of a run that was started before")
    mode.add_argument("--stop", action="store_true",
                      help="kill the run on all workers (SIGTERM, then SIGKILL)")
    g.add_argument("--stage", action="append", default=[], metavar="SOURCE",
                   help="a gs://BUCKET/PATH folder or file to copy into ~/grpo_jax/staged/ on every worker "
                        "before the run starts, and again on every TPU re-created after a preemption "
                        "(launch/stage.py; point the run at them with run.pretrained=staged/NAME, "
                        "data.data_dir=staged/NAME); repeat it for each")
    g.add_argument("--check", action="store_true",
                   help="first compile the run's programs for --slice on this machine "
                        "(launch/compile.py with the run's --preset and overrides; needs libtpu: make "
                        "install-test) and refuse to launch if one does not fit HBM; --dry-run prints "
                        "that command and compiles nothing")
    g.add_argument("--grace", type=int, default=30,
                   help="--stop: seconds the run has to save its step between SIGTERM and SIGKILL "
                        "(default %(default)s)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="re-create the TPU and resume up to N times after a preemption")
    g.add_argument("--retry-delay", type=float, default=10.0,
                   help="seconds to wait before re-attaching after a dropped ssh connection")
    g.add_argument("--notice-wait", type=float, default=60.0,
                   help="after the run exits %d (it saved its step on a SIGTERM) on a TPU that "
                        "still looks healthy: seconds to wait for its state to show the preemption "
                        "before deciding it was stopped by hand (default %%(default)s)"
                        % common.PREEMPTED_EXIT_CODE)
    common.add_tpu_arguments(parser)
    common.add_source_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` belongs to the experiment verbatim; before it, options and
    # overrides may be mixed in any order.
    passthrough: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, passthrough = argv[:at], argv[at + 1:]
    args = parser.parse_intermixed_args(argv)
    args.experiment_args = list(args.experiment_args) + passthrough
    return args


def script_path(experiment: str) -> str:
    """`quickstart` -> `experiments/quickstart.py`; a path is kept as given."""
    if "/" in experiment or experiment.endswith(".py"):
        return experiment
    return f"experiments/{experiment}.py"


def run_dir(args: argparse.Namespace, run_name: str) -> str:
    if args.run_dir:
        return args.run_dir
    if args.bucket:
        bucket = args.bucket.removeprefix("gs://").rstrip("/")
        return f"gs://{bucket}/grpo_jax/{run_name}"
    return ""


def with_overrides(user_args: list[str], extra: dict[str, str]) -> tuple[str, ...]:
    """Add ``key=value`` overrides the user did not set themselves.

    They go right after the user's last override: experiments take overrides as one
    positional list, so they must not be split by an option such as ``--preset X``.
    """
    given = {a.split("=", 1)[0] for a in user_args if _OVERRIDE_RE.fullmatch(a)}
    new = [f"{k}={v}" for k, v in extra.items() if v and k not in given]
    last = max((i for i, a in enumerate(user_args) if _OVERRIDE_RE.fullmatch(a)), default=None)
    at = len(user_args) if last is None else last + 1
    return tuple(user_args[:at] + new + user_args[at:])


def check_user_task(script: str, experiment_args: list[str]) -> None:
    """LaunchError when a ``data.task=module:name`` override names a module that is not in
    this checkout where the workers import it from: the script's folder (first on a
    script's sys.path), or the grpo_jax package (installed on every worker)."""
    from grpo_jax.config import TASKS

    for arg in experiment_args:
        key, _, value = arg.partition("=")
        if key != "data.task" or value in TASKS or ":" not in value:
            continue
        module = value.split(":", 1)[0]
        root = common.REPO_ROOT if module.split(".")[0] == "grpo_jax" else common.REPO_ROOT / Path(script).parent
        path = root.joinpath(*module.split("."))
        if not (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()):
            where = path.relative_to(common.REPO_ROOT)
            raise LaunchError(f"data.task={value}: {where}.py is not in this checkout; the workers import your "
                              f"task from {Path(script).parent}/, so put the module there and commit it before "
                              "launch/setup.py")


def make_job(args: argparse.Namespace) -> Job:
    script = script_path(args.experiment)
    if not (common.REPO_ROOT / script).is_file():
        known = sorted(p.stem for p in (common.REPO_ROOT / "experiments").glob("*.py") if p.stem != "common")
        raise LaunchError(f"{script} does not exist in this checkout; experiments: {', '.join(known)}")
    run_name = args.run_name or Path(script).stem
    directory = run_dir(args, run_name)
    if args.max_restarts and not directory.startswith("gs://"):
        raise LaunchError("--max-restarts needs checkpoints that outlive the TPU: pass "
                          "--bucket or --run-dir gs://...")
    if Path(script).stem in NO_CONFIG:
        if directory:
            raise LaunchError(f"{script} takes no config, so --bucket / --run-dir have no run.run_dir to set")
        return Job(script=script, args=tuple(args.experiment_args), run_name=run_name)
    if args.slice and get_slice(args.slice).multi_host and not directory.startswith("gs://"):
        note(f"{args.slice} has several hosts: without --bucket each worker checkpoints "
             "to its own disk")
    check_user_task(script, args.experiment_args)
    extra = {common.RUN_DIR_KEY: directory, common.SLICE_KEY: args.slice or ""}
    if args.spot or args.preemptible:
        # The SIGTERM save must fit the ~30 s notice, which a 7B step's does not: saving every
        # step bounds what a preemption loses to the step in progress (docs/tpu.md#preemption).
        extra[common.CHECKPOINT_EVERY_KEY] = "1"
    return Job(script=script, args=with_overrides(args.experiment_args, extra),
               run_name=run_name)


def start_and_follow(runner: Runner, s: common.TpuSettings, job: Job, follow: bool,
                     stage: list[str] = ()) -> int:
    if stage:
        code = runner.run(common.stage_command(s, stage))
        if code:
            return code
    code = runner.run(common.ssh_command(s, common.start_remote_command(job)))
    if code or not follow:
        return code
    return runner.run(common.ssh_command(s, common.follow_remote_command(job), worker="0"))


def recreate(runner: Runner, s: common.TpuSettings, src: common.SourceSettings) -> None:
    """Replace a preempted TPU with a fresh one and set it up again (the next start stages
    the run's --stage sources onto its empty disks)."""
    runner.run(common.delete_command(s))  # may already be gone: ignore the exit code
    runner.check(common.create_command(s))
    if s.queued:
        common.wait_until_healthy(runner, s)
    for step in common.setup_commands(s, src):
        runner.check(step)


def run_with_restarts(runner: Runner, s: common.TpuSettings, src: common.SourceSettings,
                      job: Job, max_restarts: int, retry_delay: float, notice_wait: float = 60.0,
                      stage: list[str] = ()) -> int:
    """Start + follow; on failure, tell preemption (TPU not healthy) from a real error
    (TPU fine, job exited non-zero: stop and show the code) and from a dropped ssh
    connection (exit 255 with a healthy TPU: re-attach).

    Exit PREEMPTED_EXIT_CODE: the run caught a SIGTERM and saved the step it was in. A Spot
    VM's notice comes about 30 s before it is stopped, so its state can still read healthy
    when the run has exited: the state is read again after `notice_wait` seconds, and a TPU
    still healthy then was stopped by hand (`--stop`), which is not restarted."""
    restarts, staged = 0, False
    while True:
        # Staged files stay on the workers' disks until the TPU is re-created.
        code = start_and_follow(runner, s, job, follow=True, stage=[] if staged else stage)
        staged = True
        if code == 0 or runner.dry_run:
            if runner.dry_run and max_restarts:
                note("on failure, the state would be read with: "
                     + shlex.join(common.state_command(s)))
            return code
        state = runner.query(common.state_command(s), dry_run_answer="")
        if state == common.healthy_state(s) and code == common.PREEMPTED_EXIT_CODE:
            note(f"run {job.run_name} saved its step and stopped on a signal; reading the TPU's "
                 f"state again in {notice_wait:g} s")
            time.sleep(notice_wait)
            state = runner.query(common.state_command(s), dry_run_answer="")
            if state == common.healthy_state(s):
                note(f"run {job.run_name} was stopped by a signal on a healthy TPU (run.py --stop, or "
                     "by hand), so not restarting; the same command resumes it")
                return code
        if state == common.healthy_state(s) and code != 255:
            note(f"run {job.run_name} exited with code {code}; the TPU is fine, so not "
                 f"restarting (log: ~/{common.REMOTE_DIR}/{job.path('log')} on the workers)")
            return code
        if restarts >= max_restarts:
            note(f"run {job.run_name} stopped (exit {code}, TPU {state or 'gone'}); "
                 f"{restarts} restart(s) used of --max-restarts {max_restarts}")
            return code
        restarts += 1
        if state == common.healthy_state(s):
            note(f"lost the ssh connection; re-attaching ({restarts}/{max_restarts})")
            time.sleep(retry_delay)
            continue
        note(f"TPU {s.name} is {state or 'gone'} (preempted?); re-creating it and resuming "
             f"({restarts}/{max_restarts})")
        recreate(runner, s, src)
        staged = False


def compile_command(args) -> list[str]:
    """The launch/compile.py command line that checks the experiment's config (its --preset and
    overrides) for --slice: run as a script, as the walk-through's first step runs it, so it needs
    no import path of its own and a dry run prints it like any other command."""
    from grpo_jax.config import add_config_args

    if not args.slice:
        raise LaunchError("--check needs --slice (the slice to compile for)")
    parser = argparse.ArgumentParser(add_help=False)
    add_config_args(parser)
    known, _ = parser.parse_known_args(args.experiment_args)
    script = Path(__file__).resolve().with_name("compile.py")
    return [sys.executable, os.path.relpath(script), "--slice", args.slice, "--preset", known.preset,
            *known.overrides]


def check_fits(runner: Runner, args) -> None:
    """Compile the experiment's programs for --slice ahead of time (a dry run prints the command
    and compiles nothing); LaunchError when one does not fit or the check cannot run."""
    command = compile_command(args)
    code = runner.run(command)
    if code:
        raise LaunchError(f"--check: launch/compile.py exited {code} (its reason is above): the run does not fit "
                          f"{args.slice} or cannot be compiled here (it needs libtpu: make install-test); "
                          "nothing was launched")


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = common.settings_from_args(args)
    if args.max_restarts:
        settings.require_shape()  # re-creating needs the accelerator type and runtime
    job = make_job(args)
    common.staged_paths(args.stage)  # refuses a source that is not gs://BUCKET/PATH before any command
    runner = Runner(args.dry_run)
    if args.check and not (args.stop or args.logs):
        check_fits(runner, args)
    if args.stop:
        return runner.run(common.ssh_command(settings,
                                             common.stop_remote_command(job, args.grace)))
    if args.logs:
        return runner.run(common.ssh_command(settings, common.follow_remote_command(job),
                                             worker="0"))
    if args.detach:
        return start_and_follow(runner, settings, job, follow=False, stage=args.stage)
    return run_with_restarts(runner, settings, common.source_from_args(args), job,
                             args.max_restarts, args.retry_delay, args.notice_wait, stage=args.stage)


if __name__ == "__main__":
    common.main_guard(main)
