"""Tokenizers: one small interface for the tiny model's sentencepiece and imported BPE vocabularies.

The RL loop needs four things from a tokenizer: ids for a prompt, text for a completion,
the special ids (bos/eos/pad, stop tokens), and where each token ends in the text — the
last one maps a process-supervision step that ends at character c to the token index
where that step ends.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
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

    def save_hf(self, path: str | os.PathLike) -> None:
        """Write what transformers needs to encode as this tokenizer does: tokenizer.json (the
        same pieces and merges as a `tokenizers` BPE, `hf_backend`), tokenizer_config.json
        (bos/eos/pad/unk, BOS added) with `PLAIN_CHAT_TEMPLATE`, and tokenizer.model itself
        (what grpo_jax reads back: the run's tokenizer exactly)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.hf_backend().save(str(path / "tokenizer.json"))
        piece = self._sp.id_to_piece
        conf = {"tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": piece(self.bos_id), "eos_token": piece(self.eos_id),
                "pad_token": piece(self.pad_id), "unk_token": piece(self._sp.unk_id()),
                "add_bos_token": self.add_bos, "add_eos_token": False,
                "clean_up_tokenization_spaces": False, "chat_template": PLAIN_CHAT_TEMPLATE}
        (path / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False))
        self.save(path / "tokenizer.model")

    def hf_backend(self):
        """This model as a `tokenizers.Tokenizer` that gives the same ids (what transformers
        loads from tokenizer.json).

        sentencepiece's BPE merges the adjacent pair whose merged piece scores highest; the
        `tokenizers` BPE merges the pair of lowest rank: ranking every (left, right) split of
        a piece by the piece's score gives the same merges. Its text handling maps to a
        normalizer (the dummy prefix "▁" on the whole text, spaces as "▁") and a
        pre-tokenizer: split before each "▁" (sentencepiece's words), around user symbols
        ("\n": isolated, as sentencepiece matches them first) and between digits
        (split_digits). User symbols are not added tokens: transformers would give the text
        after a leading "\n" no dummy prefix, where sentencepiece gives the whole text one.
        Runs of unknown characters fuse into one <unk>, as sentencepiece's do. One difference
        remains, transformers' convention: the text "<s>" is read as the BOS token, where
        sentencepiece never matches control symbols in text."""
        from sentencepiece import sentencepiece_model_pb2
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self.model_proto)
        spec, norm = proto.trainer_spec, proto.normalizer_spec
        if spec.model_type != spec.BPE:
            raise ValueError(f"only sentencepiece BPE models convert to tokenizer.json; this one is "
                             f"{spec.ModelType.Name(spec.model_type)}")
        if norm.name != "identity" or norm.remove_extra_whitespaces or not norm.add_dummy_prefix or spec.byte_fallback:
            raise ValueError("the sentencepiece model normalises text in a way tokenizer.json cannot repeat "
                             f"(normalizer {norm.name!r}, remove_extra_whitespaces={norm.remove_extra_whitespaces}, "
                             f"add_dummy_prefix={norm.add_dummy_prefix}, byte_fallback={spec.byte_fallback})")
        normal, user = proto.SentencePiece.NORMAL, proto.SentencePiece.USER_DEFINED
        pieces = list(proto.pieces)
        vocab = {p.piece: i for i, p in enumerate(pieces)}
        users = [p.piece for p in pieces if p.type == user]
        if any(len(u) != 1 for u in users):
            raise ValueError(f"user-defined symbols longer than one character do not convert: {users}")
        merges = []
        for i, p in enumerate(pieces):
            if p.type != normal:
                continue
            splits = [(p.piece[:k], p.piece[k:]) for k in range(1, len(p.piece))
                      if p.piece[:k] in vocab and p.piece[k:] in vocab]
            merges.extend((-p.score, i, vocab[l], vocab[r], l, r) for l, r in splits)
        merges.sort()
        unk = pieces[spec.unk_id].piece
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[(m[4], m[5]) for m in merges], unk_token=unk,
                                   fuse_unk=True, byte_fallback=False))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        pre = [pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)]
        if users:
            pre.append(pre_tokenizers.Split(Regex("|".join(re.escape(u) for u in users)), behavior="isolated"))
        if spec.split_digits:
            pre.append(pre_tokenizers.Digits(individual_digits=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        special = (proto.SentencePiece.CONTROL, proto.SentencePiece.UNKNOWN)
        tok.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                                for p in pieces if p.type in special])
        bos = pieces[self.bos_id].piece
        if self.add_bos:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)])
        return tok

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


# What the tiny model's `apply_chat_template` does (message contents joined), as the Jinja
# template transformers reads from an export; `{{ bos_token }}` because transformers'
# apply_chat_template(tokenize=True) adds no special tokens, and the run's prompts start with BOS.
PLAIN_CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


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
