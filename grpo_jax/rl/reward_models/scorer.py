"""The reward model the trainer scores with: `RewardModel` (ORM or PRM) reads the value
head at the eos token or at step ends; host-side tokenising and padding; save / load."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.model import transformer as model_lib
from grpo_jax.model.logprobs import token_logprobs
from grpo_jax import shapes
from grpo_jax.checkpoints.checkpointing import Checkpointer
from grpo_jax.config import ModelConfig
from grpo_jax.errors import CheckpointError, RewardModelError
from grpo_jax.rl.reward_models.answer_check import AnswerCheck, GreedyAnswers, agreement, combine
from grpo_jax.rl.reward_models.data import line_step_ends
from grpo_jax.text.tokenizer import Tokenizer, char_to_token_index

KINDS = ("outcome", "process")
LOSSES = ("pairwise", "pointwise")
# Where a PRM's head reads a step: "end", the token that ends it (its newline), or "value",
# the step's last token before the newline (on the testbed, the value the line writes).
READS = ("end", "value")
_FORMAT = "grpo_jax.reward_model/1"
_META_FILE = "reward_model.json"
_MIN_BUCKET = 16


# ============================================================================ tokenising (host)

@dataclasses.dataclass(frozen=True)
class Encoded:
    tokens: tuple[int, ...]  # [bos] prompt completion [eos], truncated from the left
    step_index: tuple[int, ...]  # token index of each step end (-1: cut off by truncation)
    start: int = 0  # index of the first completion token in `tokens`


def encode(tokenizer: Tokenizer, prompt: str, completion: str, step_ends: Sequence[int],
            max_len: int) -> Encoded:
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
    return Encoded(tuple(tokens[cut:]), tuple(steps), max(0, len(prompt_ids) - cut))


def read_ends(completion: str, step_ends: Sequence[int], read: str) -> list[int]:
    """The character ends a PRM reads ``step_ends`` at: as they are for ``read="end"``; for
    ``read="value"`` one character earlier where a step ends in a newline after text."""
    if read == "end":
        return [int(e) for e in step_ends]
    return [int(e) - 1 if e >= 2 and completion[e - 1] == "\n" and completion[e - 2] != "\n" else int(e)
            for e in step_ends]


def bucket(n: int, cap: int | None = None) -> int:
    """The sampler's power-of-two length bucket (at least 16), capped at ``cap`` unless
    ``n`` itself is longer."""
    b = shapes.bucket_length(n, _MIN_BUCKET)
    return b if cap is None else min(b, max(cap, n))


def pad_batch(encoded: Sequence[Encoded], rows: int, length: int, steps: int, pad_id: int,
               step_labels: Sequence[Sequence[float]] | None = None) -> dict[str, np.ndarray]:
    """Right-padded arrays: tokens/mask [rows, length], score_index / start [rows], step_index /
    step_mask / step_label [rows, steps]. Rows past len(encoded) are padding (mask all False)."""
    tokens = np.full((rows, length), pad_id, np.int32)
    start = np.zeros((rows,), np.int32)
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
        start[i] = e.start
        for j, s in enumerate(e.step_index[:steps]):
            step_index[i, j] = max(s, 0)
            step_mask[i, j] = s >= 0
            if step_labels is not None:
                step_label[i, j] = step_labels[i][j]
    return {"tokens": tokens, "mask": mask, "score_index": score_index, "start": start,
            "step_index": step_index, "step_mask": step_mask, "step_label": step_label}


LIKELIHOOD_SCALE = "likelihood_scale"


def add_likelihood_scale(params, value: float = 0.0):
    """A copy of reward-model ``params`` whose score also reads the trunk's likelihood of the
    completion (`token_values`), with the learned scale starting at ``value``."""
    return dict(params, **{LIKELIHOOD_SCALE: jnp.asarray(value, jnp.float32)})


def completion_logprobs(cfg: ModelConfig, params, hidden, tokens, mask, start):
    """[B, T]: log π(x_t | x_<t) at each of the completion's real tokens t (the trunk read as a
    language model), 0 elsewhere (before the completion starts at ``start`` [B], padding)."""
    unembed, vocab_major = model_lib.unembedding(cfg, params)
    logp = token_logprobs(hidden[:, :-1], unembed, tokens[:, 1:], vocab_major=vocab_major)  # [B, T-1]
    logp = jnp.pad(logp, ((0, 0), (1, 0)))  # logp[:, t] is that of token t
    t = jnp.arange(tokens.shape[1])[None, :]
    return jnp.where((t >= start[:, None]) & mask, logp, 0.0)


def completion_loglik(cfg: ModelConfig, params, hidden, tokens, mask, start):
    """C [B, T]: at token t, Σ log π(x_s | x_<s) over the completion's tokens s <= t
    (`completion_logprobs` summed so far)."""
    return jnp.cumsum(completion_logprobs(cfg, params, hidden, tokens, mask, start), axis=1)


def values_from_hidden(cfg: ModelConfig, params, hidden, tokens, mask, start):
    """The score at every token [B, T] float32: the value head, plus, for a model with a
    `LIKELIHOOD_SCALE`, that scale times the completion's log-likelihood so far. A wrong
    line is one the trunk, trained as a language model of right solutions, finds unlikely:
    a head that must learn to see that from one bit per sample did not (docs/reward_models.md)."""
    values = model_lib.value_outputs(params, hidden)
    if LIKELIHOOD_SCALE in params:
        values = values + params[LIKELIHOOD_SCALE] * completion_loglik(cfg, params, hidden, tokens, mask, start)
    return values


def token_values(cfg: ModelConfig, params, tokens, mask, start):
    """tokens / mask [B, T], start [B] -> the score at every token [B, T] float32."""
    hidden, _ = model_lib.forward_hidden(cfg, params, tokens, mask)
    return values_from_hidden(cfg, params, hidden, tokens, mask, start)


@functools.lru_cache(maxsize=32)
def _values_fn(cfg: ModelConfig):
    return jax.jit(functools.partial(token_values, cfg))


# ============================================================================ the model object

class RewardModel:
    """A trained ORM or PRM, used by the trainer in place of a rule reward.

    ``kind``: 'outcome' | 'process'. ``transform``: what `score` / `step_scores` return —
    'sigmoid' gives σ(r) in (0, 1) (the estimated probability of being correct; the default
    for BCE-trained models, on the scale of a 0/1 rule reward), 'identity' the raw head
    output r (the default for Bradley-Terry models, whose scores are defined only up to a
    shift). ``process_reduce``: how a PRM turns step scores into one `score`: 'min' (the
    weakest step decides; default) or 'last'. ``step_ends``: how a PRM splits a completion
    into steps when none are given (default: non-blank lines, `line_step_ends`). ``read``
    (PRM): where the head reads each step, 'end' (the step's newline) or 'value' (the token
    before it), as the model was trained (`READS`). ``answer_check`` (an `AnswerCheck`, or None):
    `score` also asks whether each completion's answer agrees with the trunk's own greedy
    answer to its question (`answer_check` module), as `with_answer_check` sets it.
    """

    def __init__(self, cfg: ModelConfig, params, tokenizer: Tokenizer, kind: str, *,
                 transform: str | None = None, loss: str | None = None, process_reduce: str = "min",
                 step_ends: Callable[[str], list[int]] = line_step_ends, max_batch: int = 64,
                 trained_steps: int = 0, read: str = "end", answer_check: AnswerCheck | None = None):
        if kind not in KINDS:
            raise ValueError(f"reward model kind must be one of {KINDS}, got {kind!r}")
        loss = loss or ("pairwise" if kind == "outcome" else "pointwise")
        transform = transform or ("identity" if loss == "pairwise" else "sigmoid")
        if transform not in ("sigmoid", "identity"):
            raise ValueError(f"transform must be 'sigmoid' or 'identity', got {transform!r}")
        if read not in READS:
            raise ValueError(f"read must be one of {READS}, got {read!r}")
        if process_reduce not in ("min", "last"):
            raise ValueError(f"process_reduce must be 'min' or 'last', got {process_reduce!r}")
        if "value_head" not in params:
            raise ValueError("reward model params have no value head; use model.add_value_head")
        self.cfg, self.params, self.tokenizer, self.kind = cfg, params, tokenizer, kind
        self.loss, self.transform, self.process_reduce = loss, transform, process_reduce
        self.step_ends, self.max_batch, self.trained_steps = step_ends, max_batch, trained_steps
        self.read, self.answer_check = read, answer_check
        self._values = _values_fn(cfg)
        self._greedy = None if answer_check is None else GreedyAnswers(cfg, params, tokenizer, answer_check)

    def with_answer_check(self, check: AnswerCheck | None) -> "RewardModel":
        """This model (the same params) with ``check`` as its answer check (None: without one)."""
        return RewardModel(self.cfg, self.params, self.tokenizer, self.kind, transform=self.transform,
                           loss=self.loss, process_reduce=self.process_reduce, step_ends=self.step_ends,
                           max_batch=self.max_batch, trained_steps=self.trained_steps, read=self.read,
                           answer_check=check)

    # ------------------------------------------------------------------ scoring
    def _raw(self, prompts: Sequence[str], completions: Sequence[str],
             step_ends: Sequence[Sequence[int]] | None) -> tuple[np.ndarray, list[np.ndarray]]:
        """Raw head outputs: at eos [B], and at every step end (list of [K_i])."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        if step_ends is not None and len(step_ends) != len(completions):
            raise ValueError(f"{len(step_ends)} step_ends lists for {len(completions)} completions")
        enc = [encode(self.tokenizer, p, c, () if step_ends is None else read_ends(c, step_ends[i], self.read),
                       self.cfg.max_seq_len) for i, (p, c) in enumerate(zip(prompts, completions))]
        final = np.zeros((len(enc),), np.float32)
        steps: list[np.ndarray] = []
        for lo in range(0, len(enc), self.max_batch):
            chunk = enc[lo:lo + self.max_batch]
            rows = max(len(chunk), min(shapes.bucket_length(len(chunk), 8), self.max_batch))
            length = bucket(max(len(e.tokens) for e in chunk), self.cfg.max_seq_len)
            batch = pad_batch(chunk, rows, length, 1, self.tokenizer.pad_id)
            values = np.asarray(self._values(self.params, batch["tokens"], batch["mask"], batch["start"]))
            for i, e in enumerate(chunk):
                final[lo + i] = values[i, len(e.tokens) - 1]
                idx = np.maximum(np.asarray(e.step_index, np.int64), 0)
                steps.append(values[i, idx].astype(np.float32))
        return final, steps

    def _out(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        return (0.5 + 0.5 * np.tanh(0.5 * x)).astype(np.float32) if self.transform == "sigmoid" else x

    def score(self, prompts: Sequence[str], completions: Sequence[str], *, check: bool = True) -> np.ndarray:
        """One reward per completion, [B] float32. ORM: the head at the last token. PRM:
        the `process_reduce` ('min' or 'last') of its step scores. With an answer check (and
        ``check``), combined with `agreement` (`answer_check.combine`)."""
        if self.kind == "outcome":
            final, _ = self._raw(prompts, completions, None)
            own = self._out(final)
        else:
            per_step = self.step_scores(prompts, completions)
            red = min if self.process_reduce == "min" else (lambda xs: xs[-1])
            own = np.asarray([red([r for _, r in steps]) for steps in per_step], np.float32)
        if self.answer_check is None or not check:
            return own
        return combine(own, self.agreement(prompts, completions), self.transform, self.answer_check.margin)

    def agreement(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
        """[B] float32: 1 where a completion's answer is the trunk's greedy answer to its
        question, else 0. Needs an answer check."""
        if self._greedy is None:
            raise RewardModelError("this reward model has no answer check (train_reward_model's answer_task)")
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        return agreement(self._greedy(prompts), completions, self.answer_check.extract)

    def greedy_answers(self, prompts: Sequence[str]) -> list[str | None]:
        """The trunk's greedy answer to each question (cached). Needs an answer check."""
        if self._greedy is None:
            raise RewardModelError("this reward model has no answer check (train_reward_model's answer_task)")
        return self._greedy(prompts)

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
                "process_reduce": self.process_reduce, "read": self.read,
                "likelihood": LIKELIHOOD_SCALE in self.params, "tokenizer": tok_kind,
                "answer_check": None if self.answer_check is None else self.answer_check.meta(),
                "model": dataclasses.asdict(self.cfg)}
        ckpt = Checkpointer(path / "checkpoints", keep=keep)
        try:
            if step in ckpt.all_steps():
                raise FileExistsError(f"{path} already holds a reward model checkpoint at step {step}")
            ckpt.save(step, {"params": self.params}, meta)
        finally:
            ckpt.close()
        (path / _META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))

    @staticmethod
    def read_meta(path: str | os.PathLike) -> dict:
        """The saved ``reward_model.json`` of ``path``, checked: a RewardModelError names the
        path and what is wrong (no such folder, no or unreadable metadata, a model config
        that does not parse). Cheap, so a run can check its reward model before it writes."""
        path = Path(path)
        meta_path = path / _META_FILE
        if not path.is_dir():
            raise RewardModelError(f"reward model {str(path)!r} is not a directory; give the folder a "
                                   "reward model was saved to (experiments/train_reward_model.py)")
        if not meta_path.is_file():
            raise RewardModelError(f"{str(path)!r} is not a saved reward model (no {_META_FILE}); give "
                                   "the folder a reward model was saved to")
        try:
            meta = json.loads(meta_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RewardModelError(f"{meta_path}: not valid JSON ({err}); save the reward model again") from None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise RewardModelError(f"{meta_path}: format {found!r}, expected {_FORMAT!r}")
        missing = [k for k in ("kind", "loss", "transform", "process_reduce", "tokenizer", "model")
                   if k not in meta]
        if missing:
            raise RewardModelError(f"{meta_path}: missing {missing}; save the reward model again")
        try:
            ModelConfig(**meta["model"]).validate()
        except (TypeError, ValueError) as err:
            raise RewardModelError(f"{meta_path}: its model config is unusable ({err})") from None
        return meta

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: Tokenizer | None = None, *,
             step: int | None = None, extract_answer: Callable[[str], str | None] | None = None,
             **kwargs) -> "RewardModel":
        """Restore a saved reward model (latest step unless ``step``). It reads text with the
        tokenizer saved with it, the one it was trained with: it scores strings, so the
        policy's may differ. ``tokenizer`` serves only a model saved without one, and its token
        ids must fit the reward model's vocabulary. A model saved with an answer check reads answers with ``extract_answer``
        (the run's task's), else with that of the task it was trained on, rebuilt by name.
        ``kwargs`` go to the constructor (e.g. max_batch). Anything unusable about ``path``
        is a RewardModelError naming it."""
        path = Path(path)
        meta = cls.read_meta(path)
        cfg = ModelConfig(**meta["model"])
        # Another tokenizer of the same size would pass every check and score other pieces.
        if meta["tokenizer"] != "none" or tokenizer is None:
            tokenizer = _load_tokenizer(meta["tokenizer"], path)
        elif tokenizer.vocab_size > cfg.vocab_size:
            # Token ids past the reward model's embedding would be clipped silently by the gather.
            raise RewardModelError(
                f"reward model {str(path)!r} has a vocabulary of {cfg.vocab_size} tokens, the policy's "
                f"tokenizer {tokenizer.vocab_size}; train the reward model with the policy's tokenizer")
        shapes = model_lib.param_shapes(cfg, value_head=True)
        if meta.get("likelihood"):  # saved before it existed: False
            shapes = dict(shapes, **{LIKELIHOOD_SCALE: jax.ShapeDtypeStruct((), jnp.float32)})
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = {"params": jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)}
        ckpt = Checkpointer(path / "checkpoints")
        try:
            out = ckpt.restore(abstract, step)
        except CheckpointError as err:
            raise RewardModelError(f"reward model {str(path)!r}: {err}") from None
        finally:
            ckpt.close()
        if out is None:
            raise RewardModelError(f"no reward model checkpoint under {str(path)!r}; save the reward model again")
        restored_step, state, _ = out
        kwargs.setdefault("process_reduce", meta["process_reduce"])
        kwargs.setdefault("read", meta.get("read", "end"))  # saved before `read` existed: "end"
        if meta.get("answer_check"):  # saved before it existed: absent
            kwargs.setdefault("answer_check", _load_answer_check(meta["answer_check"], extract_answer, path))
        return cls(cfg, state["params"], tokenizer, meta["kind"], transform=meta["transform"],
                   loss=meta["loss"], trained_steps=restored_step, **kwargs)


def _load_answer_check(meta: dict, extract_answer, path: Path) -> AnswerCheck:
    try:
        if extract_answer is None:
            from grpo_jax.tasks import get_task

            extract_answer = get_task(meta["task"]).extract_answer
        return AnswerCheck(extract_answer, meta["task"], float(meta["margin"]), int(meta["max_new_tokens"]))
    except Exception as err:  # noqa: BLE001 - any failure to rebuild it is the same user error
        raise RewardModelError(
            f"reward model {str(path)!r} checks answers with task {meta.get('task')!r}'s extraction, which "
            f"could not be rebuilt ({type(err).__name__}: {err}); pass extract_answer=task.extract_answer "
            "to RewardModel.load") from None


def _save_tokenizer(tokenizer, path: Path) -> str:
    from grpo_jax.text.tokenizer import SentencePieceTokenizer

    if isinstance(tokenizer, SentencePieceTokenizer):
        tokenizer.save(path / "tokenizer.model")
        return "sentencepiece"
    if type(tokenizer).__name__ == "BPETokenizer" and hasattr(tokenizer, "save"):
        tokenizer.save(path / "tokenizer")
        return "bpe"
    return "none"


def _load_tokenizer(kind: str, path: Path) -> Tokenizer:
    if kind == "sentencepiece":
        from grpo_jax.text.tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer.load(path / "tokenizer.model")
    if kind == "bpe":
        from grpo_jax.text.bpe_tokenizer import BPETokenizer

        return BPETokenizer.from_hf_dir(path / "tokenizer")
    raise RewardModelError(f"{path}: no tokenizer was saved with this reward model; pass tokenizer=")
