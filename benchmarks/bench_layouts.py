"""Decode-shaped matmuls in the two orientations the sampler can run them in, on this CPU.

The decode step multiplies B = 8-64 rows of activations by every weight matrix. Row-major
(`x [B, in] @ W [in, out]`, the model's own forward) and feature-major (`W [out, in] @
x [in, B]`, `grpo_jax/sampler/feature_major.py`, what the sampler runs on a single CPU device) do
the same arithmetic; which one XLA's CPU dots run faster depends on the CPU and its
kernels. This script times both on SmolLM2-135M's shapes, so that a new CPU can be
checked before trusting the sampler's choice (issue #20):

* **MLP**: 30 layers of SwiGLU (576 → 1536 → 576), each layer's weights a separate buffer
  as in the decode loop (so each is read from memory once per call, as in a decode step).
* **unembedding + softmax pass**: logits of the tied [49152, 576] embedding, then the max,
  exp and sum over the vocabulary that the token draw starts with; rows give [B, V]
  logits, feature-major [V, B].

* **MLP from memory and in cache**: the feature-major MLP of 30 distinct layers against the
  same chain with the first layer's weights in every layer (10.6 MB, kept in cache); the
  difference, read as the time to read 30 layers' weights, tells whether the dots overlap
  reading with arithmetic (a read rate near the streaming bandwidth: they do not).
* **decode attention**: one new token per row against 30 layers' KV caches of 192 slots
  (SmolLM2's 3 kv heads × 3 query heads × 64), in the two forms the feature-major step
  picks between by batch size: the model's two small dots per (row, kv head), and the
  scores as a summed product (`feature_major.attend_summed`, from
  `feature_major.SUMMED_SCORES_FROM` rows on). Speedup = dots / summed.
* **prefill in row chunks**: the sampler's prefill (`sampler.calls.programs`, SmolLM2's shapes,
  B prompts of 64 tokens) in one pass and, as it runs on a single CPU device, in chunks
  of at most `sampler.engines.PREFILL_CHUNK_TOKENS` tokens one after the other; tok/s. Where
  one pass gets slower per token as the batch grows, the chunks keep it level.

Random float32 weights (the values do not matter to the timing); reps interleaved, median
and range of the seconds per call after a warm-up. Speedup = row-major / feature-major.
A third column runs the feature-major products from bfloat16 weights as the sampler's bf16
copy does (`feature_major.dense`: bf16 operands, float32 sums): it tells whether
`rl.sample_dtype=bfloat16` pays on this CPU.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, NamedTuple

import common

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.model import transformer as model_lib
from grpo_jax.sampler import calls
from grpo_jax.sampler.engines import ENGINES, PREFILL_CHUNK_TOKENS
from grpo_jax.config import get_preset
from grpo_jax.sampler.feature_major import SUMMED_SCORES_FROM, attend_summed, dense

EMBED, MLP, VOCAB, LAYERS = 576, 1536, 49152, 30
KV_HEADS, GROUP, HEAD_DIM, SLOTS = 3, 3, 64, 192
PROMPT = 64


def _timer(fn, *args):
    def run() -> float:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - start
    return run


def _ms(s: dict) -> str:
    """`common.spread` of a summarize() dict of seconds, in milliseconds."""
    return common.spread({k: s[k] * 1e3 for k in ("median", "min", "max")})


def read_split(from_memory_s: float, in_cache_s: float, weight_bytes: int, flops: int) -> dict:
    """What a product chain's time from memory adds to the same chain with its weights in
    cache: the extra seconds, the rate at which it read its weights if that extra is all
    reading, and the in-cache arithmetic rate. Extra ≈ bytes / streaming rate means the
    kernel reads and computes one after the other, not overlapped."""
    extra = from_memory_s - in_cache_s
    return {"extra_s": extra, "read_bytes_per_s": weight_bytes / extra if extra > 0 else None,
            "in_cache_flops_per_s": flops / in_cache_s}


def mlp_programs(layers: int):
    def rows(x, ws):  # x [B, E]; ws: per layer (gate [E, F], up [E, F], down [F, E])
        for gate, up, down in ws:
            x = x + (jax.nn.silu(x @ gate) * (x @ up)) @ down
        return x

    def features(x, ws):  # x [E, B]; ws: per layer (gate [F, E], up [F, E], down [E, F])
        for gate, up, down in ws:
            x = x + down @ (jax.nn.silu(gate @ x) * (up @ x))
        return x

    def features_bf16(x, ws):  # the same, from bf16 weights (feature_major.dense)
        f32 = jnp.float32
        for gate, up, down in ws:
            x = x + dense(down, jax.nn.silu(dense(gate, x, f32)) * dense(up, x, f32), f32)
        return x
    return jax.jit(rows), jax.jit(features), jax.jit(features_bf16)


def unembed_programs():
    def rows(x, emb):  # x [B, E] -> [B, V]
        logits = jnp.einsum("be,ve->bv", x, emb)
        return jnp.log(jnp.sum(jnp.exp(logits - jnp.max(logits, -1, keepdims=True)), -1))

    def features(x, emb):  # x [E, B] -> [V, B]; emb float32 or (the bf16 column) bfloat16
        logits = dense(emb, x, jnp.float32)
        return jnp.log(jnp.sum(jnp.exp(logits - jnp.max(logits, 0, keepdims=True)), 0))
    return jax.jit(rows), jax.jit(features)


def attention_programs():
    def chain(attend):  # each layer's query depends on the last output, as in the decode loop
        def run(q, ks, vs, allowed):  # q [B, K, G, D]; ks [B, K, D, S], vs [B, K, S, D] per layer
            for k, v in zip(ks, vs):
                q = q + attend(q, k, v, allowed)
            return q
        return jax.jit(run)
    return chain(lambda q, k, v, a: model_lib.attend(q[:, None], k, v, a)[:, 0]), \
        chain(lambda q, k, v, a: attend_summed(q, k, v, a)[:, 0])


def attention_inputs(rng, b: int, layers: int):
    """Random q, per-layer caches and a mask with 2/3 of the slots allowed (slot 0 always)."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    ks = [normal(b, KV_HEADS, HEAD_DIM, SLOTS) for _ in range(layers)]
    vs = [normal(b, KV_HEADS, SLOTS, HEAD_DIM) for _ in range(layers)]
    allowed = jnp.asarray(rng.random((b, 1, SLOTS)) < 2 / 3).at[:, :, 0].set(True)
    return normal(b, KV_HEADS, GROUP, HEAD_DIM), ks, vs, allowed


def prefill_programs(cfg, params, prompt_tokens, prompt_mask, cache_len: int,
                     chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> dict:
    """{"one_pass", "chunked"}: the sampler's prefill for these prompts, compiled with the
    row chunks off (one chunk as large as the batch) and on (chunks of chunk_tokens)."""
    prefill, _ = calls.programs(cfg, None, ENGINES["feature_major"], "auto")
    return {name: prefill.lower(params, prompt_tokens, prompt_mask, None, cache_len=cache_len,
                                chunk_tokens=chunk).compile()
            for name, chunk in (("one_pass", prompt_tokens.size), ("chunked", chunk_tokens))}


def parse_args(argv):
    ap = common.base_parser(__doc__)
    ap.add_argument("--batches", default="8,32,64", help="comma list of decode batch sizes")
    return ap.parse_args(argv)


class Weights(NamedTuple):
    rows: list  # per layer (gate [E, F], up [E, F], down [F, E])
    features: list  # per layer (gate [F, E], up [F, E], down [E, F]): `rows` transposed
    bf16: list  # `features` in bfloat16
    emb: jax.Array  # [V, E]
    emb_bf16: jax.Array


def random_weights(normal, layers: int) -> Weights:
    rows = [(normal(EMBED, MLP), normal(EMBED, MLP), normal(MLP, EMBED)) for _ in range(layers)]
    features = [tuple(w.T.copy() for w in layer) for layer in rows]
    emb = normal(VOCAB, EMBED)
    return Weights(rows, features, [tuple(w.astype(jnp.bfloat16) for w in layer) for layer in features],
                   emb, emb.astype(jnp.bfloat16))


class Programs(NamedTuple):
    mlp_rows: Callable
    mlp_features: Callable
    mlp_bf16: Callable
    unembed_rows: Callable
    unembed_features: Callable
    attention_dots: Callable
    attention_summed: Callable


def programs(layers: int) -> Programs:
    return Programs(*mlp_programs(layers), *unembed_programs(), *attention_programs())


def time_matmuls(p: Programs, w: Weights, x, layers: int, reps: int) -> dict:
    """The MLP and unembedding both ways, from float32 and bf16 weights, and the feature-major
    MLP with its weights in cache, interleaved on activations x [B, E]; checks first that
    both orientations compute the same."""
    xt = x.T.copy()
    np.testing.assert_allclose(np.asarray(p.mlp_rows(x, w.rows)), np.asarray(p.mlp_features(xt, w.features)).T,
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(p.unembed_rows(x, w.emb)), np.asarray(p.unembed_features(xt, w.emb)),
                               rtol=1e-5)
    return common.interleaved({
        "mlp_rows": _timer(p.mlp_rows, x, w.rows), "mlp_features": _timer(p.mlp_features, xt, w.features),
        "unembed_rows": _timer(p.unembed_rows, x, w.emb), "unembed_features": _timer(p.unembed_features, xt, w.emb),
        "mlp_bf16": _timer(p.mlp_bf16, xt, w.bf16), "unembed_bf16": _timer(p.unembed_features, xt, w.emb_bf16),
        # The first layer's weights in every layer: small enough to stay in cache between layers.
        "mlp_in_cache": _timer(p.mlp_features, xt, [w.features[0]] * layers)},
        reps)


def cache_row(rep, b: int, s: dict, layers: int) -> list:
    """The feature-major MLP from memory against in cache (`read_split`), for batch `b`."""
    split = read_split(s["mlp_features"]["median"], s["mlp_in_cache"]["median"],
                       weight_bytes=layers * 3 * EMBED * MLP * 4, flops=layers * 3 * 2 * EMBED * MLP * b)
    rep.results[f"layout_mlp_read_bytes_per_s_b{b}"] = read = split["read_bytes_per_s"]
    rep.results[f"layout_mlp_in_cache_flops_per_s_b{b}"] = split["in_cache_flops_per_s"]
    return [b, _ms(s["mlp_features"]), _ms(s["mlp_in_cache"]), f"{split['extra_s'] * 1e3:.2f}",
            "–" if read is None else f"{read / 1e9:.1f}", f"{split['in_cache_flops_per_s'] / 1e9:.0f}"]


def time_attention(p: Programs, rng, b: int, layers: int, reps: int) -> dict:
    """Both decode attention forms, interleaved, after checking that they agree."""
    att = attention_inputs(rng, b, layers)
    np.testing.assert_allclose(np.asarray(p.attention_dots(*att)), np.asarray(p.attention_summed(*att)),
                               rtol=1e-4, atol=1e-4)
    return common.interleaved({"attention_dots": _timer(p.attention_dots, *att),
                               "attention_summed": _timer(p.attention_summed, *att)}, reps)


def attention_row(rep, b: int, a: dict) -> list:
    d, m = a["attention_dots"], a["attention_summed"]
    rep.results[f"layout_attention_summed_speedup_b{b}"] = d["median"] / m["median"]
    used = "summed" if b >= SUMMED_SCORES_FROM else "dots"
    return [b, _ms(d), _ms(m), f"{d['median'] / m['median']:.2f}×", used]


def matmul_rows(rep, b: int, s: dict) -> list[list]:
    """Row-major against feature-major, and feature-major float32 against bf16, per part."""
    rows = []
    for part in ("mlp", "unembed"):
        r, f, h = s[f"{part}_rows"], s[f"{part}_features"], s[f"{part}_bf16"]
        speedup = r["median"] / f["median"]
        rep.results[f"layout_{part}_speedup_b{b}"] = speedup
        rep.results[f"layout_{part}_bf16_speedup_b{b}"] = f["median"] / h["median"]
        rows.append([part, b, _ms(r), _ms(f), f"{speedup:.2f}×", _ms(h), f"{f['median'] / h['median']:.2f}×"])
    return rows


def report_tables(rep, layers: int, table: list, cache_table: list, att_table: list) -> None:
    rep.table(["", "batch", "row-major ms", "feature-major ms", "speedup", "feature-major bf16 ms",
               "bf16 speedup"], table)
    rep.emit("Speedup > 1: the feature-major decode step (`grpo_jax/sampler/feature_major.py`) suits this CPU. "
             "bf16 speedup = feature-major float32 / bf16 (bf16 weights and operands, float32 sums).")
    rep.emit()
    rep.emit(f"### The feature-major MLP from memory and with its weights in cache ({layers} layers; in "
             f"cache = the first layer's weights in every layer), float32")
    rep.emit()
    rep.table(["batch", "from memory ms", "in cache ms", "difference ms", "weights read at GB/s if the "
               "difference is reading", "in cache GFLOP/s"], cache_table)
    rep.emit("A read rate near the streaming bandwidth (`bench_rollout.py` prints it) means the dots read "
             "their weights and compute one after the other: decode's serial bound.")
    rep.emit()
    rep.emit(f"### Decode attention, one new token, {layers} layers × {SLOTS} cache slots ({KV_HEADS} kv heads × "
             f"{GROUP} query heads × {HEAD_DIM}), float32")
    rep.emit()
    rep.table(["batch", "two dots ms", "summed scores ms", "speedup", "the step uses"], att_table)
    rep.emit(f"Speedup > 1: the summed scores are faster; the feature-major step uses them from "
             f"{SUMMED_SCORES_FROM} rows on (`feature_major.SUMMED_SCORES_FROM`).")
    rep.emit()


def main(argv=None) -> int:
    args = parse_args(argv)
    reps = common.reps_of(args, full=9, quick=3)
    batches = [8] if args.quick else [int(b) for b in args.batches.split(",")]
    layers = 4 if args.quick else LAYERS
    rep = common.Report("layouts", args)
    rep.emit(f"## Decode-shaped matmuls, row-major vs feature-major (float32, and bf16 weights; {layers}-layer MLP "
             f"{EMBED}→{MLP}→{EMBED}, unembedding [{VOCAB}, {EMBED}]); median of {reps} interleaved reps")
    rep.emit()
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
    weights, progs = random_weights(normal, layers), programs(layers)
    table, att_table, cache_table = [], [], []
    for b in batches:
        s = time_matmuls(progs, weights, normal(b, EMBED), layers, reps)
        cache_table.append(cache_row(rep, b, s, layers))
        a = time_attention(progs, rng, b, layers, reps)
        s.update(a)
        att_table.append(attention_row(rep, b, a))
        table += matmul_rows(rep, b, s)
        rep.details[f"b{b}"] = s
    report_tables(rep, layers, table, cache_table, att_table)
    prefill_table(rep, args, reps, rng)
    return rep.finish()


def prefill_table(rep, args, reps: int, rng) -> None:
    cfg = dataclasses.replace(get_preset("smollm2-135m").model, num_layers=4 if args.quick else LAYERS)
    params = model_lib.init_params(cfg, jax.random.key(0))
    table = []
    for b in ([8] if args.quick else [16, 32, 64]):
        tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, PROMPT)), jnp.int32)
        mask = jnp.ones((b, PROMPT), bool)
        progs = prefill_programs(cfg, params, tokens, mask, PROMPT + 128)
        s = common.interleaved({n: _timer(p, params, tokens, mask, None) for n, p in progs.items()}, reps)
        o, c = s["one_pass"], s["chunked"]
        rate = lambda t: b * PROMPT / t
        rep.results[f"layout_prefill_chunked_speedup_b{b}"] = o["median"] / c["median"]
        table.append([b, ENGINES["feature_major"].prefill_chunks(b, PROMPT), f"{rate(o['median']):.0f} ({rate(o['max']):.0f}–{rate(o['min']):.0f})",
                      f"{rate(c['median']):.0f} ({rate(c['max']):.0f}–{rate(c['min']):.0f})", f"{o['median'] / c['median']:.2f}×"])
        rep.details[f"prefill_b{b}"] = s
    rep.emit(f"### The sampler's prefill, {cfg.num_layers} layers of SmolLM2-135M (random weights), prompts of "
             f"{PROMPT} tokens, float32; median (range) of {reps} interleaved reps")
    rep.emit()
    rep.table(["batch", "chunks", "one pass tok/s", f"chunks of ≤ {PREFILL_CHUNK_TOKENS} tokens tok/s",
               "speedup"], table)
    rep.emit("The feature-major engine (one CPU device) runs the sampler's prefill in the chunks (`FeatureMajor.prefill_chunks`); "
             "speedup > 1 where that pays.")
    rep.emit()


if __name__ == "__main__":
    raise SystemExit(main())
