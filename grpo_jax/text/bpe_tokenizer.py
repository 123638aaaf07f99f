"""Byte-level BPE tokenizers of imported models (GGUF metadata or an HF `tokenizer.json`).

`BPETokenizer` implements the `grpo_jax.text.tokenizer.Tokenizer` protocol on top of the
`tokenizers` library (the BPE merge loop runs in Rust). It is built either from a GGUF
file's `tokenizer.ggml.*` metadata (vocabulary in the GPT-2 byte alphabet, merges,
token types, special ids, pre-tokenizer name) or from a Hugging Face folder
(`tokenizer.json` + `tokenizer_config.json`), and saves itself as such a folder, so an
exported model's tokenizer loads in transformers too.

Chat formatting renders the model's own Jinja chat template (`tokenizer.chat_template` in
GGUF metadata, `chat_template` in tokenizer_config.json or chat_template.jinja) in
`grpo_jax.text.chat_templates`' bounded sandbox, as transformers renders it. A model without a
template has none: asking it for a chat prompt stops with one line, unless the user names a
format (`with_chat_format`: chatml, deepseek or plain), which then is the template used and
exported.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from grpo_jax.text import chat_templates
from grpo_jax.errors import PretrainedError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# How llama.cpp's `tokenizer.ggml.pre` names split text before BPE. "bytelevel" is the
# GPT-2 split built into tokenizers' ByteLevel pre-tokenizer.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": ("bytelevel",),
    "gpt2": ("bytelevel",),
    "gpt-2": ("bytelevel",),
    "smollm": ("digits", "bytelevel"),  # every digit its own piece, then the GPT-2 split
    "starcoder": ("digits", "bytelevel"),
    "llama3": ("split:llama3",),
    "llama-v3": ("split:llama3",),
    "llama-bpe": ("split:llama3",),
    "qwen2": ("split:qwen2",),
}
_SPLITS = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


class TokenizerError(PretrainedError):
    """A tokenizer description that cannot be used (names the field at fault)."""


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map.

    Bytes that are visible Latin-1 characters ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for
    themselves; the other 68 bytes (space, control characters, ...) are given the code
    points 256, 257, ... in byte order. A space is thus 'Ġ' (U+0120), a newline 'Ċ'.
    """
    visible = [b for b in range(256)
               if ord("!") <= b <= ord("~") or ord("¡") <= b <= ord("¬") or ord("®") <= b <= ord("ÿ")]
    table = {b: chr(b) for b in visible}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _build_pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind not in _PRE_TOKENIZERS:
        raise TokenizerError(
            f"tokenizer.ggml.pre={kind!r} is not supported; known pre-tokenizers: "
            f"{sorted(_PRE_TOKENIZERS)}")
    steps = []
    for step in _PRE_TOKENIZERS[kind]:
        if step == "digits":
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        elif step == "bytelevel":
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps.append(pre_tokenizers.Split(Regex(_SPLITS[step.split(":")[1]]), behavior="isolated"))
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _token_content(entry: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or {"content": ...}."""
    if entry is None:
        return None
    if isinstance(entry, Mapping):
        return entry.get("content")
    return str(entry)


def default_system_message(chat_template: str | None) -> str | None:
    """The system message a ChatML template inserts when the conversation has none, read
    as a string literal of the form '<|im_start|>system\\n...<|im_end|>' in the template."""
    if not chat_template:
        return None
    m = re.search(r"""(['"])<\|im_start\|>system(?:\n|\\n)([^'"{}]*?)<\|im_end\|>""", chat_template)
    if m is None:
        return None
    return m.group(2).replace("\\n", "\n")


class BPETokenizer:
    """Byte-level BPE with special tokens and the model's chat template (see the module docstring).

    `encode` matches special-token strings in the text ('<|im_start|>' becomes id 1 for
    SmolLM2), as transformers does. `decode` drops special tokens unless asked not to, so
    a completion ending in '<|im_end|>' and padding decodes to its text alone.
    """

    def __init__(self, backend, *, bos_id: int, eos_id: int, pad_id: int | None = None,
                 chat_template: str | None = None, add_bos: bool = False,
                 extra_stop_ids: Sequence[int] = ()):
        self._tok = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = int(bos_id)
        self.eos_id = int(eos_id)
        self.pad_id = int(eos_id if pad_id is None else pad_id)
        self.add_bos = bool(add_bos)
        self._set_template(chat_template, "missing")
        self._extra_stop_ids = [int(i) for i in extra_stop_ids]
        spec = json.loads(backend.to_str())
        self._byte_level = _uses_byte_level(spec.get("decoder"))
        self._special_ids = {int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
        self._token_bytes: list[bytes] | None = None

    def _set_template(self, chat_template: str | None, without: str) -> None:
        # chat_format: "template" (rendered in the sandbox), "plain" (the user named the plain
        # format: prompts are plain text) or "missing" (no template and no format named: a
        # chat prompt is refused rather than guessed).
        self.chat_template = chat_template or None
        self.chat_format = "template" if self.chat_template else without
        self.default_system = default_system_message(self.chat_template)

    def with_chat_format(self, name: str) -> "BPETokenizer":
        """A copy that formats conversations in the named format (chat_templates.FORMATS)
        in place of the model's own template: what a user names for a model that has no
        usable template. The named template is the one exported with the model."""
        import copy

        other = copy.copy(self)
        other._set_template(chat_templates.template_of(name), "plain")
        return other

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, path_or_reader) -> "BPETokenizer":
        """From a GGUF file (path or an open `gguf.GGUFReader`)."""
        import gguf

        reader = gguf.GGUFReader(str(path_or_reader)) if isinstance(path_or_reader, (str, os.PathLike)) else path_or_reader
        meta = {}
        for name, field in reader.fields.items():
            if name.startswith("tokenizer."):
                meta[name] = field.contents()
        return cls.from_gguf_metadata(meta)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "BPETokenizer":
        """From the `tokenizer.*` GGUF metadata as a dict of plain Python values."""
        from tokenizers import AddedToken, Tokenizer, decoders, models

        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"tokenizer.ggml.model={model!r} is not supported: only byte-level BPE ('gpt2') "
                f"vocabularies can be imported")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
            if key not in meta:
                raise TokenizerError(f"GGUF metadata has no {key}")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        merges = []
        for m in meta["tokenizer.ggml.merges"]:
            left, sep, right = m.partition(" ")
            if not sep:
                raise TokenizerError(f"tokenizer.ggml.merges entry {m!r} is not 'left right'")
            merges.append((left, right))
        pre = meta.get("tokenizer.ggml.pre", "default")
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                       ignore_merges=_PRE_TOKENIZERS.get(pre, ("",))[0] == "split:llama3"))
        backend.pre_tokenizer = _build_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        alphabet = set(byte_alphabet().values())
        specials = [AddedToken(t, special=True, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL and set(t) <= alphabet]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == _GGUF_USER_DEFINED]
        if specials:
            backend.add_special_tokens(specials)
        if user:
            backend.add_tokens(user)
        eos = int(meta["tokenizer.ggml.eos_token_id"])
        bos = int(meta.get("tokenizer.ggml.bos_token_id", eos))
        pad = meta.get("tokenizer.ggml.padding_token_id")
        # llama.cpp's end of turn (Llama-3's <|eot_id|>) ends a chat reply as eos does.
        eot = meta.get("tokenizer.ggml.eot_token_id")
        return cls(backend, bos_id=bos, eos_id=eos, pad_id=None if pad is None else int(pad),
                   chat_template=meta.get("tokenizer.chat_template"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   extra_stop_ids=() if eot is None else (int(eot),))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "BPETokenizer":
        """From a Hugging Face folder: tokenizer.json, tokenizer_config.json (special
        tokens, chat_template), optionally chat_template.jinja and generation_config.json."""
        from tokenizers import Tokenizer

        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise TokenizerError(f"{path} has no tokenizer.json")
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        conf: dict = {}
        if (path / "tokenizer_config.json").exists():
            conf = json.loads((path / "tokenizer_config.json").read_text())
        template = conf.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()

        def token_id(key: str) -> int | None:
            content = _token_content(conf.get(key))
            if content is None:
                return None
            tid = backend.token_to_id(content)
            if tid is None:
                raise TokenizerError(f"tokenizer_config.json {key}={content!r} is not in the vocabulary")
            return tid

        eos, bos, pad = token_id("eos_token"), token_id("bos_token"), token_id("pad_token")
        extra_stops: list[int] = []
        if (path / "generation_config.json").exists():
            gen = json.loads((path / "generation_config.json").read_text())
            ids = gen.get("eos_token_id")
            ids = [ids] if isinstance(ids, int) else list(ids or [])
            if eos is None and ids:
                eos = ids[0]
            extra_stops = ids
        if eos is None:
            raise TokenizerError(f"{path}: no eos_token in tokenizer_config.json or generation_config.json")
        return cls(backend, bos_id=eos if bos is None else bos, eos_id=eos, pad_id=pad,
                   chat_template=template, add_bos=bool(conf.get("add_bos_token", False)),
                   extra_stop_ids=extra_stops)

    load = from_hf_dir

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json + tokenizer_config.json (loadable by `from_hf_dir` and by
        transformers' AutoTokenizer)."""
        from tokenizers import Tokenizer, processors

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        backend = self._tok
        if self.add_bos:
            # transformers adds BOS from tokenizer.json's post-processor, not from the config's
            # add_bos_token: write it there, so `tokenizer(text)` starts as our encode_prompt does.
            backend = Tokenizer.from_str(self._tok.to_str())
            bos = self._tok.id_to_token(self.bos_id)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)])
        backend.save(str(path / "tokenizer.json"))
        conf = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._tok.id_to_token(self.bos_id),
            "eos_token": self._tok.id_to_token(self.eos_id),
            "pad_token": self._tok.id_to_token(self.pad_id),
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template:
            conf["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False))

    # ------------------------------------------------------------------ the protocol

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Ids of `text`, special-token strings matched. With `add_bos`, BOS goes first
        unless the text already starts with it: a template that writes `{{ bos_token }}`
        (Llama-3's, DeepSeek's) gives one BOS, as transformers' apply_chat_template does."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if add_bos and ids[:1] != [self.bos_id] else ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_end_offsets(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> list[int]:
        """For each token, the number of characters of `decode(ids)` it has completed.

        A token that ends inside a multi-byte character (byte-level BPE splits emoji and
        CJK characters over tokens) gets the offset before that character; the token that
        completes it gets the offset after. The last offset is len(decode(ids)).
        """
        ids = [int(i) for i in ids]
        if not ids:
            return []
        if not self._byte_level:
            texts = self._tok.decode_batch([ids[: i + 1] for i in range(len(ids))],
                                           skip_special_tokens=skip_special_tokens)
            return [len(t) for t in texts]
        table = self.bytes_table()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out, n = [], 0
        for i, tid in enumerate(ids):
            if skip_special_tokens and tid in self._special_ids:
                chunk = b""
            else:
                chunk = table[tid] if 0 <= tid < len(table) else b""
            n += len(decoder.decode(chunk, final=i == len(ids) - 1))
            out.append(n)
        return out

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        """The chat template rendered for `messages` ({"role", "content"} dicts), the text
        transformers' `apply_chat_template(..., tokenize=False)` gives. "plain" (a format the
        user named) joins the contents; a tokenizer without a template refuses."""
        if self.chat_format == "plain":
            return "".join(m["content"] for m in messages)
        formats = (f"(run.chat_format= or grpo-evaluate --chat-format: "
                   f"{', '.join(sorted(chat_templates.FORMATS))})")
        if self.chat_format == "missing":
            raise chat_templates.ChatTemplateError(
                f"this model has no chat template: name a chat format to prompt it with {formats}")
        try:
            return chat_templates.render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                         special_tokens=self.special_token_strings())
        except chat_templates.ChatTemplateError as e:
            raise chat_templates.ChatTemplateError(f"{e}; a model whose template cannot be used can be "
                                                   f"prompted in a named chat format {formats}") from None

    def special_token_strings(self) -> dict[str, str | None]:
        """bos/eos/pad as the strings a template reads (`{{ bos_token }}`)."""
        return {"bos_token": self._tok.id_to_token(self.bos_id), "eos_token": self._tok.id_to_token(self.eos_id),
                "pad_token": self._tok.id_to_token(self.pad_id)}

    @property
    def stop_ids(self) -> list[int]:
        """eos, ChatML's end of turn (when the template writes it), a GGUF's end-of-turn id
        and any extra eos ids of generation_config.json."""
        stops = [self.eos_id]
        if IM_END in (self.chat_template or ""):
            im_end = self._tok.token_to_id(IM_END)
            if im_end is not None:
                stops.append(im_end)
        stops.extend(self._extra_stop_ids)
        return list(dict.fromkeys(stops))

    # ------------------------------------------------------------------ helpers

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, tid: int) -> str | None:
        return self._tok.id_to_token(int(tid))

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def bytes_table(self) -> list[bytes]:
        """Bytes of every id: the byte-alphabet spelling undone; added tokens verbatim."""
        if self._token_bytes is None:
            inverse = {c: b for b, c in byte_alphabet().items()}
            size = self._tok.get_vocab_size(with_added_tokens=True)
            added = {int(k): v.content for k, v in self._tok.get_added_tokens_decoder().items()}
            table = []
            for tid in range(size):
                if tid in added:
                    table.append(added[tid].encode("utf-8"))
                    continue
                piece = self._tok.id_to_token(tid) or ""
                if all(ch in inverse for ch in piece):
                    table.append(bytes(inverse[ch] for ch in piece))
                else:
                    table.append(piece.encode("utf-8"))
            self._token_bytes = table
        return self._token_bytes


def _uses_byte_level(decoder_spec: Any) -> bool:
    if not decoder_spec:
        return False
    if decoder_spec.get("type") == "ByteLevel":
        return True
    if decoder_spec.get("type") == "Sequence":
        return any(_uses_byte_level(d) for d in decoder_spec.get("decoders", []))
    return False
