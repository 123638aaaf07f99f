"""Shared set-up for the CPU experiments: the arithmetic task, its tokenizer and an SFT start.

Every ablation starts RL from the same imperfect SFT model, as the paper starts every RL
method from DeepSeekMath-Instruct. The SFT run is cached in `<root>/sft` (an Orbax
checkpoint plus the tokenizer), so the second ablation reuses the first one's start.
"""

from __future__ import annotations

import os
from typing import NamedTuple


import jax

from grpo_jax.checkpoints import checkpointing
from grpo_jax import config as config_lib
from grpo_jax.model.transformer import init_params
from grpo_jax.cli.runs import make_task  # noqa: F401  (re-exported: every experiment builds its task with it)
from grpo_jax.text.tokenizer import SentencePieceTokenizer, train_sentencepiece
from grpo_jax.rl.trainer import Trainer

# The CPU setting every experiment shares (the quickstart's): 1-digit, 3-operand arithmetic,
# a 2-layer model, SFT on solutions that drop the carry or borrow of a step 70% of the time.
# That slip is systematic, so the SFT model's greedy answer is wrong on every question that
# carries while its samples are often right: the gap RL closes (the paper's Maj@K finding).
# Random slips instead leave a start whose errors are capacity errors that a few hundred
# RL steps on a 2-core CPU do not move (docs/studies/testbed/results.md, "Quickstart").
CPU_DEFAULTS = [
    "run.steps=100", "run.eval_every=25", "run.checkpoint_every=100",
    "rl.group_size=16", "rl.max_new_tokens=32", "rl.beta=0.04", "rl.temperature=1.0",
    "data.batch_size=16", "data.eval_size=128", "data.num_operands=3", "data.max_digits=1",
    "data.slip=carry", "data.wrong_step_prob=0.7",
    "optimizer.peak_lr=1e-4", "optimizer.warmup_steps=5", "optimizer.schedule=constant",
    "model.embed_dim=128", "model.num_layers=2", "model.mlp_dim=384", "model.max_seq_len=64",
]


# The testbed (grpo_jax/tasks/modular.py, docs/studies/testbed/design.md): 6 operands modulo 13 with
# exactly 2 subtractions, an SFT corpus that reads each "-" as "+" 60% of the time, a reward
# that is correctness only, and 512 distinct held-out questions whose best shortcut is under
# 0.10 (tests/tasks/test_tasks_modular.py). On top of CPU_DEFAULTS.
MODULAR_DEFAULTS = [
    "data.task=modular", "data.modulus=13", "data.num_operands=6", "data.num_subtractions=2",
    "data.wrong_step_prob=0.6", "data.format_reward=0", "data.eval_size=512",
    "rl.max_new_tokens=56", "model.max_seq_len=96", "optimizer.peak_lr=3e-4",
]

# Every regime a shipped study or the quickstart runs on (CPU_DEFAULTS + these), by name:
# a test holds each held-out set's best shortcut to <= 0.10.
STUDY_REGIMES = {"modular": MODULAR_DEFAULTS}

# What an SFT start depends on besides the model (see sft_start).
SFT_CACHE_FIELDS = ("optimizer", "run.seed", "run.steps", "data.task", "data.seed", "data.batch_size",
                    "data.num_operands", "data.max_digits", "data.slip", "data.wrong_step_prob", "data.min_carries",
                    "data.modulus", "data.num_subtractions", "data.tool_prob")


# SFT per task when --sft-steps / --sft-until are not given: (steps, until). Modular tables are
# learned after a plateau whose length varies by seed, so its SFT runs until they are
# (docs/studies/testbed/design.md); other tasks train a fixed number of steps.
SFT_DEFAULTS = {"modular": (4000, 0.95)}
SFT_DEFAULT = (1500, 0.0)


def add_sft_args(parser) -> None:
    parser.add_argument("--sft-steps", type=int, default=None,
                        help="SFT steps before RL; with --sft-until, the most SFT may take "
                             f"(default: {SFT_DEFAULTS['modular'][0]} on the testbed, {SFT_DEFAULT[0]} otherwise)")
    parser.add_argument("--sft-until", type=float, default=None,
                        help="train SFT until this share of the greedy step lines on 64 training questions "
                             "are right table lookups (tasks with `lookups_right`; 0: --sft-steps exactly; "
                             f"default: {SFT_DEFAULTS['modular'][1]} on the testbed, {SFT_DEFAULT[1]} otherwise)")
    parser.add_argument("--sft-check-every", type=int, default=250, help="SFT steps between --sft-until checks")
    parser.add_argument("--sft-lr", type=float, default=2e-3, help="SFT peak learning rate")
    parser.add_argument("--sft-batch", type=int, default=32, help="SFT sequences per step")
    parser.add_argument("--tokenizer-vocab", type=int, default=64, help="sentencepiece vocabulary size")
    parser.add_argument("--no-progress", action="store_true", help="disable progress bars")


def load_cfg(args, extra_defaults=()) -> config_lib.Config:
    return config_lib.apply_overrides(config_lib.get_preset(args.preset),
                                      CPU_DEFAULTS + list(extra_defaults) + list(args.overrides))


def tokenizer_for(task, cfg, root: str, vocab: int):
    path = os.path.join(root, "tokenizer.model")
    if os.path.exists(path):
        tok = SentencePieceTokenizer.load(path)
    else:
        os.makedirs(root, exist_ok=True)
        tok = train_sentencepiece(task.text_corpus(2000, seed=cfg.data.seed), vocab_size=vocab)
        tok.save(path)
    return tok, cfg.replace(model={"vocab_size": tok.vocab_size}).validate()


def resolve_sft_args(args, task_name: str) -> None:
    """Fill the --sft-steps / --sft-until not given with the task's defaults (SFT_DEFAULTS)."""
    steps, until = SFT_DEFAULTS.get(task_name, SFT_DEFAULT)
    if args.sft_steps is None:
        args.sft_steps = steps
    if getattr(args, "sft_until", None) is None:
        args.sft_until = until


def sft_start(cfg, task, tokenizer, root: str, args, *, mesh=None):
    """Params of the SFT model (trained once, then restored from `<root>/sft`) and its mesh."""
    resolve_sft_args(args, cfg.data.task)
    sft_cfg = cfg.replace(
        rl={"algorithm": "sft", "group_size": config_lib.RLConfig.group_size},  # SFT samples nothing
        run={"run_dir": os.path.join(root, "sft"), "steps": args.sft_steps, "eval_every": 0,
             "checkpoint_every": args.sft_steps},
        optimizer={"peak_lr": args.sft_lr, "schedule": "multistep", "warmup_steps": 20},
        data={"batch_size": args.sft_batch}).validate()
    # A cached SFT run is reused only if it was trained on the same data with the same recipe:
    # the Trainer's own check covers the model alone, since a resume may change the rest.
    _check_sft_cache(sft_cfg)
    pairs = task.sft_examples("train", args.sft_steps * args.sft_batch, cfg.data.seed,
                              wrong_step_prob=cfg.data.wrong_step_prob)

    def sft_data(step):
        chunk = pairs[step * args.sft_batch:(step + 1) * args.sft_batch]
        return [ex.prompt for ex, _ in chunk], [sol for _, sol in chunk]

    params = init_params(cfg.model, jax.random.key(cfg.run.seed))
    trainer = Trainer(sft_cfg, task=task, tokenizer=tokenizer, params=params, sft_data=sft_data,
                      mesh=mesh, eval_examples=[], progress=not args.no_progress)
    until = args.sft_until
    if until > 0:
        _train_until(cfg, trainer, task, tokenizer, until, args.sft_check_every, root)
    else:
        trainer.train()  # a no-op when the cached run already finished
    params, mesh = trainer.params, trainer.mesh
    trainer.close()
    return params, mesh


def _check_sft_cache(sft_cfg) -> None:
    """Refuse a cached SFT start of another recipe (SFT_CACHE_FIELDS). A start cached before
    data.tool_prob existed saved no such field; its corpus had no tool solutions, so it
    stands for data.tool_prob=0."""
    directory = os.path.join(sft_cfg.run.run_dir, "checkpoints")
    requested = sft_cfg.to_dict()
    if not sft_cfg.data.tool_prob and os.path.isdir(directory):
        ckpt = checkpointing.Checkpointer(directory)
        try:
            steps = ckpt.all_steps()
            saved = ckpt.read_meta(steps[-1]).get("config") or {} if steps else {}
        except Exception:  # an unreadable cache is the full check's (and the restore's) to report
            saved = {}
        finally:
            ckpt.close()
        if "tool_prob" not in saved.get("data", {"tool_prob": None}):
            del requested["data"]["tool_prob"]
    checkpointing.check_run_dir(directory, requested, also=SFT_CACHE_FIELDS)


SFT_CHECK_QUESTIONS, SFT_CHECK_SEED = 64, 9_500_000
SFT_REPORT = "sft_until.json"


def _train_until(cfg, trainer, task, tokenizer, until: float, every: int, root: str) -> None:
    """SFT in chunks of `every` steps until the greedy step lines on 64 training questions are
    right table lookups `until` of the time (`task.lookups_right`), at most `run.steps`.

    Modular tables are learned after a plateau whose length varies by seed (docs/studies/testbed/design.md):
    an SFT stopped there leaves a policy at chance, with nothing for RL to re-rank. The check
    runs at every chunk's end, also on a resumed run, so a cached start stops where it stopped.
    Writes each check to `<root>/sft/sft_until.json` (`sft_report`)."""
    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.sampler import Sampler

    examples = task.examples("train", SFT_CHECK_QUESTIONS, SFT_CHECK_SEED)
    # A resumed start keeps the checks of the steps it already ran.
    earlier = sft_report(root) or {}
    checks = [c for c in earlier.get("checks", []) if c["step"] < trainer.next_step]
    while True:
        step = trainer.next_step
        if step > 0:
            texts = evaluate(Sampler.for_run(cfg, trainer.mesh, tokenizer), trainer.params, task, tokenizer,
                             examples, key=jax.random.key(0), texts=True)["texts"]
            right = total = 0
            for text, ex in zip(texts, examples):
                r, t = task.lookups_right(text, ex)
                right, total = right + r, total + t
            share = right / total if total else 0.0
            checks.append({"step": step, "lookups_right": share, "loss": _recent_loss(trainer)})
            print(f"[sft] step {step}: greedy step lines that are right lookups {share:.3f} "
                  f"(until {until}), loss {checks[-1]['loss']}")
            if share >= until:
                break
        if step >= trainer.cfg.run.steps:
            break
        trainer.train(min(step + every, trainer.cfg.run.steps))
    report = {"until": until, "reached": bool(checks) and checks[-1]["lookups_right"] >= until,
              "steps": trainer.next_step, "cap": trainer.cfg.run.steps, "checks": checks}
    write_json(os.path.join(trainer.cfg.run.run_dir, SFT_REPORT), report)


def _recent_loss(trainer) -> float | None:
    losses = [h["loss"] for h in trainer.history[-50:] if "loss" in h]
    return round(sum(losses) / len(losses), 4) if losses else None


def sft_report(root: str) -> dict | None:
    """What `--sft-until` measured for the SFT start cached in `<root>/sft` (None without it)."""
    import json

    path = os.path.join(root, "sft", SFT_REPORT)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def held_out(task, cfg, tag: str):
    """The held-out test questions every experiment evaluates on, and their shortcut
    baselines (`grpo_jax.tasks.shortcuts`), printed once so every accuracy has its bar beside it."""
    from grpo_jax.tasks.shortcuts import shortcut_baselines

    examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    baselines = shortcut_baselines(task, examples)
    print(f"[{tag}] held-out set: {len(examples)} questions ({baselines.distinct_questions} distinct), "
          f"{baselines.line()}")
    return examples, baselines


class StudyStart(NamedTuple):
    """What every arm of a study shares (``study_start``)."""
    cfg: config_lib.Config  # the study's config, its vocabulary set to the tokenizer's
    task: object
    tokenizer: object
    params: object  # the SFT start
    mesh: object
    eval_examples: list
    shortcuts: object  # the held-out set's baselines (grpo_jax.tasks.shortcuts)
    accuracy: float  # the SFT start's held-out greedy accuracy


def study_start(cfg, args, tag: str) -> StudyStart:
    """The task of ``cfg``, its tokenizer and SFT start (both cached under ``run.run_dir``), the
    held-out questions with their shortcut baselines, and the start's held-out greedy accuracy."""
    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.sampler import Sampler

    root = cfg.run.run_dir
    task = make_task(cfg.data.task, cfg.data)
    tok, cfg = tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    params, mesh = sft_start(cfg, task, tok, root, args)
    examples, shortcuts = held_out(task, cfg, tag)
    accuracy = evaluate(Sampler.for_run(cfg, mesh, tok), params, task, tok, examples, key=jax.random.key(1))["accuracy"]
    return StudyStart(cfg, task, tok, params, mesh, examples, shortcuts, accuracy)


def rl_config(cfg, root: str, name: str, overrides=()) -> config_lib.Config:
    out = cfg.replace(run={"run_dir": os.path.join(root, name)})
    return config_lib.apply_overrides(out, list(overrides)).validate()


def run_rl(cfg, task, tokenizer, params, mesh, root: str, name: str, overrides, *, seed: int,
           eval_examples, progress: bool, reward_model=None):
    """One RL run from `params`; returns its history (a list of metric dicts, every step from
    the first, also when the run resumed from a checkpoint) and the trainer. A finished run
    is restored, not repeated, so adding a seed re-runs only the new one."""
    run_cfg = rl_config(cfg, root, f"{name}/seed{seed}", list(overrides) + [f"run.seed={seed}"])
    trainer = Trainer(run_cfg, task=task, tokenizer=tokenizer, params=params, mesh=mesh,
                      eval_examples=eval_examples, progress=progress, reward_model=reward_model)
    return train_and_close(trainer), trainer


def train_and_close(trainer) -> list[dict]:
    """Train, close, and return the metrics of every step from the first, also when the run
    resumed from a checkpoint (or had already finished): then its log holds the earlier steps.
    The trainer's params stay usable."""
    from grpo_jax.rl.metrics import read_jsonl

    history = trainer.train()
    trainer.close()  # flushes the log before it is read
    if trainer.start_step > 0:
        history = read_jsonl(os.path.join(trainer.cfg.run.run_dir, "metrics.jsonl"))
    return history


def curve(history, key: str, steps) -> list[float]:
    """Values of `key` at `steps` (step 0 is filled by the caller's starting value)."""
    by_step = {h["step"]: h[key] for h in history if key in h}
    return [by_step[s] for s in steps]


def read_json(path: str):
    import json

    with open(path) as f:
        return json.load(f)


def write_json(path: str, obj) -> str:
    import json

    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    return path


def cached_json(path: str, key: dict, compute, say=print) -> dict:
    """``compute()``'s result (a JSON-able dict), kept in the file ``path`` beside the other
    results cached there, each under the ``key`` (a dict of what decides it) it was computed
    for: a second call with an equal key reads it instead of computing it again (the start
    model's evaluation, shared by every seed and every resume of a study). Only the main
    process writes; every process computes what it does not find."""
    from grpo_jax.parallel import distributed

    entries = read_json(path) if os.path.exists(path) else []
    for entry in entries:
        if entry["key"] == key:
            say(f"read from {path} (computed before for the same key)")
            return entry["value"]
    value = compute()
    if distributed.is_main_process():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        write_json(tmp, entries + [{"key": key, "value": value}])
        os.replace(tmp, path)  # a killed write leaves the old file whole
    return value
