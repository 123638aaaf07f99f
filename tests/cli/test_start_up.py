"""What a new user meets first, each stopped in one line that names the key and says what to do:
your own task as data.task=module:name, a file task without its folder, a run dir that cannot
be written (a local folder, gs:// without gcsfs), a pretrained model given to the recipe that
trains from scratch, and one name (data.data_dir / --data-dir) for the folder of official files."""
import importlib.util
import os

import pytest

from grpo_jax import config as config_lib
from grpo_jax.checkpoints import run_files
from grpo_jax.cli import evaluate, runs
from grpo_jax.cli import train as train_cli
from grpo_jax.errors import CheckpointError, ConfigError, UnknownNameError
from grpo_jax.tasks import get_task
from grpo_jax.tasks.custom import CustomTask

TASK_MODULE = '''
import random
from grpo_jax.tasks.custom import CustomTask

def question(rng: random.Random):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b)

def reward(prompt, completion, answer):
    return completion.strip() == answer  # a bool, as people write it: 0 or 1

def broken_reward(prompt, completion, answer):
    return {"right": 1.0}[completion]

def task():
    return CustomTask(question, reward)

def broken():
    return CustomTask(question, broken_reward)

class Named(CustomTask):
    def __init__(self):
        super().__init__(question, reward)

not_a_task = dict

the_task = CustomTask(question, reward)  # built at import, as people write it

answer_digits = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_task_mod.py").write_text(TASK_MODULE)
    (tmp_path / "broken_task_mod.py").write_text("import a_dependency_nobody_has\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_task_mod"


# ----------------------------------------------------------------------------- data.task=module:name

def test_config_takes_your_own_task_by_module_and_name():
    assert config_lib.load_config("cpu-tiny", ["data.task=my_task_mod:task"]).data.task == "my_task_mod:task"
    assert config_lib.load_config("cpu-tiny", ["data.task=pkg.sub:Class"]).data.task == "pkg.sub:Class"
    with pytest.raises(ConfigError, match=r"data.task='my task' is not one of .* nor your own task as module:name"):
        config_lib.load_config("cpu-tiny", ["data.task=my task"])


@pytest.mark.parametrize("name", ["task", "Named"])
def test_a_function_or_a_class_gives_the_task_named_as_asked(user_module, name):
    task = get_task(f"{user_module}:{name}")
    assert isinstance(task, CustomTask)
    # The run records this name (task.json); grpo-evaluate rebuilds the task from it.
    assert task.name == f"{user_module}:{name}"
    assert runs.make_task(f"{user_module}:{name}", config_lib.DataConfig()).name == task.name


@pytest.mark.parametrize("spec, message", [
    ("nowhere_mod:task", "task 'nowhere_mod:task': no module named 'nowhere_mod' on the Python path; run from "
                         "the folder that holds it with PYTHONPATH=."),
    ("my_task_mod:missing", "task 'my_task_mod:missing': module 'my_task_mod' ("),
    ("my_task_mod:not_a_task", "my_task_mod.not_a_task() gave a dict, not a grpo_jax.tasks.Task"),
    ("my_task_mod:the_task", "task 'my_task_mod:the_task': my_task_mod.the_task is a CustomTask built at import; "
                             "name a function that builds it (def the_task(): return CustomTask(...))"),
    ("my_task_mod:answer_digits", "task 'my_task_mod:answer_digits': my_task_mod.answer_digits is not a Task "
                                  "class or a function returning a Task (its type: int)"),
])
def test_a_task_that_cannot_be_made_is_named(user_module, spec, message):
    with pytest.raises(UnknownNameError) as err:
        get_task(spec)
    assert message in str(err.value)


def test_an_import_error_inside_your_module_keeps_its_traceback(user_module):
    with pytest.raises(ModuleNotFoundError, match="a_dependency_nobody_has"):
        get_task("broken_task_mod:task")


def test_grpo_train_trains_your_own_task(user_module, tmp_path):
    """The whole path: grpo-train's main with data.task=module:name, one SFT step, and the
    run dir records the task under the name that rebuilds it."""
    run_dir = tmp_path / "run"
    assert train_cli.main(["--no-progress", f"data.task={user_module}:task", "rl.algorithm=sft", "run.steps=1",
                           "run.eval_every=0", "run.checkpoint_every=1", "model.num_layers=1",
                           "data.batch_size=2", f"run.run_dir={run_dir}"]) == 0
    assert run_files.read_task(str(run_dir), config_lib.Config())["task"] == f"{user_module}:task"
    assert (run_dir / "checkpoints" / "1").is_dir()


def test_a_bool_reward_scores_0_or_1_and_a_string_is_still_refused(user_module):
    from grpo_jax.tasks import Example
    from grpo_jax.tasks.custom import RewardFunctionError

    task = get_task(f"{user_module}:task")
    assert [task.reward(c, Example("1+2=", "3")) for c in ("3", " 3\n", "4")] == [1.0, 1.0, 0.0]
    with pytest.raises(RewardFunctionError, match=r"^reward\(\) must return a finite float \(or a bool: 0/1\), "
                                                  r"got '1' \(str\)"):
        CustomTask([("1+2=", "3")], lambda p, c, a: "1").reward("3", Example("1+2=", "3"))


def test_a_broken_reward_stops_grpo_train_at_start_up_as_itself(user_module, tmp_path, caplog):
    """Not as a note about shortcut baselines with the run going on to its first step; and the
    failed start leaves no run dir behind."""
    from grpo_jax.tasks.custom import RewardFunctionError

    run_dir = tmp_path / "runs" / "broken"
    with pytest.raises(RewardFunctionError, match=r"^reward\(\) raised KeyError: ") as err:
        train_cli.main(["--no-progress", f"data.task={user_module}:broken", "run.steps=1", "model.num_layers=1",
                        "data.batch_size=2", "rl.group_size=2", f"run.run_dir={run_dir}"])
    assert isinstance(err.value.__cause__, KeyError)
    assert "shortcut" not in caplog.text and "step" not in caplog.text
    assert not (tmp_path / "runs").exists()


def test_a_start_that_fails_leaves_no_empty_run_dir(user_module, tmp_path):
    with pytest.raises(UnknownNameError, match="no module named 'nowhere_mod'"):
        train_cli.main(["--no-progress", "data.task=nowhere_mod:task", f"run.run_dir={tmp_path / 'runs' / 'x'}"])
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- the folder of official files

def test_a_file_task_without_its_folder_names_data_data_dir_and_the_script(tmp_path):
    cfg = config_lib.get_preset("smollm2-135m")  # data.task=gsm8k, no folder: the README's "real small model"
    with pytest.raises(ConfigError) as err:
        train_cli.train(cfg.replace(run={"run_dir": str(tmp_path / "run")}))
    message = str(err.value)
    assert message.startswith("data.data_dir is empty: data.task=gsm8k reads GSM8K's official train.jsonl")
    assert "experiments/gsm8k_grpo.py" in message and "docs/walkthrough.md#the-data-files" in message
    with pytest.raises(ConfigError, match=r"data.data_dir=gs://b/gsm8k is not a local folder: .*launch/stage.py"):
        runs.make_task("gsm8k", config_lib.DataConfig(task="gsm8k", data_dir="gs://b/gsm8k"))


def test_grpo_evaluate_names_the_same_folder_data_dir():
    with pytest.raises(ConfigError, match=r"^--data-dir is empty: data.task=math reads MATH's official"):
        evaluate.main(["--model", "smollm2-135m", "--task", "math", "--limit", "2"])
    flags = {a.dest: a.help for a in evaluate.build_parser()._actions}
    assert "as training's data.data_dir" in flags["data_dir"] and "TFDS" in flags["tfds_dir"]
    assert "manual_dir" not in flags


def test_an_empty_folder_is_named_with_both_spellings(tmp_path):
    (tmp_path / "empty").mkdir()
    task = runs.make_task("gsm8k", config_lib.DataConfig(task="gsm8k", data_dir=str(tmp_path / "empty")))
    with pytest.raises(Exception, match=r"the folder of the official files, .*empty' \(data.data_dir; "
                                        r"grpo-evaluate --data-dir\), is missing or empty"):
        task.examples("train", 1, 0)


# ----------------------------------------------------------------------------- the run dir

def test_an_unwritable_run_dir_stops_before_the_model_loads(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match=rf"^run.run_dir={blocker}/run cannot be written: "):
        run_files.check_writable(str(blocker / "run"))
    if os.geteuid() != 0:  # root writes through permissions
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(CheckpointError, match="cannot be written: PermissionError"):
            run_files.check_writable(str(locked / "run"))
    # grpo-train checks first: the preset's pretrained model is never loaded.
    with pytest.raises(CheckpointError, match="cannot be written"):
        train_cli.main(["--preset", "smollm2-135m", f"run.run_dir={blocker}/run"])
    run_files.check_writable(str(tmp_path / "ok" / "run"))  # a writable one passes and leaves nothing
    assert sorted(os.listdir(tmp_path)) == ["a_file", "locked"] if os.geteuid() != 0 else ["a_file"]


def test_gs_run_dir_without_gcsfs_names_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else real(name, *a))
    with pytest.raises(CheckpointError) as err:
        run_files.check_writable("gs://my-bucket/grpo_jax/run")
    assert str(err.value) == ("run.run_dir=gs://my-bucket/grpo_jax/run: writing to gs:// needs the gcsfs package, "
                              "which this Python lacks: pip install gcsfs (launch/setup.py installs it on TPU VMs)")


def test_the_tpu_vms_get_gcsfs():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pins = open(os.path.join(root, "launch", "requirements-vm.txt")).read()
    assert any(line.startswith("gcsfs==") for line in pins.splitlines())


# ----------------------------------------------------------------------------- the from-scratch recipe

def test_sft_then_rl_takes_a_preset_and_refuses_a_pretrained_model(tmp_path):
    task = CustomTask([("1+1=", "2")], lambda p, c, a: 0.0)
    with pytest.raises(ConfigError, match=r"^run.pretrained=smollm2-135m: sft_then_rl trains a model from scratch"):
        train_cli.sft_then_rl(task, [f"run.run_dir={tmp_path}", "--preset", "smollm2-135m"])
    with pytest.raises(ConfigError, match="invalid choice: 'nope'"):
        train_cli.sft_then_rl(task, ["--preset", "nope"])
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --seeds"):
        train_cli.sft_then_rl(task, ["--seeds", "1"])


# ----------------------------------------------------------------------------- grpo-evaluate's --model and --out

def test_a_mistyped_model_path_is_said_not_to_exist(tmp_path):
    with pytest.raises(ConfigError) as err:
        evaluate.main(["--model", str(tmp_path / "runs" / "nosuch")])
    assert str(err.value) == (f"--model {tmp_path / 'runs' / 'nosuch'} does not exist: give a training run dir, a "
                              "grpo-export or HF folder, a GGUF file, or smollm2-135m")


@pytest.mark.parametrize("model, task, out", [
    ("runs/mytask", "mytask:task", "runs/eval/mytask-test"),
    ("runs/mytask/", "other:task", "runs/eval/mytask-other-test"),
    ("/tmp/run1", "arithmetic", "runs/eval/run1-arithmetic-test"),
    ("smollm2-135m", "pkg.tasks:Named", "runs/eval/smollm2-135m-pkg.tasks-test")])
def test_the_default_evaluation_folder_names_each_part_once(model, task, out):
    assert evaluate.default_out(model, task, "test") == out


def test_your_own_task_is_module_name_in_every_help():
    """One wording (issue 86): a Task class or a function returning one, as data.task takes it."""
    helps = [evaluate.build_parser().format_help(), train_cli.build_parser().format_help()]
    assert all("module:Class" not in h for h in helps)
    assert "or your own as module:name, a Task class or a function returning one" in " ".join(helps[0].split())
