"""The paper's Figure 5 with reward models as the paper scored it, on step labels that mean progress.

The design, written before the runs: docs/studies/arithmetic_history/figure5_progress_design.md (the flawed first
design it replaces: docs/studies/arithmetic_history/figure5_sparse_design.md). One command runs the whole study and
resumes where it was cut:

    python experiments/figure5_sparse.py --regime arithmetic    # the progress-label study as designed (history)
    python experiments/figure5_sparse.py --regime arithmetic --reward-models-only   # parts 1-3 only
    python experiments/figure5_sparse.py run.steps=2 --seeds 0 --oracle-seeds 0 --out runs/f5s_smoke
    python experiments/figure5_sparse.py --regime modular --rule-arms-only --sft-until 0.95 --sft-steps 4000 \
        --out runs/figure5_testbed                            # docs/studies/figure5_testbed/design.md (parts 1, 4, 5)
    python experiments/figure5_sparse.py --regime modular --reward-model-arms-only --rm-draws 3 --seeds 0 1 2 \
        --sft-until 0.95 --sft-steps 4000 --out runs/figure5_testbed   # docs/studies/figure5_testbed_rm/design.md

In order, each part skipped when its output already exists under --out:
1. the SFT start (cached in <out>/sft, as every CPU ablation trains it);
2. the reward models' data: --rm-questions training questions x --rm-group samples of the
   SFT model at rl.temperature, labelled by the task's rules (the oracle), and the same from
   --rm-held-out validation questions; both kinds are trained on the same labelled samples
   (<out>/reward_models/{train,held_out}.jsonl; --rm-held-out-seed draws another held-out set,
   --rm-data-only stops here); then --mc-samples of the held-out samples
   labelled again by Monte-Carlo completion (`reward_models.progress`, --mc-n continuations
   of each step prefix by the SFT model), against the rule
   (<out>/reward_models/mc_check_s<samples>_n<n>.json);
3. an outcome (ORM) and a process reward model (PRM), each by experiments/train_reward_model.py
   on the policy's task with the policy's tokenizer (<out>/reward_models/{orm,prm}, with
   metrics.json holding the held-out accuracies); with --rm-draws N > 1, N draws of each
   (run.seed=d, the same labelled samples) in <out>/reward_models/{orm,prm}_draw<d>, a
   reward-model arm's seed s scored by draw s % N;
4. the arms, every seed from the same SFT start and the same question stream per seed:
     GRPO+OS       outcome supervision, rewards from the ORM
     GRPO+PS       process supervision, step rewards from the PRM (Math-Shepherd style)
     Online RFT    samples of π_θ, gradient coefficient 1 on rule-correct outputs
     RFT           the offline control: samples of π_sft, same coefficient
     GRPO+OS-rule, GRPO+PS-rule   the oracle arms: the task's rules score them
   each seed's curve in <out>/<arm>/seed<N>.json (a finished pair is read, not rerun; an
   unfinished one resumes from its last checkpoint);
5. figure5_sparse.png (held-out greedy accuracy, mean and 95% interval per arm) and
   summary.json: each claim's paired final-accuracy gap with its verdict, and the step at
   which each arm first reaches --reach held-out accuracy with the paired speed gap, and
   whether each arm beats the held-out set's best shortcut (`grpo_jax.tasks.shortcuts`) by 10
   points in every seed.

--rule-arms-only runs parts 1, 4, 5 with the rule-scored arms alone. --reward-model-arms-only
runs the reward-model arms (GRPO+OS, GRPO+PS) on --seeds and judges them against the rule arms'
finished seed files of a --rule-arms-only study in the same --out (read, not rerun), writing
figure5_sparse_reward_models.png and summary_reward_models.json beside that study's own.

Options are config keys as in the other ablations; the regime's knobs default to
SPARSE_REGIME. Reward code only parses model text (the task's whitelisted parsers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

# The regime of docs/studies/arithmetic_history/figure5_progress_design.md; command-line overrides still win.
SPARSE_REGIME = ["data.num_operands=8", "data.min_carries=4", "data.wrong_step_prob=0.8",
                 "data.format_reward=0", "data.eval_size=256", "rl.max_new_tokens=64", "model.max_seq_len=96",
                 "run.steps=60", "run.eval_every=10", "run.checkpoint_every=10"]

GRPO_OS, GRPO_PS = ["rl.algorithm=grpo", "rl.supervision=outcome"], ["rl.algorithm=grpo", "rl.supervision=process"]
# arm -> (its overrides, the reward model scoring it: None for the rule, else 'orm' / 'prm')
ARMS = {
    "GRPO+OS": (GRPO_OS, "orm"),
    "GRPO+PS": (GRPO_PS, "prm"),
    "Online RFT": (["rl.algorithm=online_rft"], None),
    "RFT": (["rl.algorithm=rft"], None),
    "GRPO+OS-rule": (GRPO_OS, None),
    "GRPO+PS-rule": (GRPO_PS, None),
}
MAIN_ARMS = ("GRPO+OS", "GRPO+PS", "Online RFT")  # --seeds; the others run --oracle-seeds
# --rule-arms-only: the primary comparison of docs/studies/figure5_testbed/design.md, no reward models,
# every arm on --seeds.
RULE_ARMS = ("GRPO+OS-rule", "GRPO+PS-rule", "Online RFT", "RFT")
# --regime modular: the testbed's regime (experiments/common.py) with this study's lengths.
TESTBED_RUN = ["run.steps=60", "run.eval_every=10", "run.checkpoint_every=10"]

# --reward-model-arms-only: the secondary comparison of docs/studies/figure5_testbed_rm/design.md.
RM_ARMS = ("GRPO+OS", "GRPO+PS")
# --rm-draws 1 keeps the folders of the arithmetic studies; N > 1 adds _draw<d>.
RM_NAMES = {"outcome": "orm", "process": "prm"}
# The reward models' data: the seed of the training questions and of their sampling, and the
# held-out set's default (--rm-held-out-seed; every committed study's held-out set).
RM_TRAIN_SEED, RM_HELD_OUT_SEED = 5_000_000, 5_000_001

# The claims as (better, worse): judged on the seeds both arms ran.
CLAIMS = {
    "(a) online beats offline": ("Online RFT", "RFT"),
    "(b) process beats outcome": ("GRPO+PS", "GRPO+OS"),
    "(c) GRPO+OS beats Online RFT": ("GRPO+OS", "Online RFT"),
    "(b) oracle: process beats outcome": ("GRPO+PS-rule", "GRPO+OS-rule"),
    "(c) oracle: GRPO+OS beats Online RFT": ("GRPO+OS-rule", "Online RFT"),
}
RM_CLAIMS = {claim: CLAIMS[claim] for claim in ("(b) process beats outcome", "(c) GRPO+OS beats Online RFT")}
# No claims: each reward-model arm against each rule arm, paired by seed (what scoring by a
# learned model instead of the rule gives or costs).
AGAINST_RULE_ARMS = {f"{rm} − {rule}": (rm, rule) for rm in RM_ARMS for rule in RULE_ARMS}


def slug(arm: str) -> str:
    return arm.replace(" ", "_").replace("+", "_")


def seed_json(root: str, arm: str, seed: int) -> str:
    return os.path.join(root, slug(arm), f"seed{seed}.json")


def pending(root: str, plan: dict[str, list[int]]) -> list[tuple[str, int]]:
    """The (arm, seed) pairs of ``plan`` (arm -> seeds) with no finished seed JSON, seed by
    seed (every arm's seed 0 first), so a study cut short still holds paired seeds."""
    seeds = sorted({s for arm_seeds in plan.values() for s in arm_seeds})
    return [(arm, seed) for seed in seeds for arm, arm_seeds in plan.items()
            if seed in arm_seeds and not os.path.exists(seed_json(root, arm, seed))]


def reward_model_name(rm: str, draw: int, draws: int) -> str:
    """The folder under <out>/reward_models of draw ``draw`` of ``rm`` ('orm' / 'prm')."""
    return rm if draws == 1 else f"{rm}_draw{draw}"


def draw_of_seed(seed: int, draws: int) -> int:
    """The reward-model draw that scores a reward-model arm's seed ``seed``."""
    return seed % draws


def reward_model_task_args(data) -> list[str]:
    """experiments/train_reward_model.py's options and overrides for the policy's task."""
    if data.task == "arithmetic":
        return ["--operations", "+-", f"data.num_operands={data.num_operands}", f"data.max_digits={data.max_digits}",
                f"data.min_carries={data.min_carries}"]
    if data.task == "modular":
        return ["data.task=modular", f"data.modulus={data.modulus}", f"data.num_operands={data.num_operands}",
                f"data.num_subtractions={data.num_subtractions}"]
    raise ValueError(f"reward models for data.task={data.task} are not set up here (arithmetic or modular)")


# A reward-model arm's per-step training metrics, as its published curve names them.
TRAINING_SERIES = {"reward_mean": "train_reward_mean", "accuracy_train": "train_rule_accuracy",
                   "completion_length": "train_completion_length"}


def published_name(arm: str, seed: int) -> str:
    return f"{slug(arm)}_seed{seed}.json"


def varying_first_10(history: list[dict]) -> float:
    """The mean share of groups whose rewards varied over a run's first 10 steps."""
    first = [h.get("groups_varying_fraction", 0.0) for h in history[:10]]
    return sum(first) / max(1, len(first))


def publish(folder: str, run: dict) -> None:
    """A finished (arm, seed)'s curve, without its per-step history, into ``folder``."""
    import common

    os.makedirs(folder, exist_ok=True)
    out = {"arm": run["arm"], "seed": run["seed"], "steps": run["steps"], "eval_accuracy": run["eval_accuracy"],
           "groups_varying_first_10_steps": varying_first_10(run["history"])}
    if ARMS[run["arm"]][1] is not None:  # a reward-model arm: what it optimised against what the rule says
        for key, name in TRAINING_SERIES.items():
            out[name] = [h[key] for h in run["history"] if key in h]
        out["eval_reward_model_score"] = [h["eval_reward_model_score"] for h in run["history"]
                                          if "eval_reward_model_score" in h]
    common.write_json(os.path.join(folder, published_name(run["arm"], run["seed"])), out)


def pool_finals(folder: str, finals: dict[str, dict[int, float]], steps: list[int]) -> dict[str, dict[int, float]]:
    """``finals`` (arm -> seed -> step-``steps[-1]`` accuracy) joined with the published seed files
    of an earlier study in ``folder``, for the arms ``finals`` has. Refuses a seed in both, or a
    file evaluated at other steps: pooling is for the same design on fresh seeds."""
    import common

    pooled = {arm: dict(by_seed) for arm, by_seed in finals.items()}
    for name in sorted(os.listdir(folder)):
        arm_slug, _, rest = name.rpartition("_seed")
        arm = next((a for a in pooled if slug(a) == arm_slug), None)
        if arm is None or not rest.endswith(".json"):
            continue
        run = common.read_json(os.path.join(folder, name))
        if run["steps"] != steps:
            raise ValueError(f"{folder}/{name} was evaluated at steps {run['steps']}, this study at {steps}")
        if run["seed"] in pooled[arm]:
            raise ValueError(f"seed {run['seed']} of {arm} is in this study and in {folder}: pool fresh seeds only")
        pooled[arm][run["seed"]] = run["eval_accuracy"][-1]
    return pooled


def steps_to_reach(steps: list[int], accuracy: list[float], level: float, censor: int) -> int:
    """The first evaluated step whose held-out accuracy is >= ``level``; ``censor`` (a step
    past the run's end) when none is."""
    return next((s for s, a in zip(steps, accuracy) if a >= level), censor)


def judge(values: dict[str, dict[int, float]], claims: dict[str, tuple[str, str]],
          sign: float = 1.0) -> dict[str, dict]:
    """Each claim (better, worse) on the seeds both arms have: the paired gaps
    sign·(better − worse), their mean and 95% t-interval, and `stats.paired_verdict`'s verdict.
    sign = −1 judges "better gets there in fewer steps"."""
    from grpo_jax.eval.stats import paired_verdict

    out = {}
    for claim, (better, worse) in claims.items():
        seeds = sorted(set(values.get(better, {})) & set(values.get(worse, {})))
        if not seeds:
            continue
        gaps = [sign * (values[better][s] - values[worse][s]) for s in seeds]
        mean, low, high, verdict = paired_verdict(gaps)
        out[claim] = {"better": better, "worse": worse, "seeds": seeds, "gaps": gaps,
                      "mean": mean, "low": low, "high": high, "verdict": verdict}
    return out


def reward_model_data(cfg, params, task, tok, mesh, out_dir: str, args) -> tuple[str, str]:
    """(train, held-out) JSON-lines files of rule-labelled samples of the SFT model."""
    from figure5_premise import sample_groups

    from grpo_jax.rl.reward_models import label_completions, write_samples

    os.makedirs(out_dir, exist_ok=True)
    paths = os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "held_out.jsonl")
    for path, split, questions, seed in ((paths[0], "train", args.rm_questions, RM_TRAIN_SEED),
                                         (paths[1], "validation", args.rm_held_out, args.rm_held_out_seed)):
        if os.path.exists(path):
            continue
        examples = task.examples(split, questions, seed)
        samples = []
        for lo in range(0, len(examples), 32):  # 32 questions x G rows per sampling call
            chunk = examples[lo:lo + 32]
            groups = sample_groups(cfg, params, task, tok, mesh, chunk, args.rm_group, seed + lo)
            samples += label_completions(task, [e for e in chunk for _ in range(args.rm_group)],
                                         [t for texts in groups for t in texts])
        write_samples(path + ".tmp", samples)
        os.replace(path + ".tmp", path)  # a cut run never leaves a partial file behind
    return paths


def mc_check(cfg, params, task, tok, mesh, held_out_examples, held_out_path: str, out_path: str,
             samples: int, n: int) -> dict:
    """Monte-Carlo progress labels (`reward_models.progress`, the policy π_sft completing each
    step prefix ``n`` times) against the exact rule labels the reward models train on, on the
    first ``samples`` held-out samples: how often they agree, and what the estimate cost."""
    import time

    import common
    import jax

    from grpo_jax.rl.reward_models import read_samples
    from grpo_jax.rl.reward_models.progress import labelling_cost, monte_carlo_step_labels, policy_completer
    from grpo_jax.sampler import Sampler

    if os.path.exists(out_path):
        return common.read_json(out_path)
    rows = read_samples(held_out_path)[:samples]
    by_prompt = {ex.prompt: ex for ex in held_out_examples}
    examples = [by_prompt[r.prompt] for r in rows]
    sampler = Sampler.for_run(cfg, mesh, tok)
    complete = policy_completer(sampler, sampler.copy(params), tok, key=jax.random.key(6_000_000),
                                max_new_tokens=cfg.rl.max_new_tokens, temperature=cfg.rl.temperature)
    t0 = time.perf_counter()
    labels = monte_carlo_step_labels(task, examples, [r.completion for r in rows], complete, n)
    seconds = time.perf_counter() - t0
    pairs = [(e, h, s) for r, x in zip(rows, labels) for (_, e), h, s in zip(r.step_labels, x.hard, x.soft)]
    sampled = [(e, h, s) for (e, h, s), was in zip(pairs, [w for x in labels for w in x.sampled]) if was]

    def agree(items, exact=None):
        kept = [(e, h) for e, h, _ in items if exact is None or e == exact]
        return {"steps": len(kept), "agree": sum(e == h for e, h in kept) / len(kept) if kept else None}

    out = {"samples": len(rows), "n": n, "seconds": seconds, "cost": labelling_cost(labels, n),
           "all_steps": agree(pairs), "continued_steps": agree(sampled),
           "continued_exact_1": agree(sampled, 1.0), "continued_exact_0": agree(sampled, 0.0),
           "soft_mean_exact_1": float(sum(s for e, _, s in sampled if e == 1.0) / max(1, sum(e == 1.0 for e, _, _ in sampled))),
           "soft_mean_exact_0": float(sum(s for e, _, s in sampled if e == 0.0) / max(1, sum(e == 0.0 for e, _, _ in sampled)))}
    common.write_json(out_path, out)
    return out


def reward_model(kind: str, cfg, root: str, data: tuple[str, str], args, draw: int = 0) -> tuple[str, dict]:
    """Train (or find) draw ``draw`` of the ORM / PRM with experiments/train_reward_model.py
    (run.seed=draw where --rm-draws > 1); returns its folder and its metrics.json."""
    import common
    import train_reward_model

    run_dir = os.path.join(root, "reward_models", reward_model_name(RM_NAMES[kind], draw, args.rm_draws))
    metrics_path = os.path.join(run_dir, "metrics.json")
    if not os.path.exists(metrics_path):
        shutil.rmtree(run_dir, ignore_errors=True)  # a cut training run: its checkpoint would block the save
        train_reward_model.main([
            "--kind", kind, *(["--loss", args.rm_loss] if args.rm_loss else []),
            "--train-samples", data[0], "--held-out-samples", data[1],
            "--tokenizer", os.path.join(root, "tokenizer.model"), *reward_model_task_args(cfg.data),
            "--trunk-steps", str(args.rm_trunk_steps), *(["--no-progress"] if args.no_progress else []),
            "--validation-fraction", str(args.rm_validation_fraction),
            *([] if args.rm_answer_check else ["--no-answer-check"]),
            f"run.run_dir={run_dir}", f"run.steps={args.rm_steps}", f"model.max_seq_len={cfg.model.max_seq_len}",
            *([f"run.seed={draw}"] if args.rm_draws > 1 else [])])
    return os.path.join(run_dir, "reward_model"), common.read_json(metrics_path)


def main(argv=None):
    import common  # experiments/common.py (imports jax: only once a run starts)

    from grpo_jax import config as config_lib

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_config_args(p)
    common.add_sft_args(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                   help=f"seeds of the main arms {', '.join(MAIN_ARMS)} (default 0-4)")
    p.add_argument("--oracle-seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="seeds of the rule-scored oracle arms and the RFT control (default 0 1 2)")
    p.add_argument("--reach", type=float, default=0.8, help="the held-out accuracy of the speed test (default 0.8)")
    p.add_argument("--rm-questions", type=int, default=256, help="reward-model training questions")
    p.add_argument("--rm-group", type=int, default=16, help="SFT samples per reward-model question")
    p.add_argument("--rm-held-out", type=int, default=128, help="held-out (validation) questions")
    p.add_argument("--rm-held-out-seed", type=int, default=RM_HELD_OUT_SEED,
                   help="seed of the held-out questions' draw and of their sampling (sampling call i: seed + 32i; "
                        f"default {RM_HELD_OUT_SEED}, every committed study's held-out set)")
    p.add_argument("--rm-data-only", action="store_true",
                   help="stop once the reward models' labelled samples are written (no Monte-Carlo check, no "
                        "reward model); with --rm-questions 0 the training file is empty, the held-out set alone")
    p.add_argument("--rm-steps", type=int, default=1500, help="reward-model training steps (train_reward_model.py's default)")
    p.add_argument("--rm-trunk-steps", type=int, default=1500, help="reward-model base-model steps (train_reward_model.py's default)")
    p.add_argument("--rm-loss", choices=["pairwise", "pointwise"], default=None,
                   help="the ORM's loss (default: train_reward_model.py's, Bradley-Terry pairs); the studies "
                        "before issue #71 trained both kinds pointwise, so the two differed only in where the "
                        "labels sit")
    p.add_argument("--rm-validation-fraction", type=float, default=0.0,
                   help="train_reward_model.py's --validation-fraction (default 0, the script's: every model of the "
                        "committed studies kept its last step)")
    p.add_argument("--rm-answer-check", action="store_true",
                   help="train_reward_model.py's answer check (its default since issue #71; off here: every "
                        "committed study's models scored without it)")
    p.add_argument("--rm-draws", type=int, default=1,
                   help="draws of each reward model (run.seed = 0..N-1, the same labelled samples); a "
                        "reward-model arm's seed s is scored by draw s %% N (default 1: reward_models/{orm,prm})")
    p.add_argument("--mc-samples", type=int, default=32,
                   help="held-out samples whose Monte-Carlo progress labels are checked against the rule's (0: skip)")
    p.add_argument("--mc-n", type=int, default=32, help="continuations per step prefix in that check")
    p.add_argument("--reward-models-only", action="store_true",
                   help="stop once the reward models are trained (their held-out accuracies, before any arm)")
    p.add_argument("--out", default="runs/figure5_sparse", help="output directory")
    p.add_argument("--regime", choices=["arithmetic", *common.STUDY_REGIMES], default="modular",
                   help="SPARSE_REGIME on carrying arithmetic, or a study regime of experiments/common.py "
                        "(modular: the testbed) with TESTBED_RUN")
    p.add_argument("--rule-arms-only", action="store_true",
                   help=f"the rule-scored arms only ({', '.join(RULE_ARMS)}), each on --seeds: no reward models")
    p.add_argument("--reward-model-arms-only", action="store_true",
                   help=f"the reward-model arms only ({', '.join(RM_ARMS)}), each on --seeds, judged against the "
                        f"rule arms' finished seeds of a --rule-arms-only study in the same --out")
    p.add_argument("--rule-arms", nargs="+", choices=RULE_ARMS, default=list(RULE_ARMS),
                   help="with --rule-arms-only, the arms to run (default all four; a replication of claims "
                        "(b) and (c) needs no RFT)")
    p.add_argument("--pool", default=None,
                   help="a folder of an earlier run of the same design's seed files (<arm>_seed<N>.json, as "
                        "docs/studies/figure5_testbed/data holds them): the claims are judged again over its seeds "
                        "and this study's together (summary's pooled_claims); no seed may be in both")
    p.add_argument("--publish", default=None,
                   help="a folder to copy each finished (arm, seed)'s curve into as <arm>_seed<N>.json, "
                        "without the per-step history (what docs/data holds)")
    args = p.parse_intermixed_args(argv)  # overrides go before --seeds / --oracle-seeds, which take a list
    if args.rm_draws < 1:
        p.error(f"--rm-draws must be >= 1, got {args.rm_draws}")
    if args.rule_arms_only and args.reward_model_arms_only:
        p.error("--rule-arms-only and --reward-model-arms-only are two halves of one study: give one")
    regime = SPARSE_REGIME if args.regime == "arithmetic" else common.STUDY_REGIMES[args.regime] + TESTBED_RUN
    cfg = common.load_cfg(args, [f"run.run_dir={args.out}"] + regime)
    root = cfg.run.run_dir
    if args.reward_model_arms_only:  # before any training: the seeds its claims read must be there
        needed = {arm for claim in RM_CLAIMS.values() for arm in claim if arm not in RM_ARMS}
        missing = [seed_json(root, arm, s) for arm in sorted(needed) for s in args.seeds
                   if not os.path.exists(seed_json(root, arm, s))]
        if missing:
            p.error(f"--reward-model-arms-only reads the rule arms' finished seeds; missing {', '.join(missing)} "
                    f"(run --rule-arms-only with these --seeds and --out first)")
    task = common.make_task(cfg.data.task, cfg.data)
    tok, cfg = common.tokenizer_for(task, cfg, root, args.tokenizer_vocab)
    params, mesh = common.sft_start(cfg, task, tok, root, args)

    mc, models, rm_metrics = None, {}, {}
    if not args.rule_arms_only:
        mc, models, rm_metrics = reward_models_and_checks(cfg, params, task, tok, mesh, root, args)
        if args.reward_models_only or args.rm_data_only:
            return rm_metrics
    eval_examples = task.examples("test", cfg.data.eval_size, cfg.data.seed)
    if args.rule_arms_only:
        plan = {arm: list(args.seeds) for arm in RULE_ARMS if arm in args.rule_arms}
    elif args.reward_model_arms_only:
        plan = {arm: list(args.seeds) for arm in RM_ARMS}
        # Every rule arm that finished these seeds is read; a replication without RFT has none of it.
        read_only = {arm: list(args.seeds) for arm in RULE_ARMS
                     if all(os.path.exists(seed_json(root, arm, s)) for s in args.seeds)}
        return run_arms(cfg, params, task, tok, mesh, root, args, plan, models, rm_metrics, mc, eval_examples,
                        read_only=read_only, claims=RM_CLAIMS, name="reward_models")
    else:
        plan = {arm: list(args.seeds if arm in MAIN_ARMS else args.oracle_seeds) for arm in ARMS}
    return run_arms(cfg, params, task, tok, mesh, root, args, plan, models, rm_metrics, mc, eval_examples)


def reward_models_and_checks(cfg, params, task, tok, mesh, root, args):
    """Parts 2-3: the reward models' data, the Monte-Carlo label check, the ORM and PRM."""
    from grpo_jax.rl.reward_models import RewardModel

    data = reward_model_data(cfg, params, task, tok, mesh, os.path.join(root, "reward_models"), args)
    mc = None
    if args.rm_data_only:
        print(f"[figure5] wrote {data[0]} and {data[1]}")
        return mc, {}, {}
    if args.mc_samples:
        mc = mc_check(cfg, params, task, tok, mesh,
                      task.examples("validation", args.rm_held_out, args.rm_held_out_seed),
                      data[1], os.path.join(root, "reward_models", f"mc_check_s{args.mc_samples}_n{args.mc_n}.json"),
                      args.mc_samples, args.mc_n)
        print(f"[figure5] Monte-Carlo progress labels (n = {mc['n']}) vs the rule on {mc['samples']} held-out "
              f"samples: {mc['continued_steps']['agree']:.3f} of {mc['continued_steps']['steps']} continued steps "
              f"agree (rule 1: {mc['continued_exact_1']['agree']}, rule 0: {mc['continued_exact_0']['agree']}); "
              f"{mc['cost']['continuations']} continuations, {mc['seconds']:.0f} s")
    models, rm_metrics = {}, {}
    for kind, rm in RM_NAMES.items():
        for draw in range(args.rm_draws):
            name = reward_model_name(rm, draw, args.rm_draws)
            path, rm_metrics[name] = reward_model(kind, cfg, root, data, args, draw)
            models[name] = (path, RewardModel.load(path, tok))
            print(f"[figure5] {name}: {json.dumps(held_out_accuracies(rm_metrics[name]))}")
    return mc, models, rm_metrics


def held_out_accuracies(metrics: dict) -> dict:
    """A reward model's held-out accuracies and baselines from its metrics.json, rounded."""
    return {k: round(v, 3) for k, v in metrics.items()
            if k.startswith("held_out") or k in ("majority_baseline", "train_samples")}


def run_arms(cfg, params, task, tok, mesh, root, args, plan, models, rm_metrics, mc, eval_examples, *,
             read_only=None, claims=None, name=""):
    """Part 4-5: every (arm, seed) of ``plan`` not yet finished, then the verdicts of ``claims``
    (default CLAIMS) over the arms of ``plan`` and ``read_only`` (arm -> seeds whose finished
    JSONs are read, never run); with ``read_only``, each arm of ``plan`` against each of it
    too (AGAINST_RULE_ARMS). ``name`` suffixes summary<_name>.json and the figure's file."""
    import common
    import jax

    from grpo_jax.eval.evaluation import evaluate
    from grpo_jax.eval.plots import plot_runs
    from grpo_jax.sampler import Sampler
    from grpo_jax.tasks.shortcuts import clears, shortcut_baselines
    from grpo_jax.eval.stats import format_interval

    shortcuts = shortcut_baselines(task, eval_examples)
    start = evaluate(Sampler.for_run(cfg, mesh, tok), params, task, tok, eval_examples,
                     key=jax.random.key(1))["accuracy"]
    steps = [0] + list(range(cfg.run.eval_every, cfg.run.steps + 1, cfg.run.eval_every))
    scored_by = {arm: {s: reward_model_name(ARMS[arm][1], draw_of_seed(s, args.rm_draws), args.rm_draws)
                       for s in seeds} for arm, seeds in plan.items() if ARMS[arm][1] is not None}
    for arm, seed in pending(root, plan):
        overrides, scorer = ARMS[arm][0], None
        if arm in scored_by:
            path, scorer = models[scored_by[arm][seed]]
            overrides = overrides + [f"rl.reward_model={path}"]
        print(f"[figure5] {arm} seed {seed}" + (f", scored by {scored_by[arm][seed]}" if arm in scored_by else ""))
        history, _ = common.run_rl(cfg, task, tok, params, mesh, root, slug(arm), overrides, seed=seed,
                                   eval_examples=eval_examples, progress=not args.no_progress,
                                   reward_model=scorer)
        common.write_json(seed_json(root, arm, seed), {
            "arm": arm, "seed": seed, "steps": steps,
            "eval_accuracy": [start] + common.curve(history, "eval_accuracy", steps[1:]),
            "history": history})
        if args.publish:
            publish(args.publish, common.read_json(seed_json(root, arm, seed)))

    shown = plan | (read_only or {})
    runs = {arm: {s: common.read_json(seed_json(root, arm, s)) for s in seeds} for arm, seeds in shown.items()}
    for arm, by_seed in runs.items():
        for s, r in by_seed.items():
            if r["steps"] != steps:
                raise ValueError(f"{seed_json(root, arm, s)} was evaluated at steps {r['steps']}, this study at "
                                 f"{steps}: not the same study")
    censor = steps[-1] + cfg.run.eval_every
    finals = {arm: {s: r["eval_accuracy"][-1] for s, r in by_seed.items()} for arm, by_seed in runs.items()}
    reach = {arm: {s: steps_to_reach(steps, r["eval_accuracy"], args.reach, censor) for s, r in by_seed.items()}
             for arm, by_seed in runs.items()}
    varying = {arm: {s: varying_first_10(r["history"]) for s, r in by_seed.items()}
               for arm, by_seed in runs.items() if arm.startswith("GRPO")}
    pairs = CLAIMS if claims is None else claims
    claims, speed = judge(finals, pairs), judge(reach, pairs, sign=-1.0)
    against = judge(finals, {k: v for k, v in AGAINST_RULE_ARMS.items() if v[0] in plan}) if read_only else {}
    pooled = judge(pool_finals(args.pool, finals, steps), pairs) if args.pool else {}
    bar = shortcuts.best[1]
    beat_shortcut = {arm: clears(finals[arm], bar) for arm in shown}
    summary = {
        "start_accuracy": start, "steps": steps, "reach_level": args.reach, "reach_censor": censor,
        "reward_models": {rm: {k: v for k, v in m.items() if k not in ("config", "args")}
                          for rm, m in rm_metrics.items()},
        "reward_model_of_seed": scored_by, "read_not_run": read_only or {},
        "final_accuracy": finals, "steps_to_reach": reach, "groups_varying_first_10_steps": varying,
        "claims": claims, "pooled_with": args.pool, "pooled_claims": pooled, "speed": speed, "against_rule_arms": against, "shortcuts": shortcuts.to_dict(),
        "beats_best_shortcut_by_10_points_every_seed": beat_shortcut, "mc_check": mc, "config": cfg.to_dict()}
    suffix = f"_{name}" if name else ""
    summary_path = os.path.join(root, f"summary{suffix}.json")
    common.write_json(summary_path, summary)
    regime = (f"mod {cfg.data.modulus}, {cfg.data.num_operands} operands" if cfg.data.task == "modular" else
              f"{cfg.data.num_operands - 1}-step chains, >= {cfg.data.min_carries} carries")
    png = plot_runs({arm: [runs[arm][s]["eval_accuracy"] for s in sorted(runs[arm])] for arm in shown}, steps,
                    os.path.join(root, f"figure5_sparse{suffix}.png"), ylabel="held-out greedy accuracy",
                    title=f"Figure 5 ({regime})\nmean and 95% interval over seeds")
    print(f"[figure5] SFT start: held-out greedy accuracy {start:.3f}; {len(eval_examples)} held-out questions, "
          f"{shortcuts.line()}")
    for rm, m in rm_metrics.items():
        print(f"[figure5] reward model {rm}: {json.dumps(held_out_accuracies(m))}")
    for arm in shown:
        if arm in scored_by:
            print(f"[figure5] {arm} scored by: " + ", ".join(f"seed {s} {rm}" for s, rm in scored_by[arm].items()))
        print(f"[figure5] {arm:13s} final {format_interval(list(finals[arm].values()))} (seeds "
              f"{', '.join(f'{finals[arm][s]:.3f}' for s in sorted(finals[arm]))}); beats the best shortcut "
              f"{bar:.3f} by 10 points in every seed: {'yes' if beat_shortcut[arm] else 'no'}; first step at "
              f">= {args.reach}: {[reach[arm][s] for s in sorted(reach[arm])]} (never: {censor})")
    for claim, c in claims.items():
        print(f"[figure5] {claim}: {c['better']} − {c['worse']} = {c['mean']:+.3f} "
              f"[{c['low']:+.3f}, {c['high']:+.3f}] (n={len(c['seeds'])}): {c['verdict']}")
    for claim, c in pooled.items():
        print(f"[figure5] {claim}, pooled with {args.pool}: {c['better']} − {c['worse']} = {c['mean']:+.3f} "
              f"[{c['low']:+.3f}, {c['high']:+.3f}] (n={len(c['seeds'])}): {c['verdict']}")
    for comparison, c in against.items():
        print(f"[figure5] {comparison} = {c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] (n={len(c['seeds'])}; "
              f"no claim)")
    for claim, c in speed.items():
        print(f"[figure5] {claim}, speed: {c['worse']} steps − {c['better']} steps = {c['mean']:+.1f} "
              f"[{c['low']:+.1f}, {c['high']:+.1f}] (n={len(c['seeds'])}): {c['verdict']}")
    print(f"[figure5] wrote {png} and {summary_path}")
    return summary


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
