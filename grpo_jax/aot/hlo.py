"""Reading a compiled program's optimized HLO text: its computations, the trip counts of
the while loops around each, and its collectives with the bytes they move."""

import re

import numpy as np


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1,
                "f64": 8, "s64": 8}
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")

_SCATTER_FUSION = re.compile(r"^%?all-reduce-scatter\S* .*-> (.*) \{$")
# A piece of an asynchronous collective: its channel id and its fusion config's flag_start
# (-1 on the start, a flag index on each continuation).
_ASYNC_PIECE = re.compile(r'channel_id=(\d+),.*"async_collective_fusion_config":\{"flag_start":"(-?\d+)"')
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")


def _computations(hlo_text: str) -> dict:
    """{computation name: (header line, instruction lines)} of an HLO module's text
    (instructions before any header: the computation named "")."""
    comps, name = {"": ("", [])}, ""
    for line in hlo_text.splitlines():
        header = None if line.startswith(" ") else _HEADER.match(line.rstrip())
        if header:
            name = header.group(1)
            comps[name] = (line.rstrip(), [])
        elif line.startswith("  "):
            comps[name][1].append(line)
    return comps


def _loop_trips(comps: dict) -> dict:
    """{computation: [trip count of each while loop around it, outermost first]}. A loop's
    trips are the bound its condition compares the counter with (the largest s32 constant
    there: scans count up from 0 to their length)."""
    parent, trips = {}, {}
    for name, (_, lines) in comps.items():
        for line in lines:
            for callee in re.findall(r"(?:body|condition|calls|to_apply)=%([\w.\-]+)", line):
                parent.setdefault(callee, name)
            loop = re.search(r" while\(.*condition=%([\w.\-]+), body=%([\w.\-]+)", line)
            if loop:
                bounds = re.findall(r"s32\[\]\S* constant\((\d+)\)", "\n".join(comps.get(loop.group(1), ("", []))[1]))
                trips[loop.group(2)] = max(map(int, bounds)) if bounds else 1
    out = {}
    for name in comps:
        chain, c = [], name
        while c in parent:
            if c in trips:
                chain.append(trips[c])
            c = parent[c]
        out[name] = chain[::-1]
    return out


def collective_ops(hlo_text: str) -> list[dict]:
    """Every collective instruction of the optimized HLO: {"kind", "bytes", "shapes",
    "loops"}: its result shapes (e.g. ``["bf16[4096,11008]"]``) and their bytes, and the
    trip counts of the while loops around it, outermost first (it runs their product of
    times per call). The TPU backend writes a reduce-scatter as an ``all-reduce-scatter``
    fusion around an all-reduce of the whole array: that all-reduce is listed as the
    reduce-scatter it is, with the fusion's result (the shard). An asynchronous collective
    that the TPU backend overlaps with other work is split into pieces, each written as the
    whole collective with one channel id: its start (``flag_start`` -1) and continuations
    spread over the fusions it overlaps (in a loop body, or over the layers of a
    written-out program). It moves its bytes once, so it is listed once, where it starts."""
    comps = _computations(hlo_text)
    loops_of = _loop_trips(comps)
    ops, started, continued = [], set(), {}
    for name, (header, lines) in comps.items():
        scatter = _SCATTER_FUSION.match(header)
        for line in lines:
            if "=" not in line:
                continue
            rhs = line.split("=", 1)[1]
            kind = next((c for c in _COLLECTIVES if re.search(rf"\s{c}(-start)?\(", rhs)), None)
            if kind is None:
                continue
            head = rhs.split(kind, 1)[0]
            if kind == "all-reduce" and scatter:
                kind, head = "reduce-scatter", scatter.group(1)
            shapes = _SHAPE.findall(head)
            nbytes = sum((int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1)
                         * _DTYPE_BYTES.get(dtype, 4) for dtype, dims in shapes)
            op = {"kind": kind, "bytes": nbytes, "shapes": [f"{t}[{d}]" for t, d in shapes],
                  "loops": loops_of[name]}
            piece = _ASYNC_PIECE.search(rhs)
            if piece is None or piece.group(2) == "-1":
                ops.append(op)
                if piece is not None:
                    started.add(piece.group(1))
            else:
                continued.setdefault(piece.group(1), op)
    # A chain whose start is not in the text is listed once, at its first piece.
    return ops + [op for chain, op in continued.items() if chain not in started]


def collectives(hlo_text: str) -> dict:
    """{collective: {"count", "bytes"}} over the optimized HLO (``collective_ops``; an op
    inside a loop body is counted once, like cost_analysis)."""
    out = {}
    for op in collective_ops(hlo_text):
        entry = out.setdefault(op["kind"], {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += op["bytes"]
    return {k: out[k] for k in _COLLECTIVES if k in out}
