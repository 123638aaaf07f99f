"""Sentencepiece training on generated text, the Tokenizer protocol, char→token mapping."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.text.tokenizer import SentencePieceTokenizer, Tokenizer, char_to_token_index, train_sentencepiece


@pytest.fixture(scope="module")
def tok():
    r = random.Random(0)
    corpus = [f"Q: {r.randint(0, 999)}+{r.randint(0, 99)}=?\n{r.randint(0, 99)}*{r.randint(0, 9)}={r.randint(0, 999)}\nA: {r.randint(0, 999)}\n"
              for _ in range(300)]
    return train_sentencepiece(corpus, vocab_size=48)


def test_round_trip_and_special_ids(tok):
    assert isinstance(tok, Tokenizer)
    text = "Q: 305+17=?\n305+17=322\nA: 322\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode(text, add_bos=True) == [1] + ids
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == text  # specials never print
    assert tok.stop_ids == [2]


def test_digits_are_split(tok):
    pieces = [tok.decode([i]).strip() for i in tok.encode("12345")]
    assert "".join(pieces) == "12345"
    assert all(len(p) <= 1 for p in pieces)


def test_token_end_offsets_and_char_mapping(tok):
    text = "12+3=15\n15*2=30\n"
    ids = tok.encode(text)
    ends = tok.token_end_offsets(ids)
    assert ends[-1] == len(text) and ends == sorted(ends)
    first_step_end = text.index("\n") + 1
    i = char_to_token_index(ends, first_step_end)
    assert tok.decode(ids[: i + 1]) == text[:first_step_end]
    assert char_to_token_index(ends, 10_000) == len(ids) - 1


def test_save_load(tok, tmp_path):
    tok.save(tmp_path / "t.model")
    again = SentencePieceTokenizer.load(tmp_path / "t.model")
    assert again.encode("A: 42\n") == tok.encode("A: 42\n")


def test_empty_corpus_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        train_sentencepiece(["", "  "], vocab_size=32)


# The characters of the corpus, plus what a prompt may carry that the corpus never had.
_ALPHABET = list("Q: 0123456789+-*=?\nA") + ["  ", "\n\n", "x", "é", "☃"]


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(_ALPHABET), max_size=40).map("".join))
def test_hf_backend_encodes_as_sentencepiece(tok, text):
    """The tokenizer.json an export writes (`hf_backend`) gives sentencepiece's ids on any
    text over the corpus' characters, odd spacing, unknown characters and leading newlines."""
    assert _backend(tok).encode(text, add_special_tokens=False).ids == tok.encode(text)


def _backend(tok, cache={}):
    if id(tok) not in cache:
        cache[id(tok)] = tok.hf_backend()
    return cache[id(tok)]


def test_hf_backend_reads_special_token_text_as_transformers_does(tok):
    """The one known difference: "<s>" written in the text is the BOS id for transformers
    (its special tokens are matched in text), pieces for sentencepiece (never matched)."""
    assert _backend(tok).encode("<s>Q", add_special_tokens=False).ids[0] == tok.bos_id
    assert tok.encode("<s>Q")[0] != tok.bos_id


def test_hf_backend_adds_bos_and_refuses_what_it_cannot_repeat(tok):
    assert tok.hf_backend().encode("Q: 1").ids == tok.encode("Q: 1", add_bos=True)
    unigram = train_sentencepiece(["Q: 1+2=3\nA: 3\n"] * 50, vocab_size=20, model_type="unigram")
    with pytest.raises(ValueError, match="only sentencepiece BPE models convert to tokenizer.json; this one is UNIGRAM"):
        unigram.hf_backend()
