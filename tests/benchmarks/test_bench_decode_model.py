"""decode_model.py: the decode step's bytes and FLOPs per engine, against counts made by hand for
cpu-tiny's shape (2 layers, E 128, 4 heads x 32, 2 kv heads, MLP 384, vocab 512, tied)."""

import jax
import pytest

from grpo_jax.config import cpu_tiny
from grpo_jax.model import transformer as model_lib
from grpo_jax.sampler.cache import decode_windows

# 2 questions x 4 rows, 16 prompt slots, 100 new tokens: completion bucket 128, 4 phases of 32
# slots; steps 1 … 99 run 32, 32, 32 and 3 steps in the windows 32, 64, 96, 128 (from slot 0).
Q, G, P, N = 2, 4, 16, 100
B, V, E = 8, 512, 128
SLOT = 2 * 2 * 2 * 32 * 2  # layers x (k, v) x kv heads x head_dim x bf16
OWN = (32 * 32 + 32 * 64 + 32 * 96 + 3 * 128) / 99  # mean completion window of a step
ATTENTION = 4 * 2 * 4 * 32  # FLOPs per attended slot per row: 4 x layers x heads x head_dim
LAYER_WEIGHTS = 2 * (128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384)  # 2 layers: q, k, v, o, MLP


@pytest.fixture
def dm(benchmark_module):
    return benchmark_module("decode_model")


def step(dm, engine, **kw):
    return dm.decode_step(cpu_tiny().model, engine, questions=Q, group=G, prompt=P, new_tokens=N, **kw)


def test_the_phases_assumed_are_the_samplers():
    assert decode_windows(0, 128, 4) == (32, 64, 96, 128)
    assert decode_windows(P, 128, 4) == (48, 80, 112, 144)


def test_weight_bytes_read_per_decode_step_are_the_sampling_copys_bytes(dm):
    m = cpu_tiny().model  # tied: the step reads every parameter
    params = model_lib.param_shapes(m)
    assert dm.weight_read_bytes(m, 4) == 4 * sum(x.size for x in jax.tree.leaves(params))
    untied = m.__class__(**{**vars(m), "tie_embeddings": False})
    params = model_lib.param_shapes(untied)
    assert dm.weight_read_bytes(untied, 2) == 2 * (sum(x.size for x in jax.tree.leaves(params))
                                                   - untied.vocab_size * untied.embed_dim)


def test_decode_floor_by_hand(dm):
    m = cpu_tiny().model
    slot = 2 * 2 * 2 * 32 * 4  # float32
    f = dm.decode_floor(m, questions=2, group=4, prompt=16, new_tokens=8, weight_bytes=1000,
                        kv_itemsize=4, hbm_bandwidth=1e9)
    assert f["kv_bytes_per_slot"] == slot
    assert f["per_row"]["bytes_per_step"] == 1000 + 8 * (16 + 4) * slot
    assert f["shared_prompt"]["bytes_per_step"] == 1000 + (2 * 16 + 8 * 4) * slot
    assert f["per_row"]["tokens_per_s"] == pytest.approx(8 / (f["per_row"]["bytes_per_step"] / 1e9))


def test_parts_common_to_every_engine(dm):
    weights = 2 * sum(x.size for x in jax.tree.leaves(model_lib.param_shapes(cpu_tiny().model)))
    for engine in dm.ENGINES:
        s = step(dm, engine)
        assert s["rows"] == B
        assert s["bytes"]["weights"] == weights
        assert s["bytes"]["embedding"] == B * E * 2
        assert s["flops"]["weights"] == 2 * B * LAYER_WEIGHTS
        assert s["flops"]["logits"] == 2 * B * E * V + 6 * B * V
        assert s["bytes_total"] == pytest.approx(sum(s["bytes"].values()))
        assert s["flops_total"] == pytest.approx(sum(s["flops"].values()))


def test_scan_and_unrolled_read_the_whole_cache_every_step(dm):
    for engine in ("scan", "unrolled"):
        s = step(dm, engine)
        assert s["attended_slots"] == P + 128
        assert s["bytes"]["kv_read"] == B * (P + 128) * SLOT
        assert s["bytes"]["cache_update"] == B * SLOT
        assert s["bytes"]["logits"] == 4 * B * V * (1 + 3)  # written once, read by 3 reductions
        assert s["flops"]["kv_read"] == ATTENTION * B * (P + 128)


def test_shared_reads_each_prompt_once_and_its_phase_window(dm):
    s = step(dm, "shared")
    assert s["attended_slots"] == pytest.approx(P + OWN)
    assert s["bytes"]["kv_read"] == pytest.approx((Q * P + B * OWN) * SLOT)
    growth = 32 + (32 + 64) + (64 + 96) + (96 + 128)  # zeros written, then each growth's read + write
    assert s["bytes"]["cache_update"] == pytest.approx(B * (1 + growth / 99) * SLOT)
    assert s["flops"]["kv_read"] == pytest.approx(ATTENTION * B * (P + OWN))
    # Between the floor (only the filled slots) and the engines that read the whole cache.
    floor = dm.decode_floor(cpu_tiny().model, questions=Q, group=G, prompt=P, new_tokens=N, weight_bytes=0,
                            kv_itemsize=2, hbm_bandwidth=1.0)["shared_prompt"]["bytes_per_step"]
    assert floor < s["bytes"]["kv_read"] < step(dm, "unrolled")["bytes"]["kv_read"]


def test_feature_major_reads_its_rows_phase_window_prompt_included(dm):
    s = step(dm, "feature_major")
    assert s["attended_slots"] == pytest.approx(P + OWN)
    assert s["bytes"]["kv_read"] == pytest.approx(B * (P + OWN) * SLOT)
    growth = (48 + 80) + (80 + 112) + (112 + 144)  # the prefill hands it the first window
    assert s["bytes"]["cache_update"] == pytest.approx(B * (1 + growth / 99) * SLOT)


def test_generate_rewrites_its_cache_and_copies_its_logits(dm):
    s = step(dm, "generate")
    mean = P + 50  # P + s, s = 1 … 99
    assert s["attended_slots"] == mean
    assert s["bytes"]["kv_read"] == B * mean * SLOT
    assert s["bytes"]["cache_update"] == B * (2 * mean - 1) * SLOT
    # bf16 logits written and read, a float32 copy written, softmax read + write, multinomial read
    assert s["bytes"]["logits"] == B * V * (2 + 2 + 4 + 4 + 4 + 4)


def test_the_step_takes_the_larger_bound(dm):
    s = step(dm, "shared")
    assert dm.step_seconds(s, hbm_bandwidth=1e9, peak_flops=1e30) == s["bytes_total"] / 1e9
    assert dm.step_seconds(s, hbm_bandwidth=1e30, peak_flops=1e9) == s["flops_total"] / 1e9
    with pytest.raises(ValueError, match="engine"):
        step(dm, "paged")


def test_the_table_of_the_gpu_shapes(dm):
    lines = dm.table()
    assert len(lines) == 2 + 2 * len(dm.ENGINES)
    qwen_shared = next(line for line in lines if line.startswith("| qwen2.5-1.5b | shared |"))
    cells = [c.strip() for c in qwen_shared.strip("|").split("|")]
    # bf16 weights: qwen2.5-1.5b's 1,543,714,304 parameters (tied), plus 256 rows' embeddings
    assert cells[2] == f"{(2 * 1_543_714_304 + 256 * 1536 * 2) / 1e6:,.0f}"
    assert "memory" in cells[9] and "CPU only" in next(line for line in lines if "feature_major" in line)
