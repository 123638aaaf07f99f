"""Slot utilization and tokens per second: the static engine (each call decodes until its
longest row ends) against the slot engine (``rl.decode=slots``: slots refilled as rows end),
on the same rows, the same rows in flight, interleaved in one process.

Utilization = tokens produced / (rows in flight x decode steps run): the share of a decode's
row-steps that produce a token rather than padding. Three workloads:

* **smollm2**: SmolLM2-135M-Instruct (its real weights) at T = 1 on chat prompts (GSM8K-style
  and arithmetic, four each), G rows a prompt, cap 256 (G = 8) and 512 (G = 4). The static
  engine samples calls of ``--static-prompts`` prompts (their rows are the rows in flight);
  the slot engine as many slots, over one queue of every row. tokens/s = tokens / wall time
  of the whole rollout (prefill included).
* **testbed**: the testbed's shapes (a 2-layer model, G = 16, 56 new tokens) with random
  weights, whose rows end on the stop token (about one draw in 64), 16 slots (one question's
  rows) over a queue of 16 questions.
* **tool turns**: a 4-token random model that calls the sandbox often; prefill tokens per
  tool call and tokens/s, the static path's continuation calls against the slot engine's
  kept caches (only the tool's output goes through the model).
* **length model**: the 7B preset's shapes (1024 rows in flight, 64 calls a step, cap 1024)
  with lengths drawn from a heavy-tailed law (log-normal, median 300 tokens, sigma 0.8, cut
  at the cap); no model: the slot engine's schedule (``slots.schedule``, the host loop the
  engine runs, which the tests hold to the engine's own decode steps) against static calls.

Usage: python benchmarks/bench_slots.py [--quick] [--json OUT] [--skip-smollm2] [--static-prompts N]
"""

from __future__ import annotations

import time

import common  # sets OMP_WAIT_POLICY before jax loads

import jax
import numpy as np


def _static_utilization(lengths, rows_per_call: int) -> tuple[int, float]:
    from grpo_jax.sampler import slots

    steps = slots.static_steps(lengths, rows_per_call)
    return steps, float(np.sum(lengths)) / (rows_per_call * steps)


def length_model(rows_in_flight: int = 1024, calls: int = 64, cap: int = 1024, seed: int = 0) -> list[dict]:
    """Utilization of both schedules on drawn lengths, the slots at several queue sizes."""
    from grpo_jax.sampler import slots

    rng = np.random.default_rng(seed)
    out = []
    for queue in (1, 4, 16, calls):
        lengths = np.minimum(np.ceil(rng.lognormal(np.log(300), 0.8, rows_in_flight * queue)), cap).astype(int)
        steps, tokens = slots.schedule(lengths, rows_in_flight)
        static_steps, static_util = _static_utilization(lengths, rows_in_flight)
        out.append({"workload": "length model (7B preset shapes)", "rows_in_flight": rows_in_flight,
                    "queue_per_slot": queue, "rows": len(lengths), "cap": cap,
                    "mean_length": float(lengths.mean()), "at_cap": float(np.mean(lengths == cap)),
                    "static_steps": static_steps, "static_utilization": static_util,
                    "slot_steps": steps, "slot_utilization": tokens / (rows_in_flight * steps),
                    "expected_rollout_ratio": steps / static_steps})
    return out


def _agreement(a, b) -> dict:
    """How far two engines' rows agree: rows identical, and over each row's columns before its
    first differing token the largest |Δ log-prob| (the engines sum in other orders; a draw
    whose uniform lands within that rounding of a CDF boundary may then pick a neighbour)."""
    ta, tb = np.asarray(a.tokens), np.asarray(b.tokens)
    equal = (ta == tb).all(axis=1)
    first = np.where(equal, ta.shape[1], np.argmax(ta != tb, axis=1))
    shared = np.arange(ta.shape[1])[None, :] < first[:, None]
    diff = np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs))
    return {"rows_equal": int(equal.sum()), "first_divergence": [int(c) for c in first[~equal]],
            "max_logp_diff_shared": float(diff[shared].max()) if shared.any() else 0.0}


def _run(cfg, params, prompts, settings, key, group, prompts_per_call):
    from grpo_jax import sampler

    t0 = time.perf_counter()
    rollout = sampler.sample_to_host(cfg, params, prompts, settings, key=key, group_size=group,
                                     prompts_per_call=prompts_per_call)
    return time.perf_counter() - t0, rollout


def measured(name: str, cfg, params, prompts, *, group: int, cap: int, prompts_per_call: int, stop_tokens,
             pad_id: int, reps: int, temperature: float = 1.0) -> dict:
    """Both engines on the same rows: wall time (median of reps, after a warm-up that
    compiles), tokens, decode steps and utilization. The rows are checked equal."""
    from grpo_jax import sampler
    from grpo_jax.sampler import slots

    base = sampler.SamplingParams(max_new_tokens=cap, temperature=temperature, stop_tokens=tuple(stop_tokens),
                                  pad_id=pad_id)
    rows_in_flight = prompts_per_call * group
    engines = {"static": base, "slots": base.replace(engine="slots", slots=rows_in_flight)}
    key = jax.random.key(0)
    results = {}
    for label, settings in engines.items():  # warm-up: compile every program of the rollout
        results[label] = _run(cfg, params, prompts, settings, key, group, prompts_per_call)[1]
    same = _agreement(results["static"], results["slots"])
    times = {label: [] for label in engines}
    for _ in range(reps):
        for label, settings in engines.items():
            times[label].append(_run(cfg, params, prompts, settings, key, group, prompts_per_call)[0])
    lengths = np.asarray(results["static"].lengths)
    slot_lengths = np.asarray(results["slots"].lengths)
    static_steps, static_util = _static_utilization(lengths, rows_in_flight)
    slot_steps, slot_tokens = slots.schedule(slot_lengths, rows_in_flight)
    t_static, t_slots = (float(np.median(times[k])) for k in ("static", "slots"))
    return {**same, "workload": name, "rows_in_flight": rows_in_flight, "queue_per_slot": len(lengths) / rows_in_flight,
            "rows": len(lengths), "cap": cap, "mean_length": float(lengths.mean()),
            "median_length": float(np.median(lengths)), "at_cap": float(np.mean(lengths == cap)),
            "static_steps": static_steps, "static_utilization": static_util, "slot_steps": slot_steps,
            "slot_utilization": slot_tokens / (rows_in_flight * slot_steps),
            "static_tokens_per_s": int(lengths.sum()) / t_static, "slot_tokens_per_s": slot_tokens / t_slots,
            "speedup": (slot_tokens / t_slots) / (int(lengths.sum()) / t_static),
            "static_s": times["static"], "slot_s": times["slots"]}


def smollm2_workloads(reps: int, caps: tuple[int, ...], static_prompts: int) -> list[dict]:
    from grpo_jax.tasks import get_task
    from grpo_jax.tasks.prompts import build_prompt, question_of
    from grpo_jax.text.tokenizer import encode_prompt

    cfg, params, tok = common.smollm2()
    prompts = []
    for task, style in (("gsm8k_synth", "gsm8k"), ("chat_arithmetic", "arithmetic")):
        for ex in get_task(task).examples("test", 4, 0):
            prompts.append(encode_prompt(tok, build_prompt(question_of(ex), tok, task=style)))
    out = []
    for group, cap in ((8, 256), (4, 512)):
        if cap not in caps:
            continue
        out.append(measured(f"SmolLM2-135M chat, T=1, G={group}", cfg, params, prompts, group=group, cap=cap,
                            prompts_per_call=static_prompts, stop_tokens=tok.stop_ids, pad_id=tok.pad_id,
                            reps=reps))
    return out


def testbed_workload(reps: int) -> dict:
    """The testbed's shapes (experiments/common.py: a 2-layer model, 6-operand modular
    questions, a 64-piece tokenizer, G = 16, 56 new tokens) with random weights: a row ends
    where it draws the stop token, about one draw in the vocabulary's 64."""
    import dataclasses

    from grpo_jax import config as config_lib
    from grpo_jax.model import transformer as model
    from grpo_jax.tasks import get_task
    from grpo_jax.text.tokenizer import train_sentencepiece

    task = get_task("modular", modulus=13, num_operands=6, num_subtractions=2)
    tok = train_sentencepiece(list(task.text_corpus(400, seed=0)), vocab_size=64)
    cfg = dataclasses.replace(config_lib.cpu_tiny().model, embed_dim=128, num_layers=2, mlp_dim=384,
                              max_seq_len=96, vocab_size=tok.vocab_size)
    params = model.init_params(cfg, jax.random.key(0))
    prompts = [tok.encode(ex.prompt) for ex in task.examples("test", 16, 0)]
    return measured("testbed shapes (random weights)", cfg, params, prompts, group=16, cap=56,
                    prompts_per_call=1, stop_tokens=tok.stop_ids, pad_id=tok.pad_id, reps=reps)


class _Alphabet:
    """Four tokens (pad, eos, "a", "b"): a random model opens ("a") and closes ("b") code
    blocks all the time; other characters of a tool's output encode as "a"."""

    chars = ["", "", "a", "b"]
    vocab_size, stop_ids, pad_id = 4, [1], 0

    def encode(self, text, add_bos=False):
        return [3 if c == "b" else 2 for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


def tools_workload(reps: int) -> dict:
    """Tool turns: the testbed's layers on a 4-token vocabulary whose random model calls the
    sandbox often (``_Alphabet``), 4 questions x G = 8, 64 new tokens, at most 2 calls a
    row. The static path samples calls of one question's rows and prefills every running
    row's whole context for each continuation; the slot engine (8 slots) puts only the
    tool's output through the model. Both give the same rows (checked)."""
    import dataclasses

    from grpo_jax import config as config_lib
    from grpo_jax.model import transformer as model
    from grpo_jax.sampler import SamplingParams, Sampler, slots
    from grpo_jax.sampler.turns import ToolUse, generate_with_tools
    from grpo_jax.tools import LocalSandbox, PythonTool

    prefilled = []

    @dataclasses.dataclass(frozen=True)
    class Counting(Sampler):
        """Counts the context tokens the static path's continuation calls prefill."""

        def generate(self, weights, prompts, **kw):
            if kw.get("row_ids") is not None:
                prefilled.append(sum(len(p) for p in prompts))
            return super().generate(weights, prompts, **kw)

    cfg = dataclasses.replace(config_lib.cpu_tiny().model, embed_dim=128, num_layers=2, mlp_dim=384,
                              vocab_size=4, max_seq_len=160, tie_embeddings=False)
    params = model.init_params(cfg, jax.random.key(1))
    tools = ToolUse.build(PythonTool(LocalSandbox(), open="a", close="b"), _Alphabet(), 2, 4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 4, 8).tolist() for _ in range(4)]
    settings = SamplingParams(max_new_tokens=64, stop_tokens=(1,), pad_id=0)
    samplers = {"static": Counting(cfg, None, settings),
                "slots": Sampler(cfg, None, settings.replace(engine="slots", slots=8))}
    key = jax.random.key(0)
    run = lambda s: generate_with_tools(s, params, prompts, key=key, group_size=8, tools=tools, prompts_per_call=1)
    outs = {k: run(s) for k, s in samplers.items()}  # warm-up: compile
    same = _agreement(outs["static"][0], outs["slots"][0])
    times = {k: [] for k in samplers}
    counts = {}
    for _ in range(reps):
        for k, s in samplers.items():
            prefilled.clear()
            slots.APPENDED.clear()
            t0 = time.perf_counter()
            run(s)
            times[k].append(time.perf_counter() - t0)
            counts[k] = sum(prefilled) if k == "static" else slots.APPENDED["tokens"]
    rollout, runs = outs["slots"]
    calls = sum(map(len, runs))
    tokens = int(np.asarray(rollout.lengths).sum())
    t_static, t_slots = (float(np.median(times[k])) for k in ("static", "slots"))
    return {**same, "workload": "tool turns (4-token random model, G=8)", "rows": len(runs), "cap": 64, "tool_calls": calls,
            "tool_output_tokens": int(np.asarray(rollout.tool_mask).sum()),
            "static_prefill_tokens_per_call": counts["static"] / calls,
            "slot_prefill_tokens_per_call": counts["slots"] / calls,
            "static_tokens_per_s": tokens / t_static, "slot_tokens_per_s": tokens / t_slots,
            "speedup": t_static / t_slots, "static_s": times["static"], "slot_s": times["slots"]}


def tools_table(row: dict) -> str:
    headers = ["workload", "rows", "rows equal", "tool calls", "output tokens per call", "static: prefill tokens per call",
               "slots: prefill tokens per call", "static tok/s", "slots tok/s", "speedup"]
    body = [[row["workload"], row["rows"], row["rows_equal"], row["tool_calls"], f"{row['tool_output_tokens'] / row['tool_calls']:.1f}",
             f"{row['static_prefill_tokens_per_call']:.1f}", f"{row['slot_prefill_tokens_per_call']:.1f}",
             common.fmt(row["static_tokens_per_s"]), common.fmt(row["slot_tokens_per_s"]), f"{row['speedup']:.2f}x"]]
    return common.markdown_table(headers, body)


def table(rows: list[dict]) -> str:
    headers = ["workload", "cap", "rows in flight", "queue / slots", "rows equal", "mean length", "at cap",
               "static: steps", "static: utilization", "slots: steps", "slots: utilization",
               "static tok/s", "slots tok/s", "speedup"]
    body = []
    for r in rows:
        equal = f"{r['rows_equal']} / {r['rows']}" if "rows_equal" in r else "(no model)"
        body.append([r["workload"], r["cap"], r["rows_in_flight"], f"{r['queue_per_slot']:g}", equal,
                     f"{r['mean_length']:.0f}", f"{r['at_cap']:.0%}", r["static_steps"],
                     f"{r['static_utilization']:.2f}", r["slot_steps"], f"{r['slot_utilization']:.2f}",
                     common.fmt(r.get("static_tokens_per_s")), common.fmt(r.get("slot_tokens_per_s")),
                     f"{r['speedup']:.2f}x" if "speedup" in r else f"{1 / r['expected_rollout_ratio']:.2f}x (steps)"])
    return common.markdown_table(headers, body)


def main() -> int:
    parser = common.base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--skip-smollm2", action="store_true", help="leave out the SmolLM2 workloads (minutes)")
    parser.add_argument("--static-prompts", type=int, default=2,
                        help="prompts per static call = slots / G (default 2)")
    parser.add_argument("--caps", default="256,512",
                        help="SmolLM2 caps to run, of 256 (G=8) and 512 (G=4) (default both; --quick: 256)")
    args = parser.parse_args()
    caps = (256,) if args.quick else tuple(int(c) for c in args.caps.split(","))
    reps = common.reps_of(args, full=2, quick=1)
    rep = common.Report("slots", args)
    machine = common.machine_info()
    rep.emit("## Slot engine: utilization and tokens/s against the static engine (same rows, same rows in flight)")
    rep.emit()
    rep.emit(f"CPU: {machine['cpu']} ({machine['cpu_flags']}), {machine['cores']} cores; median of {reps} "
             "interleaved reps after a warm-up that compiles; \"rows equal\": rows identical between the engines.")
    rep.emit()
    rows = length_model()
    rows.append(testbed_workload(reps))
    tool_row = tools_workload(reps)
    if not args.skip_smollm2:
        rows += smollm2_workloads(reps, caps, args.static_prompts)
    rep.emit(table(rows))
    rep.emit()
    rep.emit(tools_table(tool_row))
    rep.emit()
    for r in rows:
        if r["workload"].startswith("length model"):
            rep.results[f"slot_utilization_queue{r['queue_per_slot']}"] = r["slot_utilization"]
            rep.results[f"static_utilization_queue{r['queue_per_slot']}"] = r["static_utilization"]
        elif r["workload"].startswith("SmolLM2"):
            rep.results[f"slots_tokens_per_s_smollm2_cap{r['cap']}"] = r["slot_tokens_per_s"]
            rep.results[f"static_tokens_per_s_smollm2_cap{r['cap']}"] = r["static_tokens_per_s"]
            rep.results[f"slots_speedup_smollm2_cap{r['cap']}"] = r["speedup"]
    per_call = tool_row["tool_output_tokens"] / tool_row["tool_calls"]
    rep.results.update(slot_tool_prefill_per_call=tool_row["slot_prefill_tokens_per_call"],
                       static_tool_prefill_per_call=tool_row["static_prefill_tokens_per_call"],
                       tool_output_tokens_per_call=per_call,
                       slot_tool_prefill_excess=tool_row["slot_prefill_tokens_per_call"] - per_call)
    rep.details["rows"] = rows + [tool_row]
    return rep.finish()


if __name__ == "__main__":
    raise SystemExit(main())
