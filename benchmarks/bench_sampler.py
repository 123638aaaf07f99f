"""Sampler throughput: grpo_jax.sampler.sample against transformers `generate` on CPU.

Measures, for the cpu-tiny model and a SmolLM2-135M-shaped model (random weights, float32):
  * prefill throughput  = batch × prompt_len / t(1 new token)
  * decode throughput   = batch × (N - 1) / (t(N new tokens) - t(1 new token))
  * end-to-end          = batch × N / t(N new tokens)
with prompt 64 tokens, N = 128 new tokens forced to full length (no stop token for JAX;
`min_new_tokens = max_new_tokens` for transformers), temperature 1, no top-k / top-p.
Also: decode with unrolled vs rolled (`lax.scan`) layers, and group sampling with the
prompt's prefill shared by its G samples vs every sample prefilling its own copy.

Fairness on a small shared CPU:
  * both frameworks get the machine's cores as intra-op threads (torch.set_num_threads,
    XLA's CPU thread pool defaults to the core count); they never run at the same time;
  * torch runs with OMP_WAIT_POLICY=PASSIVE (set before torch is imported): with
    OpenMP's default spin-waiting, any other process on the cores makes torch's matmuls
    several times slower, which would flatter JAX;
  * the reps of the two frameworks are interleaved, so both see the same background load;
  * the first call of every configuration (JAX compilation, torch warm-up) is excluded;
    each number is the median over the reps.

Run:  python benchmarks/bench_sampler.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch / OpenMP initialise

import common  # before jax and torch: sets OMP_WAIT_POLICY
import jax
import numpy as np

from grpo_jax.model import transformer as model_lib
from grpo_jax import sampler
from grpo_jax.config import ModelConfig, cpu_tiny, smollm2_135m

MODELS = {"tiny": lambda: cpu_tiny().model, "smollm2-135m": lambda: smollm2_135m().model}


def _prompts(cfg: ModelConfig, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, cfg.vocab_size, (batch, length)).tolist()


# ----------------------------------------------------------------------------- JAX side

class JaxRunner:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.params = model_lib.init_params(cfg, jax.random.key(0))
        self.calls = 0

    def __call__(self, prompts, new_tokens, *, group_size=1, engine="auto") -> float:
        self.calls += 1
        start = time.perf_counter()
        rollout, info = sampler.sample_with_info(self.cfg, self.params, prompts,
                                                 sampler.SamplingParams(new_tokens, 1.0, engine=engine),
                                                 key=jax.random.key(self.calls), group_size=group_size)
        jax.block_until_ready(rollout)
        elapsed = time.perf_counter() - start
        assert info.decode_steps == new_tokens and bool(rollout.mask.all()), "not full length"
        return elapsed


# ----------------------------------------------------------------------------- torch side

class TorchRunner:
    def __init__(self, cfg: ModelConfig, threads: int):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.torch = torch
        hf = LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.embed_dim, intermediate_size=cfg.mlp_dim,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_eps, tie_word_embeddings=cfg.tie_embeddings,
            max_position_embeddings=max(cfg.max_seq_len, 1024), bos_token_id=1, eos_token_id=2,
            pad_token_id=0, torch_dtype="float32")
        self.model = LlamaForCausalLM(hf).eval()

    def __call__(self, prompts, new_tokens) -> float:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.no_grad():
            start = time.perf_counter()
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, use_cache=True, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=2)
            elapsed = time.perf_counter() - start
        assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens), out.shape
        return elapsed


# ----------------------------------------------------------------------------- measuring

def fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batches 8 and 32 only, 3 reps")
    ap.add_argument("--models", default="tiny,smollm2-135m", help="comma list of: " + ",".join(MODELS))
    ap.add_argument("--batches", default=None, help="comma list (default 8,32,64; quick 8,32)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=None, help="timed reps per point (default 5; quick 3)")
    ap.add_argument("--group-size", type=int, default=8, help="G for the shared-prefill comparison")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    ap.add_argument("--no-torch", action="store_true", help="JAX only")
    ap.add_argument("--sections", default="compare,unroll,group",
                    help="comma list of: compare (vs transformers), unroll (rolled vs unrolled "
                         "decode), group (shared vs unshared prefill)")
    ap.add_argument("--out", default="", help="also write the markdown tables to this file (as they come)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in (args.batches or ("8,32" if args.quick else "8,32,64")).split(",")]
    reps = args.reps or (3 if args.quick else 5)
    n, plen = args.new_tokens, args.prompt_len
    lines = [f"# Sampler benchmark ({'quick' if args.quick else 'full'})", "",
             f"prompt {plen} tokens, {n} new tokens (full length), temperature 1, float32, "
             f"median of {reps} reps; {os.cpu_count()} cores; jax {jax.__version__}; "
             f"load average at start {os.getloadavg()[0]:.1f}", ""]

    sections = set(args.sections.split(","))
    out = open(args.out, "w") if args.out else None

    def emit(line=""):
        print(line, flush=True)
        lines.append(line)
        if out:
            out.write(line + "\n")
            out.flush()

    print("\n".join(lines), flush=True)
    if out:
        out.write("\n".join(lines) + "\n")
    jax_runners = {name: JaxRunner(MODELS[name]()) for name in args.models.split(",")}

    if "compare" in sections:
        compare(args, emit, jax_runners, batches, reps)
    big = args.models.split(",")[-1]
    if "unroll" in sections:
        unroll(args, emit, jax_runners[big], big, batches[:2], reps)
    if "group" in sections:
        group(args, emit, jax_runners[big], big, max(batches), reps)
    emit()
    emit(f"load average at end {os.getloadavg()[0]:.1f}")
    return 0


def compare(args, emit, jax_runners, batches, reps):
    n, plen = args.new_tokens, args.prompt_len
    emit("## JAX `sample` vs transformers `generate`")
    emit()
    emit("| model | batch | prefill tok/s JAX | prefill tok/s torch | decode tok/s JAX | decode tok/s torch "
         "| decode ratio | end-to-end new tok/s JAX | end-to-end torch | e2e ratio |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for name, jax_run in jax_runners.items():
        cfg = jax_run.cfg
        runners = {"jax": jax_run}
        if not args.no_torch:
            runners["torch"] = TorchRunner(cfg, args.threads)
        for batch in batches:
            r = common.rollout_rates(runners, _prompts(cfg, batch, plen), n, reps)
            j, t = r["jax"], r.get("torch")
            if t is None:
                emit(f"| {name} | {batch} | {fmt(j['prefill'])} | – | {fmt(j['decode'])} | – | – | {fmt(j['e2e'])} | – | – |")
            else:
                emit(f"| {name} | {batch} | {fmt(j['prefill'])} | {fmt(t['prefill'])} | {fmt(j['decode'])} | "
                     f"{fmt(t['decode'])} | {j['decode'] / t['decode']:.2f}× | {fmt(j['e2e'])} | "
                     f"{fmt(t['e2e'])} | {j['e2e'] / t['e2e']:.2f}× |")
        del runners
    emit()


def unroll(args, emit, jax_run, name, batches, reps):
    n, plen, cfg = args.new_tokens, args.prompt_len, jax_run.cfg
    emit(f"## Decode: unrolled vs rolled layers ({name}, JAX)")
    emit()
    emit("| batch | decode tok/s unrolled | decode tok/s rolled (`lax.scan`) | unrolled / rolled |")
    emit("|---|---|---|---|")
    for batch in batches:
        prompts = _prompts(cfg, batch, plen)
        rolled = {"unrolled": lambda p, k: jax_run(p, k, engine="auto"),
                  "rolled": lambda p, k: jax_run(p, k, engine="scan")}
        r = common.rollout_rates(rolled, prompts, n, reps)
        emit(f"| {batch} | {fmt(r['unrolled']['decode'])} | {fmt(r['rolled']['decode'])} | "
             f"{r['unrolled']['decode'] / r['rolled']['decode']:.2f}× |")

    emit()


def group(args, emit, jax_run, name, batch, reps):
    n, plen, cfg, g = args.new_tokens, args.prompt_len, jax_run.cfg, args.group_size
    emit(f"## Group sampling: shared vs unshared prefill ({name}, JAX, {batch // g} prompts × G={g})")
    emit()
    emit("| prefill | time to first token (ms) | total for all tokens (ms) | end-to-end new tok/s |")
    emit("|---|---|---|---|")
    prompts = _prompts(cfg, batch // g, plen, seed=1)
    repeated = [p for p in prompts for _ in range(g)]
    variants = {"shared (P prompts, then cache × G)": lambda p, k: jax_run(prompts, k, group_size=g),
                "unshared (P × G prompts)": lambda p, k: jax_run(repeated, k, group_size=1)}
    r = common.rollout_rates(variants, repeated, n, reps)
    for label, v in r.items():
        emit(f"| {label} | {fmt(v['t1'] * 1e3)} | {fmt(v['tn'] * 1e3)} | {fmt(v['e2e'])} |")
    shared, unshared = r.values()
    emit()
    emit(f"Sharing saves {fmt((unshared['t1'] - shared['t1']) * 1e3)} ms of prefill per batch "
         f"({unshared['t1'] / shared['t1']:.1f}× faster to the first token, "
         f"{unshared['tn'] / shared['tn']:.2f}× end to end).")


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
