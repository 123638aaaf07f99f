#!/usr/bin/env python3
"""Run launch/compile.py over the preset x slice matrix of docs/tpu.md and print the table.

    python launch/compile_matrix.py [--only PRESET] [--missing | --stale | --table] [--out benchmarks/tpu_check]

Each entry runs in its own process (one compile at a time; a failure to fit is a
result, not a crash) and writes OUT/PRESET_SLICE[_LABEL].json; --missing runs only the
entries without one, so a matrix longer than a working session resumes; --stale runs those
and the ones whose report older code wrote; --table compiles nothing and prints the table of
the reports already there. The table is compiler estimates, not measured TPU runs: each time
and MFU as its roofline bound and as the expected value at the fraction of the bound measured
programs reach on the chip (``grpo_jax.tpu_specs.EFFICIENCY``), and whether the report is
current: a report records the fingerprint of the code that wrote it (``grpo_jax.provenance``),
recomputed here. OUT/before/matrix.json (the matrix of the earlier estimator, which counted
loop bodies once and analytic FLOPs for MFU) is shown beside it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from grpo_jax import provenance
from grpo_jax.tpu_specs import expected_seconds

ROOT = Path(__file__).resolve().parent.parent
# (preset, slice, config overrides, label of the overridden row). The presets as they are,
# the 7B recipe's other reading of "batch size 1024" (1024 outputs = 16 questions x 64,
# see the preset's docstring), 64 questions per sampler call where HBM allows it (v5p-128:
# more rows per read of the weights), what makes it fit v4-32, each of those and v5litepod-256
# with an int8 KV cache (half the cache's bytes per decoded token), v5p-128's update without
# recomputation (its train step has the HBM to spare, docs/tpu.md), the v5p-128 preset that
# takes all of these with 16 decode phases, v5litepod-256 with less recomputation (dots
# saved; none needs twice the micro-batches), the v4-32 and v5litepod-256 presets, and the
# smallest slice it fits on (v5p-8: 4 chips; one question per sampler call, 16 rows per
# micro-batch). The 1.5B preset is sized for one 8-chip host and runs as it is on both
# (docs/tpu.md).
OUTPUTS_1024 = ["data.batch_size=16", "rl.num_micro_batches=4"]
MATRIX = [
    ("cpu-tiny", "v5litepod-8", [], ""),
    ("smollm2-135m", "v5litepod-8", [], ""),
    ("smollm2-135m", "v6e-8", [], ""),
    ("qwen2.5-1.5b", "v5litepod-8", [], ""),
    ("qwen2.5-1.5b", "v6e-8", [], ""),
    ("deepseekmath-rl-7b", "v5p-128", [], ""),
    ("deepseekmath-rl-7b", "v5p-128", ["rl.sample_prompts=64"], "sample_prompts-64"),
    ("deepseekmath-rl-7b", "v5p-128", ["rl.sample_prompts=64", "rl.kv_dtype=int8"], "sample_prompts-64-int8"),
    ("deepseekmath-rl-7b", "v5p-128", ["rl.sample_prompts=64", "rl.kv_dtype=int8", "model.remat=none"],
     "sample_prompts-64-int8-remat-none"),
    ("deepseekmath-rl-7b-v5p-128", "v5p-128", [], ""),
    ("deepseekmath-rl-7b", "v5p-128", OUTPUTS_1024, "1024-outputs"),
    ("deepseekmath-rl-7b", "v4-32", [], ""),
    ("deepseekmath-rl-7b", "v4-32", ["rl.sample_prompts=2"], "sample_prompts-2"),
    ("deepseekmath-rl-7b", "v4-32", ["rl.sample_prompts=2", "rl.kv_dtype=int8", "rl.num_micro_batches=512"],
     "sample_prompts-2-int8-mb512"),
    ("deepseekmath-rl-7b-v4-32", "v4-32", [], ""),
    ("deepseekmath-rl-7b", "v5litepod-256", [], ""),
    ("deepseekmath-rl-7b", "v5litepod-256", ["rl.kv_dtype=int8"], "int8"),
    ("deepseekmath-rl-7b", "v5litepod-256", ["rl.kv_dtype=int8", "model.remat=dots"], "int8-remat-dots"),
    ("deepseekmath-rl-7b", "v5litepod-256", ["rl.kv_dtype=int8", "model.remat=none", "rl.num_micro_batches=512"],
     "int8-remat-none-mb512"),
    ("deepseekmath-rl-7b-v5litepod-256", "v5litepod-256", [], ""),
    ("deepseekmath-rl-7b", "v5p-8", ["rl.sample_prompts=1", "rl.num_micro_batches=4096"], "smallest"),
    # LoRA on one host (docs/lora.md): the 7B recipe's preset, and the 1.5B beside its full fine-tune.
    ("deepseekmath-rl-7b-lora", "v5p-8", [], ""),
    ("deepseekmath-rl-7b-lora", "v6e-8", [], ""),
    ("deepseekmath-rl-7b-lora", "v5litepod-8", [], ""),
    ("qwen2.5-1.5b", "v5litepod-8", ["model.lora_rank=16", "model.lora_alpha=32"], "lora"),
]


def report_path(out: Path, preset: str, slice_name: str, label: str) -> Path:
    return out / f"{preset}_{slice_name}{'_' + label if label else ''}.json"


def command(preset: str, slice_name: str, extra: list[str], label: str, out: Path) -> list[str]:
    path = report_path(out, preset, slice_name, label)
    where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return ["launch/compile.py", "--slice", slice_name, "--preset", preset, "--json", where, *extra]


def run_one(preset: str, slice_name: str, extra: list[str], label: str, out: Path) -> dict:
    path = report_path(out, preset, slice_name, label)
    cmd = [sys.executable, str(ROOT / "launch/compile.py"), "--slice", slice_name,
           "--preset", preset, "--json", str(path), *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row = {"preset": preset, "slice": slice_name, "label": label,
           "command": " ".join(["python", *command(preset, slice_name, extra, label, out)]),
           "wall_seconds": time.perf_counter() - start, "exit_code": proc.returncode}
    if proc.returncode == 0:
        row["results"] = json.loads(path.read_text())
    else:
        row["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return row


def code_status(results: dict | None) -> str:
    """"current", "stale" (older code wrote the report) or "no record" (written before
    reports kept one: stale or not, nobody knows)."""
    current = provenance.is_current((results or {}).get("code"))
    return {True: "current", False: "stale", None: "no record"}[current]


def expected(results: dict) -> dict:
    """{"rollout", "update", "mfu"}: the step's expected values from its programs' bounds
    (recomputed with today's ``tpu_specs.EFFICIENCY``, so a report written before it had
    them shows them too); None where a bound was not counted or the chip is unknown."""
    s = results["summary"]
    chip = s.get("topology", "").split(":")[0]
    exp = {k: expected_seconds(r.get("estimated_seconds"), r.get("bound"), chip) * r.get("calls_per_step", 1)
           if expected_seconds(r.get("estimated_seconds"), r.get("bound"), chip) is not None else None
           for k, r in results.items() if k.startswith(("sample_", "train_step"))}
    sampler = [v for k, v in exp.items() if k.startswith("sample_")]
    rollout = sum(sampler) if sampler and None not in sampler else None
    update = exp.get("train_step")
    mfu = None
    if rollout is not None and update is not None and s.get("mfu") and s.get("rollout_seconds") is not None:
        mfu = s["mfu"] * (s["rollout_seconds"] + s["update_seconds"]) / (rollout + update)
    return {"rollout": rollout, "update": update, "mfu": mfu}


def _pair(bound, exp, fmt) -> str:
    if bound is None:
        return "not counted"
    return f"{fmt(bound)} / {fmt(exp) if exp is not None else '–'}"


def table(rows: list[dict], before: dict | None = None) -> str:
    """Markdown rows; the sampler's peaks include the train state it shares HBM with; times
    and MFU as "bound / expected" (``expected``); "code": ``code_status``.
    ``before``: {(preset, slice, label): row} of an earlier matrix, shown beside each row."""
    before = before or {}
    lines = ["| preset | slice | fits? | decode engine | peak HBM/chip: prefill / decode / train (GB) | "
             "HBM headroom | rollout s: bound / expected | update s: bound / expected | "
             "MFU (model FLOPs): bound / expected | code | before: rollout / update s, MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["preset"] + (f" ({r['label']})" if r.get("label") else "")
        old = before.get((r["preset"], r["slice"], r.get("label", "")))
        old_s = old.get("results", {}).get("summary") if old else None
        was = (f"{old_s['rollout_seconds']:.1f} / {old_s['update_seconds']:.1f}, {old_s['mfu']:.0%}"
               if old_s else "no" if old else "")
        if "results" not in r:
            lines.append(f"| {name} | {r['slice']} | no: {r['error']} | | | | | | | | {was} |")
            continue
        res, s = r["results"], r["results"]["summary"]
        peaks = " / ".join(f"{(res[k]['peak_bytes'] + res[k]['resident_bytes']) / 1e9:.2f}"
                           for k in ("sample_prefill", "sample_decode", "train_step"))
        exp = expected(res)
        secs = lambda x: f"{x:.1f}"
        lines.append(f"| {name} | {r['slice']} | yes | {s['decode_engine']} | {peaks} | {s['min_headroom']:.0%} | "
                     f"{_pair(s['rollout_seconds'], exp['rollout'], secs)} | "
                     f"{_pair(s['update_seconds'], exp['update'], secs)} | "
                     f"{_pair(s['mfu'], exp['mfu'], lambda x: f'{x:.0%}')} | {code_status(res)} | {was} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run only this preset's rows")
    parser.add_argument("--missing", action="store_true",
                        help="run only the rows with no report in OUT yet (a matrix cut short resumes)")
    parser.add_argument("--stale", action="store_true",
                        help="run only the rows with no report, or one that older code wrote (see --table's code column)")
    parser.add_argument("--table", action="store_true",
                        help="compile nothing: merge the reports in OUT into matrix.json and print the table")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/tpu_check"), help="JSON folder")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    def current(m) -> bool:
        path = report_path(out, m[0], m[1], m[3])
        return path.exists() and code_status(json.loads(path.read_text())) == "current"

    todo = [m for m in MATRIX if args.only in (None, m[0]) and not args.table
            and not (args.missing and report_path(out, m[0], m[1], m[3]).exists())
            and not (args.stale and current(m))]
    rows = []
    for i, (preset, slice_name, extra, label) in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {preset} on {slice_name} {' '.join(extra)}...", flush=True)
        rows.append(run_one(preset, slice_name, extra, label, out))
        print(f"    {'fits' if rows[-1]['exit_code'] == 0 else rows[-1].get('error')} "
              f"({rows[-1]['wall_seconds']:.0f} s)", flush=True)
    # --only reruns some rows: keep the others' last results, in the matrix's order.
    index = lambda r: (r["preset"], r["slice"], r.get("label", ""))
    saved = out / "matrix.json"
    merged = {index(r): r for r in (json.loads(saved.read_text()) if saved.exists() else [])}
    # The reports on disk are the latest results: written by a matrix cut short, or by a
    # row's command run by hand.
    for preset, slice_name, extra, label in MATRIX:
        path = report_path(out, preset, slice_name, label)
        if not path.exists():
            continue
        results = json.loads(path.read_text())
        if merged.get((preset, slice_name, label), {}).get("results") != results:
            merged[preset, slice_name, label] = {
                "preset": preset, "slice": slice_name, "label": label, "exit_code": 0, "wall_seconds": None,
                "command": " ".join(["python", *command(preset, slice_name, extra, label, out)]),
                "results": results}
    # A row whose compile was killed (by the OOM killer, say) has no result: not recorded,
    # so --missing runs it again.
    for r in rows:
        if r["exit_code"] < 0:
            print(f"{r['preset']} on {r['slice']} {r['label']}: killed by signal {-r['exit_code']}; not recorded")
    merged.update({index(r): r for r in rows if r["exit_code"] >= 0})
    order = [(p, s, label) for p, s, _, label in MATRIX]
    rows_all = [merged[k] for k in order if k in merged]
    saved.write_text(json.dumps(rows_all, indent=1))
    old = out / "before" / "matrix.json"
    print(table(rows_all, {index(r): r for r in json.loads(old.read_text())} if old.exists() else None))
    return 0 if all(r["exit_code"] in (0, 1) for r in rows) else 1


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
