"""The Tunix benchmark's pure parts and its wiring into run_all, without Tunix installed."""

import argparse
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

SMOLLM2_HF = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
              "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None, "tie_word_embeddings": True,
              "attention_bias": False, "mlp_bias": False}


@pytest.fixture
def bench(benchmark_module):
    return benchmark_module("bench_tunix"), benchmark_module("run_all")


def test_logit_check_passes_close_logits_and_refuses_wrong_ones(bench):
    bt, _ = bench
    ref = np.random.default_rng(0).normal(size=(2, 5, 7)).astype(np.float32)
    assert bt.logit_max_abs_diff(ref + 1e-4, ref) == pytest.approx(1e-4, rel=1e-2)
    wrong = ref.copy()
    wrong[1, 3, 2] += 11.5  # the size of the error an unpatched RoPE theta gives
    with pytest.raises(bt.LogitCheckFailed, match="refusing to time") as failed:
        bt.logit_max_abs_diff(wrong, ref)
    assert failed.value.diff == pytest.approx(11.5, rel=1e-5)  # reported, not just refused
    nan = ref.copy()
    nan[0, 0, 0] = np.nan
    with pytest.raises(bt.LogitCheckFailed):
        bt.logit_max_abs_diff(nan, ref)
    with pytest.raises(bt.LogitCheckFailed, match="shape"):
        bt.logit_max_abs_diff(ref[:, :4], ref)


def test_tunix_config_from_hf_keeps_theta_and_refuses_what_tunix_lacks(bench):
    bt, _ = bench
    f = bt.tunix_llama_fields(SMOLLM2_HF)
    assert f["rope_theta"] == 1e5 and f["weight_tying"] is True
    assert (f["num_heads"], f["num_kv_heads"], f["head_dim"], f["hidden_dim"]) == (9, 3, 64, 1536)
    with pytest.raises(ValueError, match="rope_scaling"):
        bt.tunix_llama_fields(dict(SMOLLM2_HF, rope_scaling={"type": "llama3", "factor": 8.0}))
    with pytest.raises(ValueError, match="silu"):
        bt.tunix_llama_fields(dict(SMOLLM2_HF, hidden_act="gelu"))


def test_lookup_tokenizer_adds_no_bos_and_knows_only_its_prompts(bench):
    bt, _ = bench
    tok = bt.FixedIdsTokenizer(["a b", "c"], [[5, 6], [7]])
    assert tok.encode("a b") == [5, 6] and not tok.bos_id()
    with pytest.raises(KeyError):
        tok.encode("unknown")


def test_run_all_compares_with_tunix_and_skips_without_its_venv(bench, monkeypatch, tmp_path):
    _, run_all = bench
    # The ratio is of the two sides timed in the Tunix benchmark's process, not of the
    # rollout benchmark's ours (another process, minutes earlier).
    results = {"decode_ratio_batch": 32, "decode_tokens_per_s_ours_b32": 1000.0,
               "tunix_ours_decode_tokens_per_s_b32": 400.0, "tunix_decode_tokens_per_s_b32": 150.0,
               "tunix_ours_prefill_tokens_per_s_b32": 900.0, "tunix_prefill_tokens_per_s_b32": 1000.0}
    rows, targets = run_all.summary_rows(results)
    row = next(r for r in rows if "vs Tunix" in r[0] and "decode" in r[0])
    assert row[3] == "2.67×" and row[5] == "**met**"
    assert row[1].startswith("400") and row[2].startswith("150")
    assert targets["decode_ratio_vs_tunix_b{b}"]["met"]
    assert results["prefill_ratio_vs_tunix_b32"] == pytest.approx(0.9)
    results = {"grpo_step_seconds_ours": 10.0, "grpo_step_seconds_tunix": 25.0}
    run_all.summary_rows(results)
    assert results["grpo_step_speedup_vs_tunix"] == pytest.approx(2.5)  # Tunix seconds / ours
    rows, _ = run_all.summary_rows({"decode_ratio_batch": 32, "decode_tokens_per_s_ours_b32": 400.0,
                                    "tunix_decode_tokens_per_s_b32": 150.0})
    assert next(r for r in rows if "vs Tunix" in r[0] and "decode" in r[0])[5] == "not measured"

    missing = tmp_path / "no-venv" / "bin" / "python"
    monkeypatch.setitem(run_all.OTHER_VENV, "tunix", (missing, "`make tunix-env`"))
    args = argparse.Namespace(quick=True, timeout=5, out_dir=str(tmp_path))
    run = run_all.run_one("tunix", "bench_tunix.py", {}, args, tmp_path)
    assert run["ok"] and run["returncode"] == "skipped" and "make tunix-env" in run["skipped"]
    assert run_all.status(run) == "skipped (venv missing)"


def test_paired_decode_ratios_are_rep_by_rep(bench):
    bt, _ = bench
    # decode seconds per rep: ours 1, 2, 4; Tunix 3, 3, 3 -> ratios 3, 1.5, 0.75.
    ours = {"t1_samples": [1.0, 1.0, 1.0], "tn_samples": [2.0, 3.0, 5.0]}
    tunix = {"t1_samples": [2.0, 2.0, 2.0], "tn_samples": [5.0, 5.0, 5.0]}
    r = bt.paired_decode_ratios(ours, tunix)
    assert (r["min"], r["median"], r["max"]) == pytest.approx((0.75, 1.5, 3.0))


def _pins(path: Path) -> dict:
    lines = (ln.split("#")[0].strip() for ln in path.read_text().splitlines())
    return dict(ln.lower().split("==", 1) for ln in lines if "==" in ln)


def test_tunix_venv_pins_what_our_sampler_needs_at_our_versions():
    # bench_tunix times our sampler inside Tunix's venv: the compiler and the libraries our
    # package imports must be the project's own, or the paired ratio compares other code.
    ours, tunix = _pins(BENCH.parent / "requirements.txt"), _pins(BENCH / "requirements-tunix.txt")
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex"):
        assert tunix.get(name) == ours[name], name
    assert "toolz" in tunix  # chex's one dependency Tunix does not bring
