"""bench_accelerator.py: its counts against independent ones, and its tiny run's report
(the JSON's numbers are the table's, MFU is FLOPs / time / peak, both sides ran the same tokens)."""

import contextlib
import io
import json

import jax
import numpy as np
import pytest

from grpo_jax import aot
from grpo_jax.model import transformer as model_lib
from grpo_jax.config import cpu_tiny

from tests.scripts import BENCHMARKS, import_script


@pytest.fixture
def bench(benchmark_module):
    return benchmark_module("bench_accelerator")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One --tiny run of every part in this process: (report, printed text)."""
    path = tmp_path_factory.mktemp("bench_accelerator") / "report.json"
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        code = import_script(mp, BENCHMARKS, "bench_accelerator").main(
            ["--tiny", "--in-process", "--threads", "1", "--json", str(path)])
    assert code == 0, out.getvalue()
    return json.loads(path.read_text()), out.getvalue()


def test_matmul_weights_of_the_tiny_shape_by_hand(bench):
    m = cpu_tiny().model  # 2 layers, E 128, 4 heads x 32, 2 kv heads, MLP 384, vocab 512, tied
    assert (m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size) == (
        2, 128, 4, 2, 32, 384, 512)
    per_layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384  # q, k, v, o, gate/up/down
    assert per_layer == 196_608
    assert bench.matmul_weights(m) == 2 * 196_608 + 128 * 512 == 458_752
    assert bench.matmul_weights(m) == aot.matmul_params(m)
    # (6 + 2) N per token, 8 rows x (16 + 16) tokens
    assert bench.update_flops(m, 8, 16, 16, reference=True) == 8 * 458_752 * 256 == 939_524_096
    assert bench.update_flops(m, 8, 16, 16, reference=False) == 6 * 458_752 * 256


def test_matmul_weights_equal_the_peer_models_linear_weights(bench):
    """N counted a third way: the transformers model's projection and MLP weights plus the
    unembedding (tied: the embedding), here with q/k/v biases (Qwen2) and untied."""
    m = cpu_tiny().model
    import torch

    for shape in (m, m.__class__(**{**vars(m), "attention_bias": True, "tie_embeddings": False})):
        model = bench.hf_model(shape, torch.float32, "cpu")
        linear = sum(p.numel() for name, p in model.named_parameters()
                     if name.endswith("proj.weight") or name == "lm_head.weight")
        if shape.tie_embeddings:
            linear += model.get_input_embeddings().weight.numel()
        assert bench.matmul_weights(shape) == linear


@pytest.mark.parametrize("kind,flops,bandwidth", [
    ("NVIDIA H100 80GB HBM3", 989e12, 3.35e12), ("NVIDIA H100 PCIe", 756e12, 2.0e12),
    ("NVIDIA H200", 989e12, 4.8e12), ("NVIDIA A100-SXM4-80GB", 312e12, 2.039e12),
    ("TPU v5 lite", 197e12, 819e9), ("TPU v5p", 459e12, 2765e9), ("cpu", None, None)])
def test_device_peaks_by_kind_name_their_source(bench, kind, flops, bandwidth):
    f, b, source = bench.device_peaks(kind)
    assert (f, b) == (flops, bandwidth)
    assert bool(source) == (flops is not None)


def test_the_tiny_run_reports_mfu_as_flops_over_time_over_peak(tiny_run):
    report, _ = tiny_run
    peak = report["peaks"]["peak_flops"]
    assert peak > 0 and "measured in this run" in report["peaks"]["source"]
    for name in ("jax_update", "torch_update"):
        r = report["parts"][name]["result"]
        assert r["flops"] == 8 * report["model"]["matmul_weights"] * r["rows"] * (r["prompt"] + r["completion"])
        assert r["mfu"] == pytest.approx(r["flops"] / r["seconds"]["median"] / peak)
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"]["median"])
        assert np.isfinite(r["loss"]) and r["reference"]


def test_both_sides_ran_the_same_tokens(tiny_run):
    report, _ = tiny_run
    p = {k: v["result"] for k, v in report["parts"].items()}
    assert p["jax_update"]["tokens"] == p["torch_update"]["tokens"] == 8 * (16 + 16)
    assert p["jax_update"]["micro_batches"] == p["torch_update"]["micro_batches"]
    rows = p["jax_rollout"]["rows"]
    assert rows == p["torch_generate"]["rows"] == 2 * cpu_tiny().rl.group_size
    # every row decoded all N tokens (no stop token), on either side
    assert p["jax_rollout"]["generated_tokens"] == p["torch_generate"]["generated_tokens"] == rows * 8
    assert p["jax_rollout"]["decode_tokens"] == p["torch_generate"]["decode_tokens"] == rows * 7
    for r in (p["jax_rollout"], p["torch_generate"]):
        assert r["decode_tokens_per_s"] == pytest.approx(r["decode_tokens"] / r["decode_seconds"]["median"])
        floor = r["floor"]["shared_prompt"]["tokens_per_s"]
        assert r["of_shared_prompt_floor"] == pytest.approx(r["decode_tokens_per_s"] / floor)


def test_the_printed_table_shows_the_jsons_numbers(bench, tiny_run):
    report, text = tiny_run
    lines = [line for line in text.splitlines() if line.startswith("| update") or line.startswith("| decode")]
    assert len(lines) == 4
    cells = {(c[0], c[1]): c for c in ([x.strip() for x in line.strip("|").split("|")] for line in lines)}
    fmt = bench.common.fmt
    for name, key in (("jax_update", ("update", "ours")), ("torch_update", ("update", "HF + torch"))):
        r = report["parts"][name]["result"]
        row = cells[key]
        assert row[2].startswith(fmt(r["seconds"]["median"]))
        assert row[3] == f"{r['tokens']:,}" and row[4] == fmt(r["tokens_per_s"])
        assert row[5] == f"{100 * r['mfu']:.1f}%"
    for name, key in (("jax_rollout", ("decode", "ours")), ("torch_generate", ("decode", "HF + torch"))):
        r = report["parts"][name]["result"]
        row = cells[key]
        assert row[3] == f"{r['decode_tokens']:,}" and row[4] == fmt(r["decode_tokens_per_s"])
        assert row[6] == f"{fmt(r['of_shared_prompt_floor'])} / {fmt(r['of_per_row_floor'])}"
    ratio = report["ratios"]["update_peer_seconds_over_ours"]
    assert ratio == pytest.approx(report["parts"]["torch_update"]["result"]["seconds"]["median"]
                                  / report["parts"]["jax_update"]["result"]["seconds"]["median"])
    assert f"update_peer_seconds_over_ours: {ratio:.2f}x" in text


def test_peak_flops_override_and_a_variant_row(bench, tmp_path):
    path = tmp_path / "r.json"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = bench.main(["--tiny", "--in-process", "--parts", "jax_update", "--variant", "model.remat=full",
                           "--peak-flops", "1e12", "--reps", "1", "--threads", "1", "--profile", "--json", str(path)])
    assert code == 0, out.getvalue()
    report = json.loads(path.read_text())
    assert report["peaks"]["peak_flops"] == 1e12 and "--peak-flops" in report["peaks"]["source"]
    base, variant = report["parts"]["jax_update"]["result"], report["parts"]["jax_update model.remat=full"]["result"]
    assert base["settings"]["remat"] == "none" and variant["settings"]["remat"] == "full"
    for r in (base, variant):
        assert r["mfu"] == pytest.approx(r["flops"] / r["seconds"]["median"] / 1e12)
    assert "| update | ours, model.remat=full |" in out.getvalue()
    # --profile: the base update's (not the variant's) kernels, every table adding up to their time
    profile = base["profile"]
    assert variant["profile"] is None and profile["module"] == "jit_step"
    assert 0 < profile["matmul_ms"] < profile["kernel_ms"]
    for table in ("by_part", "by_phase"):
        assert sum(profile[table].values()) == pytest.approx(profile["kernel_ms"])
    assert any("layers/mlp" in r["op"] and "dot_general" in r["op"] for r in profile["top_ops"])
    assert "where our update's kernel time goes" in out.getvalue()


@pytest.mark.parametrize("engine", ["feature_major", "shared"])
def test_the_tiny_rollouts_decode_profile_is_split_by_part(bench, benchmark_module, tmp_path, engine):
    """--profile on our rollout: one more call under jax's profiler, its decode split by part of
    the step; every part the model's and the sampler's named scopes mark is found, whichever
    engine ran (shared is the GPU's), and the parts add up to the program's span."""
    profile_ops = benchmark_module("profile_ops")
    path = tmp_path / "r.json"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = bench.main(["--tiny", "--in-process", "--parts", "jax_rollout", "--profile", "--reps", "1",
                           "--threads", "1", "--json", str(path), f"rl.decode={engine}"])
    assert code == 0, out.getvalue()
    r = json.loads(path.read_text())["parts"]["jax_rollout"]["result"]
    profile = r["profile"]
    assert r["engine"] == engine and profile["module"] == "jit_decode"
    assert profile["steps"] == r["new_tokens"] - 1 == 7 and profile["events"] > 7
    parts = profile["by_part"]
    assert list(parts) == list(profile_ops.DECODE_PARTS)
    assert sum(parts.values()) == pytest.approx(profile["span_ms"])
    assert min(parts.values()) >= 0
    for part in ("embedding", "layers", "attention", "cache update", "unembedding", "sampling"):
        assert parts[part] > 0, part
    tops = profile["top_ops"]
    assert all("/attend/" in o["op"] for o in tops["attention"])
    assert all(o["op"].startswith("sample/") for o in tops["sampling"])
    assert any("mlp/" in o["op"] and "dot_general" in o["op"] for o in tops["layers"])
    assert "where our decode's time goes" in out.getvalue()
    # the modelled step of the engine that ran, beside the measurement
    assert r["modelled_step"]["engine"] == engine and r["of_modelled_step"] > 0


def test_a_profile_that_fails_is_reported_beside_the_timings(bench):
    """The profile runs after a part's timings: its failure is recorded, not the part's."""
    import jax.numpy as jnp

    def summarize(trace):
        raise ValueError(f"no events of jit_decode among {len(trace['traceEvents'])}")

    r = bench._profile(lambda: jnp.ones(2).block_until_ready(), summarize)
    assert list(r) == ["error"] and "ValueError: no events of jit_decode" in r["error"]
