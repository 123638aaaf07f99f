"""Sentencepiece training on generated text, the Tokenizer protocol, char→token mapping."""

import random

import pytest

from grpo_jax.tokenizer import SentencePieceTokenizer, Tokenizer, char_to_token_index, train_sentencepiece


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
