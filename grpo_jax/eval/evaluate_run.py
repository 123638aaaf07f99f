"""Run a benchmark: sample a model on a task's questions, score, write per-question JSONL,
then merge the shards into the paper's metrics (greedy top-1, Pass@K, Maj@K, 95% intervals).

    settings = EvalSettings(num_samples=4, temperature=0.7)
    path = evaluate_shard(sampler, params, tokenizer, task, examples, out_dir, settings)
    summary = merge_and_summarize(out_dir)           # process 0, once every shard is done

Layout of ``out_dir``::

    settings.json                       what was run (a resumed run must match it)
    shard-00000-of-00002.jsonl          one line per question, appended chunk by chunk
    summary.json                        `evaluation.summarize` of all shards + timing

One JSONL record per question: ``index`` (position in ``examples``), ``prompt`` (the text
the model saw), ``reference`` (the task's canonical final answer), ``greedy_completion``,
``greedy_answer``, ``greedy_correct``, and ``completions`` / ``answers`` / ``correct``
(``num_samples`` each); with a tool (``evaluate_shard(..., tools=)``, `grpo-evaluate --tools
python`) also ``greedy_tool_calls`` and ``tool_calls``, each run's status, detail and seconds,
and ``greedy_own_text`` and ``own_texts``, the model's own text of each completion.

Determinism across shards and resumes: questions are cut into global chunks of
``chunk_questions`` (chunk c = questions [c*q, (c+1)*q)); chunk c belongs to shard
``c % num_shards`` and is sampled with the key ``fold_in(PRNGKey(seed), c)``. A chunk is
therefore computed identically whether one process runs all of them, two processes split
them, or a killed run resumes (a chunk is skipped only when all its questions are on disk;
a partly written line of a killed run is dropped).

Sampling and scoring are `evaluation.sample_and_score`, the one evaluation the trainer's
periodic evaluation runs too: the sampler is the only device work (greedy, then the
``num_samples`` draws); decoding, answer extraction and scoring are host-side Python on
untrusted model text (the task's bounded reward functions, never eval).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import time
from typing import Sequence

import jax

from grpo_jax.checkpoints import resume_changes
from grpo_jax.errors import ConfigError
from grpo_jax.eval import evaluation
from grpo_jax.tasks import prompts
from grpo_jax.tasks.prompts import DEEPSEEK_CHAT, is_chat_tokenizer
from grpo_jax.tasks import Example, Task

# task: the task's own text; paper: the task's paper_prompt; a prompts.STYLES key: the bare
# question in the model's chat format, as chat-model training asks it (grpo_jax.tasks.chat).
PROMPT_STYLES = ("task", "paper", *prompts.STYLES)
# tool: the task's tool_prompt, the tool-integrated protocol's (`grpo-evaluate --tools python`
# asks it; it is not a --prompt choice).
TOOL_PROMPT = "tool"


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What an evaluation draws beside the greedy answer (the sampler it is given holds the
    engine, cache and lengths): ``num_samples`` per question at ``temperature`` and
    ``top_p``. ``chunk_rows``: sampled rows per sampler call (the mesh's batch); a chunk
    holds max(1, chunk_rows // num_samples) questions."""

    num_samples: int = 1
    temperature: float = 0.7
    top_p: float = 1.0
    chunk_rows: int = 8
    seed: int = 0
    prompt: str = "task"

    def __post_init__(self):
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")
        if self.prompt not in (*PROMPT_STYLES, TOOL_PROMPT):
            raise ValueError(f"prompt must be one of {(*PROMPT_STYLES, TOOL_PROMPT)}, got {self.prompt!r}")

    @property
    def chunk_questions(self) -> int:
        return max(1, self.chunk_rows // max(1, self.num_samples))


def prompt_text(task: Task, example: Example, tokenizer, style: str) -> str:
    """The text the model sees. ``task``: the task's own prompt (``example.prompt``).
    ``paper``: the task's ``paper_prompt`` as the user turn, in the tokenizer's chat
    template, or DeepSeek-LLM's ``User: ...\\n\\nAssistant:`` for a model without one.
    ``tool`` (`TOOL_PROMPT`): the task's ``tool_prompt`` the same way.
    A ``prompts.STYLES`` key: ``prompts.chat_prompt`` of the bare question."""
    if style == "task":
        return example.prompt
    if style in prompts.STYLES:
        return prompts.chat_prompt(prompts.question_of(example), tokenizer, style)
    attr = "tool_prompt" if style == TOOL_PROMPT else "paper_prompt"
    fmt = getattr(task, attr, None)
    if fmt is None:
        raise ValueError(f"task {task.name!r} has no {attr}; use prompt='task'")
    if "question" not in example.meta:
        raise ValueError(f"task {task.name!r} examples carry no meta['question'] for the {style} prompt")
    content = fmt.format(question=example.meta["question"])
    if is_chat_tokenizer(tokenizer):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return DEEPSEEK_CHAT.format(content=content)


def shard_path(out_dir: str, shard: int, num_shards: int) -> str:
    return os.path.join(out_dir, f"shard-{shard:05d}-of-{num_shards:05d}.jsonl")


def read_records(path: str) -> list[dict]:
    """Complete JSONL lines of ``path`` (a killed writer's partial last line is dropped)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        data = f.read()
    complete = data[: data.rfind("\n") + 1]
    if len(complete) != len(data):  # drop the torn tail so appends start on a line boundary
        with open(path, "w", encoding="utf-8") as f:
            f.write(complete)
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def _check_settings(out_dir: str, meta: dict) -> None:
    path = os.path.join(out_dir, "settings.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        if old != meta:
            diff = ", ".join(f"{k} {old.get(k)!r} -> {meta.get(k)!r}" for k in sorted(set(old) | set(meta))
                             if old.get(k) != meta.get(k))
            raise ConfigError(f"{out_dir} holds an evaluation with other settings ({diff}); "
                              "use another --out or delete it")
        return
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def tool_settings(tools) -> dict:
    """What settings.json records of a tool use (`evaluate_shard`): nothing without one (an
    evaluation without tools keeps its settings.json of before), else the tool, the most calls
    per completion and the sandbox's limits (its ``limits``, where it has them)."""
    if tools is None:
        return {}
    limits = getattr(tools.tool.sandbox, "limits", None)
    sandbox = {"kind": type(tools.tool.sandbox).__name__,
               **(dataclasses.asdict(limits) if dataclasses.is_dataclass(limits) else {})}
    # as JSON reads it back (tuples as lists), so a resumed evaluation compares equal
    return {"tools": "python", "max_tool_calls": tools.max_calls, "sandbox": json.loads(json.dumps(sandbox))}


def evaluate_shard(sampler, params, tokenizer, task: Task, examples: Sequence[Example], out_dir: str,
                   settings: EvalSettings, *, shard: int = 0, num_shards: int = 1, meta: dict | None = None,
                   progress: bool = True, tools=None) -> dict[str, float]:
    """Sample and score this shard's chunks of ``examples`` [Q] with ``sampler`` (a run's
    ``sampler.Sampler``: its engine, cache and max_new_tokens; every engine draws the same
    samples) and ``params`` in its weights form, appending to the shard's JSONL
    (``evaluation.sample_and_score``, one call per chunk).

    Resumable: chunks whose questions are all in the shard file are skipped. ``meta``
    (model, task, split, ...) is saved with ``settings`` and max_new_tokens in
    settings.json; an existing out_dir with different ones is an error. With ``tools`` (a
    `grpo_jax.sampler.turns.ToolUse`) every completion may call the tool
    (`evaluation.sample_and_score`), and settings.json also records ``tools`` ("python"),
    ``max_tool_calls`` and the sandbox's limits (``sandbox``). Returns the seconds
    spent {"sample", "score"} (sampling and scoring together under "sample") and the number
    of questions done now {"questions"}.
    """
    from tqdm.auto import tqdm

    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
    if not examples:
        raise ValueError("no questions to evaluate")
    os.makedirs(out_dir, exist_ok=True)
    _check_settings(out_dir, {**dataclasses.asdict(settings), "max_new_tokens": sampler.settings.max_new_tokens,
                              **(meta or {}), **tool_settings(tools), "num_questions": len(examples)})
    path = shard_path(out_dir, shard, num_shards)
    done = {r["index"] for r in read_records(path)}
    q = settings.chunk_questions
    chunks = [c for c in range(shard, -(-len(examples) // q), num_shards)
              if not all(i in done for i in range(c * q, min((c + 1) * q, len(examples))))]
    todo = sum(min((c + 1) * q, len(examples)) - c * q for c in chunks)
    times = {"sample": 0.0, "score": 0.0, "questions": todo}
    base = jax.random.PRNGKey(settings.seed)
    bar = tqdm(total=todo, desc=f"eval {task.name} shard {shard}/{num_shards}", unit="q",
               disable=not progress, dynamic_ncols=True)
    with open(path, "a", encoding="utf-8") as out:
        for c in chunks:
            idx = list(range(c * q, min((c + 1) * q, len(examples))))
            t0 = time.perf_counter()
            records = evaluation.sample_and_score(
                sampler, params, task, tokenizer, [examples[i] for i in idx],
                [prompt_text(task, examples[i], tokenizer, settings.prompt) for i in idx],
                key=jax.random.fold_in(base, c), num_samples=settings.num_samples,
                temperature=settings.temperature, top_p=settings.top_p, tools=tools)
            t1 = time.perf_counter()
            for i, rec in zip(idx, records):
                out.write(json.dumps({"index": i, **rec}, ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())  # a chunk on disk is a chunk never sampled again
            times["sample"] += t1 - t0
            times["score"] += time.perf_counter() - t1
            bar.update(len(idx))
    bar.close()
    return times


def merge_and_summarize(out_dir: str, *, timing: dict | None = None, ks: Sequence[int] | None = None,
                        shortcuts: dict | None = None) -> dict:
    """Merge every shard's JSONL in ``out_dir`` and write summary.json (returned), with the
    set's ``shortcuts`` (`grpo_jax.tasks.shortcuts.Baselines.to_dict`) when given.

    Checks that the shards hold each of the ``num_questions`` questions exactly once.
    """
    with open(os.path.join(out_dir, "settings.json"), encoding="utf-8") as f:
        meta = json.load(f)
    paths = sorted(glob.glob(os.path.join(out_dir, "shard-*-of-*.jsonl")))
    counts = {p.rsplit("-of-", 1)[1] for p in paths}
    if len(counts) > 1:
        raise ValueError(f"{out_dir} mixes shard counts {sorted(counts)}: keep one")
    records = [r for p in paths for r in read_records(p)]
    have = sorted(r["index"] for r in records)
    if have != list(range(meta["num_questions"])):
        missing = sorted(set(range(meta["num_questions"])) - set(have))
        raise ValueError(f"{out_dir}: {len(missing)} of {meta['num_questions']} questions not evaluated "
                         f"yet (first: {missing[:5]}), or some twice; run the missing shards")
    summary = {"settings": meta, **evaluation.summarize(records, ks, seed=meta["seed"],
                                                        max_calls=meta.get("max_tool_calls"))}
    if shortcuts:
        summary["shortcuts"] = shortcuts
    if timing:
        summary["timing_s"] = timing
    tmp = os.path.join(out_dir, f"summary.json.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "summary.json"))
    return summary


def drawn(summary: dict) -> str:
    """What the table's rows were drawn at: greedy is temperature 0, pass@k and maj@k sample (a
    greedy 0% beside a pass@1 of 6% is no contradiction)."""
    k, settings = summary["samples_per_question"], summary.get("settings", {})
    if not k:
        return "greedy top-1 only (--k 0)"
    top_p = settings.get("top_p", 1.0)
    return (f"greedy top-1 at temperature 0; pass@k and maj@k from {k} sample{'s' * (k > 1)} each at temperature "
            f"{settings['temperature']:g}" + (f", top-p {top_p:g}" if top_p != 1.0 else ""))


def format_summary(summary: dict) -> str:
    """Human-readable table: greedy, then Pass@K / Maj@K at K = 1, 2, 4, ... and n."""
    def fig(d):
        return f"{100 * d['value']:5.1f}%  [{100 * d['ci95'][0]:5.1f}, {100 * d['ci95'][1]:5.1f}]"

    g = summary["greedy"]
    lines = [f"{summary['num_questions']} questions; {drawn(summary)}",
             f"greedy top-1  {fig({'value': g['accuracy'], 'ci95': g['ci95']})}  (95% Wilson)"]
    if "shortcuts" in summary:
        sc = summary["shortcuts"]
        lines.append(f"shortcuts     best {100 * sc['best_score']:5.1f}% ({sc['best']}); "
                     + ", ".join(f"{name} {100 * v:.1f}%" for name, v in sc["scores"].items()))
    changes = summary.get("settings", {}).get("config_changes")
    if changes:
        lines.append(resume_changes.describe(changes))
    ks = sorted(int(k) for k in summary.get("pass@k", {}))
    shown = [k for k in ks if k & (k - 1) == 0 or k == ks[-1]]
    for k in shown:
        lines.append(f"pass@{k:<3d}     {fig(summary['pass@k'][str(k)])}   "
                     f"maj@{k:<3d} {fig(summary['maj@k'][str(k)])}  (95% bootstrap)")
    for name, per in (("greedy", "question"), ("samples", "sample")):
        t = summary.get("tools", {}).get(name)
        if t is None:
            continue
        histogram = ", ".join(f"{c}: {n}" for c, n in t["calls_histogram"].items())
        failed = ", ".join(f"{status} {n}" for status, n in t["statuses"].items() if status != "ok")
        lines.append(f"tool calls    {name}: {t['calls_mean']:.2f} per {per}, {100 * t['with_call']:.1f}% of "
                     f"{per}s with >= 1; {per}s with 0, 1, ... calls: {histogram}")
        lines.append(f"sandbox       {name}: {t['calls']} runs, ok {t['statuses']['ok']}, failed {t['failures']} "
                     f"({failed})")
    return "\n".join(lines)
