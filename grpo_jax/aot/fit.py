"""Whether a compiled program fits a chip: its per-chip memory (``memory_analysis()``)
against HBM, with other buffers resident meanwhile; ``FitError`` names a program that does
not fit (or that the compiler refuses for lack of HBM)."""

import time
from typing import Any

import jax
import numpy as np

from grpo_jax.aot.tpu_specs import ChipSpec


class FitError(RuntimeError):
    """A program whose per-chip peak HBM exceeds the chip's capacity (or fails to compile)."""


def bytes_per_chip(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (its shards only,
    without the TPU's tile padding, which matters only for tiny arrays)."""
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def memory(compiled) -> dict:
    """Per-chip bytes from ``memory_analysis()``; peak = arguments + temps + outputs -
    aliases (donated outputs reuse their argument buffers)."""
    m = compiled.memory_analysis()
    out = {"argument_bytes": int(m.argument_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
           "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes)}
    out["peak_bytes"] = (out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"]
                         - out["alias_bytes"])
    return out


def fit(compiled, chip: ChipSpec, resident_bytes: int = 0) -> dict:
    """Per-chip memory of a compiled program (``memory``) against the chip's HBM, with
    ``resident_bytes`` of other buffers live meanwhile: fits, headroom."""
    mem = memory(compiled)
    used = mem["peak_bytes"] + resident_bytes
    return {**mem, "resident_bytes": resident_bytes, "hbm_capacity_bytes": chip.hbm_bytes,
            "fits": used <= chip.hbm_bytes, "headroom": 1 - used / chip.hbm_bytes}


def check_fit(name: str, rep: dict) -> None:
    """Raise FitError naming the program and its numbers when it does not fit HBM."""
    if not rep["fits"]:
        raise FitError(
            f"{name}: peak HBM {rep['peak_bytes'] / 1e9:.2f} GB per chip (arguments "
            f"{rep['argument_bytes'] / 1e9:.2f} + temps {rep['temp_bytes'] / 1e9:.2f} + outputs "
            f"{rep['output_bytes'] / 1e9:.2f} - aliases {rep['alias_bytes'] / 1e9:.2f})"
            + (f" + {rep['resident_bytes'] / 1e9:.2f} GB train state held meanwhile" if rep["resident_bytes"] else "")
            + f" exceeds the chip's {rep['hbm_capacity_bytes'] / 1e9:.0f} GB")


def compile_lowered(name: str, lowered) -> tuple[Any, float]:
    """(compiled, seconds); FitError naming the program when the compiler runs out of HBM
    (XLA refuses to compile what cannot fit)."""
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # jax raises JaxRuntimeError; match on XLA's status text
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise FitError(f"{name}: {str(e).splitlines()[0]}") from None
    return compiled, time.perf_counter() - start
