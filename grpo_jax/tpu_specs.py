"""Per-chip TPU constants for the ahead-of-time fit check and roofline estimates.

Source: Google Cloud TPU documentation, "TPU versions" pages (cloud.google.com/tpu/docs/
v4, /v5e, /v5p, /v6e), per chip: peak bf16 dense FLOP/s, HBM capacity, HBM bandwidth.
``hbm_bytes`` is the capacity the issue states (v4 32 GB, v5e 16 GB, v5p 95 GB,
v6e 32 GB); the compiler reports slightly less usable HBM (e.g. 95.74 GiB on v5p).
``ici_bandwidth`` is the pages' "all-reduce bandwidth per Pod" over the pod's chips (v4,
v5e, v6e); v5p's page gives only its bidirectional ICI bandwidth per chip, so its value is
derived from that as docs/tpu.md ("What the twins count") explains.
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

# Slice preset name (grpo_jax.slices) -> topology name for get_topology_desc.
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
