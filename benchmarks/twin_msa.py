"""What memory-space assignment does to the decode's counted bytes, compiled for TPU ahead of time.

    JAX_PLATFORMS=cpu python benchmarks/twin_msa.py [--preset qwen2.5-1.5b] [--questions 16]

For each slice and sampling tensor degree, the decode's HBM bytes per token and chip as
``aot.sampler_cost`` counts them from its cost twins compiled with memory-space assignment
(MSA) on and off (``aot.TWIN_OPTIONS`` sets it off), beside the floor
``aot.decode_bytes_analytic`` (the bf16 weight shard plus the KV the step must read).
docs/tpu.md, "What the twins count", explains the difference. Compiler estimates, nothing
runs (needs libtpu). Not a ``bench_*`` script: ``run_all.py`` times this CPU, and these are
TPU compiles of minutes each.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for TPU; run nothing on it

from grpo_jax import aot  # noqa: E402
from grpo_jax.config import apply_overrides, get_preset  # noqa: E402

CASES = [("v6e-8", 2), ("v6e-8", 1), ("v5litepod-8", 2), ("v5litepod-8", 4)]


def per_token_bytes(cfg, slice_name: str, questions: int, prompt_len: int, msa: bool) -> float:
    saved = aot.TWIN_OPTIONS["tpu"]
    aot.TWIN_OPTIONS["tpu"] = {**saved, "xla_msa_enable": msa}
    try:
        cost = aot.sampler_cost(cfg, aot.sample_mesh(cfg, slice_name), questions, cfg.rl.group_size, prompt_len)
    finally:
        aot.TWIN_OPTIONS["tpu"] = saved
    return float(cost["decode_per_token"][1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--questions", type=int, default=16, help="questions per sampler call")
    parser.add_argument("--prompt-len", type=int, default=256)
    args = parser.parse_args(argv)
    print("| slice, sampling mesh | counted with MSA on (GB) | with MSA off (GB) | floor: weights + KV read (GB) | seconds |")
    print("|---|---|---|---|---|")
    for slice_name, tensor in CASES:
        start = time.perf_counter()
        cfg = apply_overrides(get_preset(args.preset), [f"mesh.sample_tensor={tensor}"])
        mesh = aot.sample_mesh(cfg, slice_name)
        floor = aot.decode_bytes_analytic(cfg, mesh, args.questions, cfg.rl.group_size, args.prompt_len)
        on, off = (per_token_bytes(cfg, slice_name, args.questions, args.prompt_len, msa) for msa in (True, False))
        print(f"| {slice_name}, {mesh.shape['data']} replicas x tensor {tensor} | {on / 1e9:.2f} ({on / floor:.2f}x) | "
              f"{off / 1e9:.2f} ({off / floor:.2f}x) | {floor / 1e9:.2f} | {time.perf_counter() - start:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
