"""Train step: one GRPO policy update, ours vs plain torch vs TRL; and model-FLOPs utilisation.

The update (DeepSeekMath Eq. 21 with μ = 1): policy forward + backward, reference forward,
k3 KL (β = 0.04), clipped surrogate, sequence-mean aggregation, AdamW — on SmolLM2-135M
(imported weights), R sequences × (prompt + completion) tokens (default 16 × (64 + 192)
= 16 × 256), float32, every completion token valid.

* **ours**: `grpo_jax.train_step.make_train_step` with the `smollm2-135m` preset (4
  micro-batches, chunked log-probs of 64 positions), state donated, and by default
  `model.remat=none` (`--ours`), because the torch reference keeps every activation too:
  the same computation. The preset's own `remat="full"` (an extra forward per layer in the
  backward pass, for memory) is timed alongside as a `--variant` row.
* **torch**: `torch_reference.TorchGRPOUpdate`, the straightforward transformers version
  (full `[B,T,V]` logits, no checkpointing), AdamW with the same hyperparameters, and by
  default the same number of micro-batches (gradient accumulation) as our step, which
  also keeps its peak memory within a shared 24 GB machine (`--torch-micro-batches 1`:
  the whole batch at once).
* **TRL**: `GRPOTrainer` (use_cpu, float32, loss_type "grpo", β = 0.04, its default
  gradient checkpointing) for one optimizer step on pre-generated completions: the same
  token ids are handed to it through its `rollout_func` hook, so its step is reward +
  reference forward + policy update, like ours.

Two phases, so that torch's and TRL's models are never in memory together: (A) ours and
torch interleaved rep by rep; (B) TRL's steps with one rep of ours after each (a trainer
callback). Each ratio compares with our median from the same phase.

Throughput = R × (prompt + completion) / median seconds. MFU = model FLOPs per second /
the float32 matmul peak measured in the same process (a jitted 2048² matmul, best rep,
measured before and after the reps; the better of the two).
Model FLOPs of the update = 3 × policy forward + 1 × reference forward, each counting
every matmul of the trunk on all positions (attention as computed, T² per layer) and the
unembedding on completion positions only; rematerialisation is not counted (it is
overhead, not model work). The same count is used for every framework.
"""

from __future__ import annotations

import tempfile
import time

import common  # sets OMP_WAIT_POLICY before jax and torch load

import jax
import numpy as np


def forward_flops(mcfg, rows: int, seq: int, logit_positions: int) -> float:
    """Matmul FLOPs of one forward pass (multiply-add = 2)."""
    e, h, k, d, m, layers, v = (mcfg.embed_dim, mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim,
                                mcfg.mlp_dim, mcfg.num_layers, mcfg.vocab_size)
    proj = 2 * (e * h * d + 2 * e * k * d + h * d * e) + 2 * 3 * e * m
    attention = 2 * 2 * h * d * seq  # scores and weighted values, full T x T as computed
    return rows * seq * layers * (proj + attention) + rows * logit_positions * 2 * e * v


def update_flops(mcfg, rows: int, seq: int, completion: int) -> float:
    return 4 * forward_flops(mcfg, rows, seq, completion)


class OurUpdate:
    """A GRPO update with our jitted train step; `__call__` returns wall seconds."""

    def __init__(self, cfg, params, rows: int, prompt_ids: np.ndarray, completion_ids: np.ndarray,
                 rewards: np.ndarray):
        from grpo_jax import batching, optimizer, sharding
        from grpo_jax import train_step as ts

        self.cfg = cfg
        tx, _ = optimizer.make_optimizer(cfg.optimizer, 1000)
        self.mesh = sharding.mesh_from_shape((1, 1, 1))
        self.state = ts.init_train_state(cfg, params, tx)
        self.step = ts.make_train_step(cfg, tx, self.mesh)
        batch = batching.make_batch(prompt_ids, np.ones(prompt_ids.shape, bool), completion_ids,
                                    np.ones(completion_ids.shape, bool), rewards=rewards)
        self.batch = sharding.shard_batch(batch, self.mesh)
        start = time.perf_counter()
        compiled = self.step.compiled(self.state, self.batch)
        self.compile_seconds = time.perf_counter() - start
        self.peak_bytes = common.peak_bytes(compiled.memory_analysis())

        self.cpu_seconds: list[float] = []

    def __call__(self) -> float:
        start, cpu = time.perf_counter(), time.process_time()
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready(metrics)
        self.cpu_seconds.append(time.process_time() - cpu)
        return time.perf_counter() - start


def grpo_config(mcfg, rows: int, group: int, overrides=()):
    from grpo_jax.config import apply_overrides, smollm2_135m

    cfg = smollm2_135m()
    cfg = cfg.replace(model=mcfg, rl={"group_size": group, "beta": 0.04,
                                      "num_micro_batches": min(cfg.rl.num_micro_batches, rows)})
    return apply_overrides(cfg, overrides)


def main(argv=None) -> int:
    ap = common.base_parser(__doc__)
    ap.add_argument("--rows", type=int, default=None, help="sequences per update (default 16; quick 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; quick 32)")
    ap.add_argument("--completion-len", type=int, default=None,
                    help="completion tokens (default 192; quick 32)")
    ap.add_argument("--no-torch", action="store_true", help="skip the plain torch update")
    ap.add_argument("--torch-micro-batches", type=int, default=None,
                    help="gradient-accumulation slices for the torch update (default: the same "
                         "number of micro-batches as our step; 1 = whole batch at once, ≈ 11 GB at 16×256)")
    ap.add_argument("--no-trl", action="store_true", help="skip TRL's GRPOTrainer")
    ap.add_argument("--ours", default="model.remat=none", metavar="OVERRIDES",
                    help="space-separated config overrides of the headline step (default "
                         "'model.remat=none': no recomputation, like the torch reference)")
    ap.add_argument("--variant", action="append", default=None, metavar="OVERRIDES",
                    help="also time our step with these space-separated config overrides "
                         "(repeatable; default 'model.remat=full', the preset's memory setting)")
    args = ap.parse_args(argv)
    reps = common.reps_of(args, full=3, quick=1)
    rows = args.rows or (4 if args.quick else 16)
    tp = args.prompt_len or (32 if args.quick else 64)
    tc = args.completion_len or (32 if args.quick else 192)
    group = 4 if rows % 4 == 0 else 1
    seq = tp + tc
    rep = common.Report("train_step", args)
    rep.emit(f"## Train step: one GRPO update on SmolLM2-135M, {rows} × {seq} tokens "
             f"({tp} prompt + {tc} completion), float32")
    rep.emit()

    peak = common.matmul_peak_flops()

    mcfg, params, tok = common.smollm2()
    rng = np.random.default_rng(0)
    _, prompt_list = common.fixed_length_prompts(lambda s: tok.encode(s), rows // group, tp)
    prompt_ids = np.repeat(np.array(prompt_list, np.int32), group, axis=0)
    completion_ids = rng.integers(3, mcfg.vocab_size, (rows, tc)).astype(np.int32)
    rewards = rng.normal(size=rows).astype(np.float32)
    cfg = grpo_config(mcfg, rows, group, args.ours.split())
    fns, variants = {}, {}
    variant_overrides = ["model.remat=full"] if args.variant is None else args.variant
    for v in variant_overrides:  # before `ours`, whose step donates (deletes) `params`
        vcfg = grpo_config(mcfg, rows, group, v.split())
        own = jax.tree.map(lambda x: x.copy(), params)
        variants[v] = OurUpdate(vcfg, own, rows, prompt_ids, completion_ids, rewards)
    ours = OurUpdate(cfg, params, rows, prompt_ids, completion_ids, rewards)
    fns["ours"] = ours
    fns.update({f"ours [{v}]": u for v, u in variants.items()})
    del params
    if not args.no_torch:
        from torch_reference import TorchGRPOUpdate

        hf_dir = common.smollm2_hf_dir()
        torch_update = TorchGRPOUpdate(hf_dir, threads=args.threads, beta=cfg.rl.beta,
                                       weight_decay=cfg.optimizer.weight_decay,
                                       betas=(cfg.optimizer.b1, cfg.optimizer.b2))
        grouped = rewards.reshape(-1, group)
        adv = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-6)).reshape(-1)
        tb = torch_update.batch(prompt_ids, completion_ids, adv)
        torch_micro = args.torch_micro_batches or cfg.rl.num_micro_batches
        fns["torch"] = lambda: torch_update.step(tb, torch_micro)
        rep.details["torch_micro_batches"] = torch_micro

    # Phase A: ours (and variants) interleaved with plain torch, rep by rep.
    samples = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: compile / first call
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(fn())
    if "torch" in fns:  # free torch's models before TRL loads its own (24 GB machine)
        del fns["torch"], torch_update, tb
        import gc

        gc.collect()
    # Phase B: TRL's steps, with one rep of ours after each (a trainer callback).
    trl_steps, ours_with_trl = [], []
    if not args.no_trl:
        from torch_reference import make_trl_trainer, pregenerated_rollout

        texts = [tok.decode(p) for p in prompt_list]
        hf_dir = common.smollm2_hf_dir()
        by_text = {t: p for t, p in zip(texts, prompt_list)}
        done = [0]

        def between():
            done[0] += 1
            if done[0] > 1:  # TRL's first step is its warm-up
                ours_with_trl.append(ours())

        with tempfile.TemporaryDirectory() as out:
            trainer, timer = make_trl_trainer(
                hf_dir, texts, num_generations=group, prompts_per_step=rows // group,
                max_completion_length=tc, steps=reps + 1, beta=cfg.rl.beta,
                reward_fn=common.count_letter_reward, threads=args.threads, output_dir=out,
                rollout=pregenerated_rollout(by_text, completion_ids), between_steps=between)
            trainer.train()
        trl_steps = timer.steps[1:]
        rep.details["trl_phases"] = timer.steps
        del trainer

    # The machine's load drifts: measure the peak again after the reps and keep the best.
    again = common.matmul_peak_flops()
    if again["flops_per_s_best"] > peak["flops_per_s_best"]:
        peak = again
    rep.details["matmul_peak"] = peak
    stats = {name: common.summarize(s) for name, s in samples.items()}
    if trl_steps:
        stats["ours (reps between TRL's steps)"] = common.summarize(ours_with_trl)
        stats["TRL GRPOTrainer"] = common.summarize([s["step"] for s in trl_steps])
    tokens = rows * seq
    flops = update_flops(mcfg, rows, seq, tc)
    peak_f = peak["flops_per_s_best"]
    base = stats["ours"]["median"]
    trl_base = stats.get("ours (reps between TRL's steps)", stats["ours"])["median"]
    table = []
    for name, s in stats.items():
        ref = trl_base if name == "TRL GRPOTrainer" else base
        table.append([name, common.spread(s), common.rate_spread(tokens, s),
                      f"{s['median'] / ref:.2f}×", f"{100 * flops / s['median'] / peak_f:.1f}%"])
    rep.table(["implementation", "s / update (min–max)", "tokens/s (range)",
               "time / ours (same phase)", "MFU vs measured matmul peak"], table)
    rep.emit(f"torch: {rep.details.get('torch_micro_batches', '–')} micro-batch(es) of gradient accumulation; ours: "
             f"{cfg.rl.num_micro_batches} micro-batches, remat {cfg.model.remat!r}, log-prob chunk "
             f"{cfg.rl.logprob_chunk_size}. "
             "Phase A interleaves ours (and any `--variant`) with plain torch; phase B runs TRL's "
             "steps with one rep of ours after each; each comparison uses the ours-median of its phase.")
    rep.emit()
    rep.emit(f"Measured float32 matmul peak (jitted 2048², best of 7, before and after): {peak_f / 1e9:.1f} GFLOP/s "
             f"(median {peak['flops_per_s_median'] / 1e9:.1f}). Model FLOPs per update: "
             f"{flops / 1e12:.3f} TFLOP. Our step: compile {ours.compile_seconds:.0f} s, XLA peak "
             f"{common.fmt_bytes(ours.peak_bytes)}; reps: {reps} (median shown).")
    rep.emit()
    if trl_steps:
        phases = {k: common.summarize([s.get(k, 0.0) for s in trl_steps]) for k in ("reference", "reward")}
        rep.emit(f"TRL step phases (median s): reference forward {phases['reference']['median']:.2f}, "
                 f"reward {phases['reward']['median']:.3f}, update (rest) "
                 f"{stats['TRL GRPOTrainer']['median'] - phases['reference']['median'] - phases['reward']['median']:.2f}.")
        rep.emit()

    # -- MFU of the tiny preset (fast, so measured on its own)
    from grpo_jax.config import cpu_tiny
    from grpo_jax import model as model_lib

    tiny = cpu_tiny()
    tiny = tiny.replace(model={"max_seq_len": max(tiny.model.max_seq_len, seq)},
                        rl={"group_size": group, "beta": 0.04})
    tparams = model_lib.init_params(tiny.model, jax.random.key(0))
    t_prompts = rng.integers(3, tiny.model.vocab_size, (rows, tp)).astype(np.int32)
    t_comp = rng.integers(3, tiny.model.vocab_size, (rows, tc)).astype(np.int32)
    tiny_update = OurUpdate(tiny, tparams, rows, t_prompts, t_comp, rewards)
    tiny_stats = common.interleaved({"tiny": tiny_update}, reps=max(reps, 3))["tiny"]
    tiny_flops = update_flops(tiny.model, rows, seq, tc)
    tiny_mfu = tiny_flops / tiny_stats["median"] / peak_f
    smol_mfu = flops / base / peak_f
    # Load-insensitive cross-check: FLOPs per CPU-second of this process (all threads) over
    # the matmul's FLOPs per CPU-second (both count any spinning of idle pool threads).
    cpu_mfu = lambda f, u: f / float(np.median(u.cpu_seconds[1:] or u.cpu_seconds)) / peak["flops_per_cpu_s"]
    tiny_cpu_mfu, smol_cpu_mfu = cpu_mfu(tiny_flops, tiny_update), cpu_mfu(flops, ours)
    rep.table(["model", "s / update", "tokens/s", "model GFLOP / update", "MFU vs matmul peak",
               "MFU per CPU-second (cross-check)"], [
        ["cpu-tiny (ours)", common.spread(tiny_stats), common.rate_spread(tokens, tiny_stats),
         f"{tiny_flops / 1e9:.2f}", f"{100 * tiny_mfu:.1f}%", f"{100 * tiny_cpu_mfu:.1f}%"],
        ["SmolLM2-135M (ours)", common.spread(stats["ours"]), common.rate_spread(tokens, stats["ours"]),
         f"{flops / 1e9:.1f}", f"{100 * smol_mfu:.1f}%", f"{100 * smol_cpu_mfu:.1f}%"]])

    r = rep.results
    r["train_tokens_per_s_ours"] = tokens / base
    if "torch" in stats:
        r["train_tokens_per_s_torch"] = tokens / stats["torch"]["median"]
        r["train_tokens_per_s_ratio_vs_torch"] = stats["torch"]["median"] / base
    if trl_steps:
        r["train_tokens_per_s_trl"] = tokens / stats["TRL GRPOTrainer"]["median"]
        r["train_tokens_per_s_ours_trl_phase"] = tokens / trl_base
        r["train_tokens_per_s_ratio_vs_trl"] = stats["TRL GRPOTrainer"]["median"] / trl_base
    r["train_mfu_vs_cpu_peak"] = smol_mfu
    r["train_mfu_vs_cpu_peak_tiny"] = tiny_mfu
    r["train_matmul_peak_gflops"] = peak_f / 1e9  # its own key: bench_rollout measures one too
    r["train_mfu_per_cpu_second"] = smol_cpu_mfu
    r["train_mfu_per_cpu_second_tiny"] = tiny_cpu_mfu
    rep.details.update({"shape": {"rows": rows, "prompt": tp, "completion": tc},
                        "stats": stats, "tiny": tiny_stats, "model_flops": flops,
                        "our_peak_bytes": ours.peak_bytes, "compile_seconds": ours.compile_seconds,
                        "variants": {v: {"peak_bytes": u.peak_bytes} for v, u in variants.items()}})
    return rep.finish()


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
