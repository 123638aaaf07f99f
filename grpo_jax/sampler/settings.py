"""The sampling settings, one frozen object (`SamplingParams`), built from ``RLConfig`` by
`from_rl` once per run, for the run's ``Sampler`` (``Sampler.for_run``), which the trainer,
evaluation and the ahead-of-time check ask.

Which of them the compiled programs depend on (`engine`, `kv_dtype`, `decode_phases`, and
whether top-k / top-p filter at all, `filtered`) and which are traced (temperature, the
values of top_k and top_p, max_new_tokens within its bucket, the stop tokens, pad_id): see
``grpo_jax.sampler``'s package docstring.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grpo_jax.config import RLConfig, truncates_sampling

DECODE_PHASES = 4  # rl.decode_phases' default (``cache.decode_windows``)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What one sampler call draws, and with which decode engine.

    temperature 0 = greedy; top_k 0 = off; top_p 1 = off; stop_tokens: ids that end a
    completion (kept in it); pad_id fills prompts and completions; engine: the decode
    engine (``rl.decode``: auto, scan, unrolled, feature_major, shared; ``engines.resolve``
    turns auto into one of the others for the sampling mesh); kv_dtype: the KV cache's
    dtype (``rl.kv_dtype``: auto = the model's compute dtype, bfloat16, or int8 with a
    scale per slot and head, ``model.quantize_kv``); decode_phases: the most phases the
    feature-major and shared engines decode in (``rl.decode_phases``,
    ``cache.decode_windows``); it changes what a step reads, not what it draws; slots: the
    slot engine's decode slots (``rl.decode_slots``; 0 = the rows of one static call).
    ValueError for a value out of range.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    pad_id: int = 0
    engine: str = "auto"
    kv_dtype: str = "auto"
    decode_phases: int = DECODE_PHASES
    slots: int = 0

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not _is_int(self.decode_phases) or self.decode_phases < 1:
            raise ValueError(f"decode_phases must be an int >= 1, got {self.decode_phases!r}")
        if not _is_int(self.slots) or self.slots < 0:
            raise ValueError(f"slots must be an int >= 0 (0 = the rows of one call), got {self.slots!r}")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        object.__setattr__(self, "pad_id", int(self.pad_id))

    @classmethod
    def from_rl(cls, rl: RLConfig, *, stop_tokens=(), pad_id: int = 0) -> "SamplingParams":
        """The rollout's settings: rl's, with the tokenizer's stop tokens and pad id (values
        the programs trace: the ahead-of-time check may leave them at their defaults)."""
        return cls(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_k=rl.top_k,
                   top_p=rl.top_p, stop_tokens=stop_tokens, pad_id=pad_id, engine=rl.decode,
                   kv_dtype=rl.kv_dtype, decode_phases=rl.decode_phases, slots=rl.decode_slots)

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def evaluation(self, temperature: float = 0.0, top_p: float = 1.0) -> "SamplingParams":
        """The settings evaluation draws with: the rollout's engine, cache and lengths,
        untruncated (no top-k) at ``temperature`` (0: greedy) and ``top_p``."""
        return self.replace(temperature=temperature, top_k=0, top_p=top_p)

    @property
    def filtered(self) -> bool:
        """Top-k or top-p on: the decode then sorts the vocabulary each step (compiled in)."""
        return truncates_sampling(self.top_k, self.top_p)
