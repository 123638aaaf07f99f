"""Would jax's ragged paged attention kernel read less per decoded token than the shared engine?

    python benchmarks/paged_attention_bytes.py [--page-size 128] [--no-compile]

Arithmetic on the shapes of the matrix rows (docs/tpu.md, "Ragged paged attention"), no
TPU needed. A decode step is bound by HBM bandwidth, so what a step must read per chip is
its time. For every row this prints, averaged over the rl.max_new_tokens - 1 steps (step
s has s completion tokens in the cache):

* `shared floor`: the bf16 sampling weights on the chip, each prompt slot's KV once (the
  shared engine's `PrefixCache`: a question's rows read one copy) and each row's filled
  completion slots (`aot.decode_bytes_analytic`'s count, step by step);
* `shared, N phases`: the same, with each row reading the whole phase window it is in
  (`sampler.cache.decode_windows` with N phases) instead of its filled slots;
* `paged`: jax's `ragged_paged_attention` kernel with the question's rows pointing at
  the same prompt pages: the kernel walks each sequence's page list on its own, so every
  row reads its prompt's pages, plus its filled completion pages (whole pages of
  --page-size slots). With bf16 pages, and with float8_e4m3fn pages (the kernel's
  8-bit option: one scalar scale per cache, not our int8 scale per slot and head).

The KV sizes per chip come from the sampler's own abstract arguments on the slice's
sampling mesh (`aot.sampler_calls`), so heads split over 'tensor' are counted per chip.
Unless --no-compile, the kernel is also compiled ahead of time for one layer of each row
on its slice (`jax.experimental.topologies`, libtpu), to show the shapes are ones it takes.
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from grpo_jax import aot  # noqa: E402
from grpo_jax.config import apply_overrides, get_preset  # noqa: E402
from grpo_jax.sampler.engines import ENGINES  # noqa: E402
from grpo_jax.shapes import bucket_length  # noqa: E402
from grpo_jax.parallel.sharding import batch_degree  # noqa: E402

PROMPT_LEN = 256  # launch/compile.py's prompt bucket
ROWS = (  # (preset, slice, overrides): matrix rows of launch/compile_matrix.py
    ("deepseekmath-rl-7b", "v5p-128", []),
    ("deepseekmath-rl-7b", "v5p-128", ["rl.sample_prompts=64"]),
    ("deepseekmath-rl-7b", "v5p-128", ["rl.sample_prompts=64", "rl.kv_dtype=int8"]),
    ("deepseekmath-rl-7b", "v5litepod-256", []),
    ("qwen2.5-1.5b", "v5litepod-8", []),
    ("deepseekmath-rl-7b-lora", "v5p-8", []),
)


def shapes(preset: str, slice_name: str, overrides: list[str]) -> dict:
    """Per chip: the sampling weights' bytes, the KV bytes of one slot of one row, the
    decode rows and prompt slots, the completion bucket and the steps."""
    cfg = apply_overrides(get_preset(preset), overrides)
    smesh = aot.sample_mesh(cfg, slice_name)
    per_call = cfg.rl.sample_prompts or cfg.data.batch_size
    _, args, _ = aot.sampler_calls(cfg, smesh, per_call, cfg.rl.group_size, PROMPT_LEN)["decode"]
    params, cache = args[0], args[1]
    replicas = batch_degree(smesh)
    slots = cache.mask.shape[0] // replicas
    rows = len(ENGINES["shared"].layout(per_call, cfg.rl.group_size, replicas)[1]) // replicas
    kv = aot.bytes_per_chip((cache.k, cache.v, cache.k_scale, cache.v_scale))
    m = cfg.model
    kv_heads = m.num_kv_heads // math.gcd(m.num_kv_heads, smesh.shape["tensor"])
    return {"cfg": cfg, "mesh": smesh, "weights": aot.bytes_per_chip(params),
            "slot_bytes": kv / (slots * PROMPT_LEN), "bf16_slot_bytes": m.num_layers * 2 * kv_heads * m.head_dim * 2,
            "rows": rows, "slots": slots, "kv_heads": kv_heads, "tc": bucket_length(cfg.rl.max_new_tokens),
            "steps": cfg.rl.max_new_tokens - 1}


def per_token(s: dict, page: int) -> dict:
    """Mean bytes per decode step per chip of each way to attend (module docstring)."""
    steps = np.arange(1, s["steps"] + 1)
    weights, rows, sb = s["weights"], s["rows"], s["slot_bytes"]
    prompt = s["slots"] * PROMPT_LEN * sb
    out = {"shared floor": weights + prompt + rows * steps.mean() * sb}
    for phases in (4, 8, 16):
        windows = np.array([s["tc"] * (i + 1) // phases for i in range(phases)])
        window = windows[np.searchsorted(windows, steps)]
        out[f"shared, {phases} phases"] = weights + prompt + rows * window.mean() * sb
    pages = np.ceil((PROMPT_LEN + steps) / page) * page
    out["paged, bf16"] = weights + rows * pages.mean() * s["bf16_slot_bytes"]
    out["paged, fp8"] = weights + rows * pages.mean() * s["bf16_slot_bytes"] / 2
    return out


def compile_kernel(s: dict, slice_name: str, page: int) -> float:
    """Seconds to compile the kernel for one layer of one chip's rows, on the slice's chip."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    cfg = s["cfg"].model
    heads = cfg.num_heads * s["kv_heads"] // cfg.num_kv_heads
    pages_per_row = -(-(PROMPT_LEN + s["tc"]) // page)
    device = aot.topology_devices(aot.topology_mesh(s["cfg"], slice_name)[1])[0]
    mesh = Mesh(np.array([device]), ("x",))
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, PartitionSpec()))
    rows = s["rows"]
    args = (spec((rows, heads, cfg.head_dim), jnp.bfloat16),
            spec((rows * pages_per_row, page, 2 * s["kv_heads"], cfg.head_dim), jnp.bfloat16),
            spec((rows,), jnp.int32), spec((rows, pages_per_row), jnp.int32), spec((rows + 1,), jnp.int32),
            spec((1,), jnp.int32))
    # Block sizes given: the kernel's own lookup asks jax.devices(), which is this CPU.
    attend = lambda *a: rpa.ragged_paged_attention(*a, sm_scale=cfg.head_dim ** -0.5,
                                                   num_kv_pages_per_block=min(pages_per_row, 8),
                                                   num_queries_per_block=min(rows, 32))
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        jax.jit(attend).lower(*args).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-size", type=int, default=128, help="slots per page (default 128)")
    parser.add_argument("--no-compile", action="store_true", help="skip the kernel's AOT compile")
    args = parser.parse_args()
    names = None
    print(f"GB per decoded token per chip, mean over the steps; prompt bucket {PROMPT_LEN}, "
          f"page size {args.page_size}")
    for preset, slice_name, overrides in ROWS:
        s = shapes(preset, slice_name, overrides)
        figures = per_token(s, args.page_size)
        if names is None:
            names = list(figures)
            print("| row | rows / prompt slots per chip | " + " | ".join(names) + " | paged bf16 / shared floor |"
                  + (" kernel compiles |" if not args.no_compile else ""))
            print("|---" * (len(names) + 3 + (not args.no_compile)) + "|")
        label = f"{preset} {slice_name}" + (f" ({' '.join(overrides)})" if overrides else "")
        cells = [f"{figures[n] / 1e9:.2f}" for n in names]
        ratio = figures["paged, bf16"] / figures["shared floor"]
        compiled = "" if args.no_compile else f" {compile_kernel(s, slice_name, args.page_size):.1f} s |"
        print(f"| {label} | {s['rows']} / {s['slots']} | " + " | ".join(cells) + f" | {ratio:.2f}x |" + compiled)


if __name__ == "__main__":
    main()
