"""Tokenizers: one small interface for the tiny model's sentencepiece and imported BPE vocabularies.

The RL loop needs four things from a tokenizer: ids for a prompt, text for a completion,
the special ids (bos/eos/pad, stop tokens), and where each token ends in the text — the
last one maps a process-supervision step that ends at character c to the token index
where that step ends.
"""

from __future__ import annotations

import io
import os
from typing import Iterable, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_end_offsets(self, ids: Sequence[int]) -> list[int]:
        """For each id, the length of `decode(ids[:i+1])`: the character where token i ends."""
        ...

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str: ...

    @property
    def stop_ids(self) -> list[int]: ...


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of a prompt's text (the one way prompts are encoded: trainer, sampler callers,
    evaluation). BOS only where the tokenizer says its model was trained with one
    (`tokenizer.add_bos`; a tokenizer that does not say gets none): SmolLM2's ChatML prompts
    already start with their own `<|im_start|>`, the tiny sentencepiece model wants BOS."""
    return tokenizer.encode(text, add_bos=bool(getattr(tokenizer, "add_bos", False)))


def char_to_token_index(end_offsets: Sequence[int], char_end: int) -> int:
    """Index of the token that contains character `char_end - 1` (the token a step ends on).
    Offsets past the end map to the last token."""
    for i, end in enumerate(end_offsets):
        if end >= char_end:
            return i
    return len(end_offsets) - 1


class SentencePieceTokenizer:
    """A sentencepiece model with ids 0=pad, 1=bos, 2=eos, 3=unk. No chat template: the
    tiny model's prompts are plain text (`apply_chat_template` joins message contents)."""

    def __init__(self, model_proto: bytes):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.model_proto = model_proto  # the serialised model: what `save` writes
        self.vocab_size = self._sp.get_piece_size()
        self.pad_id, self.bos_id, self.eos_id = self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id()
        self.add_bos = True

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
        with open(path, "rb") as f:
            return cls(f.read())

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "wb") as f:
            f.write(self.model_proto)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = self._sp.encode(text)
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        specials = {self.pad_id, self.bos_id, self.eos_id}
        return self._sp.decode([int(i) for i in ids if int(i) not in specials])

    def token_end_offsets(self, ids: Sequence[int]) -> list[int]:
        return [len(self.decode(ids[: i + 1])) for i in range(len(ids))]

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)

    @property
    def stop_ids(self) -> list[int]:
        return [self.eos_id]


def train_sentencepiece(corpus: Iterable[str], vocab_size: int, *, model_type: str = "bpe",
                        user_symbols: Sequence[str] = ()) -> SentencePieceTokenizer:
    """Train a tokenizer on generated text (the tiny model's vocabulary).

    Digits are split so that every number is spelled digit by digit: arithmetic stays
    learnable for a small model. Newlines are kept as a user symbol because the tasks use
    them to end steps.
    """
    import sentencepiece as spm

    lines = [line for text in corpus for line in text.split("\n") if line.strip()]
    if not lines:
        raise ValueError("train_sentencepiece: the corpus is empty")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, split_digits=True,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, byte_fallback=False,
        user_defined_symbols=["\n", *user_symbols], normalization_rule_name="identity",
        remove_extra_whitespaces=False, hard_vocab_limit=False, num_threads=1,
        minloglevel=2)
    return SentencePieceTokenizer(buf.getvalue())
