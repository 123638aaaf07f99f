"""Reward-model training: the Bradley-Terry and pointwise losses, `train_reward_model`
(host-side batches with replay, one jitted AdamW update) and accuracy metrics."""
from __future__ import annotations

import functools
import random
from typing import Any, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax.model import transformer as model_lib
from grpo_jax.config import ModelConfig, OptimizerConfig
from grpo_jax.model.logprobs import token_logprobs
from grpo_jax.rl.optimizer import make_optimizer
from grpo_jax.rl.reward_models.answer_check import AnswerCheck, spread_margin
from grpo_jax.rl.reward_models.data import LabelledSample, ReplayBuffer, has_same_prompt_pair, replay_count
from grpo_jax.rl.reward_models.scorer import (KINDS, LIKELIHOOD_SCALE, LOSSES, READS, RewardModel, add_likelihood_scale,
                                              bucket, encode, pad_batch, read_ends, values_from_hidden)
from grpo_jax.text.tokenizer import Tokenizer


# ============================================================================ losses

def bradley_terry_loss(chosen: jax.Array, rejected: jax.Array) -> jax.Array:
    """Pairwise Bradley-Terry loss per pair: −log σ(r⁺ − r⁻) = softplus(r⁻ − r⁺). [P] -> [P]."""
    chex.assert_equal_shape([chosen, rejected])
    return jax.nn.softplus(jnp.asarray(rejected, jnp.float32) - jnp.asarray(chosen, jnp.float32))


def pointwise_loss(scores: jax.Array, labels: jax.Array) -> jax.Array:
    """Sigmoid binary cross-entropy on logits r, elementwise:
    −[y log σ(r) + (1 − y) log(1 − σ(r))] = softplus(r) − y·r (labels y in [0, 1])."""
    chex.assert_equal_shape([scores, labels])
    r = jnp.asarray(scores, jnp.float32)
    return jax.nn.softplus(r) - jnp.asarray(labels, jnp.float32) * r


# ============================================================================ training

def next_token_loss(cfg: ModelConfig, params, hidden, tokens, mask, rows) -> jax.Array:
    """Mean −log π(x_t | x_<t) over the real tokens (hidden [B, T, E], tokens / mask [B, T])
    of the rows where ``rows`` [B] is True: the joint loss that keeps the trunk a language
    model of right solutions."""
    unembed, vocab_major = model_lib.unembedding(cfg, params)
    logp = token_logprobs(hidden[:, :-1], unembed, tokens[:, 1:], vocab_major=vocab_major)
    m = mask[:, 1:] & rows[:, None]
    return -jnp.where(m, logp, 0.0).sum() / jnp.maximum(m.sum(), 1)


def _reward_loss(kind: str, loss: str, values, batch):
    if kind == "process":
        r = jnp.take_along_axis(values, batch["step_index"], axis=1)  # [B, S]
        m = batch["step_mask"]
        count = jnp.maximum(m.sum(), 1)
        per = jnp.where(m, pointwise_loss(r, batch["step_label"]), 0.0)
        right = (r > 0) == (batch["step_label"] > 0.5)
        return per.sum() / count, {"accuracy": jnp.where(m, right, False).sum() / count}
    r = jnp.take_along_axis(values, batch["score_index"][:, None], axis=1)[:, 0]  # [B]
    if loss == "pairwise":  # rows [0, P) are chosen, [P, 2P) their rejected partners
        chosen, rejected = jnp.split(r, 2)
        return bradley_terry_loss(chosen, rejected).mean(), {
            "accuracy": (chosen > rejected).mean(), "margin": (chosen - rejected).mean()}
    return pointwise_loss(r, batch["label"]).mean(), {
        "accuracy": ((r > 0) == (batch["label"] > 0.5)).mean()}


def _loss_and_metrics(cfg: ModelConfig, kind: str, loss: str, lm_weight: float, params, batch):
    hidden, _ = model_lib.forward_hidden(cfg, params, batch["tokens"], batch["mask"])
    values = values_from_hidden(cfg, params, hidden, batch["tokens"], batch["mask"], batch["start"])  # [B, T]
    value, metrics = _reward_loss(kind, loss, values, batch)
    if lm_weight:
        lm = next_token_loss(cfg, params, hidden, batch["tokens"], batch["mask"], batch["label"] > 0.5)
        metrics = dict(metrics, reward_loss=value, lm_loss=lm)
        value = value + lm_weight * lm
    return value, metrics


@functools.lru_cache(maxsize=16)
def _train_step_fn(cfg: ModelConfig, kind: str, loss: str, lm_weight: float, opt_cfg: OptimizerConfig,
                   total_steps: int):
    """(jitted update, optimizer, lr schedule), cached so that repeated training runs with
    the same shapes and settings (continued training, tests) compile once."""
    tx, schedule = make_optimizer(opt_cfg, total_steps)

    def step(params, opt_state, batch):
        (value, metrics), grads = jax.value_and_grad(
            lambda p: _loss_and_metrics(cfg, kind, loss, lm_weight, p, batch), has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = dict(metrics, loss=value, grad_norm=optax.global_norm(grads))
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1)), tx, schedule


def labelled_pairs(samples: Sequence[LabelledSample], rng: random.Random) -> tuple[list[tuple[int, int]], int]:
    """(correct, incorrect) index pairs: every same-prompt combination, then each sample
    whose prompt has no opposite-label completion paired with a random opposite-label
    sample of another prompt. Returns (pairs, number of same-prompt pairs)."""
    by_prompt: dict[str, tuple[list[int], list[int]]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(s.prompt, ([], []))[0 if s.correct else 1].append(i)
    good = [i for i, s in enumerate(samples) if s.correct]
    bad = [i for i, s in enumerate(samples) if not s.correct]
    if not good or not bad:
        raise ValueError(
            f"pairwise reward-model training needs correct and incorrect samples; got "
            f"{len(good)} correct and {len(bad)} incorrect (use loss='pointwise')")
    same = [(c, w) for pos, neg in by_prompt.values() for c in pos for w in neg]
    cross = []
    for pos, neg in by_prompt.values():
        if pos and not neg:
            cross += [(c, rng.choice(bad)) for c in pos]
        elif neg and not pos:
            cross += [(rng.choice(good), w) for w in neg]
    return same + cross, len(same)


class Stream:
    """Endless shuffled passes over a list of items (epochs without replacement)."""

    def __init__(self, items: Sequence[Any], rng: random.Random):
        self.items, self.rng, self._order = list(items), rng, []

    def take(self, k: int) -> list[Any]:
        out = []
        while len(out) < k:
            if not self._order:
                self._order = list(range(len(self.items)))
                self.rng.shuffle(self._order)
            out.append(self.items[self._order.pop()])
        return out


class BatchSource:
    """Host-side batches for `train_reward_model`: every sample tokenised once, one
    (rows, T, S) shape for the whole run, shuffled passes over new items plus exactly
    `replay_count(items, replay_fraction)` historical items per batch (an item is a
    (correct, incorrect) pair for the pairwise loss, a sample otherwise).

    Pairwise batches put the chosen sequences in rows [0, P) and their rejected partners in
    rows [P, 2P). `next()` returns (arrays, number of historical items in the batch).
    """

    def __init__(self, tokenizer: Tokenizer, samples: list[LabelledSample], history: list[LabelledSample],
                 *, kind: str, loss: str, batch_size: int, replay_fraction: float, max_len: int, seed: int,
                 read: str = "end"):
        rng = random.Random(f"train_reward_model/{seed}")
        self.kind, self.loss, self.pad_id = kind, loss, tokenizer.pad_id
        self.num_new = len(samples)
        self.items = batch_size // 2 if loss == "pairwise" else batch_size
        self.num_replay = replay_count(self.items, replay_fraction) if history else 0
        if history and self.items - self.num_replay < 1:
            raise ValueError(f"replay_fraction={replay_fraction} leaves no new samples in a batch "
                             f"of {self.items}")
        self.pool = samples + history
        self.enc = [encode(tokenizer, s.prompt, s.completion,
                           read_ends(s.completion, [e for e, _ in s.step_labels], read) if kind == "process" else (),
                           max_len)
                    for s in self.pool]
        self.length = bucket(max(len(e.tokens) for e in self.enc), max_len)
        self.max_steps = bucket(max(len(e.step_index) for e in self.enc), None) if kind == "process" else 1
        self.same_prompt_fraction = float("nan")
        if loss == "pairwise":
            pairs, same = labelled_pairs(samples, rng)
            self.same_prompt_fraction = same / len(pairs)
            self.new = Stream(pairs, rng)
            old = [(a + self.num_new, b + self.num_new) for a, b in labelled_pairs(history, rng)[0]] \
                if self.num_replay else []
        else:
            self.new = Stream(range(self.num_new), rng)
            old = range(self.num_new, len(self.pool))
        self.old = Stream(old, rng) if self.num_replay else None

    def next(self) -> tuple[dict[str, np.ndarray], int]:
        items = self.new.take(self.items - self.num_replay)
        if self.old is not None:
            items += self.old.take(self.num_replay)
        rows = [c for c, _ in items] + [w for _, w in items] if self.loss == "pairwise" else list(items)
        per_item = 2 if self.loss == "pairwise" else 1
        from_history = sum(i >= self.num_new for i in rows) // per_item
        batch = pad_batch([self.enc[i] for i in rows], len(rows), self.length, self.max_steps, self.pad_id,
                          [[r for _, r in self.pool[i].step_labels] for i in rows])
        batch["label"] = np.asarray([float(self.pool[i].correct) for i in rows], np.float32)
        if self.kind == "outcome":  # only what the jitted loss reads
            del batch["step_index"], batch["step_mask"], batch["step_label"]
        return batch, from_history


def _check_samples(samples: Sequence[LabelledSample], kind: str, where: str) -> None:
    for i, s in enumerate(samples):
        if not isinstance(s, LabelledSample):
            raise TypeError(f"{where}[{i}] is a {type(s).__name__}, not a LabelledSample")
        if kind == "process":
            if not s.step_labels:
                raise ValueError(f"a process reward model needs step labels; {where}[{i}] has none")
            if any(not 0.0 <= r <= 1.0 for _, r in s.step_labels):
                raise ValueError(f"{where}[{i}]: step labels must be in [0, 1], got {s.step_labels}")


def _checked_loss(kind: str, loss: str | None, steps: int, batch_size: int) -> str:
    """The loss ``train_reward_model`` trains ``kind`` with (``loss``, or the kind's
    default); ValueError for a kind, loss, step count or batch size it cannot train."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    loss = loss or ("pairwise" if kind == "outcome" else "pointwise")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if kind == "process" and loss != "pointwise":
        raise ValueError("a process reward model is trained with the per-step BCE: loss='pointwise'")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if batch_size < (2 if loss == "pairwise" else 1):
        raise ValueError(f"batch_size must be >= {2 if loss == 'pairwise' else 1}, got {batch_size}")
    return loss


def _initial_params(cfg_model: ModelConfig, init_params: Any, seed: int):
    """The params training starts from (``train_reward_model``'s ``init_params``): a random
    trunk and value head, or a copy (the update donates it) of a policy's params with a
    fresh value head, or of a reward model's."""
    if isinstance(init_params, RewardModel):
        init_params = init_params.params
    if init_params is None:
        return model_lib.init_params(cfg_model, jax.random.key(seed), value_head=True)
    params = jax.tree.map(jnp.array, dict(init_params))
    if "value_head" not in params:
        params = model_lib.add_value_head(cfg_model, params, jax.random.key(seed))
    return params


def train_reward_model(
    cfg_model: ModelConfig,
    tokenizer: Tokenizer,
    samples: Sequence[LabelledSample],
    *,
    kind: str = "outcome",
    loss: str | None = None,
    steps: int = 200,
    batch_size: int = 16,
    lr: float = 3e-4,
    seed: int = 0,
    init_params: Any = None,
    replay: Sequence[LabelledSample] | ReplayBuffer | None = None,
    replay_fraction: float = 0.1,
    progress: bool = True,
    optimizer: OptimizerConfig | None = None,
    process_reduce: str = "min",
    read: str | None = None,
    lm_weight: float = 0.0,
    likelihood: bool | None = None,
    validation: Sequence[LabelledSample] | None = None,
    eval_every: int = 100,
    answer_task: Any = None,
) -> tuple[RewardModel, list[dict[str, float]]]:
    """Train an ORM or PRM on labelled samples; returns (model, per-step metrics).

    kind: 'outcome' (ORM) or 'process' (PRM). loss: ORM 'pairwise' (Bradley-Terry; the
      default) or 'pointwise' (BCE on `correct`); a PRM always uses the per-step BCE
      ('pointwise', its default; 'pairwise' is an error).
    batch_size: sequences per step (pairwise: batch_size // 2 pairs). Pairs take a correct
      and an incorrect completion of the same prompt when there is one, else of another.
    init_params: None (random trunk), a policy's params (a fresh value head is added), a
      reward model's params or a `RewardModel` (continued training).
    replay, replay_fraction: historical samples (a list or `ReplayBuffer`); each batch then
      holds exactly `replay_count(items, replay_fraction)` historical items (items are
      pairs for the pairwise loss, samples otherwise). Without replay data nothing is mixed.
    optimizer: AdamW settings (grpo_jax.rl.optimizer); default `OptimizerConfig(peak_lr=lr,
      warmup_steps=min(10, steps // 10))` with the multi-step schedule. `lr` is ignored
      when `optimizer` is given.
    read: PRM, where the head reads a step (`READS`: 'end', its newline, or 'value', the token
      before it); default that of ``init_params`` when it is a `RewardModel`, else 'end'.
    lm_weight: weight of a joint next-token loss on the batch's correct samples (0: none).
    likelihood: the score also reads the trunk's log-likelihood of the completion so far,
      times a learned scale (`scorer.values_from_hidden`); default that of ``init_params``
      when it is a reward model, else False.
    validation, eval_every: labelled samples never trained on (other prompts than
      ``samples``'); every ``eval_every`` steps and at the last, the model's pairwise accuracy
      on them (`pairwise_accuracy`) is logged as ``validation_pairwise``, and the model
      returned is the one of the best evaluation (the earliest on a tie), not the last:
      on a few thousand samples the model fits its batches exactly long before the last
      step, and ranking within a prompt is what GRPO's group normalisation reads.
    answer_task: a `Task`; the trained model then checks answers (`add_answer_check` on
      ``samples``): its score ranks completions that agree with its trunk's greedy answer first.
    Metrics per step: loss, accuracy (pairs ranked right / outcomes or steps classified
      right at σ = ½), grad_norm, lr, replay_items (historical items in the batch), and
      for pairwise margin (mean r⁺ − r⁻) and same_prompt_pairs (fraction of the new pairs
      whose two completions answer the same prompt).
    """
    loss = _checked_loss(kind, loss, steps, batch_size)
    if read is None:
        read = init_params.read if isinstance(init_params, RewardModel) else "end"
    if read not in READS:
        raise ValueError(f"read must be one of {READS}, got {read!r}")
    if lm_weight < 0:
        raise ValueError(f"lm_weight must be >= 0, got {lm_weight}")
    samples = list(samples)
    history = replay.samples if isinstance(replay, ReplayBuffer) else list(replay or [])
    if not samples:
        raise ValueError("train_reward_model: no samples to train on")
    _check_samples(samples, kind, "samples")
    _check_samples(history, kind, "replay")
    if tokenizer.vocab_size > cfg_model.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
                         f"{cfg_model.vocab_size}")

    if validation is not None:
        validation = list(validation)
        _check_samples(validation, kind, "validation")
        if not has_same_prompt_pair(validation):
            raise ValueError("validation samples have no prompt with both a correct and an incorrect "
                             "completion, so their pairwise accuracy is undefined")
        if eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {eval_every}")
    source = BatchSource(tokenizer, samples, history, kind=kind, loss=loss, batch_size=batch_size,
                         replay_fraction=replay_fraction, max_len=cfg_model.max_seq_len, seed=seed, read=read)

    # Device side: params, AdamW, one jitted update.
    prior_steps = init_params.trained_steps if isinstance(init_params, RewardModel) else 0
    params = _initial_params(cfg_model, init_params, seed)
    likelihood = LIKELIHOOD_SCALE in params if likelihood is None else likelihood  # None: as init_params
    if likelihood and LIKELIHOOD_SCALE not in params:
        params = add_likelihood_scale(params)
    elif not likelihood:
        params.pop(LIKELIHOOD_SCALE, None)
    opt_cfg = optimizer or OptimizerConfig(peak_lr=lr, warmup_steps=min(10, steps // 10))
    train_step, tx, schedule = _train_step_fn(cfg_model, kind, loss, float(lm_weight), opt_cfg, steps)
    lrs = np.asarray(jax.vmap(schedule)(jnp.arange(steps)))

    def as_model(p, trained: int) -> RewardModel:
        return RewardModel(cfg_model, p, tokenizer, kind, loss=loss, process_reduce=process_reduce,
                           trained_steps=prior_steps + trained, read=read)

    validate = None if validation is None else (lambda p, trained: pairwise_accuracy(as_model(p, trained),
                                                                                     validation))
    params, trained, history_out = _fit(train_step, params, tx.init(params), source, lrs, progress=progress,
                                        desc=f"{kind} reward model", validate=validate, eval_every=eval_every)
    model = as_model(params, trained)
    if answer_task is None and isinstance(init_params, RewardModel):
        answer_task = init_params.answer_check  # continued training keeps the check, margin refitted
    return (model if answer_task is None else add_answer_check(model, answer_task, samples)), history_out


def add_answer_check(rm: RewardModel, task, samples: Sequence[LabelledSample]) -> RewardModel:
    """``rm`` checking answers with ``task``'s ``extract_answer`` (a `Task`, or an earlier
    model's `AnswerCheck`; `answer_check` module): the margin is the spread of ``rm``'s own
    scores over ``samples`` (its training samples), the greedy answer's bound their longest
    completion (plus its stop token), within the room ``max_seq_len`` leaves."""
    samples = list(samples)
    if not samples:
        raise ValueError("add_answer_check needs the model's training samples, got none")
    extract, name = (task.extract, task.task) if isinstance(task, AnswerCheck) else (task.extract_answer, task.name)
    own = rm.score([s.prompt for s in samples], [s.completion for s in samples], check=False)
    longest = max(len(rm.tokenizer.encode(s.completion)) for s in samples) + 1
    check = AnswerCheck(extract, name, spread_margin(own), min(longest, rm.cfg.max_seq_len - 1))
    return rm.with_answer_check(check)



def _fit(train_step, params, opt_state, source: "BatchSource", lrs: np.ndarray, *, progress: bool,
         desc: str, validate=None, eval_every: int = 100) -> tuple[Any, int, list[dict[str, float]]]:
    """``len(lrs)`` jitted updates of ``params`` on ``source``'s batches -> (params, the number
    of updates they hold, the metrics of every step); FloatingPointError at a non-finite loss.
    With ``validate`` (params, updates) -> score, the params of the best-scoring evaluation
    (every ``eval_every`` steps and the last) instead of the last."""
    history_out: list[dict[str, float]] = []
    best = None  # (score, updates, host copy of params): the update donates the device copy
    bar = progress_bar(progress, len(lrs), desc)
    try:
        for step in range(len(lrs)):
            batch, from_history = source.next()
            params, opt_state, metrics = train_step(params, opt_state, batch)
            row = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()},
                   "lr": float(lrs[step]), "replay_items": from_history}
            if source.loss == "pairwise":
                row["same_prompt_pairs"] = source.same_prompt_fraction
            if not np.isfinite(row["loss"]):
                raise FloatingPointError(f"reward-model loss is {row['loss']} at step {step}")
            if validate is not None and ((step + 1) % eval_every == 0 or step + 1 == len(lrs)):
                row["validation_pairwise"] = score = float(validate(params, step + 1))
                if best is None or score > best[0]:
                    best = (score, step + 1, jax.device_get(params))
            history_out.append(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}", acc=f"{row['accuracy']:.3f}")
    finally:
        if bar is not None:
            bar.close()
    if best is None:
        return params, len(lrs), history_out
    return jax.tree.map(jnp.asarray, best[2]), best[1], history_out


def progress_bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step")


# ============================================================================ evaluation

def pairwise_accuracy(rm: RewardModel, samples: Sequence[LabelledSample]) -> float:
    """Fraction of same-prompt (correct, incorrect) pairs the model ranks correct first
    (ties count ½); NaN when there is no such pair."""
    return pairwise_from_scores(samples, rm.score([s.prompt for s in samples], [s.completion for s in samples]))


def pairwise_from_scores(samples: Sequence[LabelledSample], scores: Sequence[float]) -> float:
    """`pairwise_accuracy` of any scores, one per sample (a model's, or a rule's)."""
    by_prompt: dict[str, tuple[list[float], list[float]]] = {}
    for s, r in zip(samples, scores, strict=True):
        by_prompt.setdefault(s.prompt, ([], []))[0 if s.correct else 1].append(float(r))
    wins = total = 0.0
    for pos, neg in by_prompt.values():
        for a in pos:
            for b in neg:
                wins += 1.0 if a > b else 0.5 if a == b else 0.0
                total += 1
    return wins / total if total else float("nan")


def pairwise_interval(samples: Sequence[LabelledSample], scores: Sequence[float], *, level: float = 0.95,
                      draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of `pairwise_from_scores` over questions: a question's
    pairs are not independent (one sample sits in many), so whole questions are resampled."""
    by_prompt: dict[str, tuple[list[float], list[float]]] = {}
    for s, r in zip(samples, scores, strict=True):
        by_prompt.setdefault(s.prompt, ([], []))[0 if s.correct else 1].append(float(r))
    wins, pairs = [], []
    for pos, neg in by_prompt.values():
        if pos and neg:
            a, b = np.asarray(pos)[:, None], np.asarray(neg)[None, :]
            wins.append(float((a > b).sum() + 0.5 * (a == b).sum()))
            pairs.append(a.size * b.size)
    if not pairs:
        return float("nan"), float("nan")
    pick = np.random.default_rng(seed).integers(0, len(pairs), size=(draws, len(pairs)))
    ratio = np.asarray(wins)[pick].sum(axis=1) / np.asarray(pairs, np.float64)[pick].sum(axis=1)
    lo, hi = np.quantile(ratio, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def outcome_accuracy(rm: RewardModel, samples: Sequence[LabelledSample], threshold: float | None = None) -> float:
    """Fraction of samples classified right by score > threshold (default ½ for sigmoid
    scores, 0 for raw ones)."""
    if threshold is None:
        threshold = 0.5 if rm.transform == "sigmoid" else 0.0
    scores = rm.score([s.prompt for s in samples], [s.completion for s in samples])
    return float(np.mean([(r > threshold) == s.correct for s, r in zip(samples, scores)]))


def step_accuracy(rm: RewardModel, samples: Sequence[LabelledSample]) -> tuple[float, float]:
    """PRM: (fraction of steps whose score > ½ agrees with label > ½, the majority-class
    baseline on the same steps). Steps end where the samples' step labels say."""
    if rm.kind != "process":
        raise ValueError("step_accuracy needs a process reward model")
    _check_samples(samples, "process", "samples")
    got = rm.step_scores([s.prompt for s in samples], [s.completion for s in samples],
                         [[e for e, _ in s.step_labels] for s in samples])
    threshold = 0.5 if rm.transform == "sigmoid" else 0.0
    pred = np.asarray([r > threshold for steps in got for _, r in steps])
    labels = np.asarray([y > 0.5 for s in samples for _, y in s.step_labels])
    return float(np.mean(pred == labels)), float(max(labels.mean(), 1.0 - labels.mean()))
