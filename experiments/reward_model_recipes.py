"""Which reward-model recipe fits the testbed: one row per recipe, train and held-out accuracy.

The data are the SFT corpus's worked solutions of the modular testbed (data.task=modular,
modulus 13, 6 operands, 2 subtractions), each subtraction slipped (read as "+") with
probability 0.6, labelled by the rule: what the SFT policy writes. Train: --train-prompts
questions x 4 samples of the train split; held-out: --held-out-prompts x 4 of the test split
(never trained on). Every recipe starts from the same tokenizer; trunks (next-token training
on correct solutions) are trained once per (steps, lr, size) and shared.

Each recipe writes <out>/<recipe>.json when done, so a cut run resumes at the next recipe:

    python experiments/reward_model_recipes.py --out runs/rm_recipes
    python experiments/reward_model_recipes.py --out runs/rm_recipes --recipes orm-default prm-default

The table (markdown) is printed and written to <out>/table.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import time

import jax
import numpy as np

from grpo_jax.config import ModelConfig, OptimizerConfig
from grpo_jax.rl import reward_models as rm_lib
from grpo_jax.rl.reward_models.scorer import add_likelihood_scale
from grpo_jax.tasks.modular import ModularTask
from grpo_jax.text.tokenizer import SentencePieceTokenizer, train_sentencepiece

WRONG_STEP_PROB = 0.6


@dataclasses.dataclass(frozen=True)
class Recipe:
    kind: str  # outcome | process
    loss: str = "pairwise"  # ORM: pairwise | pointwise (PRM: pointwise)
    trunk_steps: int = 500  # 0: random trunk
    trunk_lr: float = 3e-3
    steps: int = 500
    lr: float = 3e-4
    width: int = 64  # embed_dim; mlp 2x
    layers: int = 2
    read: str = "end"  # PRM: "end" (the step's newline) | "value" (the value token itself)
    lm_weight: float = 0.0  # joint next-token loss on the correct samples
    likelihood: bool = False  # the score also reads the trunk's log-likelihood of the completion
    train_prompts: int = 2000


BASE_ORM = Recipe("outcome")
BASE_PRM = Recipe("process", loss="pointwise")
DEEP_ORM = dataclasses.replace(BASE_ORM, layers=4, trunk_steps=1500, steps=1500, lr=1e-3)
DEEP_PRM = dataclasses.replace(DEEP_ORM, kind="process", loss="pointwise")
RECIPES = {
    # The script's defaults until now; then a deeper trunk (a 2-layer model has one attention
    # hop to compare a line's value with its lookup and none left to gather the lines at eos);
    # then one change at a time from the deep recipe.
    "orm-default": BASE_ORM,
    "prm-default": BASE_PRM,
    "orm-4l": DEEP_ORM,
    "prm-4l": DEEP_PRM,
    # No reward-model training: the deep trunk's log-likelihood of the completion as the score.
    "orm-4l-trunk-likelihood-only": dataclasses.replace(DEEP_ORM, steps=0, likelihood=True),
    "orm-2l-trunk-likelihood-only": dataclasses.replace(BASE_ORM, steps=0, likelihood=True),
    "orm-4l-likelihood": dataclasses.replace(DEEP_ORM, likelihood=True, lm_weight=1.0),
    "orm-4l-likelihood-no-joint-lm": dataclasses.replace(DEEP_ORM, likelihood=True),
    "prm-4l-likelihood": dataclasses.replace(DEEP_PRM, likelihood=True, lm_weight=1.0),
    "prm-4l-value": dataclasses.replace(DEEP_PRM, read="value"),
    "orm-4l-joint-lm": dataclasses.replace(DEEP_ORM, lm_weight=1.0),
    "orm-4l-pointwise": dataclasses.replace(DEEP_ORM, loss="pointwise"),
    "orm-4l-random-trunk": dataclasses.replace(DEEP_ORM, trunk_steps=0),
    "prm-4l-joint-lm": dataclasses.replace(DEEP_PRM, lm_weight=1.0),
}


def model_config(recipe: Recipe, vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, embed_dim=recipe.width, num_layers=recipe.layers, num_heads=4,
                       num_kv_heads=2, head_dim=recipe.width // 4, mlp_dim=2 * recipe.width, max_seq_len=96)


def trunk_for(recipe: Recipe, cfg: ModelConfig, tok, task, out: str, seed: int):
    if recipe.trunk_steps == 0:
        return None, None
    path = os.path.join(out, f"trunk_s{recipe.trunk_steps}_lr{recipe.trunk_lr}_w{recipe.width}_l{recipe.layers}"
                             f"_seed{seed}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    docs = [ex.prompt + sol for ex, sol in task.sft_examples("train", recipe.train_prompts, seed)]
    t0 = time.perf_counter()
    params, history = rm_lib.pretrain_trunk(cfg, tok, docs, steps=recipe.trunk_steps, batch_size=32,
                                            lr=recipe.trunk_lr, seed=seed, progress=True)
    loss = float(np.mean([h["loss"] for h in history[-20:]]))
    result = (jax.device_get(params), {"loss": loss, "seconds": time.perf_counter() - t0})
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    return result


def accuracies(rm, samples) -> dict:
    out = {"pairwise": rm_lib.pairwise_accuracy(rm, samples)}
    if rm.kind == "process":
        out["step"], out["majority"] = rm_lib.step_accuracy(rm, samples)
    return out


def run(name: str, recipe: Recipe, out: str, seed: int) -> dict:
    task = ModularTask(13, 6, 2)
    tok_path = os.path.join(out, "tokenizer.model")
    if not os.path.exists(tok_path):
        train_sentencepiece(task.text_corpus(500, seed=0), vocab_size=32).save(tok_path)
    tok = SentencePieceTokenizer.load(tok_path)
    cfg = model_config(recipe, tok.vocab_size)
    train = rm_lib.labelled_samples(task, "train", recipe.train_prompts, seed, samples_per_prompt=4,
                                    wrong_step_prob=WRONG_STEP_PROB)
    held_out = rm_lib.labelled_samples(task, "test", 256, seed + 1, samples_per_prompt=4,
                                       wrong_step_prob=WRONG_STEP_PROB)
    trunk, trunk_info = trunk_for(recipe, cfg, tok, task, out, seed)
    t0 = time.perf_counter()
    if recipe.steps == 0:  # the trunk's likelihood alone: a zero value head, scale 1
        params = dict(jax.tree.map(np.asarray, trunk), value_head=np.zeros((cfg.embed_dim,), np.float32),
                      value_bias=np.float32(0.0))
        rm = rm_lib.RewardModel(cfg, add_likelihood_scale(params, 1.0), tok, recipe.kind, loss=recipe.loss)
        return {"recipe": name, **dataclasses.asdict(recipe), "seed": seed, "trunk": trunk_info, "seconds": 0.0,
                "final_train_loss": None, "train": accuracies(rm, train[:1024]), "held_out": accuracies(rm, held_out)}
    rm, history = rm_lib.train_reward_model(
        cfg, tok, train, kind=recipe.kind, loss=recipe.loss, steps=recipe.steps, batch_size=32, seed=seed,
        init_params=trunk, optimizer=OptimizerConfig(peak_lr=recipe.lr, warmup_steps=min(50, recipe.steps // 10)),
        read=recipe.read, lm_weight=recipe.lm_weight, likelihood=recipe.likelihood, progress=False)
    seconds = time.perf_counter() - t0
    result = {"recipe": name, **dataclasses.asdict(recipe), "seed": seed, "trunk": trunk_info,
              "seconds": seconds, "final_train_loss": float(np.mean([h["loss"] for h in history[-20:]])),
              "train": accuracies(rm, train[:1024]), "held_out": accuracies(rm, held_out)}
    return result


def table(results: list[dict]) -> str:
    rows = ["| recipe | kind | layers | trunk steps | steps @ lr | read | joint LM | likelihood | train pairwise "
            "| held-out pairwise | train step acc | held-out step acc (majority) | s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        step = lambda d: "" if "step" not in d else f"{d['step']:.3f}"
        held_step = "" if "step" not in r["held_out"] else f"{r['held_out']['step']:.3f} ({r['held_out']['majority']:.3f})"
        rows.append(f"| {r['recipe']} | {r['kind']} | {r['layers']} | {r['trunk_steps']} | {r['steps']} @ {r['lr']:g} "
                    f"| {r['read']} | {r['lm_weight']:g} | {'yes' if r.get('likelihood') else 'no'} | {r['train']['pairwise']:.3f} | {r['held_out']['pairwise']:.3f} "
                    f"| {step(r['train'])} | {held_step} | {r['seconds'] + (r['trunk'] or {}).get('seconds', 0):.0f} |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/rm_recipes", help="folder for results, trunks and the tokenizer")
    p.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=list(RECIPES), metavar="NAME",
                   help="which recipes, in order (default: all)")
    p.add_argument("--seed", type=int, default=0, help="data, trunk and reward-model seed")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = []
    for name in args.recipes:
        path = os.path.join(args.out, f"{name}_seed{args.seed}.json")
        if not os.path.exists(path):
            print(f"[recipes] {name}: {RECIPES[name]}")
            result = run(name, RECIPES[name], args.out, args.seed)
            with open(path + ".tmp", "w") as f:
                json.dump(result, f, indent=2)
            os.replace(path + ".tmp", path)
        with open(path) as f:
            results.append(json.load(f))
        print(table(results[-1:]).splitlines()[-1])
    text = table(results)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
