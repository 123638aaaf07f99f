"""model.attention=splash against the model's own attention, compiled for TPU ahead of time.

    JAX_PLATFORMS=cpu python benchmarks/splash_aot.py kernel
    JAX_PLATFORMS=cpu python benchmarks/splash_aot.py train_step [--cost]

``kernel``: one v5p chip's attention of the 7B train step (4 rows x 1279 tokens, 32 heads of
128, bfloat16), forward and forward + backward, the model's own (``model.slot_attention``,
in ``model.causal_blocks`` query blocks) and splash: what XLA's ``cost_analysis()``
counts (FLOPs, bytes) and ``memory_analysis()``'s temporaries, beside the analytic count.
``train_step``: the ``deepseekmath-rl-7b`` train step for v5p-128 with
``data.batch_size=64 rl.num_micro_batches=16`` (256 rows per micro-batch, 4 per chip):
peak HBM per chip (``aot.memory``) and, with ``--cost``, ``aot.train_cost``. Compiler
estimates, nothing runs (needs libtpu). Not a ``bench_*`` script: ``run_all.py`` times this
CPU, and these are TPU compiles of minutes each.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for TPU; run nothing on it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from grpo_jax import aot  # noqa: E402
from grpo_jax.model import transformer as model, splash
from grpo_jax.config import apply_overrides, get_preset  # noqa: E402
from grpo_jax.parallel.sharding import on_mesh  # noqa: E402

ROWS, SEQ, HEADS, HEAD_DIM = 4, 256 + 1024 - 1, 32, 128


def kernel() -> None:
    mesh = Mesh(np.array(aot.topology_devices("v5p:2x2x1")[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    sds = lambda s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=jax.NamedSharding(mesh, jax.P()))
    qkv = sds((ROWS, SEQ, HEADS, HEAD_DIM))
    args = (qkv, qkv, qkv, sds((ROWS, SEQ), bool))

    def xla(q, k, v, mask):  # the model's own, as its cache-free forward calls it (causal query blocks)
        slots = jnp.broadcast_to(jnp.arange(SEQ), (ROWS, SEQ))
        return model.slot_attention(q, k, v, slots, mask, None, 0, jnp.bfloat16)[0]

    def with_backward(f):
        loss = lambda q, k, v, mask: jnp.sum(f(q, k, v, mask).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))

    dense = 4 * ROWS * HEADS * SEQ * SEQ * HEAD_DIM  # two matmuls, 2 FLOPs per multiply-add
    io = (4 * ROWS * SEQ * HEADS * HEAD_DIM * 2 + ROWS * SEQ) / 1e6
    print(f"analytic forward: {dense / 1e9:.1f} GFLOP every (query, key) pair, {dense / 2e9:.1f} causal; "
          f"q, k, v, output and mask {io:.1f} MB")
    print("| attention | pass | FLOPs counted (G) | bytes counted (MB) | temporaries (MB) |\n|---|---|---|---|---|")
    for name, f in (("xla", xla), ("splash", splash.attention)):
        for kind, g in (("forward", f), ("forward + backward", with_backward(f))):
            with on_mesh(mesh):
                compiled = jax.jit(g).lower(*args).compile()
            cost = compiled.cost_analysis()
            print(f"| {name} | {kind} | {cost.get('flops', 0.0) / 1e9:.2f} | {cost['bytes accessed'] / 1e6:.1f} "
                  f"| {compiled.memory_analysis().temp_size_in_bytes / 1e6:.1f} |")


def train_step(with_cost: bool) -> None:
    print("| attention | peak GB/chip | temporaries GB/chip | compile s |"
          + (" TFLOP/chip | GB/chip |" if with_cost else ""))
    for attention in ("xla", "splash"):
        cfg = apply_overrides(get_preset("deepseekmath-rl-7b"),
                              ["data.batch_size=64", "rl.num_micro_batches=16", f"model.attention={attention}"])
        mesh, _ = aot.topology_mesh(cfg, "v5p-128")
        rows = cfg.data.batch_size * cfg.rl.group_size
        compiled, secs = aot.compile_train_step(cfg, mesh, rows, 256)
        mem = aot.memory(compiled)
        line = f"| {attention} | {mem['peak_bytes'] / 1e9:.2f} | {mem['temp_bytes'] / 1e9:.2f} | {secs:.0f} |"
        if with_cost:
            flops, nbytes = aot.train_cost(cfg, mesh, rows, 256)[:2]
            line += f" {flops / 1e12:.2f} | {nbytes / 1e9:.1f} |"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("kernel", "train_step"))
    ap.add_argument("--cost", action="store_true", help="train_step: also aot.train_cost (8 more compiles)")
    args = ap.parse_args()
    kernel() if args.what == "kernel" else train_step(args.cost)


if __name__ == "__main__":
    main()
