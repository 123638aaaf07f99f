"""Evaluate a pretrained model on a benchmark: greedy top-1, Pass@K and Maj@K with 95% intervals.

    grpo-evaluate --model smollm2-135m --task gsm8k_synth --limit 50
    grpo-evaluate --model /ckpt/deepseek-math-7b-rl --task gsm8k \\
        --data-dir /data/gsm8k --k 64 --temperature 0.7 --max-new-tokens 1024

(`grpo-evaluate` is installed with the package; `python experiments/evaluate.py` is the same.)

--model: a GGUF file, an HF folder (config.json + safetensors), a converted folder,
"smollm2-135m", or a grpo_jax training run dir (config.json + checkpoints/, as every
training script writes it: grpo_jax.checkpoints.run_files): every saved checkpoint step is evaluated
(--step N: one), each into <out>/step-N/, and <out>/curve.json + curve.png hold greedy
accuracy (and Pass@K / Maj@K at K = --k when k > 1) against the step. On a run dir the
defaults are the run's own evaluation: its task (data.* knobs included), prompt (task.json:
style and chat template), tokenizer and stop tokens, rl.max_new_tokens, rl.decode, and its
held-out questions (data.eval_size of them, drawn with data.seed). A run resumed with other
settings (run.allow_config_changes) has its history printed, and each step's summary holds the
changes its checkpoint was trained through. A grpo-export of a run
defaults to the run's task, data knobs, prompt and held-out questions the same way.
--task: gsm8k, math, arithmetic, chat_arithmetic, countdown, gsm8k_synth, or your own task
as "module:name" (a Task class or a function returning a Task, imported from the Python path).
--prompt: on a model that is not a run dir, the default is the prompt a chat model is
trained on the task with (grpo_jax.tasks.chat): the task's prompt style in the model's chat
template (gsm8k, gsm8k_synth: gsm8k; math: math; chat_arithmetic: arithmetic, the bare
question), else the task's own text (task: arithmetic, countdown, module:name). paper: the
DeepSeekMath chain-of-thought format (the task's `paper_prompt`, gsm8k and math; the Table 5
protocol). Any other style of grpo_jax.tasks.prompts.STYLES asks the bare question that way.

--tools python: Table 5's tool-integrated protocol (gsm8k, gsm8k_synth, math): the task's
tool prompt (DeepSeekMath's, zero-shot) in the model's chat template; each completion's
```python blocks run in the sandbox (grpo_jax.tools, its default limits), at most
--max-tool-calls (4) per completion, their output appended as ```output blocks
(grpo_jax.sampler.turns); the answer is the last \\boxed{} of the model's own text. The
JSONL records each run's status, summary.json the calls per question and the sandbox's
failures by status (docs/evaluation.md).

Writes <out>/shard-*.jsonl (one line per question: prompt, completions, extracted answers,
correctness), <out>/settings.json and <out>/summary.json. A killed evaluation continues
where it stopped when rerun with the same arguments. Multi-host (or --shard i/n by hand):
each process scores its shard of questions on its own devices; process 0 merges
(--merge-only merges shards written by separate runs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
from etils import epath

from grpo_jax.text import chat_templates
from grpo_jax import cli
from grpo_jax.parallel import distributed
from grpo_jax.eval import evaluate_run, math_verify_check, plots
from grpo_jax.model import pretrained
from grpo_jax.checkpoints import resume_changes, run_files
from grpo_jax.cli import runs
from grpo_jax.config import DECODE_ENGINES, FILE_TASKS, Config, MeshConfig
from grpo_jax.errors import CheckpointError, ConfigError, PretrainedError
from grpo_jax.sampler import Sampler
from grpo_jax.tasks.shortcuts import try_shortcut_baselines
from grpo_jax.parallel.sharding import make_mesh
from grpo_jax.tasks.dataset_task import DatasetTask
from grpo_jax.sampler.turns import ToolUse
from grpo_jax.tools import LocalSandbox, PythonTool

TOOLS = ("none", "python")
DEFAULT_TOOL_CALLS = 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
    p.add_argument("--model", required=True,
                   help="GGUF file, HF folder, converted folder, smollm2-135m, or a training run dir")
    p.add_argument("--step", type=int, default=None, help="run dir: evaluate only this checkpoint step")
    p.add_argument("--task", default=None, help="gsm8k, math, arithmetic, chat_arithmetic, countdown, gsm8k_synth "
                   "or your own as module:name, a Task class or a function returning one (default on a run dir: "
                   "the run's task)")
    p.add_argument("--split", default="test", help="the task's split to evaluate")
    p.add_argument("--limit", type=int, default=None,
                   help="first N questions of the split (-1: all; default: a run dir's data.eval_size, else all)")
    p.add_argument("--k", type=int, default=1, help="samples per question (Pass@K / Maj@K for K <= k; 0: greedy only)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the k samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass of the k samples")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the run's rl.max_new_tokens for a run dir or a grpo-export of one, else 512 "
                        "(at most half the model's max length)")
    p.add_argument("--prompt", choices=evaluate_run.PROMPT_STYLES, default=None,
                   help="default: a run dir's own prompt; else the task's training prompt, its prompt style in "
                        "the chat template (gsm8k, gsm8k_synth: gsm8k; math: math; chat_arithmetic: arithmetic) "
                        "or its own text (task: arithmetic, countdown, module:name). paper: DeepSeekMath's CoT "
                        "format (gsm8k, math)")
    p.add_argument("--chat-format", choices=sorted(chat_templates.FORMATS), default=None,
                   help="a model that is not a run dir: prompt it in this named chat format instead of its own "
                        "template (for a model without a usable one; default: the model's own template)")
    p.add_argument("--tools", choices=TOOLS, default="none",
                   help="python: the tool-integrated protocol (Table 5's second half; gsm8k, gsm8k_synth, math): "
                        "the task's tool prompt, each completion's ```python blocks run in the sandbox "
                        "(grpo_jax.tools, its default limits) with their output appended, the answer read from the "
                        "last \\boxed{} of the model's own text; summary.json counts the tool calls and the "
                        "sandbox's failures (docs/evaluation.md). none: no tool")
    p.add_argument("--max-tool-calls", type=int, default=None,
                   help=f"--tools python: code blocks run per completion (default {DEFAULT_TOOL_CALLS}); a block "
                        "after the last is only text")
    p.add_argument("--math-verify", action="store_true",
                   help="also check every completion with Hugging Face's math-verify (in a worker process with a "
                        "time limit) and write <out>/math_verify.json: its accuracy and where it disagrees with the "
                        "task's own checker (default: off; not for countdown)")
    p.add_argument("--chunk-rows", type=int, default=0,
                   help="sampled rows per sampler call (default 8 per local device, at least --k)")
    p.add_argument("--seed", type=int, default=None,
                   help="questions and samples (default: a run dir's data.seed, else 0)")
    p.add_argument("--decode", choices=DECODE_ENGINES, default=None,
                   help="decode engine (default: a run dir's rl.decode, else auto)")
    p.add_argument("--data-dir", default=None,
                   help="gsm8k/math: the folder of the official files, as training's data.data_dir (default: a run "
                        "dir's data.data_dir; formats: docs/walkthrough.md)")
    p.add_argument("--tfds-dir", default=None,
                   help="gsm8k/math: where TFDS keeps the datasets it prepares from those files (default: TFDS's "
                        "own, $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    p.add_argument("--out", default="", help="output folder (default runs/eval/<model>-<task>-<split>, a task "
                   "of your own named by its module, a part that repeats the one before it once)")
    p.add_argument("--shard", default="", help="i/n: score only shard i of n (default: this process of all)")
    p.add_argument("--merge-only", action="store_true", help="merge the shards in --out and print the summary")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_tools(args) -> None:
    """The --tools options that do not combine, refused before any model is loaded; fills
    --max-tool-calls' default."""
    if args.tools == "none":
        if args.max_tool_calls is not None:
            raise ConfigError("--max-tool-calls is for --tools python (without it no code runs)")
        return
    if args.prompt is not None:
        raise ConfigError(f"--prompt {args.prompt} and --tools python do not combine: the tool-integrated protocol "
                          "asks the task's own tool prompt (docs/evaluation.md)")
    if args.math_verify:
        raise ConfigError("--math-verify and --tools python do not combine: math-verify reads whole completions, "
                          "which with tools hold the code's output too")
    args.max_tool_calls = DEFAULT_TOOL_CALLS if args.max_tool_calls is None else args.max_tool_calls
    if args.max_tool_calls < 1:
        raise ConfigError(f"--max-tool-calls must be >= 1 with --tools python, got {args.max_tool_calls} "
                          "(--tools none evaluates without the tool)")


def tool_use(args, tokenizer) -> ToolUse | None:
    """The evaluation's tool use (--tools python): a `PythonTool` on a `LocalSandbox` with its
    default limits, at most --max-tool-calls runs per completion; None for --tools none."""
    if args.tools == "none":
        return None
    try:
        return ToolUse.build(PythonTool(LocalSandbox()), tokenizer, args.max_tool_calls)
    except ValueError as e:
        raise ConfigError(f"--tools python: {e}") from None


def check_math_verify(math_verify: bool, task: str | None) -> None:
    """ConfigError for --math-verify on countdown, whose answers are not math answers."""
    if math_verify and task == "countdown":
        raise ConfigError("--math-verify checks math answers; countdown's answers are expressions checked by rule")


def check_model(model: str) -> None:
    """ConfigError when --model is neither the name smollm2-135m nor a path that exists: a
    mistyped run dir would otherwise be asked for the --task it does not need."""
    if model.lower() != pretrained.SMOLLM2_NAME and not epath.Path(model).exists():
        raise ConfigError(f"--model {model} does not exist: give a training run dir, a grpo-export or HF folder, "
                          f"a GGUF file, or {pretrained.SMOLLM2_NAME}")


def default_out(model: str, task: str, split: str) -> str:
    """runs/eval/<model>-<task>-<split>: a task of your own named by its module, and a part that
    repeats the one before it once (runs/mytask on mytask:task -> runs/eval/mytask-test)."""
    parts = [os.path.basename(os.path.normpath(model)), task.split(":", 1)[0], split]
    return os.path.join("runs", "eval", "-".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1]))


def parse_shard(text: str) -> tuple[int, int]:
    if not text:
        return jax.process_index(), jax.process_count()
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard expects i/n (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise ConfigError(f"--shard {text}: need 0 <= i < n")
    return i, n


def apply_held_out_defaults(args, cfg: Config, asked: dict, task) -> None:
    """When `task` is the run's task (task.json), fill the prompt, --limit and --seed left
    unset with the run's: its prompt form and held-out questions (data.eval_size, data.seed)."""
    if task.name == asked["task"]:
        args.prompt = args.prompt or asked["prompt"]
        args.limit = cfg.data.eval_size if args.limit is None else args.limit
        args.seed = cfg.data.seed if args.seed is None else args.seed


def apply_run_defaults(args, cfg: Config, asked: dict, task) -> None:
    """Fill the options left unset with the run's own evaluation: its held-out defaults
    (`apply_held_out_defaults`), its lengths and decode engine."""
    apply_held_out_defaults(args, cfg, asked, task)
    args.max_new_tokens = args.max_new_tokens or cfg.rl.max_new_tokens
    args.decode = args.decode or cfg.rl.decode


def score(args, shards, sampler: Sampler, params, tokenizer, task, examples, out, meta, load_s, checker=None,
          tools: ToolUse | None = None):
    """Sample and score this process's shard (i, n) into `out` with ``sampler`` (a run's, or
    a pretrained model's with the defaults) and ``params`` in its weights form; on process 0
    (no --shard) merge the shards and return the summary (with ``checker``'s second opinion,
    math-verify's, when given), else None. ``tools``: each completion may call the tool."""
    shard, num_shards = shards
    settings = evaluate_run.EvalSettings(
        num_samples=args.k, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        chunk_rows=args.chunk_rows or max(args.k, 8 * jax.local_device_count()),
        prompt=args.prompt or task.prompt_style or "task")
    times = evaluate_run.evaluate_shard(sampler, params, tokenizer, task, examples, out, settings,
                                        shard=shard, num_shards=num_shards, meta=meta,
                                        progress=not args.no_progress, tools=tools)
    print(f"shard {shard}/{num_shards}: {times['questions']} questions; load {load_s:.1f}s, "
          f"sample {times['sample']:.1f}s, score {times['score']:.1f}s", file=sys.stderr)
    distributed.barrier("evaluate")
    if args.shard or not distributed.is_main_process():
        return None
    baselines = try_shortcut_baselines(task, examples)
    return report(out, {"load": load_s, "sample": times["sample"], "score": times["score"]},
                  None if baselines is None else baselines.to_dict(), checker)


def report(out: str, timing: dict | None, shortcuts: dict | None = None, checker=None) -> dict:
    summary = evaluate_run.merge_and_summarize(out, timing=timing, shortcuts=shortcuts)
    print(evaluate_run.format_summary(summary))
    print(f"wrote {os.path.join(out, 'summary.json')}")
    if checker is not None:
        second = math_verify_check.second_opinion(out, checker)
        c = second["counts"]
        print(f"math-verify: greedy accuracy {second['greedy_accuracy']['math_verify']:.4f} (ours "
              f"{second['greedy_accuracy']['ours']:.4f}); over all completions only ours correct {c['ours_only']}, "
              f"only math-verify {c['math_verify_only']}; wrote {os.path.join(out, 'math_verify.json')}")
    return summary


def curve_point(step: int, summary: dict) -> dict:
    """One step of the curve: greedy accuracy, and Pass@K / Maj@K at the largest K drawn."""
    point = {"step": step, "greedy": summary["greedy"]["accuracy"], "greedy_ci95": summary["greedy"]["ci95"]}
    k = summary["samples_per_question"]
    if k > 1:
        for name in ("pass", "maj"):
            point[f"{name}@{k}"] = summary[f"{name}@k"][str(k)]["value"]
            point[f"{name}@{k}_ci95"] = summary[f"{name}@k"][str(k)]["ci95"]
    return point


def write_curve(out: str, points: list[dict], title: str) -> dict:
    keys = [k for k in points[0] if k != "step" and not k.endswith("_ci95")]
    curve = {"points": points}
    with open(os.path.join(out, "curve.json"), "w", encoding="utf-8") as f:
        json.dump(curve, f, indent=2)
    plots.plot_history(points, keys, os.path.join(out, "curve.png"), title=title)
    print(f"wrote {os.path.join(out, 'curve.json')} and curve.png ({len(points)} steps)")
    return curve


def main(argv=None) -> dict:
    """The summary of a model, or {"points": [...]} (the curve) for a run dir; {} on a
    process that does not merge."""
    args = build_parser().parse_args(argv)
    check_tools(args)
    # A flag that contradicts the asked task is refused before any file is looked at.
    check_math_verify(args.math_verify, args.task)
    check_model(args.model)
    distributed.initialize()
    cfg = runs.run_config(args.model)
    if cfg is None and args.step is not None:
        raise ConfigError(f"--step needs --model to be a training run dir; {args.model} is not one")
    asked = run_files.read_task(args.model, cfg) if cfg is not None else None
    # A grpo-export of a run carries the run's task, its data section and prompt form.
    exported = pretrained.export_record(args.model) if cfg is None else None
    if exported and "task" in exported:
        asked = exported["task"]
    args.task = args.task or (asked["task"] if asked else None)
    if args.task is None:
        raise ConfigError("--task is required when --model is neither a training run dir nor a grpo-export of one")
    out = args.out or default_out(args.model, args.task, args.split)
    if args.merge_only:
        if cfg is None:
            return report(out, None)
        steps = sorted(int(d.split("-", 1)[1]) for d in os.listdir(out) if d.startswith("step-"))
        steps = [args.step] if args.step is not None else steps
        points = [curve_point(s, report(os.path.join(out, f"step-{s}"), None)) for s in steps]
        return write_curve(out, points, f"{args.model} on {args.task} ({args.split})")
    shards = parse_shard(args.shard)
    # The run's own task: its data.* knobs (operands, digits, ...) decide the questions.
    run_cfg = cfg if cfg is not None else (Config.from_dict({"data": exported["data"]})
                                             if exported and "data" in exported else None)
    same_knobs = run_cfg is not None and run_cfg.data.task == args.task and args.data_dir is None
    if args.task in FILE_TASKS and not same_knobs:
        runs.check_data_dir(args.task, args.data_dir, "--data-dir")
    task = runs.make_task(args.task, run_cfg.data if same_knobs else None, data_dir=args.data_dir,
                          tfds_dir=args.tfds_dir)
    if cfg is not None:
        apply_run_defaults(args, cfg, asked, task)
    elif same_knobs:  # an export: the run's held-out questions and prompt; its lengths come below
        apply_held_out_defaults(args, run_cfg, asked, task)
    if args.tools == "python":  # the protocol's own prompt, whatever the run asked with
        if getattr(task, "tool_prompt", None) is None:
            raise ConfigError(f"--tools python asks the task's tool-integrated prompt, which gsm8k, gsm8k_synth and "
                              f"math have; task {task.name!r} has none")
        args.prompt = evaluate_run.TOOL_PROMPT
    args.limit = -1 if args.limit is None else args.limit
    args.seed = 0 if args.seed is None else args.seed
    if args.limit < 0 and not isinstance(task, DatasetTask):
        raise ConfigError(f"--task {args.task} generates its questions, so there is no 'all' of "
                          "them: give --limit N")
    examples = task.examples(args.split, args.limit, args.seed)
    check_math_verify(args.math_verify, task.name)
    checker = math_verify_check.MathVerify() if args.math_verify else None
    # Each host samples its own questions on its own devices: no collective across hosts.
    mesh = make_mesh(MeshConfig(), jax.local_devices())
    meta = {"model": args.model, "task": args.task, "split": args.split, "limit": args.limit}
    if cfg is None:
        t0 = time.perf_counter()
        model_cfg, params, tokenizer = pretrained.load(args.model, mesh=mesh)
        if tokenizer is None:
            raise PretrainedError(f"--model {args.model}: no tokenizer found next to the weights")
        # An export samples as its run did; other models 512 tokens, within their length.
        record = pretrained.export_record(args.model) or {}
        max_new_tokens = args.max_new_tokens or record.get("max_new_tokens") or min(512, model_cfg.max_seq_len // 2)
        if max_new_tokens >= model_cfg.max_seq_len:
            raise ConfigError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt: "
                              f"{args.model} holds {model_cfg.max_seq_len} positions")
        if args.chat_format:
            if not hasattr(tokenizer, "with_chat_format"):
                raise ConfigError(f"--chat-format: {args.model}'s tokenizer has no chat format to replace "
                                  "(its prompts are plain text)")
            tokenizer = tokenizer.with_chat_format(args.chat_format)
        # A pretrained model samples with the defaults of a run of it (rl.*), as a run would.
        cfg = Config(model=model_cfg).replace(rl={"max_new_tokens": max_new_tokens, "decode": args.decode or "auto"})
        tools = tool_use(args, tokenizer)
        sampler = Sampler.for_run(cfg, mesh, tokenizer)
        return score(args, shards, sampler, sampler.copy(params), tokenizer, task, examples, out, meta,
                     time.perf_counter() - t0, checker, tools) or {}

    if args.chat_format:
        raise ConfigError("--chat-format is for a model that is not a run dir; a run dir is prompted in "
                          "its own format (its run.chat_format)")
    run = runs.open_run(cfg, task, mesh)
    if args.step is not None and args.step not in run.steps:
        raise CheckpointError(f"{args.model} has no checkpoint step {args.step}; saved steps: {run.steps}")
    # The run's sampler over this host's devices (its rollout's engine, cache and policy
    # copy), with --decode and --max-new-tokens when given.
    local = run.cfg.replace(mesh={"dcn_data": 1, "dcn_fsdp": 1, "dcn_tensor": 1},
                            rl={"decode": args.decode, "max_new_tokens": args.max_new_tokens})
    sampler = Sampler.for_run(local, mesh, run.tokenizer)
    tools = tool_use(args, run.tokenizer)
    history = resume_changes.read(args.model)
    if history:
        print(f"{args.model}: {resume_changes.describe(history)}")
    points = []
    for step in [args.step] if args.step is not None else run.steps:
        t0 = time.perf_counter()
        params = sampler.copy(run.params(step, mesh))
        # Each step's summary carries the changes its checkpoint was trained through.
        changed = resume_changes.before_step(history, step)
        summary = score(args, shards, sampler, params, run.tokenizer, task, examples, os.path.join(out, f"step-{step}"),
                        {**meta, "step": step, **({"config_changes": changed} if changed else {})},
                        time.perf_counter() - t0, checker, tools)
        if summary is not None:
            points.append(curve_point(step, summary))
    run.close()
    if not points:
        return {}
    return write_curve(out, points, f"{args.model} on {args.task} ({args.split})")


def console_main() -> None:
    """The `grpo-evaluate` entry point: library errors as one line, exit 2 (grpo_jax.cli)."""
    cli.run(main, prog="grpo-evaluate")
