"""benchmarks/common.py: how a machine is named in every benchmark report."""

import pytest

ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_vp2intersect

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: other
flags\t\t: fpu
"""

XEON = """processor\t: 0
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""


@pytest.fixture
def common(benchmark_module):
    return benchmark_module("common")


def test_cpu_description_names_family_and_model_of_the_first_processor(common):
    assert common.cpu_description(ZEN5, "x86_64") == ("AMD EPYC (family 26, model 2)", "avx2,fma,avx512f,avx512_bf16")
    name, flags = common.cpu_description(XEON, "x86_64")
    assert name == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (family 6, model 143)"
    assert flags == "avx2,fma,avx512f,avx512_bf16,amx_tile,amx_bf16"


def test_cpu_description_falls_back_without_cpuinfo_fields(common):
    assert common.cpu_description("", "aarch64") == ("aarch64", "")
    assert common.cpu_description("model name\t: Some CPU\n", "x86_64") == ("Some CPU", "")


def test_decode_rate_spread_is_per_rep_and_skips_reps_without_decode_time(common):
    rates = {"t1_samples": [1.0, 1.0, 2.0], "tn_samples": [3.0, 5.0, 2.0]}
    got = common.decode_rate_spread(rates, batch=4, new_tokens=9)
    assert got["samples"] == [pytest.approx(4 * 8 / 4), pytest.approx(4 * 8 / 2)]  # sorted; rep 3 dropped
    assert common.decode_rate_spread({"t1_samples": [2.0], "tn_samples": [1.0]}, 4, 9) is None


def test_decode_roofline_takes_the_larger_bound_and_the_serial_sum(common):
    from grpo_jax.config import get_preset

    cfg = get_preset("cpu-tiny").model  # tied embeddings, no attention bias
    e, f, h, kv, d, layers = 128, 384, 4, 2, 32, 2
    params = 512 * e + e + layers * (e * h * d + 2 * e * kv * d + h * d * e + 2 * e + 3 * e * f)
    batch, context = 4, 10
    step_bytes = 4 * params + 4 * batch * context * layers * 2 * kv * d
    step_flops = batch * (2 * params + layers * 4 * h * d * context)

    # Bandwidth 10x the FLOP rate in bytes: the arithmetic takes longer -> compute-bound.
    r = common.decode_roofline(cfg, batch, context, flops_per_s=1e9, bytes_per_s=1e10)
    assert (r["step_bytes"], r["step_flops"]) == (step_bytes, step_flops)
    assert r["bound"] == "compute"
    assert r["tokens_per_s"] == pytest.approx(batch / (step_flops / 1e9), rel=1e-12)
    assert r["serial_tokens_per_s"] == pytest.approx(batch / (step_flops / 1e9 + step_bytes / 1e10), rel=1e-12)

    r = common.decode_roofline(cfg, batch, context, flops_per_s=1e12, bytes_per_s=1e9)
    assert r["bound"] == "memory"
    assert r["tokens_per_s"] == pytest.approx(batch / (step_bytes / 1e9), rel=1e-12)
    # Never overlapped, the step is slower than either bound alone, and at most twice the larger.
    assert r["tokens_per_s"] / 2 <= r["serial_tokens_per_s"] < r["tokens_per_s"]
