"""Per-chip TPU constants for the ahead-of-time fit check and roofline estimates.

Source: Google Cloud TPU documentation, "TPU versions" pages (cloud.google.com/tpu/docs/
v4, /v5e, /v5p, /v6e), per chip: peak bf16 dense FLOP/s, HBM capacity, HBM bandwidth.
``hbm_bytes`` is the capacity the issue states (v4 32 GB, v5e 16 GB, v5p 95 GB,
v6e 32 GB); the compiler reports slightly less usable HBM (e.g. 95.74 GiB on v5p).
``ici_bandwidth`` is the pages' "all-reduce bandwidth per Pod" over the pod's chips (v4,
v5e, v6e); v5p's page gives only its bidirectional ICI bandwidth per chip, so its value is
derived from that as docs/tpu.md ("What the twins count") explains.

A roofline time (``aot.report``: the largest of FLOPs / peak, bytes / HBM bandwidth and
collective bytes / ICI bandwidth) is a bound: no program reaches it. ``EFFICIENCY`` holds,
per chip, the fraction of the bound that measured programs reach, one for compute-bound
programs and one for bandwidth-bound ones (HBM or interconnect), each with its source;
``expected_seconds`` divides a bound by it.
"""

from dataclasses import dataclass

from grpo_jax.errors import UnknownNameError


@dataclass(frozen=True)
class ChipSpec:
    name: str
    peak_bf16_flops: float  # FLOP/s per chip
    hbm_bytes: float  # bytes per chip
    hbm_bandwidth: float  # bytes/s per chip
    ici_bandwidth: float  # all-reduce bytes/s per chip over the inter-chip interconnect


GB = 1e9

CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("v4", 275e12, 32 * GB, 1228e9, 1.1e15 / 4096),
    "v5e": ChipSpec("v5e", 197e12, 16 * GB, 819e9, 51.2e12 / 256),
    "v5p": ChipSpec("v5p", 459e12, 95 * GB, 2765e9, 1200e9 / 2),
    "v6e": ChipSpec("v6e", 918e12, 32 * GB, 1640e9, 102.4e12 / 256),
}

@dataclass(frozen=True)
class Efficiency:
    """Fractions of a roofline bound reached by measured programs on a chip."""

    compute: float  # of FLOPs / peak, for a compute-bound program
    bandwidth: float  # of bytes / bandwidth, for a program bound by HBM or the interconnect
    compute_source: str
    bandwidth_source: str


# Compute-bound: MaxText's published MFU for dense bf16 pre-training of the nearest model on
# the chip (model FLOPs, so recomputation is not counted: a program with remat reaches more of
# its own FLOPs than this, and its expected time here errs long). This project's own update
# measured 31% MFU on one H200 with the presets' settings and 41% with the GPU's options
# (cuDNN attention, bf16 unembedding operands, remat=dots; issue #66, benchmarks/NOTES.md); it
# has not run on a TPU.
_MAXTEXT_LLAMA2 = "https://github.com/google/maxtext/blob/main/getting_started/Run_Llama2.md"
_MAXTEXT_GEMMA = "https://github.com/google/maxtext/blob/main/getting_started/Run_Gemma.md"
_MAXTEXT_TIERS = "https://maxtext.readthedocs.io/en/maxtext-v0.2.0/reference/models/tiering.html"
# Bandwidth-bound: no public TPU figure of a decode step against its HBM floor was found; the
# project's shared-engine decode measured 0.19 of its floor on one H200 (qwen2.5-1.5b's shape,
# 256 rows, against the datasheet's bandwidth; the 7B shape with 8 of its layers 0.31; issue #66,
# benchmarks/NOTES.md). The lower one is taken, and the interconnect is given the same fraction
# (collectives have not been measured).
_DECODE_GPU = ("issue #66, measured on one H200 (benchmarks/accelerator_session.sh): the shared-engine "
               "decode of qwen2.5-1.5b's shape at 256 rows read 0.19 of its HBM floor (the 7B shape 0.31)")
EFFICIENCY: dict[str, Efficiency] = {
    "v4": Efficiency(0.57, 0.19, f"MaxText, Llama2-70B on v4-128, bf16: 57% MFU ({_MAXTEXT_LLAMA2})", _DECODE_GPU),
    "v5e": Efficiency(0.58, 0.19, f"MaxText, Gemma-7B on v5e-256, bf16: 58% MFU ({_MAXTEXT_GEMMA})", _DECODE_GPU),
    "v5p": Efficiency(0.60, 0.19, f"MaxText, Gemma-7B on v5p-128, bf16: 60% MFU ({_MAXTEXT_GEMMA})", _DECODE_GPU),
    "v6e": Efficiency(0.45, 0.19, f"MaxText, Llama 3.1 8B on v6e-256, bf16: 45.46% MFU ({_MAXTEXT_TIERS})",
                      _DECODE_GPU),
}


def expected_seconds(bound_seconds: float | None, bound: str | None, chip: str) -> float | None:
    """A roofline bound divided by the fraction of it measured programs reach on ``chip``
    (``EFFICIENCY``): ``bound`` "compute" takes the compute fraction, "memory" and
    "interconnect" the bandwidth one. None for a bound not counted or a chip without figures."""
    eff = EFFICIENCY.get(chip)
    if bound_seconds is None or bound is None or eff is None:
        return None
    return bound_seconds / (eff.compute if bound == "compute" else eff.bandwidth)


# Slice preset name (grpo_jax.parallel.slices) -> topology name for get_topology_desc.
TOPOLOGIES: dict[str, str] = {
    "v4-8": "v4:2x2x1",
    "v4-32": "v4:2x2x4",
    "v5litepod-8": "v5e:2x4",
    "v5litepod-16": "v5e:4x4",
    "v5litepod-64": "v5e:8x8",
    "v5litepod-256": "v5e:16x16",
    "v5p-8": "v5p:2x2x1",
    "v5p-128": "v5p:4x4x4",
    "v6e-8": "v6e:2x4",
    "v6e-256": "v6e:16x16",
}


def chip_of(topology: str) -> ChipSpec:
    """The chip of a topology name like ``v5p:4x4x4``; KeyError names the known chips."""
    family = topology.split(":", 1)[0]
    try:
        return CHIPS[family]
    except KeyError:
        raise UnknownNameError(f"no chip constants for topology {topology!r}; known: {', '.join(CHIPS)}") from None
