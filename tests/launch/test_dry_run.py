"""The launch scripts print exactly the gcloud commands we expect, and run nothing.

Expected commands are written out here by hand (not built with launch/common.py), for a
single-host slice (v5litepod-8) and a multi-host one (v4-32). Dry runs get an empty PATH,
so any attempt to really run gcloud or git would fail the test. The relaunch loop is
exercised for real against a fake `gcloud` that logs its arguments.
"""
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ("create", "delete", "setup", "stage", "run")
JAX = re.search(r"^jax==(\S+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)

V5E = ["--name", "qs", "--zone", "us-west4-a", "--project", "proj"]
V4 = ["--name", "pod", "--zone", "us-central2-b", "--project", "proj"]
WHERE_V5E = "--zone=us-west4-a --project=proj"
WHERE_V4 = "--zone=us-central2-b --project=proj"
INSTALL = (
    "cd grpo_jax && if [ ! -x .venv/bin/python ]; then python3 -m pip install --user --quiet uv"
    " && python3 -m uv venv --seed --python 3.11 .venv; fi && .venv/bin/pip install --quiet"
    f' -r requirements.txt -r launch/requirements-vm.txt "jax[tpu]=={JAX}" && .venv/bin/pip install --quiet --no-deps -e .'
)


def load_launch_common():
    """launch/common.py as a module: the scripts import it as their sibling `common`."""
    spec = importlib.util.spec_from_file_location("launch_common", REPO / "launch" / "common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def launch(script, *args, path=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_TPU_")}
    env["PATH"] = path if path is not None else ""
    return subprocess.run([sys.executable, str(REPO / "launch" / f"{script}.py"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def dry(script, *args):
    done = launch(script, "--dry-run", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def ssh(name, where, worker, remote):
    return (f"gcloud compute tpus tpu-vm ssh {name} {where} --worker={worker} --command "
            + shlex.quote(remote))


def start(run, python_args):
    return (f"cd grpo_jax && mkdir -p logs && if [ -f logs/{run}.pid ] && kill -0 $(cat "
            f"logs/{run}.pid) 2>/dev/null; then echo \"run {run} is already running\"; else "
            f"rm -f logs/{run}.exit; setsid nohup sh -c \"trap : TERM INT; env PYTHONUNBUFFERED=1 .venv/bin/python "
            f"{python_args}; echo \\$? > logs/{run}.exit\" > logs/{run}.log 2>&1 < /dev/null & "
            f"echo $! > logs/{run}.pid; fi")


def follow(run):
    return (f"cd grpo_jax && tail -n 200 --pid=$(cat logs/{run}.pid) -f logs/{run}.log; "
            f"exit $(cat logs/{run}.exit 2>/dev/null || echo 1)")


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_exits_0_and_mentions_dry_run(script):
    done = launch(script, "--help")
    assert done.returncode == 0, done.stderr
    assert "--dry-run" in done.stdout


# ----------------------------------------------------------------------------- create / delete

def test_create_single_host_v5e_8():
    assert dry("create", *V5E, "--slice", "v5litepod-8", "--spot") == [
        f"gcloud compute tpus tpu-vm create qs {WHERE_V5E} --accelerator-type=v5litepod-8 "
        "--version=v2-alpha-tpuv5-lite --spot",
    ]
    # v5e-8 is the name people use; --runtime-version overrides the preset's.
    assert dry("create", *V5E, "--slice", "v5e-8", "--runtime-version", "custom-rt") == [
        f"gcloud compute tpus tpu-vm create qs {WHERE_V5E} --accelerator-type=v5litepod-8 "
        "--version=custom-rt",
    ]


def test_create_multi_host_v4_32_queued_and_wait():
    assert dry("create", *V4, "--slice", "v4-32", "--queued", "--spot", "--wait") == [
        f"gcloud compute tpus queued-resources create pod {WHERE_V4} --node-id=pod "
        "--accelerator-type=v4-32 --runtime-version=tpu-ubuntu2204-base --spot",
        f"gcloud compute tpus queued-resources describe pod {WHERE_V4} "
        "--format 'value(state.state)'",
    ]


def test_create_accelerator_type_without_a_preset():
    assert dry("create", *V4, "--accelerator-type", "v4-64", "--preemptible") == [
        f"gcloud compute tpus tpu-vm create pod {WHERE_V4} --accelerator-type=v4-64 "
        "--version=tpu-ubuntu2204-base --preemptible",
    ]


def test_delete_vm_and_queued_resource():
    assert dry("delete", *V5E) == [f"gcloud compute tpus tpu-vm delete qs {WHERE_V5E} --quiet"]
    assert dry("delete", *V4, "--queued") == [
        f"gcloud compute tpus queued-resources delete pod {WHERE_V4} --force --quiet"]


# ----------------------------------------------------------------------------- setup

def test_setup_ships_a_git_archive_to_every_worker():
    assert dry("setup", *V5E, "--tarball", "/tmp/src.tgz") == [
        f"git -C {REPO} archive --format=tar.gz --output=/tmp/src.tgz HEAD",
        f"gcloud compute tpus tpu-vm scp /tmp/src.tgz qs:grpo_jax.tar.gz {WHERE_V5E} --worker=all",
        ssh("qs", WHERE_V5E, "all",
            "mkdir -p grpo_jax && tar -xzf grpo_jax.tar.gz -C grpo_jax && rm grpo_jax.tar.gz"),
        ssh("qs", WHERE_V5E, "all", INSTALL),
    ]


def test_setup_clones_on_every_worker_of_a_pod():
    lines = dry("setup", *V4, "--repo-url", "https://example.com/g.git", "--ref", "v1",
                "--python", "python3.11")
    assert lines == [
        ssh("pod", WHERE_V4, "all",
            "mkdir -p grpo_jax && cd grpo_jax && if [ ! -d .git ]; then git init -q && "
            "git remote add origin https://example.com/g.git; fi && git fetch --depth=1 origin v1 && "
            "git checkout --force FETCH_HEAD"),
        ssh("pod", WHERE_V4, "all",
            "cd grpo_jax && if [ ! -x .venv/bin/python ]; then python3.11 -m venv .venv; fi && "
            f'.venv/bin/pip install --quiet -r requirements.txt -r launch/requirements-vm.txt "jax[tpu]=={JAX}" && '
            ".venv/bin/pip install --quiet --no-deps -e ."),
    ]


# ----------------------------------------------------------------------------- run

def test_run_quickstart_on_v5e_8_starts_everywhere_and_follows_worker_0():
    assert dry("run", "quickstart", *V5E, "--slice", "v5e-8") == [
        ssh("qs", WHERE_V5E, "all",
            start("quickstart", "experiments/quickstart.py mesh.slice=v5litepod-8")),
        ssh("qs", WHERE_V5E, "0", follow("quickstart")),
    ]


def test_run_paper_recipe_on_v4_32_with_gcs_checkpoints_and_restarts():
    lines = dry("run", "gsm8k_grpo", "rl.group_size=64", *V4, "--slice", "v4-32", "--spot",
                "--bucket", "gs://my-bucket/", "--max-restarts", "5", "--run-name", "paper",
                "--", "--preset", "deepseekmath-rl-7b")
    # --spot saves every step: a 7B step's SIGTERM save does not fit the notice.
    assert lines == [
        ssh("pod", WHERE_V4, "all", start(
            "paper", "experiments/gsm8k_grpo.py rl.group_size=64 "
            "run.run_dir=gs://my-bucket/grpo_jax/paper mesh.slice=v4-32 run.checkpoint_every=1 "
            "--preset deepseekmath-rl-7b")),
        ssh("pod", WHERE_V4, "0", follow("paper")),
    ]


def test_spot_keeps_the_users_checkpoint_every():
    lines = dry("run", "train", *V5E, "--slice", "v5e-8", "--spot", "--detach", "--",
                "--preset", "cpu-tiny", "run.checkpoint_every=5")
    assert lines == [ssh("qs", WHERE_V5E, "all", start(
        "train", "experiments/train.py --preset cpu-tiny run.checkpoint_every=5 mesh.slice=v5litepod-8"))]


def test_run_stages_weights_and_data_before_starting():
    lines = dry("run", "train", *V5E, "--slice", "v5e-8", "--detach", "--stage", "gs://b/models/m7b/",
                "--stage", "gs://b/data/gsm8k", "--", "run.pretrained=staged/m7b")
    assert lines == [
        ssh("qs", WHERE_V5E, "all", "mkdir -p grpo_jax/staged && cd grpo_jax && "
            "gcloud storage cp -r --no-clobber gs://b/models/m7b staged/ && "
            "gcloud storage cp -r --no-clobber gs://b/data/gsm8k staged/"),
        ssh("qs", WHERE_V5E, "all", start(
            "train", "experiments/train.py run.pretrained=staged/m7b mesh.slice=v5litepod-8")),
    ]


def test_stage_copies_to_every_worker_and_names_the_overrides():
    done = launch("stage", "--dry-run", *V4, "gs://b/models/deepseek-math-7b-instruct", "gs://b/gsm8k/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [ssh(
        "pod", WHERE_V4, "all", "mkdir -p grpo_jax/staged && cd grpo_jax && "
        "gcloud storage cp -r --no-clobber gs://b/models/deepseek-math-7b-instruct staged/ && "
        "gcloud storage cp -r --no-clobber gs://b/gsm8k staged/")]
    # A folder named after a file task is data, never a model to load (issue 86).
    assert done.stderr.splitlines() == [
        "[launch] gs://b/models/deepseek-math-7b-instruct -> ~/grpo_jax/staged/deepseek-math-7b-instruct on every "
        "worker: run.pretrained=staged/deepseek-math-7b-instruct if it is a model, "
        "data.data_dir=staged/deepseek-math-7b-instruct if it holds GSM8K or MATH files",
        "[launch] gs://b/gsm8k/ -> ~/grpo_jax/staged/gsm8k on every worker: data.data_dir=staged/gsm8k"]


def test_tools_without_a_config_get_their_arguments_as_given():
    lines = dry("run", "evaluate", *V5E, "--slice", "v5e-8", "--spot", "--detach", "--",
                "--model", "staged/m", "--task", "gsm8k")
    assert lines == [ssh("qs", WHERE_V5E, "all", start(
        "evaluate", "experiments/evaluate.py --model staged/m --task gsm8k"))]


def test_run_keeps_the_users_run_dir_and_quotes_odd_arguments():
    lines = dry("run", "experiments/train.py", "run.run_dir=gs://b/mine", "data.task=a b", *V5E,
                "--bucket", "other", "--detach")
    assert lines == [ssh("qs", WHERE_V5E, "all", start(
        "train", "experiments/train.py run.run_dir=gs://b/mine 'data.task=a b'"))]


def test_run_logs_and_stop():
    assert dry("run", "gsm8k_grpo", *V4, "--logs") == [
        ssh("pod", WHERE_V4, "0", follow("gsm8k_grpo"))]
    assert dry("run", "gsm8k_grpo", *V4, "--stop", "--grace", "60") == [
        ssh("pod", WHERE_V4, "all",
            "cd grpo_jax && if [ -f logs/gsm8k_grpo.pid ]; then p=$(cat logs/gsm8k_grpo.pid); "
            "if kill -TERM -- -$p 2>/dev/null; then i=0; while [ $i -lt 60 ] && kill -0 -- -$p 2>/dev/null; "
            "do sleep 1; i=$((i+1)); done; fi; kill -KILL -- -$p 2>/dev/null; fi; true")]


# ----------------------------------------------------------------------------- clear errors

def test_bad_slice_name_lists_the_known_ones():
    done = launch("create", *V5E, "--slice", "v9-8", "--dry-run")
    assert done.returncode == 2 and done.stdout == ""
    assert "unknown TPU slice 'v9-8'" in done.stderr and "v5litepod-8" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["create", *V5E], "needs --slice"),
    (["create", "--name", "x", "--slice", "v4-8"], "--zone and --project are required"),
    (["create", *V5E, "--slice", "v4-8", "--queued", "--preemptible"], "use --spot"),
    (["run", "quickstart", *V5E, "--slice", "v4-8", "--max-restarts", "2"], "--bucket"),
    (["run", "quickstart", *V5E, "--run-name", "a/b"], "run name"),
    (["run", "grpo_gsm8k", *V5E], "experiments/grpo_gsm8k.py does not exist in this checkout; experiments: "),
    (["run", "train", *V5E, "--", "data.task=nothere:Task"],
     "data.task=nothere:Task: experiments/nothere.py is not in this checkout"),
    (["run", "train", *V5E, "--stage", "/local/model"], "/local/model: staging copies a folder or file inside a bucket"),
    (["run", "evaluate", *V5E, "--bucket", "b"], "takes no config"),
    (["stage", *V5E, "gs://b/x/m", "gs://c/m"], "two sources would land in the same folder"),
])
def test_bad_settings_fail_before_any_command(args, message):
    done = launch(*args, "--dry-run")
    assert done.returncode == 2 and done.stdout == ""
    assert message in done.stderr and done.stderr.count("\n") == 1 and ": error: " in done.stderr


# ----------------------------------------------------------------------------- relaunch loop

FAKE_GCLOUD = """\
#!{python}
# Logs each call. The first follow (ssh --worker=0) exits {first}, later ones {later}
# (255 is what ssh returns when the VM disappears under it). The n-th describe answers the
# n-th state (the last one from then on).
import pathlib, sys
log = pathlib.Path({log!r})
with log.open("a") as f:
    f.write(" ".join(sys.argv[1:5]) + "\\n")
if sys.argv[4] == "describe":
    states = {states!r}
    asked = sum(1 for c in log.read_text().splitlines() if c.endswith("describe"))
    print(states[min(asked, len(states)) - 1])
elif sys.argv[4] == "ssh" and "--worker=0" in sys.argv:
    follows = sum(1 for c in log.read_text().splitlines() if c.endswith("ssh")) // 2
    sys.exit({first} if follows <= 1 else {later})
"""


def fake_gcloud(tmp_path, state, first, later=0):
    """A `gcloud` on PATH that reports ``state`` (or one state of a list per describe, in
    order) and returns the given follow codes."""
    log = tmp_path / "calls.txt"
    gcloud = tmp_path / "bin" / "gcloud"
    gcloud.parent.mkdir(parents=True)
    states = [state] if isinstance(state, str) else list(state)
    gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable, log=str(log), states=states,
                                         first=first, later=later))
    gcloud.chmod(0o755)
    return str(gcloud.parent), log


SSH, DESCRIBE = "compute tpus tpu-vm ssh", "compute tpus tpu-vm describe"


def test_preempted_spot_tpu_is_recreated_and_the_run_resumed(tmp_path):
    path, log = fake_gcloud(tmp_path, state="PREEMPTED", first=255)
    done = launch("run", "quickstart", *V4, "--slice", "v4-32", "--spot", "--bucket", "b",
                  "--max-restarts", "1", "--repo-url", "https://example.com/g.git", path=path)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [
        SSH,                             # start on all workers
        SSH,                             # follow worker 0: connection lost (preempted)
        DESCRIBE,                        # state: PREEMPTED
        "compute tpus tpu-vm delete",
        "compute tpus tpu-vm create",
        SSH,                             # setup: clone
        SSH,                             # setup: install
        SSH,                             # start again (resumes from gs://b/grpo_jax/quickstart)
        SSH,                             # follow until the run finishes
    ]
    assert "re-creating it and resuming (1/1)" in done.stderr


def test_dropped_ssh_on_a_healthy_tpu_reattaches(tmp_path):
    path, log = fake_gcloud(tmp_path, state="READY", first=255)
    done = launch("run", "quickstart", *V5E, "--slice", "v5litepod-8", "--bucket", "b",
                  "--max-restarts", "3", "--retry-delay", "0", path=path)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [SSH, SSH, DESCRIBE, SSH, SSH]
    assert "re-attaching" in done.stderr


def test_a_failing_run_on_a_healthy_tpu_is_not_restarted(tmp_path):
    path, log = fake_gcloud(tmp_path, state="READY", first=3)
    done = launch("run", "quickstart", *V5E, "--slice", "v5litepod-8", "--bucket", "b",
                  "--max-restarts", "3", path=path)
    assert done.returncode == 3
    assert log.read_text().splitlines() == [SSH, SSH, DESCRIBE]
    assert "not restarting" in done.stderr


PREEMPTED = 75  # grpo_jax.parallel.preemption.EXIT_CODE: the run saved its step on a SIGTERM


def test_a_run_that_saved_on_sigterm_is_resumed_once_the_tpu_shows_the_preemption(tmp_path):
    # The VM's notice comes before it stops: the state reads READY at first.
    path, log = fake_gcloud(tmp_path, state=["READY", "PREEMPTED"], first=PREEMPTED)
    done = launch("run", "quickstart", *V4, "--slice", "v4-32", "--spot", "--bucket", "b",
                  "--max-restarts", "1", "--notice-wait", "0", "--repo-url", "https://example.com/g.git",
                  path=path)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [
        SSH, SSH,                        # start, follow: exit 75
        DESCRIBE, DESCRIBE,              # READY, then (after --notice-wait) PREEMPTED
        "compute tpus tpu-vm delete", "compute tpus tpu-vm create", SSH, SSH,
        SSH, SSH,                        # the same command again, resuming the saved step
    ]
    assert "re-creating it and resuming (1/1)" in done.stderr


def test_a_run_stopped_by_hand_on_a_healthy_tpu_is_not_restarted(tmp_path):
    path, log = fake_gcloud(tmp_path, state="READY", first=PREEMPTED)
    done = launch("run", "quickstart", *V5E, "--slice", "v5litepod-8", "--bucket", "b",
                  "--max-restarts", "3", "--notice-wait", "0", path=path)
    assert done.returncode == PREEMPTED
    assert log.read_text().splitlines() == [SSH, SSH, DESCRIBE, DESCRIBE]
    assert "stopped by a signal on a healthy TPU" in done.stderr and "not restarting" in done.stderr


# ----------------------------------------------------------------------------- remote shell

def test_remote_start_follow_stop_work_in_bash(tmp_path):
    """Run the remote snippets locally in bash against a fake venv python: quoting of odd
    arguments survives, the exit code comes back, a second start does not double-run,
    and stop kills the whole process group."""
    common = load_launch_common()

    fake = tmp_path / "grpo_jax" / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/bash\nprintf "<%s>\\n" "$@"\n[ "$1" = sleep ] && sleep 30\nexit 7\n')
    fake.chmod(0o755)

    def bash(command):
        return subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True,
                              text=True, timeout=30, env={**os.environ, "HOME": str(tmp_path)})

    job = common.Job("experiments/q.py", ("a.b=1", "data.task=x y", "q='$HOME'"), "q")
    assert bash(common.start_remote_command(job)).returncode == 0
    followed = bash(common.follow_remote_command(job))
    assert followed.returncode == 7
    assert followed.stdout.splitlines() == ["<experiments/q.py>", "<a.b=1>", "<data.task=x y>",
                                            "<q='$HOME'>"]

    sleeper = common.Job("sleep", (), "s")
    assert bash(common.start_remote_command(sleeper)).returncode == 0
    again = bash(common.start_remote_command(sleeper))
    assert "run s is already running" in again.stdout
    pid = (tmp_path / "grpo_jax" / "logs" / "s.pid").read_text().strip()
    assert bash(common.stop_remote_command(sleeper, grace_seconds=0)).returncode == 0
    # Nothing of the group may be left running (zombies are fine: in a container nobody
    # may reap them, on a TPU VM init does).
    alive = bash(f"sleep 0.3; ps -eo pgid=,stat= | awk '$1 == {pid} && $2 !~ /^Z/'")
    assert alive.stdout.strip() == "", "job survived --stop"


def test_stop_lets_the_run_save_and_records_its_exit_code(tmp_path):
    """--stop SIGTERMs the whole process group, the shell that starts python included: the
    shell must outlive python, which saves and exits 75, to record that code for the follower."""
    common = load_launch_common()
    fake = tmp_path / "grpo_jax" / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    # A run that needs a moment to save on SIGTERM, then exits as the trainer does.
    fake.write_text('#!/bin/bash\ntrap \'sleep 0.5; echo saved; exit 75\' TERM\n'
                    'echo started; sleep 30 & wait\n')
    fake.chmod(0o755)

    def bash(command):
        return subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60, env={**os.environ, "HOME": str(tmp_path)})

    job = common.Job("experiments/q.py", (), "q")
    assert bash(common.start_remote_command(job)).returncode == 0
    logs = tmp_path / "grpo_jax" / "logs"
    assert bash(f"for i in $(seq 100); do grep -q started {logs}/q.log && exit 0; sleep 0.1; done; "
                "exit 1").returncode == 0
    assert bash(common.stop_remote_command(job, grace_seconds=20)).returncode == 0
    followed = bash(common.follow_remote_command(job))
    assert followed.returncode == PREEMPTED and "saved" in followed.stdout
    assert (logs / "q.exit").read_text().strip() == str(PREEMPTED)


@pytest.mark.parametrize("target, override", [
    ("staged/smollm2.gguf", "run.pretrained=staged/smollm2.gguf"),
    ("staged/MATH", "data.data_dir=staged/MATH"),
    ("staged/gsm8k", "data.data_dir=staged/gsm8k")])
def test_stage_names_the_one_override_a_recognised_source_takes(monkeypatch, target, override):
    from tests.scripts import LAUNCH, import_script

    assert import_script(monkeypatch, LAUNCH, "stage").override_for(target) == override
