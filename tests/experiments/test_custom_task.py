"""Bring your own task: prompts + reference answers + `reward(prompt, completion, answer)`
train with every algorithm, contract errors name the prompt, and the README's example is
experiments/custom_task.py, which runs as written and improves its held-out reward."""

import importlib.util
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from grpo_jax import config as config_lib
from grpo_jax.model.transformer import init_params
from grpo_jax.tasks import Example
from grpo_jax.tasks.custom import CustomTask, RewardFunctionError
from grpo_jax.text.tokenizer import train_sentencepiece
from grpo_jax.rl.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
PAIRS = [(f"{a}*{b}=", str(a * b)) for a in range(4) for b in range(4)]


def digit_share(prompt, completion, answer):
    """Depends on the stripped completion only, so the trainer's two uses of the reward (the
    reward itself, correctness on the extracted answer) see the same value."""
    text = completion.strip()
    return 1.0 if text == answer else sum(c.isdigit() for c in text) / (len(text) + 1)


class Recorder:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, prompt, completion, answer):
        value = self.fn(prompt, completion, answer)
        self.calls.append((prompt, completion, answer, value))
        return value


@pytest.fixture(scope="module")
def tok():
    return train_sentencepiece([p + a for p, a in PAIRS] * 5 + ["0123456789 +*=\n"], vocab_size=24)


def _cfg(tmp_path, tok, *overrides):
    return config_lib.load_config("cpu-tiny", [
        "model.embed_dim=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.head_dim=16", "model.mlp_dim=64", "model.max_seq_len=32", f"model.vocab_size={tok.vocab_size}",
        "rl.group_size=4", "rl.max_new_tokens=6", "data.batch_size=4", "data.eval_size=4",
        "optimizer.peak_lr=3e-3", "optimizer.warmup_steps=0", "optimizer.schedule=constant",
        "run.eval_every=0", "run.checkpoint_every=100", f"run.run_dir={tmp_path}", *overrides])


def _trainer(cfg, tok, task):
    return Trainer(cfg, task=task, tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                   eval_examples=[], progress=False, resume=False)


@pytest.mark.parametrize("algorithm", ["grpo", "online_rft", "dpo", "ppo"])
def test_custom_reward_drives_every_algorithm(tmp_path, tok, algorithm):
    reward = Recorder(digit_share)
    task = CustomTask(PAIRS, reward)
    trainer = _trainer(_cfg(tmp_path, tok, f"rl.algorithm={algorithm}"), tok, task)
    questions = {(ex.prompt, ex.answer) for ex in trainer.questions(0)}
    metrics = trainer.train_step(0)
    trainer.close()
    # Every call scored one of the step's questions, with that question's own reference answer.
    assert {(p, a) for p, _, a, _ in reward.calls} == questions
    values = [v for *_, v in reward.calls]
    # 4 questions x G = 4 samples (DPO then pairs them up), each scored and checked for correctness.
    assert len(values) == 2 * 4 * 4
    assert metrics["reward_mean"] == pytest.approx(sum(values) / len(values), abs=1e-6)
    assert metrics["accuracy_train"] == pytest.approx(sum(v >= 1.0 for v in values) / len(values))
    assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm"))


def test_process_supervision_takes_one_reward_per_line(tmp_path, tok):
    step_reward = Recorder(lambda prompt, completion, answer: [float(len(line)) for line in completion.splitlines()])
    task = CustomTask(PAIRS, digit_share, step_reward=step_reward)
    assert task.step_rewards("12\n345\n6", Example("1*2=", "2")) == [(3, 2.0), (7, 3.0), (8, 1.0)]
    trainer = _trainer(_cfg(tmp_path, tok, "rl.supervision=process"), tok, task)
    metrics = trainer.train_step(0)
    trainer.close()
    assert len(step_reward.calls) == 1 + 4 * 4 and math.isfinite(metrics["loss"])  # the call above + B x G


def test_generator_prompts_depend_on_seed_and_split_only():
    draws = []

    def question(rng):
        draws.append(rng.random())
        a = rng.randint(0, 999)  # a space with enough held-out prompts for 5 distinct ones
        return f"{a}+1=", str(a + 1)

    task = CustomTask(question, digit_share)
    first = task.examples("train", 5, seed=3)
    assert task.examples("train", 5, seed=3) == first
    assert task.examples("train", 5, seed=4) != first and task.examples("test", 5, seed=3) != first
    assert all(int(ex.prompt.split("+")[0]) + 1 == int(ex.answer) for ex in first)
    listed = CustomTask(PAIRS, digit_share, eval_prompts=PAIRS[:2])
    assert [(e.prompt, e.answer) for e in listed.examples("test", 8, 0)] == PAIRS[:2]
    assert {(e.prompt, e.answer) for e in listed.examples("train", 50, 0)} <= set(PAIRS)


@pytest.mark.parametrize("bad, fragment", [
    (lambda p, c, a: "1.0", "must return a finite float (or a bool: 0/1), got '1.0' (str)"),
    (lambda p, c, a: None, "got None (NoneType)"),
    (lambda p, c, a: float("nan"), "got nan"),
    (lambda p, c, a: 1 / 0, "reward() raised ZeroDivisionError: division by zero"),
])
def test_reward_contract_errors_name_the_prompt(bad, fragment):
    task = CustomTask(PAIRS, bad)
    with pytest.raises(RewardFunctionError) as err:
        task.reward("42", Example("6*7=", "42"))
    assert fragment in str(err.value) and "prompt '6*7='" in str(err.value) and "completion '42'" in str(err.value)


def test_a_reward_broken_everywhere_stops_the_trainer_at_start_up(tmp_path, tok):
    def broken(prompt, completion, answer):
        raise KeyError("oops")

    task, cfg = CustomTask(PAIRS, broken), _cfg(tmp_path, tok)
    with pytest.raises(RewardFunctionError, match=r"^reward\(\) raised KeyError: 'oops' — for prompt ") as err:
        Trainer(cfg, task=task, tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                eval_examples=[Example(p, a) for p, a in PAIRS[5:9]], progress=False)  # 1, 2, 3, 0: rules guess "0"
    assert isinstance(err.value.__cause__, KeyError)


def test_errors_in_training_name_the_prompt_and_keep_the_cause(tmp_path, tok):
    def broken(prompt, completion, answer):  # fine on the shortcut rules' numeric answers
        if not completion.strip().isdigit():
            raise KeyError("oops")
        return float(completion.strip() == answer)

    trainer = _trainer(_cfg(tmp_path, tok), tok, CustomTask(PAIRS, broken))
    prompts = [ex.prompt for ex in trainer.questions(0)]
    with pytest.raises(RewardFunctionError) as err:
        trainer.train_step(0)
    trainer.close()
    assert isinstance(err.value.__cause__, KeyError)
    assert re.search(r"prompt '(.*?)'", str(err.value)).group(1) in prompts


def test_other_contract_errors():
    with pytest.raises(RewardFunctionError, match=r"step_reward\(\) must return one float per line \(2 lines\)"):
        CustomTask(PAIRS, digit_share, step_reward=lambda p, c, a: [1.0]).step_rewards("1\n2", Example("q", "a"))
    with pytest.raises(RewardFunctionError, match=r"question\(rng\) for train seed 0 must be a \(prompt, answer\)"):
        CustomTask(lambda rng: ("1+1=", 2), digit_share).examples("train", 1, 0)
    with pytest.raises(RewardFunctionError, match=r"prompts\[1\] must be a \(prompt, answer\) pair"):
        CustomTask([("a", "b"), "c"], digit_share)


# ------------------------------------------------------------------ the README example

EXAMPLE = REPO / "experiments" / "custom_task.py"


def test_readme_shows_the_example_file_verbatim_in_at_most_25_lines():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Your own task", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == EXAMPLE.read_text()
    assert len(block.splitlines()) <= 25


def test_readme_example_runs_as_written_and_improves_its_reward(tmp_path):
    spec = importlib.util.spec_from_file_location("custom_task_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.reward("3+4=", " 7", "7") == 1.0
    assert {example.solution("1+1=", "2", random.Random(s)) for s in range(20)} == {"2", "3"}
    # The command a user types, on the one CPU device a user has (not the suite's 8 fake ones).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, str(EXAMPLE), f"run.run_dir={tmp_path}"], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, shortcut = map(float, re.search(
        r"held-out greedy reward: (\S+) -> (\S+) \(best shortcut (\S+)\)", done.stdout).groups())
    # The margin absorbs CPU-to-CPU drift (docs/studies/custom_task/results.md has the measured run); learning
    # means clearing the best rule that skips the skill by 10 points.
    assert after >= before + 0.25 and after >= 0.75 and after >= shortcut + 0.10, (before, after, shortcut)
