"""Reward models: an outcome reward model (ORM) and a process reward model (PRM).

Both are the policy's transformer trunk with the scalar value head (`model.value_outputs`),
read at different tokens of the sequence ``[bos] prompt completion [eos]``:

- ORM: one score per output, the head at the appended ``eos`` (the last real token),
  r_φ(q, o) = v_φ(q, o)_{|q|+|o|}. Trained with either
    pairwise Bradley-Terry    L = −log σ( r_φ(q, o⁺) − r_φ(q, o⁻) )      (o⁺ correct, o⁻ not)
    pointwise (sigmoid BCE)   L = −[ y log σ(r_φ) + (1 − y) log(1 − σ(r_φ)) ],  y = 1[o correct]
- PRM: one score per step, the head at the token where step j ends, r_φ^index(j); trained
  with the pointwise BCE per step against the step labels, averaged over every step of
  the batch. Step ends are character offsets into the completion (the format of
  ``Task.step_rewards``) mapped to token indices with ``token_end_offsets`` +
  ``char_to_token_index``: a step ends on the token covering its last character.

These are the reward models of DeepSeekMath §4.1 (r_φ of PPO's Eq. 3/4 and of GRPO with
outcome / process supervision). The paper trains them from the base model at lr 2e-5;
here `train_reward_model` starts from random, from a policy (a fresh value head is
added) or from an earlier reward model (continued training).

Iterative RL (Algorithm 1): after each iteration the reward model continues training on
new samples labelled by the rule, with a `ReplayBuffer` of historical samples making up
`replay_fraction` (10%) of every batch.

Host/device boundary: tokenising, batching, pairing and replay mixing are host-side
numpy; the forward, loss and AdamW update are one jitted function per training run
(fixed bucketed shapes, so it compiles once).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax import model as model_lib
from grpo_jax.checkpointing import Checkpointer
from grpo_jax.config import ModelConfig, OptimizerConfig
from grpo_jax.optimizer import make_optimizer
from grpo_jax.tokenizer import Tokenizer, char_to_token_index

__all__ = [
    "KINDS",
    "LOSSES",
    "LabelledSample",
    "ReplayBuffer",
    "RewardModel",
    "bradley_terry_loss",
    "pointwise_loss",
    "pretrain_trunk",
    "replay_count",
    "label_completions",
    "labelled_samples",
    "line_step_ends",
    "pairwise_accuracy",
    "outcome_accuracy",
    "step_accuracy",
    "train_reward_model",
]

KINDS = ("outcome", "process")
LOSSES = ("pairwise", "pointwise")
_FORMAT = "grpo_jax.reward_model/1"
_META_FILE = "reward_model.json"
_MIN_BUCKET = 16


# ============================================================================ data

@dataclasses.dataclass(frozen=True)
class LabelledSample:
    """One (prompt, completion) with its rule/oracle labels.

    ``correct``: the outcome label (final answer right). ``step_labels``: ``(end, label)``
    per step as ``Task.step_rewards`` returns them (``end`` an exclusive character offset
    into ``completion``, ``label`` in [0, 1]); needed only by process reward models.
    """

    prompt: str
    completion: str
    correct: bool
    step_labels: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "step_labels",
                           tuple((int(e), float(r)) for e, r in self.step_labels))


def label_completions(task, examples: Sequence[Any], completions: Sequence[str]) -> list[LabelledSample]:
    """Label completions with a task's rules: ``correct`` = the extracted final answer is
    right (``task.is_correct``), ``step_labels`` = ``task.step_rewards``."""
    if len(examples) != len(completions):
        raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
    return [LabelledSample(ex.prompt, c, bool(task.is_correct(task.extract_answer(c), ex)),
                           tuple(task.step_rewards(c, ex)))
            for ex, c in zip(examples, completions)]


def labelled_samples(task, split: str, num_prompts: int, seed: int, *, samples_per_prompt: int = 4,
                     wrong_step_prob: float = 0.5) -> list[LabelledSample]:
    """Synthetic reward-model data: ``samples_per_prompt`` worked solutions per question
    from ``task.sft_text`` (each step wrong with probability ``wrong_step_prob``), labelled
    by the task's rules. Deterministic in (split, num_prompts, seed)."""
    rng = random.Random(f"reward_models/{split}/{seed}")
    examples, completions = [], []
    for ex in task.examples(split, num_prompts, seed):
        for _ in range(samples_per_prompt):
            examples.append(ex)
            completions.append(task.sft_text(ex, rng, wrong_step_prob))
    return label_completions(task, examples, completions)


def line_step_ends(completion: str) -> list[int]:
    """Default step segmentation: one step per non-blank line, ending after its ``\\n``
    (the convention of ``Task.step_rewards``). No non-blank line: one step, the whole text."""
    ends, start = [], 0
    for part in completion.split("\n"):
        end = start + len(part) + 1
        if part.strip():
            ends.append(min(end, len(completion)))
        start = end
    return ends or [len(completion)]


class ReplayBuffer:
    """Historical labelled samples for continued reward-model training (iterative RL).

    Holds at most ``capacity`` samples (None: unbounded); once full, reservoir sampling
    keeps a uniform sample of everything ever added, so old iterations stay represented.
    Iterative RL, after each iteration's new labelled samples ``new``::

        rm, _ = train_reward_model(cfg, tok, new, init_params=rm, replay=buffer)  # 10% history
        buffer.add(new)

    `train_reward_model` mixes by the same rule as `mix` (`replay_count` historical items
    per batch), drawing both parts in shuffled passes rather than with replacement.
    """

    def __init__(self, capacity: int | None = None, seed: int = 0):
        if capacity is not None and capacity < 1:
            raise ValueError(f"ReplayBuffer capacity must be >= 1 or None, got {capacity}")
        self.capacity = capacity
        self._items: list[LabelledSample] = []
        self._seen = 0
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def samples(self) -> list[LabelledSample]:
        return list(self._items)

    def add(self, samples: Iterable[LabelledSample]) -> None:
        for s in samples:
            self._seen += 1
            if self.capacity is None or len(self._items) < self.capacity:
                self._items.append(s)
            else:
                j = self._rng.randrange(self._seen)
                if j < self.capacity:
                    self._items[j] = s

    def sample(self, k: int, rng: random.Random | None = None) -> list[LabelledSample]:
        """``k`` historical samples drawn uniformly with replacement."""
        if k and not self._items:
            raise ValueError("ReplayBuffer.sample: the buffer is empty")
        rng = rng or self._rng
        return [self._items[rng.randrange(len(self._items))] for _ in range(k)]

    def mix(self, new: Sequence[Any], n: int, fraction: float = 0.1,
            rng: random.Random | None = None) -> list[Any]:
        """A batch of ``n``: exactly ``replay_count(n, fraction)`` historical samples, the
        rest drawn uniformly from ``new`` (with replacement), historical ones last."""
        k = replay_count(n, fraction) if self._items else 0
        if n - k and not new:
            raise ValueError("ReplayBuffer.mix: no new samples to draw from")
        rng = rng or self._rng
        return [new[rng.randrange(len(new))] for _ in range(n - k)] + self.sample(k, rng)


def replay_count(n: int, fraction: float) -> int:
    """How many of a batch of ``n`` items come from history: n · fraction rounded half up,
    at least 1 when ``fraction`` > 0 (so a small batch still replays), at most n."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"replay_fraction must be in [0, 1], got {fraction}")
    if fraction == 0.0:
        return 0
    return min(n, max(1, math.floor(n * fraction + 0.5)))


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


# ============================================================================ tokenising (host)

@dataclasses.dataclass(frozen=True)
class _Encoded:
    tokens: tuple[int, ...]  # [bos] prompt completion [eos], truncated from the left
    step_index: tuple[int, ...]  # token index of each step end (-1: cut off by truncation)


def _encode(tokenizer: Tokenizer, prompt: str, completion: str, step_ends: Sequence[int],
            max_len: int) -> _Encoded:
    """Tokenise ``[bos] prompt completion [eos]``, keep the last ``max_len`` tokens (the
    scores are read at the end) and map each step's character end to its token index.

    Only the kept tokens' character offsets are computed (plus one decode of the dropped
    part), so an arbitrarily long untrusted completion costs O(len) + O(max_len²) at most.
    """
    prompt_ids = list(tokenizer.encode(prompt, add_bos=True))
    comp_ids = list(tokenizer.encode(completion))
    tokens = prompt_ids + comp_ids + [tokenizer.eos_id]
    cut = max(0, len(tokens) - max_len)
    steps: list[int] = []
    if step_ends:
        dropped = max(0, cut - len(prompt_ids))  # completion tokens before the window
        base = len(tokenizer.decode(comp_ids[:dropped])) if dropped else 0
        offsets = [base + o for o in tokenizer.token_end_offsets(comp_ids[dropped:])]
        for end in step_ends:
            if dropped and int(end) <= base:
                steps.append(-1)  # the step ends before the kept window
            else:
                idx = len(prompt_ids) + dropped + char_to_token_index(offsets, int(end)) - cut
                steps.append(idx if idx >= 0 else -1)
    return _Encoded(tuple(tokens[cut:]), tuple(steps))


def _bucket(n: int, cap: int | None = None) -> int:
    b = max(_MIN_BUCKET, 1 << max(0, int(n) - 1).bit_length())
    return b if cap is None else min(b, max(cap, n))


def _pad_batch(encoded: Sequence[_Encoded], rows: int, length: int, steps: int, pad_id: int,
               step_labels: Sequence[Sequence[float]] | None = None) -> dict[str, np.ndarray]:
    """Right-padded arrays: tokens/mask [rows, length], score_index [rows], step_index /
    step_mask / step_label [rows, steps]. Rows past len(encoded) are padding (mask all False)."""
    tokens = np.full((rows, length), pad_id, np.int32)
    mask = np.zeros((rows, length), bool)
    score_index = np.zeros((rows,), np.int32)
    step_index = np.zeros((rows, steps), np.int32)
    step_mask = np.zeros((rows, steps), bool)
    step_label = np.zeros((rows, steps), np.float32)
    for i, e in enumerate(encoded):
        n = len(e.tokens)
        tokens[i, :n] = e.tokens
        mask[i, :n] = True
        score_index[i] = n - 1
        for j, s in enumerate(e.step_index[:steps]):
            step_index[i, j] = max(s, 0)
            step_mask[i, j] = s >= 0
            if step_labels is not None:
                step_label[i, j] = step_labels[i][j]
    return {"tokens": tokens, "mask": mask, "score_index": score_index,
            "step_index": step_index, "step_mask": step_mask, "step_label": step_label}


def _token_values(cfg: ModelConfig, params, tokens, mask):
    hidden, _ = model_lib.forward_hidden(cfg, params, tokens, mask)
    return model_lib.value_outputs(params, hidden)  # [B, T] float32


def _frozen(dc) -> tuple:
    """A hashable key for a config dataclass (jitted functions are cached per config)."""
    return (type(dc).__name__,) + tuple(sorted(dataclasses.asdict(dc).items()))


@functools.lru_cache(maxsize=32)
def _values_fn(cfg_key: tuple):
    cfg = ModelConfig(**dict(cfg_key[1:]))
    return jax.jit(functools.partial(_token_values, cfg))


def _fresh_value_head(cfg: ModelConfig, params, key: jax.Array) -> dict:
    """``params`` plus a new value head, initialised as `model.Transformer` does (kernel
    normal(0.02), bias 0). Same result as `model.add_value_head` up to the random draw,
    without compiling the whole model's init for two small arrays."""
    shapes = model_lib.param_shapes(cfg, value_head=True)
    kernel, bias = shapes["value_head"], shapes["value_bias"]
    out = dict(params)
    out["value_head"] = (0.02 * jax.random.normal(key, kernel.shape, jnp.float32)).astype(kernel.dtype)
    out["value_bias"] = jnp.zeros(bias.shape, bias.dtype)
    return out


# ============================================================================ the model object

class RewardModel:
    """A trained ORM or PRM, used by the trainer in place of a rule reward.

    ``kind``: 'outcome' | 'process'. ``transform``: what `score` / `step_scores` return —
    'sigmoid' gives σ(r) in (0, 1) (the estimated probability of being correct; the default
    for BCE-trained models, on the scale of a 0/1 rule reward), 'identity' the raw head
    output r (the default for Bradley-Terry models, whose scores are defined only up to a
    shift). ``process_reduce``: how a PRM turns step scores into one `score`: 'min' (the
    weakest step decides; default) or 'last'. ``step_ends``: how a PRM splits a completion
    into steps when none are given (default: non-blank lines, `line_step_ends`).
    """

    def __init__(self, cfg: ModelConfig, params, tokenizer: Tokenizer, kind: str, *,
                 transform: str | None = None, loss: str | None = None, process_reduce: str = "min",
                 step_ends: Callable[[str], list[int]] = line_step_ends, max_batch: int = 64,
                 trained_steps: int = 0):
        if kind not in KINDS:
            raise ValueError(f"reward model kind must be one of {KINDS}, got {kind!r}")
        loss = loss or ("pairwise" if kind == "outcome" else "pointwise")
        transform = transform or ("identity" if loss == "pairwise" else "sigmoid")
        if transform not in ("sigmoid", "identity"):
            raise ValueError(f"transform must be 'sigmoid' or 'identity', got {transform!r}")
        if process_reduce not in ("min", "last"):
            raise ValueError(f"process_reduce must be 'min' or 'last', got {process_reduce!r}")
        if "value_head" not in params:
            raise ValueError("reward model params have no value head; use model.add_value_head")
        self.cfg, self.params, self.tokenizer, self.kind = cfg, params, tokenizer, kind
        self.loss, self.transform, self.process_reduce = loss, transform, process_reduce
        self.step_ends, self.max_batch, self.trained_steps = step_ends, max_batch, trained_steps
        self._values = _values_fn(_frozen(cfg))

    # ------------------------------------------------------------------ scoring
    def _raw(self, prompts: Sequence[str], completions: Sequence[str],
             step_ends: Sequence[Sequence[int]] | None) -> tuple[np.ndarray, list[np.ndarray]]:
        """Raw head outputs: at eos [B], and at every step end (list of [K_i])."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        if step_ends is not None and len(step_ends) != len(completions):
            raise ValueError(f"{len(step_ends)} step_ends lists for {len(completions)} completions")
        enc = [_encode(self.tokenizer, p, c, () if step_ends is None else step_ends[i],
                       self.cfg.max_seq_len) for i, (p, c) in enumerate(zip(prompts, completions))]
        final = np.zeros((len(enc),), np.float32)
        steps: list[np.ndarray] = []
        for lo in range(0, len(enc), self.max_batch):
            chunk = enc[lo:lo + self.max_batch]
            rows = max(len(chunk), min(max(8, 1 << (len(chunk) - 1).bit_length()), self.max_batch))
            length = _bucket(max(len(e.tokens) for e in chunk), self.cfg.max_seq_len)
            batch = _pad_batch(chunk, rows, length, 1, self.tokenizer.pad_id)
            values = np.asarray(self._values(self.params, batch["tokens"], batch["mask"]))
            for i, e in enumerate(chunk):
                final[lo + i] = values[i, len(e.tokens) - 1]
                idx = np.maximum(np.asarray(e.step_index, np.int64), 0)
                steps.append(values[i, idx].astype(np.float32))
        return final, steps

    def _out(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        return (0.5 + 0.5 * np.tanh(0.5 * x)).astype(np.float32) if self.transform == "sigmoid" else x

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
        """One reward per completion, [B] float32. ORM: the head at the last token. PRM:
        the `process_reduce` ('min' or 'last') of its step scores."""
        if self.kind == "outcome":
            final, _ = self._raw(prompts, completions, None)
            return self._out(final)
        per_step = self.step_scores(prompts, completions)
        red = min if self.process_reduce == "min" else (lambda xs: xs[-1])
        return np.asarray([red([r for _, r in steps]) for steps in per_step], np.float32)

    def step_scores(self, prompts: Sequence[str], completions: Sequence[str],
                    step_ends: Sequence[Sequence[int]] | None = None) -> list[list[tuple[int, float]]]:
        """``[(end, score), ...]`` per completion, the format of ``Task.step_rewards``.

        PRM: one score per step; steps end at ``step_ends`` (character offsets, e.g. from
        the task's ``step_rewards``) or else where ``self.step_ends`` splits the text. ORM:
        its outcome score as one step ending at ``len(completion)`` (as ``Task``'s default).
        Steps cut off by left-truncation to ``max_seq_len`` read the first kept token.
        """
        if self.kind == "outcome":
            final = self.score(prompts, completions)
            return [[(len(c), float(s))] for c, s in zip(completions, final)]
        if step_ends is None:
            step_ends = [self.step_ends(c) for c in completions]
        _, steps = self._raw(prompts, completions, step_ends)
        return [[(int(e), float(r)) for e, r in zip(ends, self._out(vals))]
                for ends, vals in zip(step_ends, steps)]

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike, step: int | None = None, *, keep: int = 3) -> None:
        """Checkpoint the params (Orbax, `Checkpointer`; step = `trained_steps` unless given)
        plus ``reward_model.json`` (model config, kind, transform) and the tokenizer
        (sentencepiece model or HF tokenizer folder) into directory ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        step = self.trained_steps if step is None else step
        tok_kind = _save_tokenizer(self.tokenizer, path)
        meta = {"format": _FORMAT, "kind": self.kind, "loss": self.loss, "transform": self.transform,
                "process_reduce": self.process_reduce, "tokenizer": tok_kind,
                "model": dataclasses.asdict(self.cfg)}
        ckpt = Checkpointer(path / "checkpoints", keep=keep)
        try:
            if not ckpt.save(step, {"params": self.params}, meta):
                raise FileExistsError(f"{path} already holds a reward model checkpoint at step {step}")
        finally:
            ckpt.close()
        (path / _META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: Tokenizer | None = None, *,
             step: int | None = None, **kwargs) -> "RewardModel":
        """Restore a saved reward model (latest step unless ``step``); ``tokenizer`` is needed
        only if none was saved with it. ``kwargs`` go to the constructor (e.g. max_batch)."""
        path = Path(path)
        meta_path = path / _META_FILE
        if not meta_path.exists():
            raise FileNotFoundError(f"{path} is not a saved reward model (no {_META_FILE})")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{meta_path}: unknown format {meta.get('format')!r}")
        cfg = ModelConfig(**meta["model"])
        tokenizer = tokenizer or _load_tokenizer(meta["tokenizer"], path)
        shapes = model_lib.param_shapes(cfg, value_head=True)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = {"params": jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)}
        ckpt = Checkpointer(path / "checkpoints")
        try:
            out = ckpt.restore(abstract, step)
        finally:
            ckpt.close()
        if out is None:
            raise FileNotFoundError(f"no readable reward model checkpoint under {path}")
        restored_step, state, _ = out
        kwargs.setdefault("process_reduce", meta["process_reduce"])
        return cls(cfg, state["params"], tokenizer, meta["kind"], transform=meta["transform"],
                   loss=meta["loss"], trained_steps=restored_step, **kwargs)


def _save_tokenizer(tokenizer, path: Path) -> str:
    from grpo_jax.tokenizer import SentencePieceTokenizer

    if isinstance(tokenizer, SentencePieceTokenizer):
        tokenizer.save(path / "tokenizer.model")
        return "sentencepiece"
    if type(tokenizer).__name__ == "BPETokenizer" and hasattr(tokenizer, "save"):
        tokenizer.save(path / "tokenizer")
        return "bpe"
    return "none"


def _load_tokenizer(kind: str, path: Path) -> Tokenizer:
    if kind == "sentencepiece":
        from grpo_jax.tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer.load(path / "tokenizer.model")
    if kind == "bpe":
        from grpo_jax.bpe_tokenizer import BPETokenizer

        return BPETokenizer.from_hf_dir(path / "tokenizer")
    raise ValueError(f"{path}: no tokenizer was saved with this reward model; pass tokenizer=")


# ============================================================================ training

def _loss_and_metrics(cfg: ModelConfig, kind: str, loss: str, params, batch):
    values = _token_values(cfg, params, batch["tokens"], batch["mask"])  # [B, T]
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


@functools.lru_cache(maxsize=16)
def _train_step_fn(cfg_key: tuple, kind: str, loss: str, opt_key: tuple, total_steps: int):
    """(jitted update, optimizer, lr schedule), cached so that repeated training runs with
    the same shapes and settings (continued training, tests) compile once."""
    cfg = ModelConfig(**dict(cfg_key[1:]))
    tx, schedule = make_optimizer(OptimizerConfig(**dict(opt_key[1:])), total_steps)

    def step(params, opt_state, batch):
        (value, metrics), grads = jax.value_and_grad(
            lambda p: _loss_and_metrics(cfg, kind, loss, p, batch), has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = dict(metrics, loss=value, grad_norm=optax.global_norm(grads))
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1)), tx, schedule


def _pairs(samples: Sequence[LabelledSample], rng: random.Random) -> tuple[list[tuple[int, int]], int]:
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


class _Stream:
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


class _BatchSource:
    """Host-side batches for `train_reward_model`: every sample tokenised once, one
    (rows, T, S) shape for the whole run, shuffled passes over new items plus exactly
    `replay_count(items, replay_fraction)` historical items per batch (an item is a
    (correct, incorrect) pair for the pairwise loss, a sample otherwise).

    Pairwise batches put the chosen sequences in rows [0, P) and their rejected partners in
    rows [P, 2P). `next()` returns (arrays, number of historical items in the batch).
    """

    def __init__(self, tokenizer: Tokenizer, samples: list[LabelledSample], history: list[LabelledSample],
                 *, kind: str, loss: str, batch_size: int, replay_fraction: float, max_len: int, seed: int):
        rng = random.Random(f"train_reward_model/{seed}")
        self.kind, self.loss, self.pad_id = kind, loss, tokenizer.pad_id
        self.num_new = len(samples)
        self.items = batch_size // 2 if loss == "pairwise" else batch_size
        self.num_replay = replay_count(self.items, replay_fraction) if history else 0
        if history and self.items - self.num_replay < 1:
            raise ValueError(f"replay_fraction={replay_fraction} leaves no new samples in a batch "
                             f"of {self.items}")
        self.pool = samples + history
        self.enc = [_encode(tokenizer, s.prompt, s.completion,
                            [e for e, _ in s.step_labels] if kind == "process" else (), max_len)
                    for s in self.pool]
        self.length = _bucket(max(len(e.tokens) for e in self.enc), max_len)
        self.max_steps = _bucket(max(len(e.step_index) for e in self.enc), None) if kind == "process" else 1
        self.same_prompt_fraction = float("nan")
        if loss == "pairwise":
            pairs, same = _pairs(samples, rng)
            self.same_prompt_fraction = same / len(pairs)
            self.new = _Stream(pairs, rng)
            old = [(a + self.num_new, b + self.num_new) for a, b in _pairs(history, rng)[0]] \
                if self.num_replay else []
        else:
            self.new = _Stream(range(self.num_new), rng)
            old = range(self.num_new, len(self.pool))
        self.old = _Stream(old, rng) if self.num_replay else None

    def next(self) -> tuple[dict[str, np.ndarray], int]:
        items = self.new.take(self.items - self.num_replay)
        if self.old is not None:
            items += self.old.take(self.num_replay)
        rows = [c for c, _ in items] + [w for _, w in items] if self.loss == "pairwise" else list(items)
        per_item = 2 if self.loss == "pairwise" else 1
        from_history = sum(i >= self.num_new for i in rows) // per_item
        batch = _pad_batch([self.enc[i] for i in rows], len(rows), self.length, self.max_steps, self.pad_id,
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
    optimizer: AdamW settings (grpo_jax.optimizer); default `OptimizerConfig(peak_lr=lr,
      warmup_steps=min(10, steps // 10))` with the multi-step schedule. `lr` is ignored
      when `optimizer` is given.
    Metrics per step: loss, accuracy (pairs ranked right / outcomes or steps classified
      right at σ = ½), grad_norm, lr, replay_items (historical items in the batch), and
      for pairwise margin (mean r⁺ − r⁻) and same_prompt_pairs (fraction of the new pairs
      whose two completions answer the same prompt).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    loss = loss or ("pairwise" if kind == "outcome" else "pointwise")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if kind == "process" and loss != "pointwise":
        raise ValueError("a process reward model is trained with the per-step BCE: loss='pointwise'")
    samples = list(samples)
    if not samples:
        raise ValueError("train_reward_model: no samples to train on")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if batch_size < (2 if loss == "pairwise" else 1):
        raise ValueError(f"batch_size must be >= {2 if loss == 'pairwise' else 1}, got {batch_size}")
    history = replay.samples if isinstance(replay, ReplayBuffer) else list(replay or [])
    _check_samples(samples, kind, "samples")
    _check_samples(history, kind, "replay")
    if tokenizer.vocab_size > cfg_model.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
                         f"{cfg_model.vocab_size}")

    source = _BatchSource(tokenizer, samples, history, kind=kind, loss=loss, batch_size=batch_size,
                          replay_fraction=replay_fraction, max_len=cfg_model.max_seq_len, seed=seed)

    # Device side: params, AdamW, one jitted update.
    prior_steps = init_params.trained_steps if isinstance(init_params, RewardModel) else 0
    if isinstance(init_params, RewardModel):
        init_params = init_params.params
    if init_params is None:
        params = model_lib.init_params(cfg_model, jax.random.key(seed), value_head=True)
    else:
        params = jax.tree.map(jnp.array, dict(init_params))  # a copy: the update donates it
        if "value_head" not in params:
            params = _fresh_value_head(cfg_model, params, jax.random.key(seed))
    opt_cfg = optimizer or OptimizerConfig(peak_lr=lr, warmup_steps=min(10, steps // 10))
    train_step, tx, schedule = _train_step_fn(_frozen(cfg_model), kind, loss, _frozen(opt_cfg), steps)
    opt_state = tx.init(params)
    lrs = np.asarray(jax.vmap(schedule)(jnp.arange(steps)))

    history_out: list[dict[str, float]] = []
    bar = _progress_bar(progress, steps, f"{kind} reward model")
    try:
        for step in range(steps):
            batch, from_history = source.next()
            params, opt_state, metrics = train_step(params, opt_state, batch)
            row = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()},
                   "lr": float(lrs[step]), "replay_items": from_history}
            if loss == "pairwise":
                row["same_prompt_pairs"] = source.same_prompt_fraction
            if not np.isfinite(row["loss"]):
                raise FloatingPointError(f"reward-model loss is {row['loss']} at step {step}")
            history_out.append(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}", acc=f"{row['accuracy']:.3f}")
    finally:
        if bar is not None:
            bar.close()
    rm = RewardModel(cfg_model, params, tokenizer, kind, loss=loss, process_reduce=process_reduce,
                     trained_steps=prior_steps + steps)
    return rm, history_out


def pretrain_trunk(
    cfg_model: ModelConfig,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    init_params: Any = None,
    progress: bool = True,
) -> tuple[Any, list[dict[str, float]]]:
    """Next-token training on documents: the base model a reward model starts from.

    The paper trains its reward models from DeepSeekMath-Base, a model that already does
    the arithmetic the reward model has to check. A reward model trained from a random
    trunk sees one bit per sample and must discover arithmetic from it (a three-way
    relation between a, b and c): the tiny CPU model stays at chance for thousands of
    steps. Next-token training on worked solutions gives it those features in a few
    hundred. Minimises mean −log π(x_t | x_<t) over the real tokens of ``[bos] text [eos]``.
    Returns (params without a value head, per-step metrics).
    """
    texts = list(texts)
    if not texts:
        raise ValueError("pretrain_trunk: no texts")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
    enc = [_Encoded(tuple(tokenizer.encode(t, add_bos=True)[-cfg_model.max_seq_len + 1:]
                          + [tokenizer.eos_id]), ()) for t in texts]
    length = _bucket(max(len(e.tokens) for e in enc), cfg_model.max_seq_len)
    stream = _Stream(range(len(enc)), random.Random(f"pretrain_trunk/{seed}"))
    params = (model_lib.init_params(cfg_model, jax.random.key(seed)) if init_params is None
              else jax.tree.map(jnp.array, dict(init_params)))
    tx, schedule = make_optimizer(OptimizerConfig(peak_lr=lr, warmup_steps=min(10, steps // 10)), steps)
    opt_state = tx.init(params)
    lrs = np.asarray(jax.vmap(schedule)(jnp.arange(steps)))

    def nll(p, tokens, mask):
        logits = model_lib.forward_logits(cfg_model, p, tokens[:, :-1], mask[:, :-1])
        logp = jax.nn.log_softmax(logits)
        token_nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        target = mask[:, 1:]
        return jnp.where(target, token_nll, 0.0).sum() / jnp.maximum(target.sum(), 1)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_fn(p, s, tokens, mask):
        value, grads = jax.value_and_grad(nll)(p, tokens, mask)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    out: list[dict[str, float]] = []
    bar = _progress_bar(progress, steps, "trunk (next-token)")
    try:
        for step in range(steps):
            batch = _pad_batch([enc[i] for i in stream.take(batch_size)], batch_size, length, 1,
                               tokenizer.pad_id)
            params, opt_state, value = step_fn(params, opt_state, batch["tokens"], batch["mask"])
            out.append({"step": step, "loss": float(value), "lr": float(lrs[step])})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{out[-1]['loss']:.4f}")
    finally:
        if bar is not None:
            bar.close()
    return params, out


def _progress_bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step")


# ============================================================================ evaluation

def pairwise_accuracy(rm: RewardModel, samples: Sequence[LabelledSample]) -> float:
    """Fraction of same-prompt (correct, incorrect) pairs the model ranks correct first
    (ties count ½); NaN when there is no such pair."""
    scores = rm.score([s.prompt for s in samples], [s.completion for s in samples])
    by_prompt: dict[str, tuple[list[float], list[float]]] = {}
    for s, r in zip(samples, scores):
        by_prompt.setdefault(s.prompt, ([], []))[0 if s.correct else 1].append(float(r))
    wins = total = 0.0
    for pos, neg in by_prompt.values():
        for a in pos:
            for b in neg:
                wins += 1.0 if a > b else 0.5 if a == b else 0.0
                total += 1
    return wins / total if total else float("nan")


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
