"""A task asked the way a chat model is trained on it: every Example's prompt is the bare
question in the model's chat format (`grpo_jax.tasks.prompts.chat_prompt`), scoring unchanged.

    task = chat_task(get_task("chat_arithmetic"), tokenizer)   # style: the task's prompt_style
"""
from __future__ import annotations

import dataclasses

from grpo_jax.tasks import prompts
from grpo_jax.tasks import Example, Task


class ChatPromptTask(Task):
    """`base` with its questions asked in prompt style `style`; `prompt_form` records it."""

    stop_strings = ()  # the base task's stops follow its plain "Question: ..." text

    def __init__(self, base: Task, tokenizer, style: str):
        prompts.get_style(style)  # an unknown style fails here, not at the first question
        self.base, self.tokenizer = base, tokenizer
        self.name, self.prompt_style, self.prompt_form = base.name, style, style

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        return [dataclasses.replace(ex, prompt=prompts.chat_prompt(prompts.question_of(ex), self.tokenizer,
                                                                   self.prompt_style))
                for ex in self.base.examples(split, n, seed)]

    def reward(self, completion, example):
        return self.base.reward(completion, example)

    def step_rewards(self, completion, example):
        return self.base.step_rewards(completion, example)

    def extract_answer(self, completion):
        return self.base.extract_answer(completion)

    def is_correct(self, answer, example):
        return self.base.is_correct(answer, example)

    def sft_text(self, example, rng=0, wrong_step_prob=0.0):
        return self.base.sft_text(example, rng, wrong_step_prob)

    def shortcuts(self, train):
        return self.base.shortcuts(train)  # the rules read the question's metadata, kept as it was


def chat_task(base: Task, tokenizer, style: str | None = None) -> ChatPromptTask:
    """`base` asked in prompt style `style` (default: the task's own `prompt_style`)."""
    style = style or base.prompt_style
    if style is None:
        raise ValueError(f"task {base.name!r} has no prompt_style: pass a grpo_jax.tasks.prompts.STYLES key")
    return ChatPromptTask(base, tokenizer, style)
