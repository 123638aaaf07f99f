"""Rollout: our sampler vs transformers `generate` on SmolLM2-135M with its real weights.

The SmolLM2 version of `bench_sampler.py` (which uses random weights and also compares
rolled/unrolled decode and shared/unshared prefill): this script reuses its runners and
`common.rollout_rates` (interleaved reps, warm-up excluded, medians), swapping in the imported
SmolLM2-135M-Instruct weights on both sides (`transformers` loads the same weights from
an HF export of our params).

Setting: B prompts of 64 real tokens (text), 128 new tokens forced to full length (no
stop token on our side, `min_new_tokens` for transformers), temperature 1, top-k off,
top-p 1, float32, KV cache on both sides.
  * prefill throughput = B × 64 / t(1 new token)
  * decode throughput  = B × 127 / (t(128 new tokens) − t(1 new token))
The spread is over reps of the per-rep decode throughput. Every rep runs every batch size
and every runner in turn (`common.rollout_rates_by_batch`), so the per-token comparison
between batch sizes (larger never slower) is rep by rep, not minutes apart.

`--bf16` adds a third runner, interleaved with the other two: ours sampling from a bfloat16
copy of the weights, which is what the trainer does with `rl.sample_dtype=bfloat16` (on one
CPU device its decode multiplies bf16 weights by bf16-rounded activations, accumulating in
float32; its prefill upcasts the weights to the model's float32); its rows are compared
with ours in float32. It also measures what the copy costs in accuracy: one batch sampled
from it at temperature 1, scored again by the float32 trainer (`logprobs.sequence_logprobs`),
per completion token |Δ log p|, the estimated KL(sampler ‖ trainer), and the share of
tokens whose truncated-importance weight π_trainer / π_sampler the cap C = 2 would clip
(`rl.tis_cap`, the correction); the float32 sampler is the control.
"""

from __future__ import annotations

import time

import common  # sets OMP_WAIT_POLICY before jax and torch load

import bench_sampler  # the sampler engineer's benchmark: its runners


class SmolJax(bench_sampler.JaxRunner):
    """bench_sampler's JAX runner with imported weights instead of random ones."""

    def __init__(self, cfg, params):
        self.cfg, self.params, self.calls = cfg, params, 0


class SmolTorch(bench_sampler.TorchRunner):
    """bench_sampler's transformers runner with the same imported weights."""

    def __init__(self, hf_dir, threads: int):
        torch = common.torch_setup(threads)
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def mismatch_stats(sample_logp, trainer_logp, mask, cap: float = 2.0) -> dict:
    """Sampler vs trainer log-probs of the same tokens ([B, T] each, mask [B, T]): per real
    token mean / 99th percentile / max of |Δ log p|, the k1 estimate of KL(sampler ‖
    trainer) = mean(log p_sampler − log p_trainer), and the share of tokens whose TIS
    weight exp(log p_trainer − log p_sampler) exceeds ``cap``."""
    import numpy as np

    m = np.asarray(mask, bool)
    s, t = np.asarray(sample_logp, np.float64)[m], np.asarray(trainer_logp, np.float64)[m]
    gap = np.abs(s - t)
    return {"tokens": int(m.sum()), "mean_abs": float(gap.mean()), "p99_abs": float(np.percentile(gap, 99)),
            "max_abs": float(gap.max()), "kl_k1": float((s - t).mean()),
            "tis_capped_fraction": float((np.exp(t - s) > cap).mean())}


def measure_mismatch(cfg, params, policies: dict, prompts, new_tokens: int) -> dict:
    """For each named sampling policy: `mismatch_stats` of one temperature-1 batch drawn from
    it and scored by the float32 trainer's `logprobs.sequence_logprobs` on ``params``."""
    import jax

    from grpo_jax import logprobs, sampling

    score = jax.jit(lambda p, r: logprobs.sequence_logprobs(cfg, p, r, temperature=1.0, chunk_size=64))
    out = {}
    for name, policy in policies.items():
        r = sampling.sample(cfg, policy, prompts, key=jax.random.key(0), max_new_tokens=new_tokens,
                            temperature=1.0)
        out[name] = mismatch_stats(r.logprobs, score(params, r), r.mask)
    return out


def per_token_gains(by_batch: dict) -> dict:
    """{(smaller, larger batch): {"<phase>_<runner>": summarize()}} for each pair of adjacent
    batch sizes of `common.rollout_rates_by_batch`'s result, phases prefill and decode, the
    runners "jax" and "torch" (`common.per_token_gain`)."""
    sizes = sorted(by_batch)
    return {(a, b): {f"{phase}_{runner}": common.per_token_gain(by_batch[a][runner], by_batch[b][runner], a, b, phase)
                     for phase in ("prefill", "decode") for runner in ("jax", "torch")}
            for a, b in zip(sizes, sizes[1:])}


def main(argv=None) -> int:
    ap = common.base_parser(__doc__)
    ap.add_argument("--batches", default=None, help="comma list (default 8,32,64; quick 8)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128; quick 16")
    ap.add_argument("--bf16", action="store_true",
                    help="also time ours sampling from bfloat16 weights (rl.sample_dtype=bfloat16)")
    args = ap.parse_args(argv)
    reps = common.reps_of(args, full=3, quick=1)
    batches = [int(b) for b in (args.batches or ("8" if args.quick else "8,32,64")).split(",")]
    n = args.new_tokens or (16 if args.quick else 128)
    plen = args.prompt_len
    rep = common.Report("rollout", args)
    rep.emit(f"## Rollout: SmolLM2-135M (imported weights), prompts of {plen} tokens, {n} new tokens "
             f"(full length), temperature 1, top-p 1, float32; median of {reps} interleaved reps")
    rep.emit()

    # The machine's own limits, measured before anything else loads the cores, and again
    # after the reps: a shared machine's speed drifts (one run measured 107 GFLOP/s at its
    # start, 207 minutes later), and a roofline from a slow moment would flatter us.
    peak = common.matmul_peak_flops()["flops_per_s_best"]
    bandwidth = common.stream_bandwidth()["bytes_per_s_best"]
    cfg, params, tok = common.smollm2()
    hf_dir = common.smollm2_hf_dir()
    runners = {"jax": SmolJax(cfg, params), "torch": SmolTorch(hf_dir, args.threads)}
    if args.bf16:
        from grpo_jax.sampling import sampling_copy

        runners["jax_bf16"] = SmolJax(cfg, sampling_copy(cfg, params, "bfloat16"))
    bf16_rows = []
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    rows, per_batch = [], {}
    rng = lambda s: f"{common.fmt(s['min'])}–{common.fmt(s['max'])}"
    prompts_by_batch, same = {}, {}
    for batch in batches:
        texts, prompts_by_batch[batch] = common.fixed_length_prompts(lambda s: tok.encode(s), batch, plen, seed=batch)
        same[batch] = all(hf_tok(t)["input_ids"] == p for t, p in zip(texts, prompts_by_batch[batch]))
    start = time.perf_counter()
    by_batch = common.rollout_rates_by_batch(runners, prompts_by_batch, n, reps)
    for batch, res in by_batch.items():
        j, t = res["jax"], res["torch"]
        rates = {k: common.decode_rate_spread(r, batch, n) for k, r in res.items()}
        ratio = j["decode"] / t["decode"]
        per_batch[batch] = {"jax": j, "torch": t, "decode_rate_spread": rates, "ratio": ratio,
                            "tokenizers_agree": same[batch]}
        if args.bf16:
            h = res["jax_bf16"]
            per_batch[batch]["jax_bf16"] = h
            bf16_rows.append([batch, common.fmt(h["prefill"]), f"{h['prefill'] / j['prefill']:.2f}×",
                              f"{common.fmt(h['decode'])} ({rng(rates['jax_bf16'])})",
                              f"**{h['decode'] / j['decode']:.2f}×**", f"{h['decode'] / t['decode']:.2f}×"])
    seconds = time.perf_counter() - start
    peak = max(peak, common.matmul_peak_flops()["flops_per_s_best"])
    bandwidth = max(bandwidth, common.stream_bandwidth()["bytes_per_s_best"])
    rep.emit(f"Machine limits (jax, float32; the best of a measurement before and one after the "
             f"reps): matmul {peak / 1e9:.0f} GFLOP/s, streaming {bandwidth / 1e9:.1f} GB/s; decode "
             f"roofline = batch / max(step bytes / bandwidth, step FLOPs / matmul peak), every "
             f"weight and the mean cache read once per step; serial bound = batch / (step bytes / "
             f"bandwidth + step FLOPs / matmul peak), the same step with reading and arithmetic "
             f"never overlapped, as XLA's CPU dots run decode-shaped products (NOTES.md).")
    rep.emit()
    for batch, v in per_batch.items():
        j, t, rates = v["jax"], v["torch"], v["decode_rate_spread"]
        roof = v["roofline"] = common.decode_roofline(cfg, batch, plen + n // 2, flops_per_s=peak,
                                                      bytes_per_s=bandwidth)
        rows.append([batch, common.fmt(j["prefill"]), common.fmt(t["prefill"]),
                     f"{j['prefill'] / t['prefill']:.2f}×",
                     f"{common.fmt(j['decode'])} ({rng(rates['jax'])})",
                     f"{common.fmt(t['decode'])} ({rng(rates['torch'])})", f"**{v['ratio']:.2f}×**",
                     f"{common.fmt(roof['tokens_per_s'])} ({roof['bound']})",
                     f"{j['decode'] / roof['tokens_per_s']:.0%}",
                     f"{common.fmt(roof['serial_tokens_per_s'])} ({j['decode'] / roof['serial_tokens_per_s']:.0%})",
                     common.fmt(j["e2e"]), common.fmt(t["e2e"])])
    rep.table(["batch", "prefill tok/s ours", "prefill tok/s transformers", "prefill ratio",
               "decode tok/s ours (range)", "decode tok/s transformers (range)", "decode ratio",
               "decode roofline tok/s", "ours / roofline", "serial bound tok/s (ours / it)",
               "end-to-end new tok/s ours", "end-to-end transformers"], rows)
    gains = per_token_gains(by_batch)
    if gains:
        rep.emit(f"Per token, each batch size against the next smaller one (every rep runs every batch "
                 f"size in turn; median (range) over the {reps} reps of the per-rep ratio; ≥ 1.00× = "
                 f"not slower per token):")
        rep.emit()
        rep.table(["batches", "prefill ours", "prefill transformers", "decode ours", "decode transformers"],
                  [[f"{large} / {small}"] + [f"{g[k]['median']:.2f}× ({g[k]['min']:.2f}–{g[k]['max']:.2f})"
                                             for k in ("prefill_jax", "prefill_torch", "decode_jax", "decode_torch")]
                   for (small, large), g in gains.items()])
        for (small, large), g in gains.items():
            for k, v in g.items():
                phase, runner = k.split("_", 1)
                who = {"jax": "ours", "torch": "transformers"}[runner]
                rep.results[f"{phase}_per_token_gain_b{large}_over_b{small}_{who}"] = v["median"]
    rep.details["reps_seconds"] = seconds
    if bf16_rows:
        rep.emit("Ours in bfloat16 (same interleaved reps):")
        rep.emit()
        rep.table(["batch", "prefill tok/s bf16", "vs ours f32", "decode tok/s bf16 (range)",
                   "vs ours f32", "vs transformers f32"], bf16_rows)
        mb = 32 if 32 in per_batch else batches[-1]
        _, prompts = common.fixed_length_prompts(lambda s: tok.encode(s), mb, plen, seed=mb)
        mism = measure_mismatch(cfg, params, {"float32": runners["jax"].params,
                                              "bfloat16": runners["jax_bf16"].params}, prompts, n)
        rep.emit()
        rep.emit(f"What the bf16 copy costs: batch {mb} sampled at temperature 1, {n} new tokens, its "
                 f"log-probs scored again by the float32 trainer (per completion token):")
        rep.table(["sampler", "tokens", "mean abs Δ log p", "p99 abs Δ log p", "max abs Δ log p",
                   "KL(sampler ‖ trainer)", "TIS weights > 2"],
                  [[k, v["tokens"], f"{v['mean_abs']:.2e}", f"{v['p99_abs']:.2e}", f"{v['max_abs']:.2e}",
                    f"{v['kl_k1']:.2e}", f"{v['tis_capped_fraction']:.2%}"] for k, v in mism.items()])
        rep.details["bf16_logprob_mismatch"] = mism
        for k, v in mism.items():
            rep.results[f"logprob_mismatch_mean_abs_{k}"] = v["mean_abs"]
    main_batch = 32 if 32 in per_batch else batches[-1]
    rep.results["decode_tokens_per_s_ratio_vs_transformers"] = per_batch[main_batch]["ratio"]
    rep.results["decode_ratio_batch"] = main_batch
    for b, v in per_batch.items():
        rep.results[f"decode_tokens_per_s_ours_b{b}"] = v["jax"]["decode"]
        rep.results[f"decode_tokens_per_s_transformers_b{b}"] = v["torch"]["decode"]
        rep.results[f"prefill_tokens_per_s_ours_b{b}"] = v["jax"]["prefill"]
        rep.results[f"prefill_tokens_per_s_transformers_b{b}"] = v["torch"]["prefill"]
        rep.results[f"decode_roofline_tokens_per_s_b{b}"] = v["roofline"]["tokens_per_s"]
        rep.results[f"decode_fraction_of_roofline_b{b}"] = v["jax"]["decode"] / v["roofline"]["tokens_per_s"]
        rep.results[f"decode_serial_bound_tokens_per_s_b{b}"] = v["roofline"]["serial_tokens_per_s"]
        if "jax_bf16" in v:
            rep.results[f"decode_tokens_per_s_ours_bf16_b{b}"] = v["jax_bf16"]["decode"]
            rep.results[f"prefill_tokens_per_s_ours_bf16_b{b}"] = v["jax_bf16"]["prefill"]
    rep.results["matmul_peak_gflops"] = peak / 1e9
    rep.results["stream_bandwidth_gb_per_s"] = bandwidth / 1e9
    rep.details["per_batch"] = per_batch
    if not all(v["tokenizers_agree"] for v in per_batch.values()):
        rep.emit("Note: our tokenizer and the HF tokenizer disagreed on some prompt; both sides "
                 "still get the same token ids (ours).")
    return rep.finish()


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
