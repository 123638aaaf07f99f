"""Candidates for the word_arithmetic task: each one's shortcut audit and untrained accuracy.

For each candidate (operand ranges of `grpo_jax.tasks.word_arithmetic`, named in CANDIDATES):
the held-out set (data.seed 0, balanced by kind), every shortcut's score on it
(`grpo_jax.tasks.shortcuts`, fitted on training questions: `fit_examples`), and, unless --no-model,
SmolLM2-135M-Instruct's greedy accuracy on it, overall and per kind, for each prompt style
given: `word_arithmetic` (the task's: "Work it out one operation per line, then give the
answer."), `word_arithmetic_chain` (the same, "using the result of each line in the next"),
`arithmetic_instructed` ("Answer with just the number.": the untrained model told the
answer's form) and `arithmetic` (the bare question).

    python experiments/word_arithmetic_candidates.py "2 kinds, 19-9"            # the chosen task
    python experiments/word_arithmetic_candidates.py "4 kinds, 19-9, then" "4 kinds, C2, then" --no-model
    python experiments/word_arithmetic_candidates.py "2 kinds, 19-9" --styles word_arithmetic \\
        word_arithmetic_chain arithmetic_instructed --json runs/word_candidates.json

The design this fed: docs/studies/smollm2_words/design.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import time


# name -> (kinds, ranges replacing grpo_jax.tasks.word_arithmetic.RANGES' (kind -> (a, b, c
# ranges, the largest first result)) [, phrasing]), in the order they were measured.
CANDIDATES = {
    # every added or subtracted number (a difference included) in [2, 19], factors in [2, 9]
    "4 kinds, 19-9, then": (("+*", "-*", "*+", "*-"), {}, "then"),
    # smaller first sums and differences, larger multipliers and addends
    "4 kinds, C2, then": (("+*", "-*", "*+", "*-"), {
        "+*": ((2, 12), (2, 12), (2, 12), 14), "-*": ((4, 31), (2, 19), (2, 12), 12),
        "*+": ((2, 9), (2, 9), (10, 49), 81), "*-": ((3, 9), (3, 9), (2, 19), 81)}, "then"),
    # the two kinds SmolLM2 answered best at 19-9, first phrasing
    "2 kinds, 19-9, then": (("+*", "*+"), {}, "then"),
    # the same, the second operation acting on "the result": the task's default
    "2 kinds, 19-9": (("+*", "*+"), {}),
}


def audit(task, examples) -> dict:
    from grpo_jax.tasks.shortcuts import shortcut_baselines

    return shortcut_baselines(task, examples).to_dict()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("candidates", nargs="+", choices=sorted(CANDIDATES), help="names of CANDIDATES")
    p.add_argument("--questions", type=int, default=192, help="held-out questions (default 192: 48 per kind)")
    p.add_argument("--styles", nargs="+", default=["word_arithmetic", "arithmetic_instructed"],
                   help="prompt styles the untrained model is asked in (grpo_jax.tasks.prompts.STYLES)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy completion length (default 64)")
    p.add_argument("--no-model", action="store_true", help="audits only, no model")
    p.add_argument("--examples", type=int, default=4, help="greedy completions printed per style")
    p.add_argument("--json", default=None, help="also write everything here")
    args = p.parse_args(argv)

    from grpo_jax.tasks import get_task

    sampler = params = tokenizer = None
    if not args.no_model:
        sampler, params, tokenizer = load_model(args.max_new_tokens)
    out = {}
    for spec in args.candidates:
        kinds, ranges, *phrasing = CANDIDATES[spec]
        task = get_task("word_arithmetic", kinds=kinds, ranges=ranges, phrasing=(phrasing or ["result"])[0])
        examples = task.examples("test", args.questions, 0)
        row = {"kinds": kinds, "phrasing": task.phrasing, "ranges": {k: task.ranges[k] for k in kinds}, "questions": len(examples),
               "test_space_per_kind": {k: len(task.space("test", k)) for k in task.kinds},
               "audit": audit(task, examples), "untrained": {}}
        print(f"candidate {spec}: {len(examples)} held-out questions (test split per kind "
              f"{row['test_space_per_kind']}); best shortcut {row['audit']['best_score']:.3f} "
              f"({row['audit']['best']})", flush=True)
        for name, score in sorted(row["audit"]["scores"].items(), key=lambda kv: -kv[1]):
            print(f"    {score:.3f}  {name}")
        for style in ([] if args.no_model else args.styles):
            row["untrained"][style] = greedy(task, examples, style, sampler, params, tokenizer, args.examples)
        out[spec] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return out


def load_model(max_new_tokens: int):
    """SmolLM2-135M-Instruct, its chat tokenizer and a greedy sampler of `max_new_tokens`."""
    from gsm8k_grpo import ChatTokenizer

    from grpo_jax import config as config_lib
    from grpo_jax.model import pretrained
    from grpo_jax.parallel.sharding import make_mesh
    from grpo_jax.sampler import Sampler

    cfg = config_lib.apply_overrides(config_lib.get_preset("smollm2-135m"), [
        f"rl.max_new_tokens={max_new_tokens}", "model.remat=none"]).validate()
    mesh = make_mesh(cfg.mesh)
    model_cfg, params, tokenizer = pretrained.load(
        cfg.run.pretrained, mesh=mesh, overrides={k: getattr(cfg.model, k) for k in pretrained.RUNTIME_FIELDS})
    cfg = cfg.replace(model=model_cfg).validate()
    tokenizer = ChatTokenizer(tokenizer)
    return Sampler.for_run(cfg, mesh, tokenizer), params, tokenizer


def greedy(task, examples, style, sampler, params, tokenizer, show: int) -> dict:
    """Greedy accuracy (overall and per kind) of the untrained model asked in `style`."""
    import dataclasses

    import jax

    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.tasks import prompts
    from grpo_jax.tasks.chat import chat_task

    asked = [dataclasses.replace(ex, prompt=prompts.chat_prompt(ex.meta["question"], tokenizer, style))
             for ex in examples]
    wrapped = chat_task(task, tokenizer, style)
    t0 = time.perf_counter()
    result = evaluate(sampler, params, wrapped, tokenizer, asked, key=jax.random.key(1), texts=True)
    per_kind = collections.defaultdict(list)
    for ex, ok in zip(examples, result["correct"]):
        per_kind[ex.meta["kind"]].append(ok)
    row = {"accuracy": result["accuracy"], "right": sum(result["correct"]),
           "per_kind": {k: sum(v) / len(v) for k, v in per_kind.items()},
           "examples": [{"question": ex.meta["question"], "answer": ex.answer, "completion": text}
                        for ex, text in zip(examples[:show], result["texts"])],
           "seconds": round(time.perf_counter() - t0, 1)}
    print(f"  untrained, style {style!r}: greedy accuracy {row['accuracy']:.3f} ({row['right']}/{len(examples)}); "
          f"per kind {', '.join(f'{k} {v:.3f}' for k, v in row['per_kind'].items())} ({row['seconds']:.0f} s)", flush=True)
    for ex in row["examples"]:
        print(f"    {ex['question']} [{ex['answer']}] -> {ex['completion']!r}")
    return row


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
