#!/usr/bin/env python3
"""Run launch/compile.py over the preset x slice matrix of docs/tpu.md and print the table.

    python launch/compile_matrix.py [--only PRESET] [--missing | --stale | --table] [--out benchmarks/tpu_check]
    python launch/compile_matrix.py --overlap [--missing] [--out benchmarks/tpu_check]

Each entry runs in its own process (one compile at a time; a failure to fit is a
result, not a crash) and writes OUT/PRESET_SLICE[_LABEL].json; --missing runs only the
entries without one, so a matrix longer than a working session resumes; --stale runs those
and the ones whose report older code wrote; --table compiles nothing and prints the table of
the reports already there. The table is compiler estimates, not measured TPU runs: each time
and MFU as its roofline bound and as the expected value at the fraction of the bound measured
programs reach on the chip (``grpo_jax.aot.tpu_specs.EFFICIENCY``), and whether the report is
current: a report records the fingerprint of the code that wrote it (``grpo_jax.aot.provenance``),
recomputed here. OUT/before/matrix.json (the matrix of the earlier estimator, which counted
loop bodies once and analytic FLOPs for MFU) is shown beside it.

--overlap prints the table of the splits in ``OVERLAP`` instead: the slice cut into sampling
and training chips (``mesh.sample_devices``, rl.async_steps=1), the rollout, the update, the
hand-off and the overlapped step max(rollout, update) + hand-off, beside the synchronous step
(rollout + update on every chip: the matrix's report of the same preset), and the split whose
expected overlapped step is the shortest. Each split is scaled from the synchronous report
(``scaled_split``: no compile); ``--overlap --missing`` first compiles the splits without a report
in OUT/overlap/ (``launch/compile.py ... mesh.sample_devices=N``) and shows them beside.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from grpo_jax.aot import provenance
from grpo_jax.parallel.slices import get_slice
from grpo_jax.parallel.split_mesh import overlapped_step
from grpo_jax.aot.tpu_specs import expected_seconds

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


# (preset, slice, sampling chips of each split): the 7B presets of the two pod slices, split
# in two. Whole hosts sample (4 chips, the sampling mesh's tensor degree); the batch is
# sharded over the training chips' data x fsdp groups, whose count must divide a micro-batch's
# 256 rows, so the training chips are a power of two times the training mesh's tensor degree.
OVERLAP = [
    ("deepseekmath-rl-7b-v5p-128", "v5p-128", (32, 48, 56)),
    ("deepseekmath-rl-7b-v5litepod-256", "v5litepod-256", (128, 192, 224)),
]


def overlap_path(out: Path, preset: str, slice_name: str, sample: int) -> Path:
    return out / "overlap" / f"{preset}_{slice_name}_sample-{sample}.json"


def overlap_args(sample: int) -> list[str]:
    return ["rl.async_steps=1", f"mesh.sample_devices={sample}"]


def _hand_off(preset: str, slice_name: str, sample: int, train: int, chip: str) -> tuple[float, float, float]:
    """(bytes, bound s, expected s) of one hand-off of ``preset``'s sampling copy from
    ``train`` chips to ``sample`` chips of the slice (``split_mesh.hand_off_seconds``)."""
    from grpo_jax.model import transformer as model_lib
    from grpo_jax.parallel import split_mesh
    from grpo_jax.config import get_preset
    from grpo_jax.aot.tpu_specs import CHIPS

    cfg = get_preset(preset)
    tensor = cfg.mesh.sample_tensor or get_slice(slice_name).sample_mesh[2]
    policy = split_mesh.hand_off_bytes(model_lib.param_shapes(cfg.model), cfg.rl.sample_dtype)
    bound = split_mesh.hand_off_seconds(policy, sample / tensor, tensor, train, CHIPS[chip].ici_bandwidth)
    return policy, bound, expected_seconds(bound, "interconnect", chip)


def _scaled_rollout(results: dict, cfg, factor: float, weights_bytes: float, chip) -> tuple:
    """(bound, expected, peak bytes per chip) of the rollout when each sampling replica
    takes ``factor`` times the rows of the synchronous report's, in as many calls: every
    count of each call scales by ``factor`` except the decode's read of the weights
    (``weights_bytes`` per chip per step, the same whatever the rows), and so do the
    programs' temporaries (the KV cache), not their arguments (the weights)."""
    steps = cfg.rl.max_new_tokens - 1
    bound = expected_s = 0.0
    peak = 0
    for name in ("sample_prefill", "sample_decode"):
        r = results[name]
        fixed = weights_bytes * steps if name == "sample_decode" else 0.0
        times = {"compute": r["flops_per_chip"] * factor / chip.peak_bf16_flops,
                 "memory": (fixed + (r["bytes_per_chip"] - fixed) * factor) / chip.hbm_bandwidth,
                 "interconnect": r["ici_bytes_per_chip"] * factor / chip.ici_bandwidth}
        which = max(times, key=times.get)
        bound += times[which] * r["calls_per_step"]
        expected_s += expected_seconds(times[which], which, chip.name) * r["calls_per_step"]
        peak = max(peak, r["argument_bytes"] + r["temp_bytes"] * factor)
    return bound, expected_s, peak


def scaled_split(results: dict, preset: str, slice_name: str, sample: int) -> dict:
    """A split's step estimated from the synchronous report ``results`` of N chips, without
    a compile. The training chips run the same per-chip micro-batch N / train times as often
    (rl.num_micro_batches x N / train), so the update's bound and expected time scale by
    N / train and its peak HBM by the state and batch it holds (the train step's arguments).
    The sampling chips keep the preset's questions per call, each replica taking N / sample
    times the rows (``_scaled_rollout``: the weights' read per decode step does not grow)
    when that fits HBM with no train state beside it; else they take N / sample times the
    calls of the same per-chip program (rl.sample_prompts x sample / N questions a call).
    The settings it takes are in "settings"; a compiled row (``--overlap --missing``) counts
    the split's own programs instead."""
    from grpo_jax.config import get_preset
    from grpo_jax.aot.tpu_specs import CHIPS

    s, step = results["summary"], _expected_step(results)
    chip = CHIPS[s.get("topology", "").split(":")[0]]
    n = s["chips"]
    train = n - sample
    cfg = get_preset(preset)
    policy, hb, he = _hand_off(preset, slice_name, sample, train, chip.name)
    tensor = cfg.mesh.sample_tensor or get_slice(slice_name).sample_mesh[2]
    bound, exp, peak = _scaled_rollout(results, cfg, n / sample, policy / tensor, chip)
    questions = cfg.rl.sample_prompts
    if peak > chip.hbm_bytes:
        bound, exp, questions = step["rollout"][0] * n / sample, step["rollout"][1] * n / sample, questions * sample / n
        peak = max(results[k]["peak_bytes"] for k in ("sample_prefill", "sample_decode"))
    out = {"rollout": (bound, exp), "update": tuple(x * n / train for x in step["update"]), "hand_off": (hb, he)}
    out["overlapped"] = tuple(overlapped_step(*xs) for xs in zip(out["rollout"], out["update"], out["hand_off"]))
    t = results["train_step"]
    out.update(sample_devices=sample, train_devices=train, hand_off_bytes=policy, sample_peak_bytes=peak,
               train_peak_bytes=t["peak_bytes"] + t["argument_bytes"] * (n / train - 1),
               hbm_bytes=t["hbm_capacity_bytes"], settings=(questions, cfg.rl.num_micro_batches * n / train))
    return out


def _expected_step(results: dict) -> dict:
    """{"rollout", "update", ["hand_off", "overlapped"], "synchronous"}: (bound, expected)
    seconds of a report's step (``expected``'s times; the hand-off at the interconnect's
    fraction); None where not counted."""
    s, exp = results["summary"], expected(results)
    chip = s.get("topology", "").split(":")[0]
    out = {"rollout": (s["rollout_seconds"], exp["rollout"]), "update": (s["update_seconds"], exp["update"])}
    if "hand_off_seconds" in s:
        out["hand_off"] = (s["hand_off_seconds"], expected_seconds(s["hand_off_seconds"], "interconnect", chip))
        out["overlapped"] = tuple(None if None in xs else overlapped_step(*xs)
                                  for xs in zip(out["rollout"], out["update"], out["hand_off"]))
    out["synchronous"] = tuple(None if None in xs else xs[0] + xs[1] for xs in zip(out["rollout"], out["update"]))
    return out


def overlap_table(synchronous: dict, compiled: dict) -> str:
    """Markdown rows of every ``OVERLAP`` split: scaled from the synchronous report
    (``scaled_split``), and compiled where ``compiled`` holds its report; per slice, the
    split whose expected overlapped step is shortest. ``synchronous``: {(preset, slice): the
    matrix's report}; ``compiled``: {(preset, slice, sampling chips): report}."""
    secs = lambda x: f"{x:.1f}"
    pair = lambda p: _pair(p[0], p[1], secs)
    gb = lambda x: f"{x / 1e9:.1f}"
    lines = ["| slice | chips: sample / train | estimate | questions per sampler call, micro-batches | "
             "rollout s | update s | hand-off s (GB) | overlapped step s | synchronous step s | "
             "peak per chip: sample / train / HBM (GB) | code |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    best = {}
    for preset, slice_name, samples in OVERLAP:
        sync = synchronous.get((preset, slice_name))
        if sync is None:
            lines.append(f"| {slice_name} | | no report of {preset} on {slice_name}: run the matrix first | "
                         "| | | | | | | |")
            continue
        step = _expected_step(sync)
        n = sync["summary"].get("chips")
        t = sync["train_step"]
        lines.append(f"| {slice_name} | {n} / {n}, in turn | synchronous ({preset}) | "
                     f"{get_settings(preset)} | {pair(step['rollout'])} | {pair(step['update'])} | – | – | "
                     f"{pair(step['synchronous'])} | {gb(sync_sample_peak(sync))} / "
                     f"{gb(t['peak_bytes'] + t['resident_bytes'])} / {gb(t['hbm_capacity_bytes'])} | {code_status(sync)} |")
        splittable = get_slice(slice_name).splittable
        for sample in samples:
            est = scaled_split(sync, preset, slice_name, sample)
            q, mb = est["settings"]
            kind = "scaled" if splittable else "scaled; the compiler refuses it (one slice)"
            lines.append(f"| {slice_name} | {sample} / {est['train_devices']} | {kind} | {q:g}, {mb:g} | "
                         f"{pair(est['rollout'])} | {pair(est['update'])} | {est['hand_off'][0]:.3f} / "
                         f"{est['hand_off'][1]:.3f} ({gb(est['hand_off_bytes'])}) | {pair(est['overlapped'])} | "
                         f"{pair(step['synchronous'])} | {gb(est['sample_peak_bytes'])} / {gb(est['train_peak_bytes'])} / "
                         f"{gb(est['hbm_bytes'])} | "
                         f"{code_status(sync)} |")
            # A split the TPU compiler refuses on one slice is shown (what two slices might
            # give, the DCN hand-off aside) but never picked.
            candidates = [("scaled", est["overlapped"][1], sample, est["train_devices"])] if splittable else []
            res = compiled.get((preset, slice_name, sample))
            if res is not None:
                got, summary = _expected_step(res), res["summary"]
                tr = res["train_step"]
                lines.append(f"| {slice_name} | {sample} / {summary['train_devices']} | compiled | "
                             f"{get_settings(preset)} | {pair(got['rollout'])} | {pair(got['update'])} | "
                             f"{got['hand_off'][0]:.3f} / {got['hand_off'][1]:.3f} ({gb(summary['hand_off_bytes'])}) | "
                             f"{pair(got['overlapped'])} | {pair(step['synchronous'])} | "
                             f"{gb(sync_sample_peak(res))} / {gb(tr['peak_bytes'])} / {gb(tr['hbm_capacity_bytes'])} | "
                             f"{code_status(res)} |")
                candidates.append(("compiled", got["overlapped"][1], sample, summary["train_devices"]))
            for kind, seconds, s_chips, t_chips in candidates:
                if seconds is not None and (slice_name not in best or seconds < best[slice_name][1]):
                    best[slice_name] = (kind, seconds, s_chips, t_chips, step["synchronous"][1])
    lines.append("")
    for preset, slice_name, _ in OVERLAP:
        if (preset, slice_name) in synchronous and not get_slice(slice_name).splittable:
            lines.append(f"{slice_name}: no split; the TPU compiler runs no program on part of this slice (limited ICI "
                         f"routing), so sampling and training share one mesh (synchronous "
                         f"{_expected_step(synchronous[preset, slice_name])['synchronous'][1]:.1f} s) or need two slices")
    for slice_name, (kind, seconds, s_chips, t_chips, sync_s) in best.items():
        lines.append(f"{slice_name}: shortest expected overlapped step {seconds:.1f} s ({kind}) with {s_chips} chips "
                     f"sampling and {t_chips} training; synchronous on every chip {sync_s:.1f} s")
    return "\n".join(lines)


def sync_sample_peak(results: dict) -> float:
    """The sampler's largest peak per chip in a report, with what is resident beside it."""
    return max(results[k]["peak_bytes"] + results[k]["resident_bytes"] for k in ("sample_prefill", "sample_decode"))


def get_settings(preset: str) -> str:
    from grpo_jax.config import get_preset

    cfg = get_preset(preset)
    return f"{cfg.rl.sample_prompts}, {cfg.rl.num_micro_batches}"


def run_overlap(out: Path, missing: bool) -> int:
    """--overlap: with ``missing``, compile the ``OVERLAP`` splits without a report in
    OUT/overlap/ first (the real compiles: long); then print ``overlap_table`` from the
    synchronous reports in OUT and the compiled splits. 0 unless a compile crashed."""
    (out / "overlap").mkdir(parents=True, exist_ok=True)
    failed, compiled, synchronous = False, {}, {}
    for preset, slice_name, samples in OVERLAP:
        path = report_path(out, preset, slice_name, "")
        if path.exists():
            synchronous[preset, slice_name] = json.loads(path.read_text())
        for sample in samples:
            path = overlap_path(out, preset, slice_name, sample)
            if missing and not path.exists() and get_slice(slice_name).splittable:
                print(f"{preset} on {slice_name}, {sample} chips sampling...", flush=True)
                row = run_one(preset, slice_name, overlap_args(sample), "", out, path)
                print(f"    {'fits' if row['exit_code'] == 0 else row.get('error')} ({row['wall_seconds']:.0f} s)",
                      flush=True)
                failed |= row["exit_code"] not in (0, 1)
            if path.exists():
                compiled[preset, slice_name, sample] = json.loads(path.read_text())
    print(overlap_table(synchronous, compiled))
    return 1 if failed else 0


def report_path(out: Path, preset: str, slice_name: str, label: str) -> Path:
    return out / f"{preset}_{slice_name}{'_' + label if label else ''}.json"


def command(preset: str, slice_name: str, extra: list[str], label: str, out: Path) -> list[str]:
    path = report_path(out, preset, slice_name, label)
    where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return ["launch/compile.py", "--slice", slice_name, "--preset", preset, "--json", where, *extra]


def run_one(preset: str, slice_name: str, extra: list[str], label: str, out: Path, path: Path | None = None) -> dict:
    path = path or report_path(out, preset, slice_name, label)
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
    parser.add_argument("--overlap", action="store_true",
                        help="the split rows (OVERLAP: sampling and training chips apart, rl.async_steps=1) "
                             "and their table instead of the matrix")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/tpu_check"), help="JSON folder")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.overlap:
        return run_overlap(out, args.missing)
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
