#!/usr/bin/env python3
"""Compile a preset's programs for a TPU slice on this (CPU-only) machine and check they fit.

    python launch/compile.py --slice v5p-128 --preset deepseekmath-rl-7b --json out.json
    python launch/compile.py --slice v5p-128 --preset deepseekmath-rl-7b rl.async_steps=1 mesh.sample_devices=32

Needs libtpu, the TPU compiler, on this machine: `make install-test` installs it (or
`pip install -r requirements-tpu.txt` into your venv). For each program a run executes (sampler prefill,
sampler decode, train step -- which holds the reference log-prob pass --, the in-run
evaluation's prefill and decode, and with rl.max_tool_calls > 0 the prefill and decode of the
largest calls that continue rows after a tool call; the same programs the trainer runs: its
Sampler's calls, grpo_jax.sampler.turns' continuations and grpo_jax.rl.programs' train step)
it prints per-chip peak HBM against the chip's capacity, FLOPs and bytes with every loop
trip counted, a roofline time (a bound: no program runs faster) and an expected time (the
bound over the fraction of it measured programs reach on that chip,
``grpo_jax.aot.tpu_specs.EFFICIENCY``, with its source). Exits 1 naming the program and its
numbers as soon as one does not fit (the sampler is compiled first). The numbers are
compiler estimates, not measurements on a TPU. The JSON records which code wrote it
(``grpo_jax.aot.provenance``), so that a stale report can be told apart.

With ``mesh.sample_devices=N`` (and rl.async_steps >= 1) the slice is split as a run splits it
(``grpo_jax.parallel.split_mesh``): the sampler is compiled on the first N chips, with no train state
beside it, the train step on the rest, and the summary adds the hand-off of the policy between
them and the overlapped step, max(rollout, update) + hand-off.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for TPU; run nothing on it

from grpo_jax import aot  # noqa: E402  (after JAX_PLATFORMS)
from grpo_jax.rl import programs
from grpo_jax.aot import provenance
from grpo_jax.config import add_config_args, config_from_args  # noqa: E402
from grpo_jax.aot.tpu_specs import EFFICIENCY, chip_of, expected_seconds  # noqa: E402
from grpo_jax.sampler import turns  # noqa: E402


def check(cfg, slice_name: str, prompt_len: int, log=print, sampler_only: bool = False) -> dict:
    """{program: report} for every program of a run of ``cfg`` on ``slice_name``, plus a
    "summary"; raises aot.FitError naming the first program that does not fit, as soon as
    it is compiled (the sampler first: its KV cache is what usually does not fit, and it
    compiles faster than the train step), before any cost is counted. The sampler is compiled for one call of
    rl.sample_prompts questions (as the trainer makes them). Each program's FLOPs and bytes
    count every loop trip (``aot.sampler_cost``, ``aot.train_cost``); MFU is the model's
    FLOPs (``aot.model_flops``) over chips x peak x the estimated step time. The in-run
    evaluation's programs (`fitted_evaluation`) and a tool rollout's continuations
    (`tool_turns`) are reported beside the step, outside its summary.
    ``sampler_only``: stop after the sampler (no train step, no summary)."""
    mesh, topology = aot.topology_mesh(cfg, slice_name)
    chip = chip_of(topology)
    g = cfg.rl.group_size
    questions = cfg.data.batch_size
    per_call = cfg.rl.sample_prompts or questions
    calls = -(-questions // per_call)
    results = {}
    smesh = aot.sample_mesh(cfg, slice_name)
    halves = aot.split_of(cfg, slice_name)
    engine = aot.run_sampler(cfg, smesh).engine.name
    compiled, state_bytes = fitted_sampler(cfg, slice_name, prompt_len, lambda b: log(
        f"[1/2] sampler: {per_call} prompts x G={g} per call, {calls} call(s), {cfg.rl.sample_dtype} "
        f"policy, decode engine {engine}, mesh {dict(smesh.shape)}, {b / 1e9:.2f} GB/chip of "
        "train state resident"))
    rows = questions * programs.group_size(cfg)
    if not sampler_only:
        log(f"[2/2] train step: {rows} rows x ({prompt_len}+{cfg.rl.max_new_tokens}) tokens, "
            f"{cfg.rl.num_micro_batches} micro-batches, mesh {dict(mesh.shape)}")
        train, train_secs = aot.compile_train_step(cfg, mesh, rows, prompt_len)
        aot.check_fit("train_step", aot.fit(train, chip))
    useful = aot.model_flops(cfg, per_call, prompt_len)
    cost = _counted(lambda: aot.sampler_cost(cfg, smesh, per_call, g, prompt_len), ("prefill", "decode"), log)
    for name, (program, secs) in compiled.items():
        rep = aot.report(program, chip, cost[name], useful[name] / smesh.size, resident_bytes=state_bytes)
        rep.update(compile_seconds=secs, calls_per_step=calls)
        if name == "decode":
            per_token = cost.get("decode_per_token")
            rep.update(engine=engine, analytic_bytes_per_token=aot.decode_bytes_analytic(cfg, smesh, per_call, g, prompt_len),
                       flops_per_token=None if per_token is None else float(per_token[0]),
                       bytes_per_token=None if per_token is None else float(per_token[1]),
                       ici_bytes_per_token=None if per_token is None else float(per_token[2]),
                       ici_collectives_per_token=None if per_token is None else float(per_token[3]))
        results[f"sample_{name}"] = rep
        log(_line(f"sample_{name}", rep))
    # Fit only, outside the step's summary: it runs every run.eval_every steps.
    evaluation = fitted_evaluation(cfg, slice_name, prompt_len, state_bytes, log)
    # Outside the summary too: how many continuations a step makes depends on what the model writes.
    evaluation.update(tool_turns(cfg, slice_name, prompt_len, state_bytes, log))
    if sampler_only:
        return {**results, **evaluation}
    cost = _counted(lambda: {"train_step": aot.train_cost(cfg, mesh, rows, prompt_len)}, ("train_step",), log)
    useful = aot.model_flops(cfg, questions, prompt_len)["train_step"]
    rep = aot.report(train, chip, cost["train_step"], useful / mesh.size)
    rep.update(compile_seconds=train_secs, calls_per_step=1)
    results["train_step"] = rep
    log(_line("train_step", rep))
    results["summary"] = summary(results, chip, slice_name=slice_name, topology=topology, chips=mesh.size,
                                 decode_engine=engine)
    if halves is not None:
        results["summary"].update(overlap(cfg, results, chip, halves))
        log(_overlap_line(results["summary"]))
    return {**results, **evaluation}


def overlap(cfg, results: dict, chip, halves) -> dict:
    """A split run's step (``split_mesh``): the hand-off of the ``rl.sample_dtype`` policy
    from the training chips to the sampling chips (``split_mesh.split_hand_off_seconds`` at the
    chip's ICI bandwidth, ``tpu_specs``: the figure the roofline charges collectives with, a
    copy crossing the same links) and the overlapped step, max(rollout, update) + hand-off,
    each as a bound and expected (the hand-off at the bandwidth fraction). MFU over every
    chip of the slice and the overlapped step."""
    from grpo_jax.model import transformer as model_lib
    from grpo_jax.parallel import split_mesh

    s = results["summary"]
    policy = split_mesh.hand_off_bytes(model_lib.param_shapes(cfg.model), cfg.rl.sample_dtype)
    bound = split_mesh.split_hand_off_seconds(policy, halves, chip.ici_bandwidth)
    out = {"sample_devices": halves.sample_devices, "train_devices": halves.train_devices,
           "chips": halves.sample_devices + halves.train_devices, "hand_off_bytes": policy,
           "hand_off_seconds": bound, "hand_off_seconds_expected": expected_seconds(bound, "interconnect", chip.name)}
    # The model's FLOPs over the slice: each program's per-chip count times its mesh's chips.
    flops = sum(r["model_flops_per_chip"] * r["calls_per_step"]
                * (halves.train_devices if k == "train_step" else halves.sample_devices)
                for k, r in results.items() if k.startswith(("sample_", "train_step")))
    for suffix in ("", "_expected"):
        rollout, update, hand = s[f"rollout_seconds{suffix}"], s[f"update_seconds{suffix}"], out[f"hand_off_seconds{suffix}"]
        step = None if None in (rollout, update, hand) else split_mesh.overlapped_step(rollout, update, hand)
        out[f"overlapped_seconds{suffix}"] = step
        out[f"mfu{suffix}"] = None if not step else flops / (out["chips"] * chip.peak_bf16_flops * step)
    return out


def _overlap_line(s: dict) -> str:
    if s["overlapped_seconds"] is None:
        return "  overlapped step not estimated (a cost was not counted)"
    return (f"  split {s['sample_devices']} sampling / {s['train_devices']} training chips: hand-off "
            f"{s['hand_off_bytes'] / 1e9:.1f} GB, bound {s['hand_off_seconds']:.3f} s (expected "
            f"{_seconds(s['hand_off_seconds_expected'])} s); overlapped step bound {s['overlapped_seconds']:.1f} s "
            f"(expected {_seconds(s['overlapped_seconds_expected'])} s)")


def fitted_sampler(cfg, slice_name: str, prompt_len: int, announce=lambda state_bytes: None):
    """(the sampler's compiled programs for one call of rl.sample_prompts questions, the
    train state's bytes per chip); aot.FitError naming the first program that does not fit
    HBM beside the train state (the train step's donated arguments stay resident while the
    sampler runs)."""
    mesh, topology = aot.topology_mesh(cfg, slice_name)
    # A split run's sampling chips hold no train state.
    state_bytes = 0 if aot.split_of(cfg, slice_name) else aot.bytes_per_chip(aot.train_state(cfg, mesh)[1])
    announce(state_bytes)
    per_call = cfg.rl.sample_prompts or cfg.data.batch_size
    compiled = aot.compile_sampler(cfg, aot.sample_mesh(cfg, slice_name), per_call, cfg.rl.group_size, prompt_len)
    for name, (program, _) in compiled.items():  # every fit first: counting costs more compiles
        aot.check_fit(f"sample_{name}", aot.fit(program, chip_of(topology), state_bytes))
    return compiled, state_bytes


def fitted_evaluation(cfg, slice_name: str, prompt_len: int, state_bytes: int, log=print) -> dict:
    """{"eval_prefill" | "eval_decode": fit report} of the in-run evaluation's sampler call
    (``aot.run_sampler(..., evaluation=True)``: data.eval_size questions, one greedy row
    each, on the sampling mesh), beside the train state; aot.FitError when it does not fit.
    Its loop trips are not counted: it runs every run.eval_every steps, outside the step."""
    chip = chip_of(aot.topology_mesh(cfg, slice_name)[1])
    compiled = aot.compile_sampler(cfg, aot.sample_mesh(cfg, slice_name), cfg.data.eval_size, 1, prompt_len,
                                   evaluation=True)
    reports = {}
    for name, (program, secs) in compiled.items():
        rep = {**aot.fit(program, chip, state_bytes), "compile_seconds": secs}
        aot.check_fit(f"eval_{name}", rep)
        reports[f"eval_{name}"] = rep
        log(f"  eval_{name:9s} peak {(rep['peak_bytes'] + state_bytes) / 1e9:7.2f} / "
            f"{rep['hbm_capacity_bytes'] / 1e9:.0f} GB fits  ({cfg.data.eval_size} questions x 1 greedy row; "
            f"cost not counted)  compile {secs:.0f} s")
    return reports


def tool_turns(cfg, slice_name: str, prompt_len: int, state_bytes: int, log=print) -> dict:
    """{"tool_prefill_C+N" | "tool_decode_C+N": report} with rl.max_tool_calls > 0 (else
    {}): the largest calls a tool rollout makes to continue its rows after a tool call
    (``turns.continuation_shapes``: each running row's context, in a bucket of C tokens,
    prefilled afresh, and the rest of the budget decoded into N completion columns; every
    other continuation holds no more cache slots; every prompt filling its bucket of
    ``prompt_len``), at the most rows one call takes
    (``turns.continuation_rows``), beside the train state; aot.FitError when one does not
    fit. Each is costed with every loop trip counted (``aot.call_cost``) for the longest
    decode of its shape. ``calls_per_step`` is None: how many continuations a step makes
    depends on what the model writes."""
    if not cfg.rl.max_tool_calls:
        return {}
    mesh = aot.sample_mesh(cfg, slice_name)
    chip = chip_of(aot.topology_mesh(cfg, slice_name)[1])
    g = cfg.rl.group_size
    rows = turns.continuation_rows(cfg.data.batch_size * g, cfg.rl.sample_prompts, g)
    n = aot.matmul_params(cfg.model)
    reports = {}
    for used in turns.continuation_shapes(prompt_len, cfg.rl.max_new_tokens):
        call = turns.continuation_call(aot.run_sampler(cfg, mesh), rows, prompt_len + used, used)
        shape = f"{call.prompt_len}+{call.num_cols}"
        compiled = {name: aot.compile_lowered(f"tool_{name}_{shape}", lowered)
                    for name, lowered in aot.lower_tool_turn(cfg, mesh, rows, prompt_len + used, used).items()}
        for name, (program, _) in compiled.items():
            aot.check_fit(f"tool_{name}_{shape}", aot.fit(program, chip, state_bytes))
        of = lambda sampler: turns.continuation_call(sampler, rows, prompt_len + used, used)
        cost = _counted(lambda: aot.call_cost(cfg, mesh, of), ("prefill", "decode"), log)
        # The prefill recomputes tokens the rollout has read before: no useful FLOPs.
        useful = {"prefill": 0.0, "decode": 2.0 * n * rows * call.settings.max_new_tokens / mesh.size}
        for name, (program, secs) in compiled.items():
            rep = aot.report(program, chip, cost[name], useful[name], resident_bytes=state_bytes)
            rep.update(compile_seconds=secs, calls_per_step=None, rows=rows, used_tokens=used,
                       prompt_bucket=call.prompt_len, completion_bucket=call.num_cols)
            reports[f"tool_{name}_{shape}"] = rep
            log(_line(f"tool_{name}_{shape}", rep) + f"  ({rows} rows after {used} tokens)")
    return reports


# The length law the slot engine's expected rollout is stated for (``--slots``):
# log-normal completion lengths, median 300 tokens, sigma 0.8, cut at rl.max_new_tokens.
SLOT_LENGTHS = {"median": 300, "sigma": 0.8, "seed": 0}


def slot_engine(cfg, slice_name: str, prompt_len: int, log=print) -> dict:
    """{"slot_prefill" | "slot_decode" | "slot_append": report, "slot_rollout": estimate}:
    the slot engine's programs (``aot.slot_programs``: a chunk's prefill, the decode loop,
    a tool output's append) compiled for the sampling mesh beside the train state, each
    fit-checked (aot.FitError), and the rollout of a step expected from them: the decode
    steps of `SLOT_LENGTHS`' rows on the slots (``slots.schedule``) times one decode
    iteration's cost (the compiled loop's cost analysis counts its body once: one step,
    its insert and output branches included), plus each chunk's prefill (its layer loop
    counted once, so times the layers); against the static engine, whose calls each
    decode to the cap when a row of theirs reaches it."""
    import numpy as np

    from grpo_jax.sampler import slots as slots_lib

    mesh, topology = aot.topology_mesh(cfg, slice_name)
    chip = chip_of(topology)
    smesh = aot.sample_mesh(cfg, slice_name)
    state_bytes = 0 if aot.split_of(cfg, slice_name) else aot.bytes_per_chip(aot.train_state(cfg, mesh)[1])
    reports = {}
    programs_ = aot.slot_programs(cfg, smesh, prompt_len)
    num_slots = programs_["slot_decode"][1][1].row.shape[0]
    for name, (program, args, kw) in programs_.items():
        compiled, secs = aot.compile_lowered(name, program.lower(*args, **kw))
        rep = aot.fit(compiled, chip, state_bytes)
        aot.check_fit(name, rep)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        layers = cfg.model.num_layers if name == "slot_prefill" else 1
        flops, nbytes = layers * float(cost.get("flops", 0.0)), layers * float(cost.get("bytes accessed", 0.0))
        times = {"compute": flops / chip.peak_bf16_flops, "memory": nbytes / chip.hbm_bandwidth}
        bound = max(times, key=times.get)
        rep.update(compile_seconds=secs, flops_per_chip=flops, bytes_per_chip=nbytes, bound=bound,
                   estimated_seconds=times[bound], expected_seconds=expected_seconds(times[bound], bound, chip.name))
        reports[name] = rep
        log(f"  {name:13s} peak {(rep['peak_bytes'] + state_bytes) / 1e9:7.2f} / {rep['hbm_capacity_bytes'] / 1e9:.0f} GB "
            f"fits; per call {flops:.3g} FLOPs, {nbytes / 1e9:.2f} GB, {bound}-bound {times[bound] * 1e3:.2f} ms "
            f"(expected {_seconds(rep['expected_seconds'] and rep['expected_seconds'] * 1e3)} ms)  compile {secs:.0f} s")
    g, cap = cfg.rl.group_size, cfg.rl.max_new_tokens
    rows = cfg.data.batch_size * g
    rng = np.random.default_rng(SLOT_LENGTHS["seed"])
    lengths = np.minimum(np.ceil(rng.lognormal(np.log(SLOT_LENGTHS["median"]), SLOT_LENGTHS["sigma"], rows)), cap)
    steps, tokens = slots_lib.schedule(lengths.astype(int), num_slots)
    per_call = cfg.rl.sample_prompts or cfg.data.batch_size
    chunk_questions = programs_["slot_prefill"][1][1].shape[0]
    chunks = -(-cfg.data.batch_size // max(1, chunk_questions - 1))
    static_steps = slots_lib.static_steps(lengths.astype(int), per_call * g)
    estimate = {"slots": num_slots, "rows": rows, "lengths": {**SLOT_LENGTHS, "cap": cap},
                "mean_length": float(lengths.mean()), "at_cap": float(np.mean(lengths == cap)),
                "decode_steps": steps, "utilization": tokens / (num_slots * steps),
                "static_decode_steps": static_steps, "chunks": chunks}
    for suffix, key in (("", "estimated_seconds"), ("_expected", "expected_seconds")):
        d, p = reports["slot_decode"][key], reports["slot_prefill"][key]
        estimate[f"rollout_seconds{suffix}"] = None if None in (d, p) else steps * d + chunks * p
    reports["slot_rollout"] = estimate
    log(f"  slot rollout: {rows} rows on {num_slots} slots, lengths log-normal (median {SLOT_LENGTHS['median']}, "
        f"sigma {SLOT_LENGTHS['sigma']}, cap {cap}: mean {estimate['mean_length']:.0f}, {estimate['at_cap']:.0%} "
        f"at the cap): {steps} decode steps (utilization {estimate['utilization']:.2f}; static calls: "
        f"{static_steps}), bound {estimate['rollout_seconds']:.1f} s, expected "
        f"{_seconds(estimate['rollout_seconds_expected'])} s per step")
    return reports


def largest_fitting(candidates: list[int], fits) -> int | None:
    """The largest of ascending ``candidates`` for which ``fits`` holds, by bisection (fit
    is monotone: more questions per call never need less HBM); None if none does."""
    lo, hi = -1, len(candidates)  # candidates[lo] fits (or lo = -1), candidates[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            lo = mid
        else:
            hi = mid
    return candidates[lo] if lo >= 0 else None


def search_sample_prompts(cfg, slice_name: str, prompt_len: int, log=print) -> int:
    """The most questions per sampler call (rl.sample_prompts, a divisor of data.batch_size
    so that every call is full) whose sampler fits the slice beside the train state; fit
    checks only, no cost count. aot.FitError when not even one question fits."""
    batch = cfg.data.batch_size

    def fits(n: int) -> bool:
        try:
            fitted_sampler(cfg.replace(rl={"sample_prompts": n}), slice_name, prompt_len)
        except aot.FitError as e:
            log(f"  sample_prompts={n}: does not fit ({e})")
            return False
        log(f"  sample_prompts={n}: fits")
        return True

    best = largest_fitting([d for d in range(1, batch + 1) if batch % d == 0], fits)
    if best is None:
        raise aot.FitError(f"sample_prompts: not even one question ({cfg.rl.group_size} rows) per sampler call "
                           f"fits {slice_name}")
    return best


def _counted(count, names, log) -> dict:
    """``count()``, or {name: the NotCounted} for each of ``names`` when a cost twin does not
    fit HBM: the programs fit (checked before), only their time is unknown."""
    try:
        return count()
    except aot.NotCounted as e:
        log(f"  not counted: {e}")
        return dict.fromkeys(names, e)


def summary(results: dict, chip, **where) -> dict:
    """The step from its programs' reports: rollout (every sampler call) and update seconds,
    MFU (the model's FLOPs over chips x peak x their sum), the smallest HBM headroom; each
    time and MFU twice, from the roofline bounds (``rollout_seconds``, ``update_seconds``,
    ``mfu``) and from the expected times (``*_expected``). None when a program's cost could
    not be counted (``aot.NotCounted``)."""
    sampler = [r for k, r in results.items() if k.startswith("sample")]
    model_flops = sum(r["model_flops_per_chip"] * r["calls_per_step"] for r in results.values())
    out = {**where, "fits": True}
    for key, suffix in (("estimated_seconds", ""), ("expected_seconds", "_expected")):
        rollout = (sum(r[key] * r["calls_per_step"] for r in sampler)
                   if all(r[key] is not None for r in sampler) else None)
        update = results["train_step"][key]
        mfu = (None if rollout is None or update is None
               else model_flops / chip.peak_bf16_flops / (rollout + update) if rollout + update else 0.0)
        out.update({f"rollout_seconds{suffix}": rollout, f"update_seconds{suffix}": update, f"mfu{suffix}": mfu})
    eff = EFFICIENCY.get(chip.name)
    return {**out, "efficiency": None if eff is None else {"compute": eff.compute, "bandwidth": eff.bandwidth},
            "not_counted": [k for k, r in results.items() if r["estimated_seconds"] is None],
            "min_headroom": min(r["headroom"] for r in results.values()),
            "compile_seconds": sum(r["compile_seconds"] for r in results.values())}


def _seconds(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _line(name: str, r: dict) -> str:
    cost = (f"{r['flops_per_chip'] / 1e12:9.2f} TFLOP/chip  {r['bytes_per_chip'] / 1e9:9.2f} GB/chip  "
            f"{r['ici_bytes_per_chip'] / 1e9:8.2f} GB ICI/chip  bound {r['estimated_seconds']:8.3f} s ({r['bound']}-bound), "
            f"expected {_seconds(r['expected_seconds'])} s"
            if r["estimated_seconds"] is not None else "cost not counted (its twin does not fit HBM)")
    return (f"  {name:14s} peak {(r['peak_bytes'] + r['resident_bytes']) / 1e9:7.2f} / {r['hbm_capacity_bytes'] / 1e9:.0f} GB "
            f"{'fits' if r['fits'] else 'DOES NOT FIT'}  {cost}  compile {r['compile_seconds']:.0f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slice", required=True,
                        help="slice preset (v5p-128, v4-32, v5litepod-256, ...) or topology (v5e:2x2)")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per row (default 256)")
    parser.add_argument("--json", help="write the per-program reports here")
    parser.add_argument("--sampler-only", action="store_true",
                        help="compile and count the sampler's programs only (no train step)")
    parser.add_argument("--search-sample-prompts", action="store_true",
                        help="find the most questions per sampler call (rl.sample_prompts) that fit, "
                             "by sampler fit checks only, and print it")
    parser.add_argument("--slots", action="store_true",
                        help="compile and cost the slot engine's programs (rl.decode=slots) and its expected "
                             "rollout at a stated length law, instead of the run's programs")
    add_config_args(parser)
    args = parser.parse_args(argv)
    if not aot.libtpu_available():
        print(f"{parser.prog}: error: libtpu is not installed: make install-test (or pip install -r requirements-tpu.txt)",
              file=sys.stderr)
        return 2
    cfg = config_from_args(args)
    if args.search_sample_prompts:
        try:
            best = search_sample_prompts(cfg, args.slice, args.prompt_len)
        except aot.FitError as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return 1
        print(f"rl.sample_prompts={best}: the most questions per sampler call whose sampler fits "
              f"{args.slice} beside the train state ({best * cfg.rl.group_size} rows per call)")
        return 0
    if args.slots:
        try:
            results = slot_engine(cfg, args.slice, args.prompt_len)
        except aot.FitError as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return 1
        results["code"] = provenance.record(["launch/compile.py"])
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=float))
        return 0
    try:
        results = check(cfg, args.slice, args.prompt_len, sampler_only=args.sampler_only)
    except aot.FitError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    results["code"] = provenance.record(["launch/compile.py"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.sampler_only:
        sampler = {k: r for k, r in results.items() if k.startswith("sample")}
        dec = results["sample_decode"]
        if dec["estimated_seconds"] is None:
            print("sampler fits; its cost was not counted (a cost twin does not fit HBM)")
            return 0
        rollout = {key: sum(r[key] * r["calls_per_step"] for r in sampler.values())
                   if all(r[key] is not None for r in sampler.values()) else None
                   for key in ("estimated_seconds", "expected_seconds")}
        print(f"sampler fits: rollout bound {rollout['estimated_seconds']:.1f} s per step (expected "
              f"{_seconds(rollout['expected_seconds'])} s), decode {dec['bytes_per_token'] / 1e9:.2f} GB/token/chip against "
              f"{dec['analytic_bytes_per_token'] / 1e9:.2f} GB of weights + KV read, "
              f"{dec['ici_collectives_per_token']:.0f} collectives of {dec['ici_bytes_per_token'] / 1e6:.1f} MB "
              "in all per token; compiler estimates")
        return 0
    s = results["summary"]
    if s["not_counted"]:
        print(f"fits (HBM headroom {s['min_headroom']:.0%}); step time not estimated: the cost of "
              f"{', '.join(s['not_counted'])} was not counted (a cost twin does not fit HBM)")
        return 0
    eff = s["efficiency"]
    expected = ("" if s["rollout_seconds_expected"] is None else
                f"; expected {s['rollout_seconds_expected']:.1f} s + {s['update_seconds_expected']:.1f} s, "
                f"MFU {s['mfu_expected']:.0%}, at {eff['compute']:.0%} of the compute bound and "
                f"{eff['bandwidth']:.0%} of the bandwidth bound (measured elsewhere: grpo_jax/aot/tpu_specs.py)")
    step = ("" if "overlapped_seconds" not in s else
            f" ({s['sample_devices']} chips sample, {s['train_devices']} train: overlapped step "
            f"{s['overlapped_seconds']:.1f} s, expected {_seconds(s['overlapped_seconds_expected'])} s)")
    print(f"fits: bound (roofline of every loop trip) rollout {s['rollout_seconds']:.1f} s + update "
          f"{s['update_seconds']:.1f} s per step{step}, MFU {s['mfu']:.0%} (model FLOPs){expected}; HBM headroom "
          f"{s['min_headroom']:.0%}; compiler estimates, not TPU measurements")
    return 0


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
