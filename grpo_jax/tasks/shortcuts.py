"""Shortcut baselines: what a held-out set gives to rules that skip the skill being taught.

A held-out accuracy means learning only beside the score of the simplest ways to get it
without the skill: the commonest answer, and rules a model could pick up from the prompt's
surface (for arithmetic: right units digit, the rest guessed from the signs). Every rule is
fitted on the training split only and scored on the held-out questions with the task's own
``is_correct``; the best of them is the bar a result has to clear.

A task offers its rules through ``Task.shortcuts(train)``: a dict name -> guess function
``guess(example) -> answer string | None`` built from the training examples. The constant
answer is added here for every task.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable, Hashable, Iterable, Sequence

log = logging.getLogger(__name__)

Guess = Callable[[Any], "str | None"]

# Training questions a rule is fitted on (enough for lookup tables keyed by a few surface
# features, cheap for generated tasks).
FIT_SIZE = 4000
FIT_SEED = 7_000_000


@dataclasses.dataclass(frozen=True)
class Baselines:
    """Accuracy of every shortcut on one held-out set; ``best`` is the highest."""

    scores: dict[str, float]
    num_questions: int
    distinct_questions: int
    fit_questions: int

    @property
    def best(self) -> tuple[str, float]:
        name = max(self.scores, key=lambda k: (self.scores[k], k == "constant"))
        return name, self.scores[name]

    def line(self) -> str:
        """One line for logs: the best shortcut and the constant's score."""
        name, score = self.best
        text = f"best shortcut {score:.3f} ({name})"
        if name != "constant":
            text += f", constant {self.scores['constant']:.3f}"
        return text

    def to_dict(self) -> dict:
        name, score = self.best
        return {"scores": dict(self.scores), "best": name, "best_score": score,
                "num_questions": self.num_questions, "distinct_questions": self.distinct_questions,
                "fit_questions": self.fit_questions}


def commonest(values: Iterable[Hashable]):
    """The most frequent value (ties: the first seen); None for no values."""
    counts = collections.Counter(values)
    return max(counts, key=counts.__getitem__) if counts else None


def lookup_rule(train: Sequence, key: Callable[[Any], Hashable], target: Callable[[Any], Hashable],
                answer: Callable[[Any, Any], "str | None"]) -> Guess:
    """A rule that predicts ``target`` from ``key`` by the commonest training value per key
    (the commonest overall for an unseen key), and answers ``answer(example, predicted)``."""
    by_key: dict[Hashable, list] = collections.defaultdict(list)
    for ex in train:
        by_key[key(ex)].append(target(ex))
    table = {k: commonest(v) for k, v in by_key.items()}
    fallback = commonest(target(ex) for ex in train)
    return lambda ex: answer(ex, table.get(key(ex), fallback))


def shortcut_baselines(task, held_out: Sequence, train: Sequence | None = None) -> Baselines:
    """Every shortcut's accuracy on ``held_out`` (examples of ``task``), fitted on ``train``
    (default: ``FIT_SIZE`` training questions of the task, or all a small question space
    holds)."""
    if train is None:
        train = fit_examples(task)
    if not train:
        raise ValueError("shortcut_baselines: no training examples to fit the rules on")
    constant = commonest(ex.answer for ex in train)
    rules: dict[str, Guess] = {"constant": lambda ex: constant, **task.shortcuts(train)}
    n = len(held_out)
    scores = {name: (sum(guess_is_right(task, guess(ex), ex) for ex in held_out) / n if n else 0.0)
              for name, guess in rules.items()}
    return Baselines(scores, n, len({ex.prompt for ex in held_out}), len(train))


def guess_is_right(task, guess, example) -> bool:
    """Whether a rule's guess is right, scored as the task's own answers: a guess is an answer
    in the form of ``example.answer`` (not a completion), so it is right when it is the
    reference answer, or when the task's check of an extracted answer (``is_correct``)
    accepts it. A task whose reward reads a formatted answer (an ``A:`` line) would score a
    bare guess 0 through ``is_correct`` alone."""
    if guess is None:
        return False
    return str(guess).strip() == str(example.answer).strip() or bool(task.is_correct(guess, example))


def numeric_rules(train: Sequence) -> dict[str, Guess]:
    """The arithmetic task's units-digit rules for any task whose answers are integers, reading
    nothing but the answer and the prompt's text: the right units digit with the digits above
    it the commonest in training, overall and per prompt shape (the prompt with every number
    masked, i.e. its operator order). Pass as ``CustomTask(..., shortcuts=numeric_rules)``."""
    import re

    def integer(text: str) -> int | None:
        return int(text) if re.fullmatch(r"-?\d{1,18}", str(text).strip()) else None

    def above(ex) -> int | None:
        value = integer(ex.answer)
        return None if value is None else value // 10

    def with_units(ex, rest) -> str | None:
        value = integer(ex.answer)
        return None if value is None or rest is None else str(10 * rest + value % 10)

    keys = {"overall": lambda ex: None, "by prompt shape": lambda ex: re.sub(r"\d+", "#", ex.prompt)}
    return {f"units digit + commonest rest {name}": lookup_rule(train, key, above, with_units)
            for name, key in keys.items()}


LEARNING_MARGIN = 0.10


def clears(accuracies, bar: float, margin: float = LEARNING_MARGIN) -> bool:
    """The learning claim where a task cannot push its best shortcut under 10%: every
    seed's accuracy (an iterable, or a dict seed -> accuracy) beats the best shortcut ``bar``
    by ``margin``."""
    values = list(accuracies.values() if isinstance(accuracies, dict) else accuracies)
    return bool(values) and all(v >= bar + margin for v in values)


def fit_examples(task, size: int = FIT_SIZE) -> list:
    """Training questions to fit rules on: ``size`` of them, or, for a task whose training
    split holds fewer distinct questions, a quarter as many at a time down to 250."""
    while True:
        try:
            return task.examples("train", size, FIT_SEED)
        except (ValueError, RuntimeError):
            if size <= 250:
                raise
            size //= 4


def try_shortcut_baselines(task, held_out: Sequence) -> "Baselines | None":
    """`shortcut_baselines`, or None with a warning for a task whose training split cannot
    be drawn here (a dataset task without its training file): the accuracy then stands alone.
    A user's function that breaks its contract (`RewardFunctionError`, a ValueError) is raised
    as itself: the run would meet it at its first step."""
    from grpo_jax.tasks.custom import RewardFunctionError

    try:
        return shortcut_baselines(task, held_out)
    except RewardFunctionError:
        raise
    except (OSError, ValueError, RuntimeError, NotImplementedError) as err:
        log.warning("no shortcut baselines for task %r: its training split could not be drawn (%s)",
                    getattr(task, "name", type(task).__name__), err)
        return None


__all__ = ["Baselines", "FIT_SIZE", "LEARNING_MARGIN", "clears", "commonest", "guess_is_right", "lookup_rule",
           "numeric_rules", "shortcut_baselines",
           "try_shortcut_baselines"]
