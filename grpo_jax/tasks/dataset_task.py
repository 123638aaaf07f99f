"""Shared base for tasks backed by a TFDS dataset (GSM8K, MATH)."""
from __future__ import annotations

from typing import Any

import numpy as np

from grpo_jax.tasks import Example, Task


class DatasetTask(Task):
    """Reads ``dataset`` ("gsm8k" / "math") through :mod:`grpo_jax.data.loading`.

    ``data_dir`` is where TFDS keeps prepared datasets (TFDS default if None);
    ``manual_dir`` holds the official files (TFDS default ``<data_dir>/downloads/manual``).
    The dataset is built on first use if it is not prepared yet; ``skip_bad_rows`` leaves
    malformed rows out (counted and logged) instead of raising a DataError.
    """

    dataset: str = ""
    splits: tuple[str, ...] = ("train", "test")
    # The chain-of-thought format DeepSeekMath-Instruct 7B and DeepSeekMath-RL 7B are
    # evaluated with (Table 5's "Chain-of-Thought Reasoning" rows, GSM8K and MATH alike).
    # The paper does not print it; the models' published cards do: "Please use
    # chain-of-thought prompt to test DeepSeekMath-Instruct and DeepSeekMath-RL: English
    # questions: {question}\nPlease reason step by step, and put your final answer within
    # \boxed{}." It is the user turn; `grpo_jax.eval.evaluate_run.prompt_text` wraps it in the
    # model's chat template. ``{question}`` is ``Example.meta["question"]``.
    paper_prompt: str = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    # The tool-integrated format (Table 5's "Tool-Integrated Reasoning" rows): DeepSeekMath's
    # released evaluation (github.com/deepseek-ai/DeepSeek-Math, evaluation/README.md and
    # run_subset_parallel.py's markup_question) asks English questions, zero-shot, as
    # "{question}\nPlease integrate natural language reasoning with programs to solve the
    # problem above, and put your final answer within \boxed{}." `grpo-evaluate --tools
    # python` sends it as the user turn, like ``paper_prompt``.
    tool_prompt: str = ("{question}\nPlease integrate natural language reasoning with programs to solve the problem "
                        "above, and put your final answer within \\boxed{{}}.")

    def __init__(self, data_dir: str | None = None, manual_dir: str | None = None, *,
                 skip_bad_rows: bool = False):
        self.data_dir = data_dir
        self.manual_dir = manual_dir
        self.skip_bad_rows = skip_bad_rows
        self._sources: dict[str, Any] = {}

    def to_example(self, record: dict) -> Example:
        """A decoded record (str fields) -> Example."""
        raise NotImplementedError

    def source(self, split: str):
        if split not in self.splits:
            raise ValueError(f"{self.name} has splits {self.splits}, got {split!r}")
        if split not in self._sources:
            from grpo_jax.data import loading

            self._sources[split] = loading.data_source(
                self.dataset, split, self.data_dir, self.manual_dir, skip_bad_rows=self.skip_bad_rows
            )
        return self._sources[split]

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` examples of ``split`` in a seeded random order (all of them if n exceeds
        the split, or n < 0)."""
        from grpo_jax.data import loading

        source = self.source(split)
        order = np.random.default_rng(seed).permutation(len(source))
        if n >= 0:
            order = order[:n]
        return [self.to_example(loading.decode_record(source[int(i)])) for i in order]

    def loader(self, split: str, *, batch_size: int, seed: int, **kwargs):
        """A Grain loader of lists of Examples; ``kwargs`` go to ``loading.make_loader``
        (shuffle, num_epochs, shard_index, shard_count, drop_remainder)."""
        from grpo_jax.data import loading

        return loading.make_loader(
            self.source(split), batch_size=batch_size, seed=seed, transform=self.to_example, **kwargs
        )
