"""Scaling: where a GRPO step's time and memory go as G and the completion length grow.

Model: the `cpu-tiny` preset (random weights; a 2-core CPU cannot run SmolLM2-135M at
G = 64 × 1024 tokens in reasonable time, and the shape of the curves is what matters),
float32, P = 2 prompts of 64 tokens, β = 0.04, completions forced to full length.
Sweeps: G ∈ {4, 8, 16, 32, 64} at 128 new tokens, and 128 → 1024 new tokens at G = 8.

Per point, median of the reps (compilation excluded):
  sampling  = `sampler.sample` (shared prefill + while-loop decode)
  reference = the step's reference forward alone (micro-batched chunked log-probs, jitted)
  update    = jitted train step − reference
and memory: the train step's compiled peak (arguments + outputs − aliases + temporaries,
`common.peak_bytes`) and the sampler's KV cache size. Writes `scaling.png` next to this
script (or `--png`).
"""

from __future__ import annotations

import os
import time

import common

import jax
import numpy as np


class Point:
    """One (G, length) configuration of the tiny model: compiled sampler, step and reference."""

    def __init__(self, group: int, new_tokens: int, prompts: int, prompt_len: int, seed: int = 0):
        from grpo_jax.rl import algorithms, optimizer
        from grpo_jax.model import logprobs
        from grpo_jax.parallel import sharding
        from grpo_jax.model import transformer as model_lib
        from grpo_jax.rl import train_step as ts
        from grpo_jax.config import cpu_tiny

        cfg = cpu_tiny().replace(model={"max_seq_len": prompt_len + new_tokens + 1},
                                 rl={"group_size": group, "beta": 0.04, "max_new_tokens": new_tokens})
        self.cfg, self.g, self.n, self.sharding = cfg, group, new_tokens, sharding
        rng = np.random.default_rng(seed)
        self.prompts = rng.integers(3, cfg.model.vocab_size, (prompts, prompt_len)).tolist()
        tx, _ = optimizer.make_optimizer(cfg.optimizer, 1000)
        self.mesh = sharding.mesh_from_shape((1, 1, 1))
        # Params on the mesh from the start, as the train step returns them: otherwise the
        # sampler compiles once for single-device params and again after the first update.
        params = model_lib.init_params(cfg.model, jax.random.key(seed), self.mesh)
        self.state = ts.init_train_state(cfg, params, tx)
        self.step = ts.make_train_step(cfg, tx, self.mesh)
        mcfg, num = cfg.model, cfg.rl.num_micro_batches
        self.ref_fn = jax.jit(lambda p, b: algorithms.map_micro_batches(
            lambda mb: logprobs.sequence_logprobs(mcfg, p, mb, temperature=1.0,
                                                  chunk_size=cfg.rl.logprob_chunk_size), b, num))
        rows = prompts * group
        from grpo_jax.shapes import bucket_length

        self.cache_bytes = (2 * mcfg.num_layers * rows * (bucket_length(prompt_len) + bucket_length(new_tokens))
                            * mcfg.num_kv_heads * mcfg.head_dim * 4)
        self.calls = 0
        batch = self._batch(self._sample())
        self.peak_bytes = common.peak_bytes(self.step.compiled(self.state, batch).memory_analysis())

    def _sample(self):
        from grpo_jax import sampler

        self.calls += 1
        out = sampler.sample(self.cfg.model, self.state.params, self.prompts,
                             sampler.SamplingParams(max_new_tokens=self.n, temperature=1.0),
                             key=jax.random.key(self.calls), group_size=self.g)
        return jax.block_until_ready(out)

    def _batch(self, rollout):
        from grpo_jax.rl import batching

        rewards = np.asarray(rollout.tokens).mean(axis=1).astype(np.float32)
        batch = batching.batch_from_rollout(rollout, rewards, np.zeros(len(rewards), bool))
        return self.sharding.shard_batch(batch, self.mesh)

    def __call__(self) -> dict:
        t0 = time.perf_counter()
        rollout = self._sample()
        t1 = time.perf_counter()
        batch = self._batch(rollout)
        t2 = time.perf_counter()
        self.state, metrics = self.step(self.state, batch)
        jax.block_until_ready(metrics)
        t3 = time.perf_counter()
        jax.block_until_ready(self.ref_fn(self.state.ref_params, batch))
        t4 = time.perf_counter()
        return {"sampling": t1 - t0, "host": t2 - t1, "step": t3 - t2, "reference": t4 - t3,
                "update": (t3 - t2) - (t4 - t3), "total": t3 - t0}


def run_point(group, new_tokens, args, reps) -> dict:
    start = time.perf_counter()
    point = Point(group, new_tokens, args.prompts, args.prompt_len)
    point()  # warm-up: compiles the reference function (the sampler and step compiled in __init__)
    setup = time.perf_counter() - start
    runs = [point() for _ in range(reps)]
    med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    spread = {k: (float(min(r[k] for r in runs)), float(max(r[k] for r in runs))) for k in runs[0]}
    return {"group": group, "new_tokens": new_tokens, "rows": args.prompts * group,
            "median": med, "range": spread, "peak_bytes": point.peak_bytes,
            "cache_bytes": point.cache_bytes, "setup_seconds": setup,
            "tokens": args.prompts * group * new_tokens}


def plot(g_points, l_points, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, pts, key, label in ((axes[0], g_points, "group", "G (samples per prompt), 128 new tokens"),
                                (axes[1], l_points, "new_tokens", "new tokens per sample, G = 8")):
        xs = [str(p[key]) for p in pts]
        bottom = np.zeros(len(pts))
        for phase, color in (("sampling", "tab:blue"), ("reference", "tab:orange"), ("update", "tab:green")):
            vals = np.array([max(p["median"][phase], 0.0) for p in pts])
            ax.bar(xs, vals, bottom=bottom, label=phase, color=color)
            bottom += vals
        ax.set_xlabel(label)
        ax.set_ylabel("seconds per GRPO step (median)")
        ax2 = ax.twinx()
        ax2.plot(xs, [p["peak_bytes"] / 1e6 for p in pts], "k.-", label="train-step peak MB")
        ax2.plot(xs, [p["cache_bytes"] / 1e6 for p in pts], "k:", label="KV cache MB")
        ax2.set_ylabel("MB")
        if ax is axes[0]:
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    fig.suptitle("GRPO step scaling (cpu-tiny, 2 prompts × G, float32, 2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = common.base_parser(__doc__)
    ap.add_argument("--groups", default=None, help="comma list (default 4,8,16,32,64; quick 4,8)")
    ap.add_argument("--lengths", default=None, help="comma list (default 128,256,512,1024; quick 128,256)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--png", default=os.path.join(common.BENCH_DIR, "scaling.png"))
    args = ap.parse_args(argv)
    reps = common.reps_of(args, full=3, quick=1)
    groups = [int(x) for x in (args.groups or ("4,8" if args.quick else "4,8,16,32,64")).split(",")]
    lengths = [int(x) for x in (args.lengths or ("128,256" if args.quick else "128,256,512,1024")).split(",")]
    rep = common.Report("scaling", args)
    rep.emit(f"## Scaling (cpu-tiny, {args.prompts} prompts of {args.prompt_len} tokens, β=0.04, "
             f"full-length completions; median of {reps})")
    rep.emit()
    cache: dict[tuple, dict] = {}

    def point(g, n):
        if (g, n) not in cache:
            cache[(g, n)] = run_point(g, n, args, reps)
        return cache[(g, n)]

    g_points = [point(g, 128) for g in groups]
    l_points = [point(8, n) for n in lengths]

    def rows(points):
        out = []
        for p in points:
            m = p["median"]
            total = m["total"]
            share = lambda k: f"{100 * max(m[k], 0) / total:.0f}%"
            out.append([p["group"], p["new_tokens"], p["rows"], f"{total:.2f}",
                        f"{m['sampling']:.2f} ({share('sampling')})", f"{m['reference']:.2f} ({share('reference')})",
                        f"{max(m['update'], 0):.2f} ({share('update')})", common.fmt(p["tokens"] / total),
                        common.fmt_bytes(p["peak_bytes"]), common.fmt_bytes(p["cache_bytes"])])
        return out

    headers = ["G", "new tokens", "rows", "step s", "sampling s", "reference s", "update s",
               "new tok/s", "train-step peak", "KV cache"]
    rep.emit("### Growing G (128 new tokens)")
    rep.emit()
    rep.table(headers, rows(g_points))
    rep.emit("### Growing completion length (G = 8)")
    rep.emit()
    rep.table(headers, rows(l_points))
    try:
        plot(g_points, l_points, args.png)
        rep.emit(f"Plot: `{os.path.relpath(args.png, common.ROOT)}`")
        rep.emit()
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
        rep.emit(f"(plot failed: {e})")
    first, last = l_points[0], l_points[-1]
    rep.results["scaling_length_time_growth"] = last["median"]["total"] / first["median"]["total"]
    rep.results["scaling_length_factor"] = last["new_tokens"] / first["new_tokens"]
    rep.results["scaling_group_time_growth"] = g_points[-1]["median"]["total"] / g_points[0]["median"]["total"]
    rep.results["scaling_group_factor"] = g_points[-1]["group"] / g_points[0]["group"]
    rep.details.update({"groups": g_points, "lengths": l_points})
    return rep.finish()


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
