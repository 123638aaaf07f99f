"""Does GRPO teach the testbed's policy to call a Python tool, and does the tool help?

The design, written before the code and the runs: docs/studies/tools_learning/design.md. One command
runs the whole study and resumes where it was cut:

    python experiments/tools_learning.py                         # the study as designed: seeds 0 1 2
    python experiments/tools_learning.py --seeds 100 --out runs/tools_pilot   # the pilot's one seed
    python experiments/tools_learning.py --eval-size 256 --eval-every 20 --tool-prob 0.5   # pilot knobs
    python experiments/tools_learning.py run.steps=2 --seeds 0 --out runs/tools_smoke --sft-steps 20 \\
        --sft-until 0 data.eval_size=16                         # a smoke run (any key=value wins)

In order, each part skipped when its output already exists under --out:
1. the tokenizer and the SFT start on the tool-using corpus (data.tool_prob of the worked
   solutions call the tool), trained once until --sft-until (cached in <out>/sft, as every
   testbed study trains it);
2. the SFT start measured on the held-out questions with the tool and without
   (<out>/start.json): greedy accuracy, tool-call rate (the share of questions with at least
   one sandbox call), the accuracy of the questions answered with a call and of those
   without, the sandbox's statuses;
3. the arms, each seed from the same SFT start, the same questions in the same order:
     GRPO + tool     rl.max_tool_calls=1: a closed block runs in the sandbox, its output joins
                     the context (masked out of the loss, the KL and the entropy)
     GRPO, no tool   rl.max_tool_calls=0: a block is plain text, nothing runs
   evaluated every --eval-every steps on the held-out questions with the arm's own tool
   setting (the evaluations of a cut run are kept in <out>/<arm>/seed<N>.evals.json); each
   seed's curves in <out>/<arm>/seed<N>.json, written once the seed is done (a finished
   seed is read, not rerun; an unfinished one resumes from its last checkpoint);
4. summary.json: (T1) the paired step-end gap GRPO + tool − GRPO, no tool with
   `stats.paired_verdict`'s verdict, (T2) whether the tool arm's call rate ends above the
   start's in every seed, and for each arm whether every seed ends >= the best shortcut +
   0.10 (`shortcuts.clears`); tools_learning_accuracy.png and tools_learning_call_rate.png
   (mean and 95% interval per arm against the step).

Options are config keys as in the other experiments (``key=value``, after the design's
settings, so they win). Model text only reaches the task's parsers and the sandbox.
"""

from __future__ import annotations

import argparse
import os

TOOL, NO_TOOL = "GRPO + tool", "GRPO, no tool"
ARMS = {TOOL: ["rl.max_tool_calls=1"], NO_TOOL: ["rl.max_tool_calls=0"]}
# The design's settings on top of the testbed's (experiments/common.py MODULAR_DEFAULTS):
# 60 steps of 16 questions x G = 16 at lr 3e-4, beta 0.04, T = 1.
STUDY = ["rl.algorithm=grpo", "run.steps=60", "data.batch_size=16", "rl.group_size=16", "optimizer.peak_lr=3e-4",
         "rl.beta=0.04", "rl.temperature=1.0"]
# The pilot may change only these (the design's "Cost" section), each to one of its values.
PILOT = {"eval_size": (512, 256), "eval_every": (10, 20), "tool_prob": (0.25, 0.5)}
START_JSON = "start.json"
# Evaluation keys: the held-out greedy completions are drawn with this key at every step.
EVAL_KEY = 7_300_000


SLUGS = {TOOL: "grpo_tool", NO_TOOL: "grpo_no_tool"}  # folder names, and --arms' spelling


def slug(arm: str) -> str:
    return SLUGS[arm]


def seed_json(root: str, arm: str, seed: int) -> str:
    return os.path.join(root, slug(arm), f"seed{seed}.json")


def evals_json(root: str, arm: str, seed: int) -> str:
    return os.path.join(root, slug(arm), f"seed{seed}.evals.json")


def pending(root: str, arms, seeds) -> list[tuple[str, int]]:
    """The (arm, seed) pairs without a finished seed JSON, seed by seed (both arms' seed 0
    first), so a study cut short still holds paired seeds."""
    return [(arm, seed) for seed in seeds for arm in arms if not os.path.exists(seed_json(root, arm, seed))]


def write_json_atomic(path: str, obj) -> str:
    """``obj`` as JSON at ``path``, never half-written: a cut run leaves the old file or none."""
    import common

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    common.write_json(path + ".tmp", obj)
    os.replace(path + ".tmp", path)
    return path


def held_out_with_tools(sampler, weights, task, tokenizer, examples, tools) -> dict:
    """The policy's greedy completions of ``examples`` with the tool (``tools``, a
    `sampler.turns.ToolUse`) or without (None): accuracy (the answer line of the model's own
    text, `evaluation.own_text`), the tool-call rate (questions with at least one sandbox
    call), the accuracy of the questions answered with a call and without, the share whose
    own text holds a closed code block (called or not), and the sandbox's statuses."""
    import jax

    from grpo_jax.eval.evaluation import own_text
    from grpo_jax.parallel.sharding import to_host
    from grpo_jax.sampler.turns import generate_with_tools
    from grpo_jax.text.tokenizer import encode_prompt

    ids = [encode_prompt(tokenizer, ex.prompt) for ex in examples]
    greedy, key = sampler.evaluation(), jax.random.key(EVAL_KEY)
    if tools is None:
        rollout, runs = jax.tree.map(to_host, greedy.sample(weights, ids, key=key, group_size=1)), [[]] * len(ids)
    else:
        rollout, runs = generate_with_tools(greedy, weights, ids, key=key, group_size=1, tools=tools)
    texts = [own_text(rollout, r, tokenizer) for r in range(len(ids))]
    right = [bool(task.is_correct(task.extract_answer(t), ex)) for t, ex in zip(texts, examples)]
    called = [bool(row) for row in runs]
    with_call = [r for r, c in zip(right, called) if c]
    without = [r for r, c in zip(right, called) if not c]
    statuses: dict[str, int] = {}
    for row in runs:
        for run in row:
            statuses[run.status] = statuses.get(run.status, 0) + 1
    block = task.tool or _python_tool()
    return {"accuracy": sum(right) / len(right), "call_rate": sum(called) / len(called),
            "accuracy_with_call": sum(with_call) / len(with_call) if with_call else None,
            "accuracy_without_call": sum(without) / len(without) if without else None,
            "questions_with_call": len(with_call), "sandbox_calls": sum(len(row) for row in runs),
            "block_rate": sum(block.code(t) is not None for t in texts) / len(texts), "statuses": statuses}


def _python_tool():
    from grpo_jax.tools import PythonTool

    return PythonTool()


def tool_use(task, tokenizer, cfg, arm: str):
    """The arm's tool use (`sampler.turns.ToolUse`), None for the arm without the tool."""
    from grpo_jax.sampler.turns import ToolUse

    return None if arm == NO_TOOL else ToolUse.build(task.tool, tokenizer, 1, cfg.rl.tool_workers)


def start_measure(cfg, task, tok, params, mesh, examples, root: str) -> dict:
    """Part 2: the SFT start on the held-out questions with the tool and without (cached)."""
    import common

    from grpo_jax.sampler import Sampler

    path = os.path.join(root, START_JSON)
    if os.path.exists(path):
        return common.read_json(path)
    sampler = Sampler.for_run(cfg, mesh, tok)
    weights = sampler.copy(params)
    out = {arm: held_out_with_tools(sampler, weights, task, tok, examples, tool_use(task, tok, cfg, arm))
           for arm in ARMS}
    return common.read_json(write_json_atomic(path, out))


def run_seed(cfg, task, tok, params, mesh, examples, root: str, arm: str, seed: int, start: dict, progress: bool):
    """One (arm, seed): GRPO from the SFT start, evaluated with the arm's tool setting every
    run.eval_every steps (each evaluation kept as it is made, so a cut run keeps them); then
    the seed's JSON."""
    import common

    from grpo_jax.rl.metrics import read_jsonl
    from grpo_jax.rl.trainer import Trainer

    run_cfg = common.rl_config(cfg, root, f"{slug(arm)}/seed{seed}", ARMS[arm] + [f"run.seed={seed}"])
    # No in-run evaluation: the trainer's reads no tool; the study evaluates with the arm's.
    trainer = Trainer(run_cfg, task=task, tokenizer=tok, params=params, mesh=mesh, eval_examples=[],
                      progress=progress)
    steps = eval_steps(cfg)
    path = evals_json(root, arm, seed)
    evals = {int(s): e for s, e in (common.read_json(path) if os.path.exists(path) else {}).items()}
    evals[0] = start[arm]
    tools = trainer.tool_use
    for step in steps[1:]:
        if step in evals and step <= trainer.next_step:
            continue
        if step < trainer.next_step:
            raise ValueError(f"{run_cfg.run.run_dir} resumed at step {trainer.next_step}, past the evaluation of "
                             f"step {step} that {path} lacks: checkpoint at the evaluation steps "
                             "(run.checkpoint_every = run.eval_every), or start the seed over")
        trainer.train(step)
        evals[step] = held_out_with_tools(trainer.sampler, trainer.sampler.copy(trainer.params), task, tok,
                                          examples, tools)
        write_json_atomic(path, {str(s): e for s, e in sorted(evals.items())})
        print(f"[tools] {arm} seed {seed} step {step}: accuracy {evals[step]['accuracy']:.3f}, "
              f"call rate {evals[step]['call_rate']:.3f}")
    trainer.close()  # flushes the log before it is read
    history = read_jsonl(os.path.join(run_cfg.run.run_dir, "metrics.jsonl"))
    rows = cfg.data.batch_size * cfg.rl.group_size
    run = {"arm": arm, "seed": seed, "steps": steps, "tool_prob": cfg.data.tool_prob,
           **{key: [evals[s][key] for s in steps] for key in
              ("accuracy", "call_rate", "accuracy_with_call", "accuracy_without_call", "block_rate", "statuses",
               "sandbox_calls")},
           "training_sandbox_calls": round(sum(h.get("tool_calls", 0.0) for h in history) * rows),
           "training_tool_failures": [h.get("tool_failures", 0.0) for h in history],
           "history": history}
    write_json_atomic(seed_json(root, arm, seed), run)
    return run


def eval_steps(cfg) -> list[int]:
    return [0] + list(range(cfg.run.eval_every, cfg.run.steps + 1, cfg.run.eval_every))


def verdicts(runs: dict[str, dict[int, dict]], start: dict, bar: float) -> dict:
    """The design's tests on finished seeds (``runs``: arm -> seed -> seed JSON): (T1) the
    paired step-end gap tool − no tool over the seeds both arms ran, with
    `stats.paired_verdict`'s verdict; (T2) the tool arm's step-end call rate above the SFT
    start's (``start``, start.json) in every seed; learning: every seed of an arm ends at or
    above ``bar`` (the best shortcut) + 0.10."""
    from grpo_jax.eval.stats import paired_verdict
    from grpo_jax.tasks.shortcuts import LEARNING_MARGIN, clears

    finals = {arm: {s: r["accuracy"][-1] for s, r in by_seed.items()} for arm, by_seed in runs.items()}
    out: dict = {"final_accuracy": finals, "best_shortcut": bar, "learning_bar": bar + LEARNING_MARGIN}
    seeds = sorted(set(finals.get(TOOL, {})) & set(finals.get(NO_TOOL, {})))
    if seeds:
        gaps = [finals[TOOL][s] - finals[NO_TOOL][s] for s in seeds]
        mean, low, high, verdict = paired_verdict(gaps)
        out["T1"] = {"claim": "the tool helps", "seeds": seeds, "gaps": gaps, "mean": mean, "low": low,
                     "high": high, "verdict": verdict}
    if runs.get(TOOL):
        start_rate = start[TOOL]["call_rate"]
        ends = {s: r["call_rate"][-1] for s, r in runs[TOOL].items()}
        out["T2"] = {"claim": "GRPO learns to call it", "start_call_rate": start_rate, "final_call_rate": ends,
                     "holds": all(rate > start_rate for rate in ends.values())}
    out["learning"] = {arm: clears(by_seed, bar) for arm, by_seed in finals.items()}
    return out


def main(argv=None):
    import common

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from grpo_jax import config as config_lib

    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of both arms (default 0 1 2)")
    p.add_argument("--arms", nargs="+", choices=list(SLUGS.values()), default=list(SLUGS.values()),
                   help=f"arms to run, {SLUGS[TOOL]} ({TOOL}) and {SLUGS[NO_TOOL]} ({NO_TOOL}) (default both)")
    p.add_argument("--eval-size", type=int, choices=PILOT["eval_size"], default=PILOT["eval_size"][0],
                   help="held-out questions (the design's pilot knob: 512 or 256)")
    p.add_argument("--eval-every", type=int, choices=PILOT["eval_every"], default=PILOT["eval_every"][0],
                   help="steps between held-out evaluations (the design's pilot knob: 10 or 20)")
    p.add_argument("--tool-prob", type=float, choices=PILOT["tool_prob"], default=PILOT["tool_prob"][0],
                   help="share of SFT solutions that call the tool (the design's pilot knob: 0.25 or 0.5)")
    p.add_argument("--out", default="runs/tools_learning", help="output directory")
    args = p.parse_intermixed_args(argv)  # overrides go before --seeds, which takes a list
    arms = [arm for arm in ARMS if SLUGS[arm] in args.arms]
    knobs = [f"data.eval_size={args.eval_size}", f"run.eval_every={args.eval_every}",
             f"run.checkpoint_every={args.eval_every}", f"data.tool_prob={args.tool_prob}"]
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}"] + common.MODULAR_DEFAULTS + STUDY + knobs)
    if cfg.data.task != "modular" or cfg.data.tool_prob <= 0:
        p.error(f"the study needs data.task=modular with data.tool_prob > 0, got {cfg.data.task}, "
                f"{cfg.data.tool_prob}")
    if cfg.run.steps % cfg.run.eval_every:
        p.error(f"run.steps={cfg.run.steps} must be a multiple of run.eval_every={cfg.run.eval_every}: "
                "the gap is judged at the last step")
    root = cfg.run.run_dir
    task = common.make_task(cfg.data.task, cfg.data)
    tok, cfg = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    params, mesh = common.sft_start(cfg, task, tok, root, args)
    examples, shortcuts = common.held_out(task, cfg, "tools")
    start = start_measure(cfg, task, tok, params, mesh, examples, root)
    for arm in ARMS:
        s = start[arm]
        print(f"[tools] SFT start, {arm} setting: accuracy {s['accuracy']:.3f}, call rate {s['call_rate']:.3f} "
              f"(with a call {s['accuracy_with_call']}, without {s['accuracy_without_call']}); "
              f"best shortcut {shortcuts.best[1]:.3f}")
    steps = eval_steps(cfg)
    for arm, seed in pending(root, arms, args.seeds):
        print(f"[tools] {arm} seed {seed}")
        run_seed(cfg, task, tok, params, mesh, examples, root, arm, seed, start, not args.no_progress)
    return summarize(root, arms, args.seeds, steps, start, shortcuts, cfg)


def summarize(root: str, arms, seeds, steps, start: dict, shortcuts, cfg) -> dict:
    """Part 4: the verdicts over the finished seeds, summary.json and the two figures."""
    import common

    from grpo_jax.eval.plots import plot_runs

    runs = {arm: {s: common.read_json(seed_json(root, arm, s)) for s in seeds} for arm in arms}
    for arm, by_seed in runs.items():
        for s, r in by_seed.items():
            if r["steps"] != steps:
                raise ValueError(f"{seed_json(root, arm, s)} was evaluated at steps {r['steps']}, this study at "
                                 f"{steps}: not the same study")
    summary = {**verdicts(runs, start, shortcuts.best[1]), "steps": steps, "start": start,
               "call_rate": {arm: {s: r["call_rate"] for s, r in by_seed.items()} for arm, by_seed in runs.items()},
               "shortcuts": shortcuts.to_dict(), "config": cfg.to_dict()}
    path = write_json_atomic(os.path.join(root, "summary.json"), summary)
    pngs = [plot_runs({arm: [runs[arm][s][key] for s in sorted(runs[arm])] for arm in arms}, steps,
                      os.path.join(root, f"tools_learning_{key}.png"), ylabel=f"held-out greedy {label}",
                      title=f"Learning to call the tool (mod {cfg.data.modulus}, {cfg.data.num_operands} operands)\n"
                            "mean and 95% interval over seeds")
            for key, label in (("accuracy", "accuracy"), ("call_rate", "tool-call rate"))]
    for arm in arms:
        print(f"[tools] {arm}: final accuracy " + ", ".join(f"{summary['final_accuracy'][arm][s]:.3f}"
                                                             for s in sorted(runs[arm]))
              + f" (best shortcut {shortcuts.best[1]:.3f}; learning: {'yes' if summary['learning'][arm] else 'no'})")
    if "T1" in summary:
        t1 = summary["T1"]
        print(f"[tools] T1 {TOOL} − {NO_TOOL} = {t1['mean']:+.3f} [{t1['low']:+.3f}, {t1['high']:+.3f}] "
              f"(n={len(t1['seeds'])}): {t1['verdict']}")
    if "T2" in summary:
        t2 = summary["T2"]
        print(f"[tools] T2 call rate at the end {t2['final_call_rate']} vs the start's {t2['start_call_rate']:.3f}: "
              f"{'holds' if t2['holds'] else 'does not hold'}")
    print(f"[tools] wrote {path}, {pngs[0]} and {pngs[1]}")
    return summary


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
