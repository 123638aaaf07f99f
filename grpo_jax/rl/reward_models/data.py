"""Reward-model data: labelled (prompt, completion) samples, labelling by a task's rules,
and the replay buffer of Algorithm 1's iterative reward-model training. Host-side only."""
from __future__ import annotations

import dataclasses
import json
import math
import random
from typing import Any, Iterable, Sequence


@dataclasses.dataclass(frozen=True)
class LabelledSample:
    """One (prompt, completion) with its rule/oracle labels.

    ``correct``: the outcome label (final answer right). ``step_labels``: ``(end, label)``
    per step as ``Task.step_rewards`` returns them (``end`` an exclusive character offset
    into ``completion``, ``label`` in [0, 1]); needed only by process reward models.
    """

    prompt: str
    completion: str
    correct: bool
    step_labels: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "step_labels",
                           tuple((int(e), float(r)) for e, r in self.step_labels))


def label_completions(task, examples: Sequence[Any], completions: Sequence[str]) -> list[LabelledSample]:
    """Label completions with a task's rules: ``correct`` = the extracted final answer is
    right (``task.is_correct``), ``step_labels`` = ``task.step_rewards``."""
    if len(examples) != len(completions):
        raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
    return [LabelledSample(ex.prompt, c, bool(task.is_correct(task.extract_answer(c), ex)),
                           tuple(task.step_rewards(c, ex)))
            for ex, c in zip(examples, completions)]


def labelled_samples(task, split: str, num_prompts: int, seed: int, *, samples_per_prompt: int = 4,
                     wrong_step_prob: float = 0.5, **sft_kwargs) -> list[LabelledSample]:
    """Synthetic reward-model data: ``samples_per_prompt`` worked solutions per question
    from ``task.sft_text`` (each step wrong with probability ``wrong_step_prob``; further
    keywords go to it, e.g. the modular task's ``lookup_error_prob``), labelled by the task's
    rules. Deterministic in (split, num_prompts, seed)."""
    rng = random.Random(f"reward_models/{split}/{seed}")
    examples, completions = [], []
    for ex in task.examples(split, num_prompts, seed):
        for _ in range(samples_per_prompt):
            examples.append(ex)
            completions.append(task.sft_text(ex, rng, wrong_step_prob, **sft_kwargs))
    return label_completions(task, examples, completions)


def split_by_prompt(samples: Sequence[LabelledSample], fraction: float, seed: int
                    ) -> tuple[list[LabelledSample], list[LabelledSample]]:
    """(train, validation): the samples of a ``fraction`` of the distinct prompts, drawn at
    random (deterministic in ``seed``), go to validation, so no prompt is in both. Order
    within each part is kept."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the validation fraction must be in (0, 1), got {fraction}")
    prompts = sorted({s.prompt for s in samples})
    held = math.ceil(fraction * len(prompts))
    if held >= len(prompts):
        raise ValueError(f"a validation fraction of {fraction} of {len(prompts)} prompts leaves none to train on")
    chosen = set(random.Random(f"split_by_prompt/{seed}").sample(prompts, held))
    return [s for s in samples if s.prompt not in chosen], [s for s in samples if s.prompt in chosen]


def has_same_prompt_pair(samples: Sequence[LabelledSample]) -> bool:
    """Whether some prompt has both a correct and an incorrect completion: a pairwise accuracy
    needs one."""
    labels: dict[str, set[bool]] = {}
    for s in samples:
        labels.setdefault(s.prompt, set()).add(bool(s.correct))
    return any(len(v) == 2 for v in labels.values())


def write_samples(path, samples: Iterable[LabelledSample]) -> int:
    """Labelled samples as JSON lines (prompt, completion, correct, step_labels), the file
    `read_samples` reads back; returns how many were written."""
    n = 0
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps({"prompt": s.prompt, "completion": s.completion, "correct": s.correct,
                                "step_labels": [list(x) for x in s.step_labels]}) + "\n")
            n += 1
    return n


def read_samples(path) -> list[LabelledSample]:
    """The labelled samples of a `write_samples` file, in order."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [LabelledSample(r["prompt"], r["completion"], bool(r["correct"]),
                           tuple(tuple(x) for x in r["step_labels"])) for r in rows]


def line_step_ends(completion: str) -> list[int]:
    """Default step segmentation: one step per non-blank line, ending after its ``\\n``
    (the convention of ``Task.step_rewards``). No non-blank line: one step, the whole text."""
    ends, start = [], 0
    for part in completion.split("\n"):
        end = start + len(part) + 1
        if part.strip():
            ends.append(min(end, len(completion)))
        start = end
    return ends or [len(completion)]


class ReplayBuffer:
    """Historical labelled samples for continued reward-model training (iterative RL).

    Holds at most ``capacity`` samples (None: unbounded); once full, reservoir sampling
    keeps a uniform sample of everything ever added, so old iterations stay represented.
    Iterative RL, after each iteration's new labelled samples ``new``::

        rm, _ = train_reward_model(cfg, tok, new, init_params=rm, replay=buffer)  # 10% history
        buffer.add(new)

    `train_reward_model` mixes by the same rule as `mix` (`replay_count` historical items
    per batch), drawing both parts in shuffled passes rather than with replacement.
    """

    def __init__(self, capacity: int | None = None, seed: int = 0):
        if capacity is not None and capacity < 1:
            raise ValueError(f"ReplayBuffer capacity must be >= 1 or None, got {capacity}")
        self.capacity = capacity
        self._items: list[LabelledSample] = []
        self._seen = 0
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def samples(self) -> list[LabelledSample]:
        return list(self._items)

    def add(self, samples: Iterable[LabelledSample]) -> None:
        for s in samples:
            self._seen += 1
            if self.capacity is None or len(self._items) < self.capacity:
                self._items.append(s)
            else:
                j = self._rng.randrange(self._seen)
                if j < self.capacity:
                    self._items[j] = s

    def sample(self, k: int, rng: random.Random | None = None) -> list[LabelledSample]:
        """``k`` historical samples drawn uniformly with replacement."""
        if k and not self._items:
            raise ValueError("ReplayBuffer.sample: the buffer is empty")
        rng = rng or self._rng
        return [self._items[rng.randrange(len(self._items))] for _ in range(k)]

    def mix(self, new: Sequence[Any], n: int, fraction: float = 0.1,
            rng: random.Random | None = None) -> list[Any]:
        """A batch of ``n``: exactly ``replay_count(n, fraction)`` historical samples, the
        rest drawn uniformly from ``new`` (with replacement), historical ones last."""
        k = replay_count(n, fraction) if self._items else 0
        if n - k and not new:
            raise ValueError("ReplayBuffer.mix: no new samples to draw from")
        rng = rng or self._rng
        return [new[rng.randrange(len(new))] for _ in range(n - k)] + self.sample(k, rng)


def replay_count(n: int, fraction: float) -> int:
    """How many of a batch of ``n`` items come from history: n · fraction rounded half up,
    at least 1 when ``fraction`` > 0 (so a small batch still replays), at most n."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"replay_fraction must be in [0, 1], got {fraction}")
    if fraction == 0.0:
        return 0
    return min(n, max(1, math.floor(n * fraction + 0.5)))
