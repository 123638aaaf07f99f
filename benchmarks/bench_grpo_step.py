"""Whole GRPO step, ours vs TRL's GRPOTrainer: sample, reward, reference log-probs, update.

SmolLM2-135M-Instruct (imported weights, float32), P = 2 prompts of 64 tokens × G = 4
samples, 128 new tokens forced to full length, temperature 1, top-p 1, β = 0.04 (k3),
sequence-mean ("grpo") aggregation, trivial reward (number of letters "e" in the decoded
completion), lr 1e-6, one update per batch (μ = 1).

* **ours**: `sampler.sample` (shared prefill, while-loop decode, unrolled layers) →
  host decode + reward → `batch_from_rollout` → the jitted train step of the
  `smollm2-135m` preset (reference forward + update in one program; remat "full", like
  TRL's gradient checkpointing), with 1 micro-batch because TRL also runs the 8
  sequences as one batch. The step's reference forward is also timed on its own (the same
  micro-batched chunked log-probs, jitted separately) to split the step into reference /
  update; that extra call is outside the step's timing.
* **TRL**: `GRPOTrainer(use_cpu=True, bf16=False, use_vllm=False, beta=0.04,
  loss_type="grpo", num_generations=4, max_completion_length=128,
  generation_kwargs={"min_new_tokens": 128})` with per-phase timers (see
  `torch_reference.make_trl_trainer`); everything else is TRL's default (gradient
  checkpointing on, fused AdamW).

Median seconds per step after the first (warm-up / compilation); our reps run between
TRL's steps (trainer callback), so both see the same background load.
Speedup = TRL seconds / ours; the target is ≥ 2 (our step ≤ 0.5× TRL's).
"""

from __future__ import annotations

import time

import common

import jax
import numpy as np

from grpo_jax.config import REMAT_POLICIES

PHASES = ("sampling", "reward", "reference", "update", "step")


class OurGRPOStep:
    def __init__(self, prompts: list[list[int]], *, group: int, new_tokens: int, beta: float,
                 remat: str):
        from grpo_jax.rl import algorithms, optimizer
        from grpo_jax.model import logprobs
        from grpo_jax.parallel import sharding
        from grpo_jax.rl import train_step as ts
        from grpo_jax.config import smollm2_135m

        self.sharding = sharding
        self.mesh = sharding.mesh_from_shape((1, 1, 1))
        # Params on the mesh from the start, as the train step returns them: otherwise the
        # sampler compiles once for single-device params and again after the first update.
        mcfg, params, self.tok = common.smollm2({"remat": remat}, mesh=self.mesh)
        # TRL updates on all P × G sequences at once (gradient_accumulation_steps=1); so do we.
        cfg = smollm2_135m().replace(
            model=mcfg, data={"batch_size": len(prompts)},
            rl={"group_size": group, "beta": beta, "max_new_tokens": new_tokens, "num_micro_batches": 1})
        self.cfg, self.prompts, self.group, self.n = cfg, prompts, group, new_tokens
        tx, _ = optimizer.make_optimizer(cfg.optimizer, 1000)
        self.state = ts.init_train_state(cfg, params, tx)
        self.step_fn = ts.make_train_step(cfg, tx, self.mesh)
        num = cfg.rl.num_micro_batches
        self.ref_fn = jax.jit(lambda p, b: algorithms.map_micro_batches(
            lambda mb: logprobs.sequence_logprobs(mcfg, p, mb, temperature=cfg.rl.temperature,
                                                  chunk_size=cfg.rl.logprob_chunk_size), b, num))
        self.calls = 0
        self.last: dict[str, float] = {}

    def __call__(self) -> float:
        from grpo_jax.rl import batching
        from grpo_jax import sampler

        sw = common.Stopwatch()
        self.calls += 1
        start = time.perf_counter()
        with sw("sampling"):
            rollout = sampler.sample(self.cfg.model, self.state.params, self.prompts,
                                     sampler.SamplingParams(self.n, pad_id=self.tok.pad_id),
                                     key=jax.random.key(self.calls), group_size=self.group)
            jax.block_until_ready(rollout)
        with sw("reward"):
            tokens = np.asarray(rollout.tokens)
            texts = [self.tok.decode(row.tolist()) for row in tokens]
            rewards = np.array([common.count_letter_reward(t) for t in texts], np.float32)
            batch = batching.batch_from_rollout(rollout, rewards, np.zeros(len(texts), bool))
            batch = self.sharding.shard_batch(batch, self.mesh)
        with sw("step"):
            self.state, metrics = self.step_fn(self.state, batch)
            jax.block_until_ready(metrics)
        total = time.perf_counter() - start
        assert bool(np.asarray(rollout.mask).all()), "completions must be full length"
        ref = time.perf_counter()  # outside the step's timing: the reference forward alone
        jax.block_until_ready(self.ref_fn(self.state.ref_params, batch))
        t = sw.totals
        t["reference"] = time.perf_counter() - ref
        t["update"] = t["step"] - t["reference"]
        t["step"] = total
        self.last = dict(t)
        return total


def parse_args(argv):
    ap = common.base_parser(__doc__)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128; quick 16")
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--remat", default="full", choices=REMAT_POLICIES,
                    help="our step's rematerialisation (TRL checkpoints whole layers: 'full' is like for like)")
    return ap.parse_args(argv)


def trl_steps_between(args, ours: OurGRPOStep, texts: list[str], n: int, reps: int) -> tuple[list[dict], list[dict]]:
    """TRL's GRPOTrainer steps with one of ours after each but the warm-up: (TRL's per-step
    phase seconds, warm-up included; ours' phase seconds)."""
    from torch_reference import run_trl

    our_steps: list[dict] = []

    def one():
        ours()
        our_steps.append(ours.last)

    steps = run_trl(common.smollm2_hf_dir(), texts, after_warm_step=one, num_generations=args.group_size,
                    prompts_per_step=args.prompts, max_completion_length=n, steps=reps + 1, beta=args.beta,
                    reward_fn=common.count_letter_reward, threads=args.threads, min_new_tokens=n)
    return steps, our_steps


def trl_phases(step: dict) -> dict:
    """One TRL step's seconds under our phase names: sampling = generate, update = the rest."""
    return dict(step, sampling=step.get("generate", 0.0),
                update=step["step"] - step.get("generate", 0.0) - step.get("reward", 0.0) - step.get("reference", 0.0))


def report_steps(rep, our_steps: list[dict], trl_steps: list[dict], first: dict) -> None:
    """The phase table of ours (and TRL's, with the ratios, when it ran)."""
    ours_s = {k: common.summarize([s.get(k, 0.0) for s in our_steps]) for k in PHASES}
    rows = [["ours", *(common.spread(ours_s[k]) for k in PHASES)]]
    result = rep.results
    result["grpo_step_seconds_ours"] = ours_s["step"]["median"]
    if trl_steps:
        trl_s = {k: common.summarize([s.get(k, 0.0) for s in trl_steps]) for k in PHASES}
        rows.append(["TRL GRPOTrainer", *(common.spread(trl_s[k]) for k in PHASES)])
        speed = {k: trl_s[k]["median"] / max(ours_s[k]["median"], 1e-9) for k in PHASES}
        rows.append(["TRL / ours", *(f"{speed[k]:.2f}×" for k in PHASES)])
        result["grpo_step_seconds_trl"] = trl_s["step"]["median"]
        result["grpo_step_speedup_vs_trl"] = speed["step"]
        result.update({f"grpo_step_{k}_speedup_vs_trl": speed[k] for k in ("sampling", "reference", "update")})
        rep.details["trl"] = trl_s
    rep.table(["", "sampling s", "reward s", "reference s", "update s", "whole step s"], rows)
    rep.emit("Ours: 'reference' is the step's reference forward timed separately (same program "
             "shape), 'update' = jitted step − reference; the whole step also includes host "
             f"transfers. First (compiling) step: {first['wall']:.0f} s.")
    rep.details.update({"ours": ours_s, "our_steps": our_steps, "first": first})


def main(argv=None) -> int:
    args = parse_args(argv)
    reps = common.reps_of(args, full=3, quick=1)
    n = args.new_tokens or (16 if args.quick else 128)
    g, p = args.group_size, args.prompts
    rep = common.Report("grpo_step", args)
    rep.emit(f"## Whole GRPO step: SmolLM2-135M, {p} prompts × G={g}, {args.prompt_len}-token prompts, "
             f"{n} new tokens (full length), β={args.beta}; median of {reps} steps after the first")
    rep.emit()
    tok = common.smollm2_tokenizer()
    texts, prompts = common.fixed_length_prompts(lambda s: tok.encode(s), p, args.prompt_len, seed=7)
    ours = OurGRPOStep(prompts, group=g, new_tokens=n, beta=args.beta, remat=args.remat)
    start = time.perf_counter()
    ours()  # warm-up: compiles the sampler, the step and the reference function
    first = dict(ours.last, wall=time.perf_counter() - start)
    trl_steps: list[dict] = []
    if args.no_trl:
        our_steps = []
        for _ in range(reps):
            ours()
            our_steps.append(ours.last)
    else:
        rep.details["trl_steps"], our_steps = trl_steps_between(args, ours, texts, n, reps)
        trl_steps = [trl_phases(s) for s in rep.details["trl_steps"][1:]]
    report_steps(rep, our_steps, trl_steps, first)
    return rep.finish()


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
