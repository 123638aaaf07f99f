"""Which collectives does libtpu write for an FSDP gradient, and can the program change that?

    python benchmarks/fsdp_collectives.py [--rows 2] [--tokens 1024]

The train step shards every weight over the `fsdp` axis: XLA's partitioner gathers a layer's
weight before its matmuls and reduce-scatters its gradient. On v5p-128 (fsdp 64 over the
whole 4x4x4 torus) libtpu's optimized program holds all-reduces of whole matrices instead
(benchmarks/NOTES.md). This compiles a toy of that step for TPU ahead of time on this CPU
(libtpu + `jax.experimental.topologies`) in two write-ups:

* `gspmd`: weights sharded by annotation, the partitioner inserts the collectives (what
  the model does);
* `shard_map`: the collectives written by hand, `all_gather(tiled)` of each layer's weight
  in the forward pass, whose transpose is a `psum_scatter` (a reduce-scatter in the
  program handed to the compiler).

The toy: the gradient of a scan over 2 layers of `tanh(x @ w) @ w.T`, w [4096, 11008] bf16
(the 7B model's MLP shape) sharded over fsdp on its first axis, `--rows` rows per chip of
`--tokens` tokens. For each topology and write-up it prints the collectives of the optimized
program (an op inside the layer loop counted once) with the largest shape each moves.
"""

from __future__ import annotations

import argparse
import functools
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from grpo_jax import aot  # noqa: E402

# (topology, fsdp degree): the whole torus, and part of it
TOPOLOGIES = [("v5p:4x4x4", 64), ("v5p:4x4x8", 64), ("v5p:4x4x4", 16), ("v5e:8x8", 64), ("v5e:4x4", 16)]
W_SPEC = P(None, "fsdp", None)  # [layers, d, f]: each chip holds d / fsdp rows of every layer
X_SPEC = P(("data", "fsdp"), None, None)  # [rows, tokens, d]: every chip its own rows


def _layer(h: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.tanh(h @ w) @ w.T


def _loss(h: jax.Array) -> jax.Array:
    return jnp.sum(h.astype(jnp.float32) ** 2)


def loss_gspmd(ws: jax.Array, x: jax.Array) -> jax.Array:
    """ws [layers, d, f] sharded by W_SPEC, x [rows, tokens, d]: the partitioner gathers."""
    h, _ = jax.lax.scan(lambda h, w: (_layer(h, w), None), x, ws)
    return _loss(h)


def loss_shard_map(mesh: Mesh):
    """The same loss with the weight all-gather written by hand, per chip."""
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(W_SPEC, X_SPEC), out_specs=P())
    def loss(ws, x):
        def body(h, w):
            return _layer(h, jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)), None

        h, _ = jax.lax.scan(body, x, ws)
        return jax.lax.psum(_loss(h), ("data", "fsdp"))

    return loss


def fsdp_mesh(devices: list, fsdp: int) -> Mesh:
    """[data, fsdp] over the devices in order: fsdp-sized groups of neighbours."""
    return Mesh(np.array(devices).reshape(len(devices) // fsdp, fsdp), ("data", "fsdp"))


def gradient(loss, mesh: Mesh):
    """jit of d loss / d ws, the gradient sharded like the weights."""
    return jax.jit(jax.grad(loss), out_shardings=NamedSharding(mesh, W_SPEC))


def abstract_args(mesh: Mesh, rows: int, tokens: int, d: int = 4096, f: int = 11008, layers: int = 2):
    ws = jax.ShapeDtypeStruct((layers, d, f), jnp.bfloat16, sharding=NamedSharding(mesh, W_SPEC))
    x = jax.ShapeDtypeStruct((rows * mesh.size, tokens, d), jnp.bfloat16,
                             sharding=NamedSharding(mesh, X_SPEC))
    return ws, x


def written_collectives(lowered_text: str) -> dict:
    """{stablehlo collective: count} in the program handed to the compiler."""
    names = ("all_gather", "reduce_scatter", "all_reduce")
    return {n: len(re.findall(rf"stablehlo\.{n}\b", lowered_text)) for n in names}


def compiled_collectives(hlo_text: str) -> dict:
    """{kind: (count, largest shape)} in the compiled program (`aot.collective_ops`)."""
    out: dict = {}
    for op in aot.collective_ops(hlo_text):
        count, (shape, nbytes) = out.get(op["kind"], (0, ("", 0)))
        if op["bytes"] > nbytes:
            shape, nbytes = ",".join(op["shapes"]), op["bytes"]
        out[op["kind"]] = (count + 1, (shape, nbytes))
    return {k: (c, s) for k, (c, (s, _)) in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2, help="rows per chip (default 2)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per row (default 1024)")
    args = parser.parse_args()
    print(f"toy FSDP gradient, 2 layers of w [4096, 11008] bf16, {args.rows} rows x {args.tokens} "
          "tokens per chip; collectives of the optimized program (count, largest shape)")
    print("| topology | fsdp | write-up | handed to the compiler | compiled |")
    print("|---|---|---|---|---|")
    for topology, fsdp in TOPOLOGIES:
        mesh = fsdp_mesh(aot.topology_devices(topology), fsdp)
        for name, loss in (("gspmd", loss_gspmd), ("shard_map", loss_shard_map(mesh))):
            with jax.set_mesh(mesh):
                lowered = gradient(loss, mesh).lower(*abstract_args(mesh, args.rows, args.tokens))
                compiled = compiled_collectives(lowered.compile().as_text())
            written = ", ".join(f"{k} {v}" for k, v in written_collectives(lowered.as_text()).items() if v)
            cells = "; ".join(f"{k} x{c} {s}" for k, (c, s) in compiled.items())
            print(f"| {topology} | {fsdp} | {name} | {written or '(inserted by the partitioner)'} | {cells} |")


if __name__ == "__main__":
    main()
