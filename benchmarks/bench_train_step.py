"""Train step: one GRPO policy update, ours vs plain torch vs TRL; and model-FLOPs utilisation.

The update (DeepSeekMath Eq. 21 with μ = 1): policy forward + backward, reference forward,
k3 KL (β = 0.04), clipped surrogate, sequence-mean aggregation, AdamW — on SmolLM2-135M
(imported weights), R sequences × (prompt + completion) tokens (default 16 × (64 + 192)
= 16 × 256), float32, every completion token valid.

* **ours**: `grpo_jax.rl.train_step.make_train_step` with the `smollm2-135m` preset (4
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

import dataclasses
import gc
import time
from typing import Callable, NamedTuple

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
        from grpo_jax.rl import batching, optimizer
        from grpo_jax.parallel import sharding
        from grpo_jax.rl import train_step as ts

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


TRL = "TRL GRPOTrainer"
OURS_TRL_PHASE = "ours (reps between TRL's steps)"
TINY, SMOL = "cpu-tiny (ours)", "SmolLM2-135M (ours)"


def grpo_config(mcfg, rows: int, group: int, overrides=()):
    from grpo_jax.config import apply_overrides, smollm2_135m

    cfg = smollm2_135m()
    cfg = cfg.replace(model=mcfg, rl={"group_size": group, "beta": 0.04,
                                      "num_micro_batches": min(cfg.rl.num_micro_batches, rows)})
    return apply_overrides(cfg, overrides)


def parse_args(argv):
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
    return ap.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One update's batch: `rows` sequences of `prompt` + `completion` tokens, in groups of
    `group` sequences that share a prompt."""

    rows: int
    prompt: int
    completion: int

    @property
    def group(self) -> int:
        return 4 if self.rows % 4 == 0 else 1

    @property
    def seq(self) -> int:
        return self.prompt + self.completion

    @property
    def tokens(self) -> int:
        return self.rows * self.seq


def shape_of(args) -> Shape:
    return Shape(rows=args.rows or (4 if args.quick else 16), prompt=args.prompt_len or (32 if args.quick else 64),
                 completion=args.completion_len or (32 if args.quick else 192))


class Inputs(NamedTuple):
    """The token ids and rewards every framework updates on."""

    prompt_list: list[list[int]]  # [rows / group][prompt], one per group
    prompt_ids: np.ndarray  # [rows, prompt], each prompt `group` times
    completion_ids: np.ndarray  # [rows, completion]
    rewards: np.ndarray  # [rows]


def update_inputs(tok, vocab_size: int, shape: Shape, rng) -> Inputs:
    """Real-text prompts of exactly `shape.prompt` tokens, random completion ids and rewards."""
    _, prompt_list = common.fixed_length_prompts(lambda s: tok.encode(s), shape.rows // shape.group, shape.prompt)
    prompt_ids = np.repeat(np.array(prompt_list, np.int32), shape.group, axis=0)
    completion_ids = rng.integers(3, vocab_size, (shape.rows, shape.completion)).astype(np.int32)
    rewards = rng.normal(size=shape.rows).astype(np.float32)
    return Inputs(prompt_list, prompt_ids, completion_ids, rewards)


def our_updates(mcfg, params, shape: Shape, inputs: Inputs, ours: str,
                variants: list[str]) -> tuple[OurUpdate, dict[str, OurUpdate]]:
    """The headline update (config overrides `ours`) and one update per entry of `variants`,
    each on its own copy of `params`. The variants are built first: the headline step
    donates (deletes) `params`."""
    arrays = (shape.rows, inputs.prompt_ids, inputs.completion_ids, inputs.rewards)
    built = {v: OurUpdate(grpo_config(mcfg, shape.rows, shape.group, v.split()),
                          jax.tree.map(lambda x: x.copy(), params), *arrays) for v in variants}
    return OurUpdate(grpo_config(mcfg, shape.rows, shape.group, ours.split()), params, *arrays), built


def torch_update(cfg, shape: Shape, inputs: Inputs, args) -> tuple[Callable[[], float], int]:
    """Plain torch's update of the same batch (`torch_reference.TorchGRPOUpdate`, group-relative
    advantages computed here) as a callable returning seconds, and its micro-batch count."""
    from torch_reference import TorchGRPOUpdate

    update = TorchGRPOUpdate(common.smollm2_hf_dir(), threads=args.threads, beta=cfg.rl.beta,
                             weight_decay=cfg.optimizer.weight_decay, betas=(cfg.optimizer.b1, cfg.optimizer.b2))
    grouped = inputs.rewards.reshape(-1, shape.group)
    adv = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-6)).reshape(-1)
    batch = update.batch(inputs.prompt_ids, inputs.completion_ids, adv)
    micro = args.torch_micro_batches or cfg.rl.num_micro_batches
    return (lambda: update.step(batch, micro)), micro


def trl_phase(cfg, shape: Shape, inputs: Inputs, tok, ours: OurUpdate, reps: int,
              threads: int) -> tuple[list[dict], list[float]]:
    """Phase B: TRL's GRPOTrainer steps on the same token ids (handed over by its rollout hook),
    one rep of ours after each step but the warm-up. Returns (TRL's per-step phase seconds,
    warm-up included; our seconds between its steps)."""
    from torch_reference import pregenerated_rollout, run_trl

    texts = [tok.decode(p) for p in inputs.prompt_list]
    ours_between: list[float] = []
    steps = run_trl(common.smollm2_hf_dir(), texts, after_warm_step=lambda: ours_between.append(ours()),
                    num_generations=shape.group, prompts_per_step=shape.rows // shape.group,
                    max_completion_length=shape.completion, steps=reps + 1, beta=cfg.rl.beta,
                    reward_fn=common.count_letter_reward, threads=threads,
                    rollout=pregenerated_rollout(dict(zip(texts, inputs.prompt_list)), inputs.completion_ids))
    return steps, ours_between


def best_peak(before: dict) -> dict:
    """The machine's load drifts: measure the matmul peak again after the reps and keep the best."""
    again = common.matmul_peak_flops()
    return again if again["flops_per_s_best"] > before["flops_per_s_best"] else before


def update_rows(stats: dict, tokens: int, flops: float, peak_f: float) -> list[list]:
    """One table row per implementation; TRL's time ratio is against ours of its own phase."""
    base = stats["ours"]["median"]
    trl_base = stats.get(OURS_TRL_PHASE, stats["ours"])["median"]
    return [[name, common.spread(s), common.rate_spread(tokens, s),
             f"{s['median'] / (trl_base if name == TRL else base):.2f}×",
             f"{100 * flops / s['median'] / peak_f:.1f}%"] for name, s in stats.items()]


def report_updates(rep, stats: dict, shape: Shape, flops: float, ours: OurUpdate, peak: dict, reps: int,
                   trl_steps: list[dict]) -> None:
    """The implementations' table and notes (phase B's only when TRL ran)."""
    cfg, peak_f = ours.cfg, peak["flops_per_s_best"]
    rep.table(["implementation", "s / update (min–max)", "tokens/s (range)",
               "time / ours (same phase)", "MFU vs measured matmul peak"],
              update_rows(stats, shape.tokens, flops, peak_f))
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
        phases = {k: common.summarize([s.get(k, 0.0) for s in trl_steps])["median"] for k in ("reference", "reward")}
        rep.emit(f"TRL step phases (median s): reference forward {phases['reference']:.2f}, "
                 f"reward {phases['reward']:.3f}, update (rest) "
                 f"{stats[TRL]['median'] - phases['reference'] - phases['reward']:.2f}.")
        rep.emit()


def tiny_update(shape: Shape, rewards: np.ndarray, rng) -> OurUpdate:
    """Our update of the cpu-tiny preset (random weights and token ids) at the same shape."""
    from grpo_jax.model import transformer as model_lib
    from grpo_jax.config import cpu_tiny

    tiny = cpu_tiny()
    tiny = tiny.replace(model={"max_seq_len": max(tiny.model.max_seq_len, shape.seq)},
                        rl={"group_size": shape.group, "beta": 0.04})
    params = model_lib.init_params(tiny.model, jax.random.key(0))
    prompts = rng.integers(3, tiny.model.vocab_size, (shape.rows, shape.prompt)).astype(np.int32)
    completions = rng.integers(3, tiny.model.vocab_size, (shape.rows, shape.completion)).astype(np.int32)
    return OurUpdate(tiny, params, shape.rows, prompts, completions, rewards)


def mfu(flops: float, update: OurUpdate, stats: dict, peak: dict) -> tuple[float, float]:
    """(model FLOPs per second over the matmul peak; the load-insensitive cross-check: FLOPs
    per CPU-second of this process (all threads) over the matmul's FLOPs per CPU-second,
    both counting any spinning of idle pool threads)."""
    cpu_seconds = float(np.median(update.cpu_seconds[1:] or update.cpu_seconds))
    return flops / stats["median"] / peak["flops_per_s_best"], flops / cpu_seconds / peak["flops_per_cpu_s"]


def report_mfu(rep, shape: Shape, models: dict[str, tuple[float, int, OurUpdate, dict]], peak: dict) -> dict:
    """The MFU table of {name: (model FLOPs per update, decimals of its GFLOP cell, its update,
    its stats)}; returns {name: `mfu`}."""
    out = {name: mfu(flops, u, s, peak) for name, (flops, _, u, s) in models.items()}
    rep.table(["model", "s / update", "tokens/s", "model GFLOP / update", "MFU vs matmul peak",
               "MFU per CPU-second (cross-check)"],
              [[name, common.spread(s), common.rate_spread(shape.tokens, s), f"{flops / 1e9:.{digits}f}",
                f"{100 * out[name][0]:.1f}%", f"{100 * out[name][1]:.1f}%"]
               for name, (flops, digits, _, s) in models.items()])
    return out


def record_results(rep, stats: dict, shape: Shape, mfus: dict, peak: dict) -> None:
    r, tokens, base = rep.results, shape.tokens, stats["ours"]["median"]
    r["train_tokens_per_s_ours"] = tokens / base
    if "torch" in stats:
        r["train_tokens_per_s_torch"] = tokens / stats["torch"]["median"]
        r["train_tokens_per_s_ratio_vs_torch"] = stats["torch"]["median"] / base
    if TRL in stats:
        trl_base = stats[OURS_TRL_PHASE]["median"]
        r["train_tokens_per_s_trl"] = tokens / stats[TRL]["median"]
        r["train_tokens_per_s_ours_trl_phase"] = tokens / trl_base
        r["train_tokens_per_s_ratio_vs_trl"] = stats[TRL]["median"] / trl_base
    r["train_mfu_vs_cpu_peak"] = mfus[SMOL][0]
    r["train_mfu_vs_cpu_peak_tiny"] = mfus[TINY][0]
    r["train_matmul_peak_gflops"] = peak["flops_per_s_best"] / 1e9  # its own key: bench_rollout measures one too
    r["train_mfu_per_cpu_second"] = mfus[SMOL][1]
    r["train_mfu_per_cpu_second_tiny"] = mfus[TINY][1]


def main(argv=None) -> int:
    args = parse_args(argv)
    reps, shape = common.reps_of(args, full=3, quick=1), shape_of(args)
    rep = common.Report("train_step", args)
    rep.emit(f"## Train step: one GRPO update on SmolLM2-135M, {shape.rows} × {shape.seq} tokens "
             f"({shape.prompt} prompt + {shape.completion} completion), float32")
    rep.emit()
    peak = common.matmul_peak_flops()
    mcfg, params, tok = common.smollm2()
    rng = np.random.default_rng(0)
    inputs = update_inputs(tok, mcfg.vocab_size, shape, rng)
    variants = ["model.remat=full"] if args.variant is None else args.variant
    ours, built = our_updates(mcfg, params, shape, inputs, args.ours, variants)
    fns = {"ours": ours, **{f"ours [{v}]": u for v, u in built.items()}}
    if not args.no_torch:
        fns["torch"], rep.details["torch_micro_batches"] = torch_update(ours.cfg, shape, inputs, args)
    stats = common.interleaved(fns, reps)  # phase A
    del fns  # frees torch's models before TRL loads its own
    gc.collect()
    trl_steps = []
    if not args.no_trl:
        rep.details["trl_phases"], ours_between = trl_phase(ours.cfg, shape, inputs, tok, ours, reps, args.threads)
        trl_steps = rep.details["trl_phases"][1:]
        stats[OURS_TRL_PHASE] = common.summarize(ours_between)
        stats[TRL] = common.summarize([s["step"] for s in trl_steps])
    rep.details["matmul_peak"] = peak = best_peak(peak)
    flops = update_flops(mcfg, shape.rows, shape.seq, shape.completion)
    report_updates(rep, stats, shape, flops, ours, peak, reps, trl_steps)
    tiny = tiny_update(shape, inputs.rewards, rng)
    tiny_stats = common.interleaved({"tiny": tiny}, reps=max(reps, 3))["tiny"]
    tiny_flops = update_flops(tiny.cfg.model, shape.rows, shape.seq, shape.completion)
    mfus = report_mfu(rep, shape, {TINY: (tiny_flops, 2, tiny, tiny_stats), SMOL: (flops, 1, ours, stats["ours"])},
                      peak)
    record_results(rep, stats, shape, mfus, peak)
    rep.details.update({"shape": dataclasses.asdict(shape),
                        "stats": stats, "tiny": tiny_stats, "model_flops": flops,
                        "our_peak_bytes": ours.peak_bytes, "compile_seconds": ours.compile_seconds,
                        "variants": {v: {"peak_bytes": u.peak_bytes} for v, u in built.items()}})
    return rep.finish()


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
