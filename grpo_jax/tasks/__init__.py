"""Tasks: where questions come from and how completions are scored.

A task turns a split into :class:`Example` s (a prompt that ends exactly where the model
starts writing, a reference answer, and metadata) and scores completions (the generated
text only, without the prompt):

- ``reward(completion, example)``: outcome reward (format + correctness).
- ``step_rewards(completion, example)``: process rewards, a list of
  ``(end, reward)`` per step in order, where ``end`` is an exclusive CHARACTER offset
  into the completion: ``completion[start:end]`` is the step including its trailing
  newline. The trainer maps it to a token index with the tokenizer's character offsets:
  the step ends at the token that covers character ``end - 1``. Tasks without a
  step-level rule return the outcome reward as one step ending at ``len(completion)``.
- ``extract_answer(completion)``: a canonical answer string (or None) for majority
  voting; equal strings mean equal answers.
- ``sft_text(example, rng, wrong_step_prob)``: a worked solution (completion text only;
  the SFT document is ``example.prompt + sft_text``).

Tasks are created by name: ``get_task("arithmetic", num_operands=3)``. Modules are
imported on first use, so asking for ``arithmetic`` never imports TFDS.
"""
from __future__ import annotations

import dataclasses
import importlib
import random
import zlib
from typing import Any, Callable, Iterator

import numpy as np

from grpo_jax.errors import UnknownNameError


@dataclasses.dataclass(frozen=True)
class Example:
    """One question. ``prompt`` ends where the model should start writing."""

    prompt: str
    answer: str
    meta: dict = dataclasses.field(default_factory=dict, hash=False)


SPLITS = ("train", "validation", "test")


def as_random(rng: Any) -> random.Random:
    """Accept a ``random.Random``, a ``numpy.random.Generator`` or an int seed."""
    if isinstance(rng, random.Random):
        return rng
    if isinstance(rng, np.random.Generator):
        return random.Random(int(rng.integers(0, 2**63 - 1)))
    if isinstance(rng, (int, np.integer)):
        return random.Random(int(rng))
    raise TypeError(f"expected random.Random, numpy Generator or int, got {type(rng)}")


class Task:
    """Base class; subclasses set ``name`` and implement ``examples`` and ``reward``."""

    name: str = ""
    # A sampler may stop once one of these is generated; it stays part of the completion.
    stop_strings: tuple[str, ...] = ()
    # How a chat model is asked this task: a `grpo_jax.tasks.prompts.STYLES` key (the bare
    # question, `meta["question"]`, in the model's chat format), or None for the task's own
    # text only. `grpo_jax.tasks.chat.chat_task` trains with it; `grpo-evaluate` defaults to it.
    prompt_style: str | None = None
    # What `Example.prompt` is: "task" (the task's own text) or the prompt style a chat
    # wrapper put the question in. A run records it, so its evaluation asks the same way.
    prompt_form: str = "task"
    # The tool the policy may call while it answers (a `grpo_jax.tools.PythonTool`), when
    # rl.max_tool_calls > 0; its outputs are part of the completion the reward reads.
    tool = None

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` examples of ``split``; the same (split, n, seed) always gives the same list."""
        raise NotImplementedError

    def reward(self, completion: str, example: Example) -> float:
        raise NotImplementedError

    def step_rewards(self, completion: str, example: Example) -> list[tuple[int, float]]:
        """Default: the outcome reward as a single step ending at the end of the completion."""
        return [(len(completion), self.reward(completion, example))]

    def extract_answer(self, completion: str) -> str | None:
        raise NotImplementedError

    def is_correct(self, answer: str | None, example: Example) -> bool:
        """Whether an extracted answer (``extract_answer`` output) is right for ``example``."""
        raise NotImplementedError

    def shortcuts(self, train: list[Example]) -> dict[str, Callable[[Example], str | None]]:
        """Rules that answer without the skill the task teaches, fitted on ``train``: name ->
        ``guess(example)``, scored by `grpo_jax.tasks.shortcuts` beside every held-out accuracy
        (which adds the commonest answer for every task). Default: none beyond that."""
        return {}

    def sft_text(self, example: Example, rng: Any = 0, wrong_step_prob: float = 0.0) -> str:
        raise NotImplementedError(f"task {self.name!r} has no worked solutions")

    def sft_examples(
        self, split: str, n: int, seed: int, wrong_step_prob: float = 0.0
    ) -> list[tuple[Example, str]]:
        """``n`` pairs ``(example, worked solution)`` for SFT, deterministic per seed;
        ``wrong_step_prob`` > 0 makes the SFT model start imperfect (where supported)."""
        rng = random.Random(f"sft/{seed}")
        return [(ex, self.sft_text(ex, rng, wrong_step_prob)) for ex in self.examples(split, n, seed)]

    def text_corpus(self, n: int, seed: int = 0) -> Iterator[str]:
        """``n`` full documents (prompt + worked solution), e.g. to train a tokenizer."""
        rng = random.Random(seed)
        for example in self.examples("train", n, seed):
            yield example.prompt + self.sft_text(example, rng)


def split_of(question: str) -> str:
    """Stable split of a generated question (crc32 bucket of its text): 10% test, 10%
    validation, 80% train, so splits never share a question, whatever the seeds."""
    bucket = zlib.crc32(question.encode()) % 10
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


def draw_distinct(draw: Callable[[], Any], question: Callable[[Any], str], split: str, n: int,
                  tries: int) -> list:
    """The first ``n`` items of ``draw()`` whose ``question`` text is new and in ``split``
    (``split_of``), within ``tries`` draws: how generated tasks build a split's examples."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    out, seen = [], set()
    for _ in range(tries):
        if len(out) == n:
            break
        item = draw()
        text = question(item)
        if text not in seen and split_of(text) == split:
            seen.add(text)
            out.append(item)
    if len(out) != n:
        raise ValueError(f"could not draw {n} distinct {split!r} questions in {tries} tries")
    return out


# name -> "module:Class"; imported lazily so cheap tasks never pull in TFDS.
_REGISTRY: dict[str, str] = {
    "arithmetic": "grpo_jax.tasks.arithmetic:ArithmeticTask",
    "chat_arithmetic": "grpo_jax.tasks.chat_arithmetic:ChatArithmeticTask",
    "countdown": "grpo_jax.tasks.countdown:CountdownTask",
    "gsm8k": "grpo_jax.tasks.gsm8k:Gsm8kTask",
    "gsm8k_synth": "grpo_jax.tasks.gsm8k_synth:Gsm8kSynthTask",
    "math": "grpo_jax.tasks.math_task:MathTask",
    "modular": "grpo_jax.tasks.modular:ModularTask",
    "word_arithmetic": "grpo_jax.tasks.word_arithmetic:WordArithmeticTask",
}


def register_task(name: str, target: str) -> None:
    """Register ``"module:Class"`` under ``name`` (for tasks defined outside this package)."""
    if name in _REGISTRY and _REGISTRY[name] != target:
        raise ValueError(f"task {name!r} already registered as {_REGISTRY[name]}")
    _REGISTRY[name] = target


def available_tasks() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **kwargs) -> Task:
    """Instantiate a task, passing ``kwargs`` to its constructor: a registered name, or your
    own as ``"module:name"``, where ``name`` is a Task class or a function returning a Task
    (`user_task`)."""
    if name not in _REGISTRY and ":" in name:
        return user_task(name, **kwargs)
    if name not in _REGISTRY:
        raise UnknownNameError(f"unknown task {name!r}; available: {available_tasks()} or your own as module:name")
    module_name, cls_name = _REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(**kwargs)


def user_task(spec: str, **kwargs) -> Task:
    """The task ``spec`` = ``"module:name"`` names: ``module`` imported from the Python path,
    ``name`` in it a Task class or a function returning a Task, called with ``kwargs``.

    The task's ``name`` becomes ``spec``: a run records its task's name (task.json), and
    `grpo-evaluate` rebuilds the task of a run dir from it. UnknownNameError, naming ``spec``,
    when the module is not importable, has no ``name``, or ``name`` makes no Task; an error
    raised inside the user's module (one of its own imports, say) keeps its traceback."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
            raise
        raise UnknownNameError(f"task {spec!r}: no module named {module_name!r} on the Python path; run from "
                               "the folder that holds it with PYTHONPATH=. (or install it)") from None
    if not hasattr(module, attr):
        raise UnknownNameError(f"task {spec!r}: module {module_name!r} ({module.__file__}) has no {attr!r}")
    target = getattr(module, attr)
    # An instance is refused rather than shared: every make_task call (the trainer's, the
    # evaluation's, chat_task's wrapping) would get and rename the same object.
    if isinstance(target, Task):
        raise UnknownNameError(f"task {spec!r}: {module_name}.{attr} is a {type(target).__name__} built at import; "
                               f"name a function that builds it (def {attr}(): return {type(target).__name__}(...)) "
                               "or a Task class")
    if not callable(target):
        raise UnknownNameError(f"task {spec!r}: {module_name}.{attr} is not a Task class or a function "
                               f"returning a Task (its type: {type(target).__name__})")
    task = target(**kwargs)
    if not isinstance(task, Task):
        raise UnknownNameError(f"task {spec!r}: {module_name}.{attr}() gave a {type(task).__name__}, not a "
                               "grpo_jax.tasks.Task (e.g. a grpo_jax.tasks.custom.CustomTask)")
    task.name = spec
    return task


__all__ = ["Example", "Task", "SPLITS", "as_random", "available_tasks", "draw_distinct", "get_task",
           "register_task", "split_of", "user_task"]
