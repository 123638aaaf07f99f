"""Prompts for instruction-tuned models: a task question in the model's chat format, with a
chain-of-thought instruction that tells the model how to mark its final answer so the
task's rule reward can read it.

    text = build_prompt("Natalia sold 48 clips ...", tokenizer, task="gsm8k")
    ids = encode_prompt(tokenizer, text)      # grpo_jax.text.tokenizer.encode_prompt

The chat format is the model's own template (rendered in grpo_jax.text.chat_templates' sandbox)
or one the user named; with a ChatML template (SmolLM2, Qwen2) the result is

    <|im_start|>system\\n{system or the template's default}<|im_end|>\\n
    <|im_start|>user\\n{instruction}\\n\\n{question}<|im_end|>\\n
    <|im_start|>assistant\\n{assistant_prefix}          <- the model writes here

| task      | the answer the reward reads                 | assistant_prefix                |
| gsm8k     | the number after "####" (else the last one) | ""                              |
| math      | the last \\boxed{...}                        | ""                              |
| countdown | the expression in <answer>...</answer>      | "Let me solve this step by step.\\n<think>" |
| arithmetic| the last number (no instruction: the bare question) | ""                       |

Countdown opens the <think> tag for the model (TinyZero / GRPO-Zero), which the
Countdown reward expects. A tokenizer without a chat template (the tiny model's
sentencepiece) gets the same content as plain text: instruction, "Question: ...",
"Answer:" and the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


# DeepSeek-LLM's chat format (DeepSeekMath-Instruct/RL use it): the paper protocol's prompt
# (grpo-evaluate --prompt paper) for a plain-text model.
DEEPSEEK_CHAT = "User: {content}\n\nAssistant:"


@dataclass(frozen=True)
class PromptStyle:
    """How one task is asked. `assistant_prefix` starts the assistant's turn; the model
    continues from it. `system` (None = the chat template's default) is the system turn."""

    instruction: str
    assistant_prefix: str = ""
    system: str | None = None


STYLES: dict[str, PromptStyle] = {
    "gsm8k": PromptStyle(
        instruction=("Solve the following math word problem. Think step by step, writing one "
                     "step per line. On the last line, write the final answer as a plain number "
                     'in the form "#### <number>".')),
    "math": PromptStyle(
        instruction=("Solve the following math problem. Think step by step, and put the final "
                     "answer inside \\boxed{}.")),
    # The bare question ("What is 34 - 7?"), as a user would ask it: the reward reads the
    # last number, and the chat experiment measures what RL adds without an instruction.
    "arithmetic": PromptStyle(instruction=""),
    # The control for what RL adds: the same question with an instruction on the answer's form.
    "arithmetic_instructed": PromptStyle(instruction="Answer with just the number."),
    # Two operations in words (word_arithmetic): asked for one operation a line, SmolLM2
    # writes lines a step reward can read, and gets more right than asked bare or told the
    # answer's form; the "chain" wording got fewer (docs/studies/smollm2_words/design.md).
    "word_arithmetic": PromptStyle(instruction="Work it out one operation per line, then give the answer."),
    "word_arithmetic_chain": PromptStyle(instruction=("Work it out one operation per line, using the result of "
                                                      "each line in the next, then give the answer.")),
    "countdown": PromptStyle(
        instruction=("Solve the puzzle below. Think it through inside <think> </think> tags, then "
                     "give only the final expression inside <answer> </answer> tags, for example "
                     "<answer> (1 + 2) * 3 </answer>."),
        assistant_prefix="Let me solve this step by step.\n<think>"),
}


def countdown_question(numbers: Sequence[int], target: int) -> str:
    """The Countdown question for `numbers` and `target`."""
    listed = ", ".join(str(int(n)) for n in numbers)
    return (f"Using the numbers [{listed}], write an expression that equals {int(target)}. You may "
            f"use + - * / and parentheses, and must use every number exactly once.")


def get_style(task: str) -> PromptStyle:
    if task not in STYLES:
        raise KeyError(f"no prompt style for task {task!r}; known: {sorted(STYLES)}")
    return STYLES[task]


def build_messages(question: str, task: str = "gsm8k", *, style: PromptStyle | None = None,
                   system: str | None = None) -> list[dict[str, str]]:
    """The conversation: an optional system turn, then the instruction and the question."""
    style = style or get_style(task)
    system = system if system is not None else style.system
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": join_blocks(style.instruction, question.strip())})
    return messages


def is_chat_tokenizer(tokenizer) -> bool:
    """True when prompts for this tokenizer are conversations in its chat template; False for
    plain-text models (the tiny model's sentencepiece, a model the user named "plain" for).
    A pretrained model without a template counts as a chat model: its chat prompt is then
    refused in one line (apply_chat_template) rather than written in a format it never saw."""
    return getattr(tokenizer, "chat_format", "plain") != "plain"


def build_prompt(question: str, tokenizer, task: str = "gsm8k", *, style: PromptStyle | None = None,
                 system: str | None = None) -> str:
    """Prompt text in the tokenizer's chat format, ending where the model starts writing."""
    style = style or get_style(task)
    if is_chat_tokenizer(tokenizer):
        messages = build_messages(question, task, style=style, system=system)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True) + style.assistant_prefix
    head = f"{system}\n\n" if system else ""
    return f"{head}{join_blocks(style.instruction, f'Question: {question.strip()}')}\nAnswer:\n{style.assistant_prefix}"


def question_of(example) -> str:
    """The bare question of a task's Example (`meta["question"]`), which a chat prompt asks."""
    if "question" not in example.meta:
        raise ValueError(f"the example {example.prompt[:60]!r} has no meta['question'] to ask in a chat prompt")
    return example.meta["question"]


def chat_prompt(question: str, tokenizer, style: str) -> str:
    """`question` asked in prompt style `style` in the model's chat format (`build_prompt`):
    what chat-model training (`grpo_jax.tasks.chat`) and its evaluation (`grpo-evaluate`)
    both send."""
    return build_prompt(question, tokenizer, task=style)


def join_blocks(*parts: str) -> str:
    """Non-empty parts, a blank line between them (a style may have no instruction)."""
    return "\n\n".join(p for p in parts if p)
