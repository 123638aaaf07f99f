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

    from grpo_jax.model import logprobs
    from grpo_jax import sampler

    score = jax.jit(lambda p, r: logprobs.sequence_logprobs(cfg, p, r, temperature=1.0, chunk_size=64))
    out = {}
    for name, policy in policies.items():
        r = sampler.sample(cfg, policy, prompts,
                           sampler.SamplingParams(max_new_tokens=new_tokens, temperature=1.0),
                           key=jax.random.key(0))
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


def parse_args(argv):
    ap = common.base_parser(__doc__)
    ap.add_argument("--batches", default=None, help="comma list (default 8,32,64; quick 8)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128; quick 16")
    ap.add_argument("--bf16", action="store_true",
                    help="also time ours sampling from bfloat16 weights (rl.sample_dtype=bfloat16)")
    return ap.parse_args(argv)


def machine_limits(before: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """(matmul FLOP/s, streaming bytes/s), each the best of this measurement and `before`.
    Measured before anything else loads the cores and again after the reps: a shared
    machine's speed drifts, and a roofline from a slow moment would flatter us."""
    return (max(before[0], common.matmul_peak_flops()["flops_per_s_best"]),
            max(before[1], common.stream_bandwidth()["bytes_per_s_best"]))


def make_runners(cfg, params, hf_dir, threads: int, bf16: bool) -> dict:
    """Ours and transformers on the same weights, and ours from a bfloat16 copy if `bf16`."""
    runners = {"jax": SmolJax(cfg, params), "torch": SmolTorch(hf_dir, threads)}
    if bf16:
        from grpo_jax.sampler import sampling_copy

        runners["jax_bf16"] = SmolJax(cfg, sampling_copy(cfg, params, "bfloat16"))
    return runners


def batch_prompts(tok, hf_dir, batches: list[int], plen: int) -> tuple[dict, dict]:
    """({batch: its prompts' token ids}, {batch: whether the HF tokenizer gives the same ids})."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    prompts_by_batch, same = {}, {}
    for batch in batches:
        texts, prompts_by_batch[batch] = common.fixed_length_prompts(lambda s: tok.encode(s), batch, plen, seed=batch)
        same[batch] = all(hf_tok(t)["input_ids"] == p for t, p in zip(texts, prompts_by_batch[batch]))
    return prompts_by_batch, same


def per_batch_results(by_batch: dict, n: int, same: dict, roofline) -> dict:
    """{batch: each runner's rates, their per-rep decode rate spreads, the decode ratio ours /
    transformers, whether the tokenizers agreed, and `roofline(batch)`}."""
    out = {}
    for batch, res in by_batch.items():
        out[batch] = {"jax": res["jax"], "torch": res["torch"],
                      "decode_rate_spread": {k: common.decode_rate_spread(r, batch, n) for k, r in res.items()},
                      "ratio": res["jax"]["decode"] / res["torch"]["decode"], "tokenizers_agree": same[batch]}
        if "jax_bf16" in res:
            out[batch]["jax_bf16"] = res["jax_bf16"]
        out[batch]["roofline"] = roofline(batch)
    return out


def value_range(s: dict) -> str:
    return f"{common.fmt(s['min'])}–{common.fmt(s['max'])}"


def report_limits(rep, peak: float, bandwidth: float) -> None:
    rep.emit(f"Machine limits (jax, float32; the best of a measurement before and one after the "
             f"reps): matmul {peak / 1e9:.0f} GFLOP/s, streaming {bandwidth / 1e9:.1f} GB/s; decode "
             f"roofline = batch / max(step bytes / bandwidth, step FLOPs / matmul peak), every "
             f"weight and the mean cache read once per step; serial bound = batch / (step bytes / "
             f"bandwidth + step FLOPs / matmul peak), the same step with reading and arithmetic "
             f"never overlapped, as XLA's CPU dots run decode-shaped products (NOTES.md).")
    rep.emit()


def report_rates(rep, per_batch: dict) -> None:
    """Ours vs transformers per batch size, with the decode roofline."""
    rows = []
    for batch, v in per_batch.items():
        j, t, rates, roof = v["jax"], v["torch"], v["decode_rate_spread"], v["roofline"]
        rows.append([batch, common.fmt(j["prefill"]), common.fmt(t["prefill"]),
                     f"{j['prefill'] / t['prefill']:.2f}×",
                     f"{common.fmt(j['decode'])} ({value_range(rates['jax'])})",
                     f"{common.fmt(t['decode'])} ({value_range(rates['torch'])})", f"**{v['ratio']:.2f}×**",
                     f"{common.fmt(roof['tokens_per_s'])} ({roof['bound']})",
                     f"{j['decode'] / roof['tokens_per_s']:.0%}",
                     f"{common.fmt(roof['serial_tokens_per_s'])} ({j['decode'] / roof['serial_tokens_per_s']:.0%})",
                     common.fmt(j["e2e"]), common.fmt(t["e2e"])])
    rep.table(["batch", "prefill tok/s ours", "prefill tok/s transformers", "prefill ratio",
               "decode tok/s ours (range)", "decode tok/s transformers (range)", "decode ratio",
               "decode roofline tok/s", "ours / roofline", "serial bound tok/s (ours / it)",
               "end-to-end new tok/s ours", "end-to-end transformers"], rows)


def report_gains(rep, by_batch: dict, reps: int) -> None:
    """Per-token speed of each batch size over the next smaller one (nothing with one size)."""
    gains = per_token_gains(by_batch)
    if not gains:
        return
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


def report_bf16(rep, per_batch: dict, mismatch: dict, batch: int, n: int) -> None:
    """Ours from the bfloat16 copy against ours in float32 and transformers, and what the copy
    costs in log-prob accuracy (`measure_mismatch` of `batch` prompts)."""
    rows = []
    for b, v in per_batch.items():
        j, t, h, rates = v["jax"], v["torch"], v["jax_bf16"], v["decode_rate_spread"]
        rows.append([b, common.fmt(h["prefill"]), f"{h['prefill'] / j['prefill']:.2f}×",
                     f"{common.fmt(h['decode'])} ({value_range(rates['jax_bf16'])})",
                     f"**{h['decode'] / j['decode']:.2f}×**", f"{h['decode'] / t['decode']:.2f}×"])
    rep.emit("Ours in bfloat16 (same interleaved reps):")
    rep.emit()
    rep.table(["batch", "prefill tok/s bf16", "vs ours f32", "decode tok/s bf16 (range)",
               "vs ours f32", "vs transformers f32"], rows)
    rep.emit()
    rep.emit(f"What the bf16 copy costs: batch {batch} sampled at temperature 1, {n} new tokens, its "
             f"log-probs scored again by the float32 trainer (per completion token):")
    rep.table(["sampler", "tokens", "mean abs Δ log p", "p99 abs Δ log p", "max abs Δ log p",
               "KL(sampler ‖ trainer)", "TIS weights > 2"],
              [[k, v["tokens"], f"{v['mean_abs']:.2e}", f"{v['p99_abs']:.2e}", f"{v['max_abs']:.2e}",
                f"{v['kl_k1']:.2e}", f"{v['tis_capped_fraction']:.2%}"] for k, v in mismatch.items()])
    rep.details["bf16_logprob_mismatch"] = mismatch
    for k, v in mismatch.items():
        rep.results[f"logprob_mismatch_mean_abs_{k}"] = v["mean_abs"]


def record_results(rep, per_batch: dict, main_batch: int, peak: float, bandwidth: float) -> None:
    r = rep.results
    r["decode_tokens_per_s_ratio_vs_transformers"] = per_batch[main_batch]["ratio"]
    r["decode_ratio_batch"] = main_batch
    for b, v in per_batch.items():
        r[f"decode_tokens_per_s_ours_b{b}"] = v["jax"]["decode"]
        r[f"decode_tokens_per_s_transformers_b{b}"] = v["torch"]["decode"]
        r[f"prefill_tokens_per_s_ours_b{b}"] = v["jax"]["prefill"]
        r[f"prefill_tokens_per_s_transformers_b{b}"] = v["torch"]["prefill"]
        r[f"decode_roofline_tokens_per_s_b{b}"] = v["roofline"]["tokens_per_s"]
        r[f"decode_fraction_of_roofline_b{b}"] = v["jax"]["decode"] / v["roofline"]["tokens_per_s"]
        r[f"decode_serial_bound_tokens_per_s_b{b}"] = v["roofline"]["serial_tokens_per_s"]
        if "jax_bf16" in v:
            r[f"decode_tokens_per_s_ours_bf16_b{b}"] = v["jax_bf16"]["decode"]
            r[f"prefill_tokens_per_s_ours_bf16_b{b}"] = v["jax_bf16"]["prefill"]
    r["matmul_peak_gflops"] = peak / 1e9
    r["stream_bandwidth_gb_per_s"] = bandwidth / 1e9


def main(argv=None) -> int:
    args = parse_args(argv)
    reps = common.reps_of(args, full=3, quick=1)
    batches = [int(b) for b in (args.batches or ("8" if args.quick else "8,32,64")).split(",")]
    n, plen = args.new_tokens or (16 if args.quick else 128), args.prompt_len
    main_batch = 32 if 32 in batches else batches[-1]
    rep = common.Report("rollout", args)
    rep.emit(f"## Rollout: SmolLM2-135M (imported weights), prompts of {plen} tokens, {n} new tokens "
             f"(full length), temperature 1, top-p 1, float32; median of {reps} interleaved reps")
    rep.emit()
    limits = machine_limits()
    cfg, params, tok = common.smollm2()
    hf_dir = common.smollm2_hf_dir()
    runners = make_runners(cfg, params, hf_dir, args.threads, args.bf16)
    prompts_by_batch, same = batch_prompts(tok, hf_dir, batches, plen)
    start = time.perf_counter()
    by_batch = common.rollout_rates_by_batch(runners, prompts_by_batch, n, reps)
    seconds = time.perf_counter() - start
    peak, bandwidth = machine_limits(limits)
    per_batch = per_batch_results(by_batch, n, same, lambda b: common.decode_roofline(
        cfg, b, plen + n // 2, flops_per_s=peak, bytes_per_s=bandwidth))
    report_limits(rep, peak, bandwidth)
    report_rates(rep, per_batch)
    report_gains(rep, by_batch, reps)
    rep.details["reps_seconds"] = seconds
    if args.bf16:
        mismatch = measure_mismatch(cfg, params, {"float32": runners["jax"].params,
                                                  "bfloat16": runners["jax_bf16"].params},
                                    prompts_by_batch[main_batch], n)
        report_bf16(rep, per_batch, mismatch, main_batch, n)
    record_results(rep, per_batch, main_batch, peak, bandwidth)
    rep.details["per_batch"] = per_batch
    if not all(v["tokenizers_agree"] for v in per_batch.values()):
        rep.emit("Note: our tokenizer and the HF tokenizer disagreed on some prompt; both sides "
                 "still get the same token ids (ours).")
    return rep.finish()


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
