"""The unified paradigm: SFT, RFT, Online RFT, DPO, PPO and GRPO as one kind of object.

DeepSeekMath §5.2.1 (Eq. 5) writes the gradient of every method as

    ∇_θ J_A(θ) = E_(q,o)~D [ 1/|o| Σ_t GC_A(q, o, t, π_rf) ∇_θ log π_θ(o_t | q, o_<t) ]

three components: a **data source** D, a **reward function** π_rf and an **algorithm**
A that turns them into the gradient coefficient GC. Here an algorithm is exactly that: a
frozen dataclass naming its data source and reward (read by the trainer, which never
branches on algorithm names) plus two device-side functions used by the one train step:

* ``prepare(state, batch, cfg)`` — once per sampled batch, before the μ updates: the
  model outputs every update needs but no update changes (π_θold and π_ref log-probs,
  old values), turned into per-row ``extras`` (advantages, loss mask, …) by the pure
  ``extras_from_logprobs``;
* ``loss_parts(params, micro_batch, extras, cfg)`` — per micro-batch, differentiated:
  runs the model (one forward, chunked log-probs) and returns the pure
  ``loss_parts_from_logprobs``: ``(numerator, denominator, metrics)`` of the loss, with
  ``losses.aggregate_parts``'s contract (sum numerators and denominators over
  micro-batches, divide once).

    | algorithm  | data_source      | reward | gradient coefficient GC                    |
    | SFT        | dataset          | none   | 1                                          |
    | RFT        | sft_policy       | rule   | 1 if o correct else 0                      |
    | OnlineRFT  | policy           | rule   | 1 if o correct else 0                      |
    | DPO        | sft_policy_pairs | rule   | ±β σ(β ℓ(o−) − β ℓ(o+)), ℓ = mean log π/π_ref |
    | PPO        | policy           | model  | A_t (GAE)                                  |
    | GRPO       | policy           | model  | Â_i,t + β(π_ref/π_θ − 1)                   |

Because the loss is written as a function of per-token log-probs, the tests check this
table by autodiff: d loss / d logp_t = −GC_t / (|o| · #outputs) at ρ = 1.

Numbers are data, modes are code (as in MaxText and Tunix): ``RLHParams`` carries the
rl.* fields whose role is "number" (β, ε, γ, λ, value clip range, DPO β, temperature, TIS
cap) as traced scalars, so changing them never recompiles; every mode (algorithm, μ,
micro-batches, aggregation, KL estimator, supervision, std scaling, advantage estimator,
policy loss, whitening, value clipping / TIS / dynamic sampling / truncation masking on or
off) is a plain Python branch on the static ``cfg``, so only the chosen branch is traced
and computed (``RLConfig.modes()`` holds them: the step's cache key).

Conventions: rows of a batch are B = P·G outputs, row p·G + g the g-th output for
question p (DPO: row 2p chosen o+, row 2p+1 rejected o−). ``extras`` is an ``Extras``
dataclass of arrays whose leading axis is B (split into micro-batches with the batch); ``metrics``
from ``loss_parts*`` map a name to ``(sum, count)`` (the train step sums both over
micro-batches and divides), except names in ``MAX_METRICS``, which map to
``(max, count)`` and are combined by max.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.rl import advantages as adv_lib
from grpo_jax import loops
from grpo_jax.rl import losses
from grpo_jax.model import packing
from grpo_jax.config import RL_NUMBERS, RL_SWITCHES, Config, RLConfig
from grpo_jax.rl.data_sources import DATA_SOURCES, DATASET, POLICY, SFT_POLICY, SFT_POLICY_PAIRS, DataSource
from grpo_jax.model.logprobs import sequence_logprobs, sequence_values

__all__ = [
    "RLHParams", "Extras", "Algorithm", "SFT", "RFT", "OnlineRFT", "DPO", "PPO", "GRPO",
    "ALGORITHMS", "DATA_SOURCES", "MAX_METRICS", "algorithm_of", "get_algorithm",
    "split_micro_batches", "merge_micro_batches", "map_micro_batches",
]

MAX_METRICS = ("logprob_mismatch_max", "ratio_deviation_max")

Metrics = dict[str, Any]


# ----------------------------------------------------------------- micro-batches

def _check_rows(rows: int, num: int, unit: int) -> None:
    if rows % (num * unit):
        raise ValueError(
            f"batch of {rows} rows cannot be split into rl.num_micro_batches={num} micro-batches"
            + (f" of whole units of {unit} rows" if unit > 1 else "")
            + f": {rows} is not a multiple of {num * unit}")


def split_micro_batches(tree: Any, num: int, unit: int = 1) -> Any:
    """``[B, ...]`` leaves -> ``[num, B/num, ...]``.

    Rows are taken in units of ``unit`` consecutive rows (2 for DPO's chosen/rejected
    pairs); micro-batch k holds units k, k + num, k + 2·num, … (strided), so every
    device's contiguous shard of the batch contributes equally to every micro-batch and
    splitting moves no data between devices.
    """
    def split(x):
        rows = x.shape[0]
        _check_rows(rows, num, unit)
        x = x.reshape((rows // (num * unit), num, unit) + x.shape[1:])
        x = jnp.moveaxis(x, 1, 0)
        return x.reshape((num, rows // num) + x.shape[3:])

    return jax.tree.map(split, tree)


def merge_micro_batches(tree: Any, unit: int = 1) -> Any:
    """Inverse of ``split_micro_batches``: ``[num, B/num, ...]`` -> ``[B, ...]``."""
    def merge(x):
        num, per = x.shape[:2]
        x = x.reshape((num, per // unit, unit) + x.shape[2:])
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape((num * per,) + x.shape[3:])

    return jax.tree.map(merge, tree)


def map_micro_batches(fn: Callable[[Any], Any], tree: Any, num: int, unit: int = 1) -> Any:
    """``fn`` (rows -> per-row outputs) applied one micro-batch at a time (``lax.map``),
    results put back in row order: bounds the memory of a forward pass over a big batch."""
    if num == 1:
        return fn(tree)
    return merge_micro_batches(loops.map(fn, split_micro_batches(tree, num, unit)), unit)


# ----------------------------------------------------------------- hyperparameters

@flax.struct.dataclass
class RLHParams:
    """The rl.* fields whose role is "number" (``config.RL_NUMBERS``, in their order: β, ε,
    γ, λ, the value clip range, DPO's β, the temperature, the TIS cap) as float32 scalars
    the train step reads as data, so changing one never recompiles. Modes (aggregation, KL
    estimator, supervision, ...) are Python branches on the static cfg, so only the chosen
    one is traced (``RLConfig.modes()``, the step's cache key)."""

    beta: Any
    eps_low: Any
    eps_high: Any
    gamma: Any
    lam: Any
    value_clip: Any
    dpo_beta: Any
    temperature: Any
    tis_cap: Any

    @classmethod
    def from_config(cls, rl: RLConfig) -> "RLHParams":
        """Host-side (numpy float32 scalars): put on device by the caller, or used as constants."""
        return cls(**{name: np.float32(getattr(rl, name)) for name in RL_NUMBERS})


assert tuple(f.name for f in dataclasses.fields(RLHParams)) == RL_NUMBERS, "RLHParams lists config.RL_NUMBERS"


def _switch(cfg: Config, name: str) -> bool:
    """Whether the ``RL_SWITCHES`` switch ``name`` is on for ``cfg`` (compiled in)."""
    return RL_SWITCHES[name](cfg.rl)


def _hp(cfg: Config, hp: RLHParams | None) -> RLHParams:
    return RLHParams.from_config(cfg.rl) if hp is None else hp


# ----------------------------------------------------------------- per-row extras

@flax.struct.dataclass
class Extras:
    """What ``prepare`` computes once per batch for the μ updates: per-row arrays with the
    batch's leading axis B (split into micro-batches with it). A field an algorithm does
    not use stays None:

    | field      | shape    | set by                                                   |
    | loss_mask  | [B, Tc]  | every algorithm (completion mask minus dropped rows)     |
    | advantages | [B, Tc]  | PPO (GAE), GRPO (group / process)                        |
    | old_logp   | [B, Tc]  | PPO; GRPO at μ > 1, or the sampler's after top-k / top-p |
    |            |          | or rl.async_steps > 0 (without TIS)                      |
    | ref_logp   | [B, Tc]  | DPO; GRPO with β > 0                                     |
    | old_values | [B, Tc]  | PPO (V_ψold, for value clipping)                         |
    | returns    | [B, Tc]  | PPO (GAE targets of V_ψ)                                 |
    """

    loss_mask: Any
    advantages: Any = None
    old_logp: Any = None
    ref_logp: Any = None
    old_values: Any = None
    returns: Any = None


# ----------------------------------------------------------------- shared helpers

def _token_mean_parts(x, mask) -> tuple[jax.Array, jax.Array]:
    return losses.aggregate_parts(x, mask, "token_mean")


def _masked_mean_std(x, mask) -> tuple[jax.Array, jax.Array]:
    m = mask.astype(bool)
    count = jnp.maximum(jnp.sum(m), 1)
    mean = jnp.sum(jnp.where(m, x, 0.0)) / count
    var = jnp.sum(jnp.where(m, jnp.square(x - mean), 0.0)) / count
    return mean, jnp.sqrt(var)


def own_tokens(batch) -> jax.Array:
    """``[B, Tc]`` bool: the completion tokens the policy wrote, the only ones the loss, the KL
    and the entropy read: ``batch.mask`` without the tokens a tool wrote (``batch.tool_mask``,
    None for a rollout without tools). The tool's tokens stay in the context: the forward
    passes read ``batch.mask``."""
    mask = batch.mask.astype(bool)
    return mask if batch.tool_mask is None else mask & ~batch.tool_mask.astype(bool)


def _truncation_mask(batch, cfg: Config) -> jax.Array:
    """The policy's own completion tokens (`own_tokens`), minus truncated rows when
    rl.mask_truncated."""
    mask = own_tokens(batch)
    if cfg.rl.mask_truncated:
        mask = mask & ~batch.truncated.astype(bool)[:, None]
    return mask


def _aggregate_parts(per_token, mask, cfg: Config):
    return losses.aggregate_parts(per_token, mask, cfg.rl.aggregation)


def _kl(logp, ref_logp, cfg: Config):
    return losses.kl_penalty(logp, ref_logp, cfg.rl.kl_estimator)


def _sampler_truncates(cfg: Config) -> bool:
    """Top-k / top-p sampling without TIS: the batch was drawn from a truncated
    distribution, so the sampler's recorded log-probs (not a recomputed π_θ) are π_θold at
    the first update. With rl.tis_cap > 0 the TIS weight corrects for the sampler instead."""
    return _switch(cfg, "truncated_sampling") and not _switch(cfg, "truncated_is")


def _sampler_was_older(cfg: Config) -> bool:
    """rl.async_steps > 0 without TIS: the batch was drawn by the weights of k steps ago,
    so π_θold is the behaviour policy, the sampler's recorded log-probs, at every update
    (a recomputed π_θ would hide the staleness from the ratio and the clip). With
    rl.tis_cap > 0, π_θold is the current π_θ and the TIS weight min(π_θ/π_sampler, C)
    corrects for the older sampler (decoupled PPO)."""
    return _switch(cfg, "stale_sampling") and not _switch(cfg, "truncated_is")


def _common_loss_metrics(algo: "Algorithm", logp, batch, entropy) -> Metrics:
    mask = own_tokens(batch)
    metrics: Metrics = {}
    if entropy is not None:
        metrics["entropy"] = _token_mean_parts(entropy, mask)
    if algo.data_source.sampled:
        gap = jnp.where(mask, jnp.abs(losses.as_float(batch.sample_logprobs) - losses.as_float(logp)), 0.0)
        metrics["logprob_mismatch_max"] = (jnp.max(gap), jnp.asarray(1.0, jnp.float32))
        metrics["logprob_mismatch_mean"] = _token_mean_parts(gap, mask)
    return metrics


def _policy_objective(logp, old_logp, adv, mask, batch, cfg: Config, hp: RLHParams):
    """Per-token policy objective of rl.policy_loss (to be maximised) and its metrics:
    ``clipped`` (PPO/GRPO, ``losses.clipped_surrogate``), ``gspo``
    (``losses.gspo_surrogate``) or ``cispo`` (``losses.cispo_objective``); times the TIS
    weight min(π_θold/π_sampler, rl.tis_cap) when rl.tis_cap > 0 (``losses.tis_weights``).
    The mode is compiled in (a Python branch on cfg); ε and the cap are traced."""
    kind, eps = cfg.rl.policy_loss, dict(eps_low=hp.eps_low, eps_high=hp.eps_high)
    if kind == "gspo":
        objective = losses.gspo_surrogate(logp, old_logp, adv, mask, **eps)
    elif kind == "cispo":
        objective = losses.cispo_objective(logp, old_logp, adv, **eps)
    else:
        objective = losses.clipped_surrogate(logp, old_logp, adv, **eps)
    metrics = _surrogate_metrics(logp, old_logp, adv, mask, hp)
    if _switch(cfg, "truncated_is"):
        weight = losses.tis_weights(old_logp, batch.sample_logprobs, hp.tis_cap)
        objective = objective * weight
        capped = jnp.exp(losses.as_float(old_logp) - losses.as_float(batch.sample_logprobs)) > hp.tis_cap
        metrics["tis_capped_fraction"] = _token_mean_parts(capped.astype(jnp.float32), mask)
    return objective, metrics


# ----------------------------------------------------------------- the interface

@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One row of the unified paradigm table (see the module docstring).

    Attributes read by the trainer: ``name``; ``data_source`` — a
    ``data_sources.DataSource``: what is sampled, how many rows a question takes and how
    the step's batch is built (the SFT data, outputs sampled offline from π_sft or online
    from π_θ, or (o+, o−) pairs from π_sft, row 2p chosen / 2p+1 rejected); ``reward`` — ``'none'``,
    ``'rule'`` or ``'model'``; ``needs_value_model``; ``needs_reference(cfg)``.
    ``micro_batch_unit``: consecutive rows that must stay in one micro-batch.

    Every method taking ``hp`` reads rl.* values from it (``RLHParams.from_config(cfg.rl)``
    when None) and only structure from ``cfg``.
    """

    name: str = ""
    data_source: DataSource = POLICY
    reward: str = "none"
    needs_value_model: bool = False
    micro_batch_unit: int = 1

    # -- structure: what the train step must keep / compute (static)
    def needs_reference(self, cfg: Config) -> bool:
        """Whether a frozen π_ref is kept (and its log-probs computed once per batch)."""
        return False

    def needs_old_logprobs(self, cfg: Config) -> bool:
        """Whether π_θold log-probs are computed once per batch, before the updates.
        With a single update (μ = 1) π_θold = π_θ, so the loss uses stop_gradient(logp)
        instead and saves one forward pass."""
        return False

    def logprob_temperature(self, hp: RLHParams):
        """Temperature of the policy whose log-probs enter the loss. One rule: likelihood
        objectives (SFT, RFT, Online RFT, DPO) train the model's own distribution, T = 1,
        whatever rl.temperature, so RFT is SFT on correct outputs (Eq. 10) and DPO's
        ℓ = log π_θ/π_ref compares the models themselves; importance-ratio objectives
        (PPO, GRPO) override this with the sampling temperature, so that ρ = 1 on-policy."""
        return 1.0

    # -- once per batch
    def prepare(self, state: Any, batch: Any, cfg: Config, hp: RLHParams | None = None, *,
                group_size: int | None = None) -> tuple[Extras, Metrics]:
        """Model outputs that stay fixed during the μ updates, then ``extras_from_logprobs``.

        Forward passes run micro-batch by micro-batch (rl.num_micro_batches), without
        gradients. Returns ``(extras, metrics)``; metrics are full-batch scalars.
        """
        hp = _hp(cfg, hp)
        num, unit = cfg.rl.num_micro_batches, self.micro_batch_unit
        p = getattr(batch, "packing", None)
        ordered = batch if p is None else packing.in_order(batch, p)  # micro-batches as packed
        back = (lambda rows: rows) if p is None else (lambda rows: packing.rows_back(rows, p))
        run = lambda fn: jax.lax.stop_gradient(back(map_micro_batches(fn, ordered, num, unit)))
        logp_kw = dict(temperature=self.logprob_temperature(hp),
                       chunk_size=cfg.rl.logprob_chunk_size)
        old_logp = ref_logp = old_values = None
        if self.needs_old_logprobs(cfg):
            old_logp = run(lambda mb: sequence_logprobs(cfg.model, state.params, mb, **logp_kw))
        if self.needs_reference(cfg):
            if state.ref_params is None:
                raise ValueError(f"{self.name} with this config needs a reference model but "
                                 "state.ref_params is None; build the state with init_train_state(cfg, ...)")
            ref_logp = run(lambda mb: sequence_logprobs(cfg.model, state.ref_params, mb, **logp_kw))
        if self.needs_value_model:
            old_values = run(lambda mb: sequence_values(cfg.model, state.value_params, mb))
        return self.extras_from_logprobs(batch, cfg, hp, group_size=group_size, old_logp=old_logp,
                                         ref_logp=ref_logp, old_values=old_values)

    def extras_from_logprobs(self, batch: Any, cfg: Config, hp: RLHParams | None = None, *,
                             group_size: int | None = None, old_logp=None, ref_logp=None,
                             old_values=None) -> tuple[Extras, Metrics]:
        """Pure part of ``prepare``: per-row extras from the batch and precomputed
        log-probs / values (all ``[B, Tc]``)."""
        return Extras(loss_mask=own_tokens(batch)), {}

    # -- per micro-batch, differentiated
    def loss_parts(self, params: Any, micro_batch: Any, extras: Extras, cfg: Config,
                   hp: RLHParams | None = None, *, value_params: Any = None
                   ) -> tuple[jax.Array, jax.Array, Metrics]:
        """``(numerator, denominator, metrics)`` of the loss on one micro-batch: one model
        forward with chunked log-probs (and the value model's, for PPO), then
        ``loss_parts_from_logprobs``."""
        hp = _hp(cfg, hp)
        logp, entropy = sequence_logprobs(
            cfg.model, params, micro_batch, temperature=self.logprob_temperature(hp),
            chunk_size=cfg.rl.logprob_chunk_size, with_entropy=True,
            keep_probs=cfg.rl.logprob_keep_probs)
        values = None
        if self.needs_value_model:
            values = sequence_values(cfg.model, value_params, micro_batch)
        return self.loss_parts_from_logprobs(logp, micro_batch, extras, cfg, hp, values=values,
                                             entropy=entropy)

    def loss_parts_from_logprobs(self, logp: jax.Array, batch: Any, extras: Extras, cfg: Config,
                                 hp: RLHParams | None = None, *, values=None, entropy=None
                                 ) -> tuple[jax.Array, jax.Array, Metrics]:
        raise NotImplementedError

    def loss_from_logprobs(self, logp: jax.Array, batch: Any, extras: Extras, cfg: Config,
                           hp: RLHParams | None = None, *, values=None) -> jax.Array:
        """numerator / denominator (0 when nothing is valid): the scalar loss of a whole
        batch given its log-probs; what the unified-paradigm tests differentiate."""
        num, den, _ = self.loss_parts_from_logprobs(logp, batch, extras, cfg, hp, values=values)
        return losses.safe_divide(num, den)


# ----------------------------------------------------------------- SFT / RFT

@dataclasses.dataclass(frozen=True)
class SFT(Algorithm):
    """Supervised fine-tuning (DeepSeekMath Eq. 6–7).

    | data source: q, o ~ P_sft (the dataset) | reward: – | GC = 1 |

    loss = aggregate(−log π_θ(o_t|q,o_<t)) over completion tokens (``sequence_mean`` is
    exactly −Eq. 6). Log-probs are the model's own (T = 1), whatever rl.temperature.
    """

    name: str = "sft"
    data_source: DataSource = DATASET
    reward: str = "none"

    def loss_parts_from_logprobs(self, logp, batch, extras, cfg, hp=None, *, values=None,
                                 entropy=None):
        per_token = losses.sft_loss(logp) * self._coefficient(batch)[:, None]
        num, den = _aggregate_parts(per_token, extras.loss_mask, cfg)
        metrics = {"loss": (num, den), "pg_loss": (num, den)}
        metrics.update(_common_loss_metrics(self, logp, batch, entropy))
        return num, den, metrics

    def _coefficient(self, batch) -> jax.Array:
        return jnp.ones(batch.tokens.shape[0], jnp.float32)


@dataclasses.dataclass(frozen=True)
class RFT(SFT):
    """Rejection-sampling fine-tuning (DeepSeekMath Eq. 8–10), offline.

    | data source: q ~ P_sft, o ~ π_sft (sampled once from the SFT model) | reward: rule |
    | GC = 𝕀(o) = 1 if o is correct else 0 |

    loss = aggregate(−𝕀(o) log π_θ(o_t|q,o_<t)): incorrect outputs stay in the
    denominator with zero weight (the expectation is over all sampled outputs).
    ``batch.correct`` carries 𝕀(o); rl.mask_truncated drops truncated outputs. Log-probs
    at T = 1, as SFT's (``Algorithm.logprob_temperature``).
    """

    name: str = "rft"
    data_source: DataSource = SFT_POLICY
    reward: str = "rule"

    def extras_from_logprobs(self, batch, cfg, hp=None, *, group_size=None, old_logp=None,
                             ref_logp=None, old_values=None):
        return Extras(loss_mask=_truncation_mask(batch, cfg)), {}

    def _coefficient(self, batch) -> jax.Array:
        return batch.correct.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class OnlineRFT(RFT):
    """Online rejection-sampling fine-tuning (DeepSeekMath Eq. 10 with online data).

    | data source: q ~ P_sft, o ~ π_θ (sampled from the current policy) | reward: rule |
    | GC = 𝕀(o) = 1 if o is correct else 0 |

    Same loss as RFT; only the data source differs (the trainer samples from π_θ).
    """

    name: str = "online_rft"
    data_source: DataSource = POLICY


# ----------------------------------------------------------------- DPO

@dataclasses.dataclass(frozen=True)
class DPO(Algorithm):
    """Direct preference optimisation (DeepSeekMath Eq. 12–14).

    | data source: q ~ P_sft, o+, o− ~ π_sft (pairs) | reward: rule |
    | GC = ±β σ(β log π_θ(o−)/π_ref(o−) − β log π_θ(o+)/π_ref(o+)) (+ on o+, − on o−) |

    loss per pair = −log σ(β ℓ(o+) − β ℓ(o−)),  ℓ(o) = 1/|o| Σ_t log π_θ(o_t)/π_ref(o_t)
    (Eq. 12's per-token-mean form), averaged over pairs; rows 2p / 2p+1 of a batch are the
    chosen / rejected outputs of pair p, and a pair is never split across micro-batches.
    β = rl.dpo_beta. (Eq. 14 leaves out the constant factor β that autodiff gives.)
    rl.aggregation does not apply: the loss is a mean over pairs. Log-probs at T = 1, for
    π_θ and π_ref alike (``Algorithm.logprob_temperature``).
    """

    name: str = "dpo"
    data_source: DataSource = SFT_POLICY_PAIRS
    reward: str = "rule"
    micro_batch_unit: int = 2

    def needs_reference(self, cfg: Config) -> bool:
        return True

    def extras_from_logprobs(self, batch, cfg, hp=None, *, group_size=None, old_logp=None,
                             ref_logp=None, old_values=None):
        if batch.tokens.shape[0] % 2:
            raise ValueError(f"DPO needs chosen/rejected pairs: an even number of rows, got "
                             f"{batch.tokens.shape[0]}")
        if ref_logp is None:
            raise ValueError("DPO needs reference log-probs")
        return Extras(loss_mask=own_tokens(batch), ref_logp=losses.as_float(ref_logp)), {}

    def loss_parts_from_logprobs(self, logp, batch, extras, cfg, hp=None, *, values=None,
                                 entropy=None):
        hp = _hp(cfg, hp)
        mask = extras.loss_mask
        count = jnp.sum(mask.astype(jnp.float32), axis=1)
        log_ratio = jnp.where(mask, losses.as_float(logp) - extras.ref_logp, 0.0)
        seq = jnp.sum(log_ratio, axis=1) / jnp.maximum(count, 1.0)  # ℓ(o), Eq. 12
        pairs = seq.reshape(-1, 2)
        valid = jnp.all(count.reshape(-1, 2) > 0, axis=1)
        zero = jnp.zeros_like(pairs[:, 0])
        per_pair = losses.dpo_loss(pairs[:, 0], pairs[:, 1], zero, zero, hp.dpo_beta)
        num = jnp.sum(jnp.where(valid, per_pair, 0.0))
        den = jnp.sum(valid).astype(jnp.float32)
        kl = _kl(logp, extras.ref_logp, cfg)
        metrics = {"loss": (num, den), "pg_loss": (num, den), "kl": _token_mean_parts(kl, mask),
                   "dpo_accuracy": (jnp.sum(valid & (pairs[:, 0] > pairs[:, 1])), den)}
        metrics.update(_common_loss_metrics(self, logp, batch, entropy))
        return num, den, metrics


# ----------------------------------------------------------------- PPO / GRPO

def _surrogate_metrics(logp, old_logp, advantages, mask, hp: RLHParams) -> Metrics:
    """clip_fraction, and the spread of the token ratio ρ = π_θ/π_θold: mean and max of
    |ρ − 1| over the loss tokens (the max at the first update, ``MAX_METRICS``), which a
    batch sampled by older weights (rl.async_steps) moves away from 0."""
    clipped = losses.clipped_tokens(logp, old_logp, advantages, eps_low=hp.eps_low,
                                    eps_high=hp.eps_high)
    deviation = jnp.where(mask, jnp.abs(jnp.exp(losses.as_float(logp) - losses.as_float(old_logp)) - 1.0), 0.0)
    return {"clip_fraction": _token_mean_parts(clipped.astype(jnp.float32), mask),
            "ratio_deviation_mean": _token_mean_parts(deviation, mask),
            "ratio_deviation_max": (jnp.max(deviation), jnp.asarray(1.0, jnp.float32))}


@dataclasses.dataclass(frozen=True)
class PPO(Algorithm):
    """Proximal policy optimisation with a value model and GAE (DeepSeekMath Eq. 1–2, 15–18).

    | data source: q ~ P_sft, o ~ π_θ | reward: model | GC = A_t (GAE) |

    prepare: π_θold log-probs and old values V_ψold (and π_ref log-probs if β > 0); per-
    token rewards r_t = r_φ(q,o)·[t last] − β log(π_θold(o_t)/π_ref(o_t)) (Eq. 2,
    ``advantages.ppo_token_rewards``); A, R = GAE(γ = rl.gamma, λ = rl.lam); optional
    whitening of A over the batch's loss tokens (rl.whiten_advantages).
    loss = aggregate(−min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) + ½(V_ψ − R)²
    [clipped around V_ψold by rl.value_clip, 0 = off]); the value model V_ψ has its own
    parameters and AdamW and is trained in the same step: the two terms share no
    parameter, so no value-loss coefficient is needed (Adam would cancel it); the value
    model's step size is optimizer.value_lr_scale × peak_lr. rl.kl_estimator does not
    apply (the penalty is Eq. 2's log-ratio inside the reward); the ``kl`` metric is its
    token mean. adv_mean / adv_std describe the advantages that enter the loss.
    """

    name: str = "ppo"
    data_source: DataSource = POLICY
    reward: str = "model"
    needs_value_model: bool = True

    def needs_reference(self, cfg: Config) -> bool:
        return _switch(cfg, "kl_penalty")

    def logprob_temperature(self, hp):
        return hp.temperature

    def needs_old_logprobs(self, cfg: Config) -> bool:
        return True  # the KL part of the reward is computed from π_θold

    def extras_from_logprobs(self, batch, cfg, hp=None, *, group_size=None, old_logp=None,
                             ref_logp=None, old_values=None):
        hp = _hp(cfg, hp)
        if old_logp is None or old_values is None:
            raise ValueError("PPO needs old log-probs and old values")
        mask = own_tokens(batch)  # GAE steps from one of the policy's tokens to the next
        loss_mask = _truncation_mask(batch, cfg)
        old_logp, old_values = losses.as_float(old_logp), losses.as_float(old_values)
        ref = losses.as_float(ref_logp) if (self.needs_reference(cfg) and ref_logp is not None) else old_logp
        token_rewards = adv_lib.ppo_token_rewards(batch.rewards, old_logp, ref, mask, hp.beta)
        advantages, returns = adv_lib.gae(token_rewards, old_values, mask, gamma=hp.gamma,
                                          lam=hp.lam)
        if cfg.rl.whiten_advantages:
            advantages = adv_lib.whiten(advantages, loss_mask)
        advantages = jnp.where(loss_mask, advantages, 0.0)
        adv_mean, adv_std = _masked_mean_std(advantages, loss_mask)
        kl_num, kl_den = _token_mean_parts(old_logp - ref, loss_mask)
        metrics = {"adv_mean": adv_mean, "adv_std": adv_std,
                   "kl": losses.safe_divide(kl_num, kl_den),
                   "return_mean": _masked_mean_std(returns, loss_mask)[0],
                   "value_mean": _masked_mean_std(old_values, loss_mask)[0]}
        # The KL reward compares the policies themselves; the ratio's π_θold is the
        # distribution the batch was drawn from (the sampler's, after top-k / top-p or
        # by older weights).
        ratio_old = losses.as_float(batch.sample_logprobs) if _sampler_truncates(cfg) or _sampler_was_older(cfg) \
            else old_logp
        extras = Extras(loss_mask=loss_mask, advantages=advantages, returns=returns,
                        old_values=old_values, old_logp=ratio_old)
        return extras, metrics

    def loss_parts_from_logprobs(self, logp, batch, extras, cfg, hp=None, *, values=None,
                                 entropy=None):
        hp = _hp(cfg, hp)
        if values is None:
            raise ValueError("PPO's loss needs the value model's values")
        mask = extras.loss_mask
        adv, old_logp = extras.advantages, extras.old_logp
        surrogate, policy_metrics = _policy_objective(logp, old_logp, adv, mask, batch, cfg, hp)
        args = (values, extras.old_values, extras.returns, mask)
        vloss = losses.value_loss(*args, clip_eps=hp.value_clip if _switch(cfg, "value_clipping") else None)
        num, den = _aggregate_parts(-surrogate + vloss, mask, cfg)
        pg_num, _ = _aggregate_parts(-surrogate, mask, cfg)
        v_num, _ = _aggregate_parts(vloss, mask, cfg)
        metrics = {"loss": (num, den), "pg_loss": (pg_num, den), "value_loss": (v_num, den)}
        metrics.update(policy_metrics)
        metrics.update(_common_loss_metrics(self, logp, batch, entropy))
        return num, den, metrics


def _process_groups_vary(step_mask, step_rewards) -> jax.Array:
    """[P] bool: whether a group's valid step rewards vary (as ``process_advantages``)."""
    valid = step_mask.astype(bool)
    r = losses.as_float(step_rewards)
    hi = jnp.max(jnp.where(valid, r, -jnp.inf), axis=(1, 2))
    lo = jnp.min(jnp.where(valid, r, jnp.inf), axis=(1, 2))
    return (jnp.sum(valid, axis=(1, 2)) > 1) & (hi != lo)


@dataclasses.dataclass(frozen=True)
class GRPO(Algorithm):
    """Group relative policy optimisation (DeepSeekMath Eq. 3–4, 19–21).

    | data source: q ~ P_sft, {o_i} ~ π_θ | reward: model | GC = Â_i,t + β(π_ref/π_θ − 1) |

    J = 1/G Σ_i 1/|o_i| Σ_t [ min(ρ Â, clip(ρ, 1−ε_low, 1+ε_high) Â) − β D_KL[π_θ‖π_ref] ]
    with D_KL the k3 estimator π_ref/π_θ − log(π_ref/π_θ) − 1 (rl.kl_estimator: k1, k2, k3)
    and aggregation rl.aggregation (sequence_mean is the paper's). Advantages, once per
    batch: outcome supervision Â_i,t = (r_i − mean r)/(std r + eps) over the G outputs of a
    question (rl.scale_by_std=false: r_i − mean r, Dr. GRPO); process supervision
    Â_i,t = Σ_{index(j) ≥ t} r̃_i^index(j) (without std scaling: the step rewards are only
    centred). rl.skip_zero_variance_groups drops groups whose rewards are all equal from
    the loss (and its denominator; DAPO dynamic sampling); rl.mask_truncated drops outputs
    that hit max_new_tokens. β = 0 keeps no reference model at all; μ = 1 computes no
    separate π_θold forward (ρ = exp(logp − stop_gradient(logp))), except after top-k /
    top-p sampling, where π_θold is the sampler's recorded log-prob of the truncated
    distribution it drew from (so ρ = π_θ / π_sampler); with rl.async_steps > 0 (and no
    TIS) it is the sampler's at every μ, the weights of k steps ago being the behaviour
    policy.

    Variants (compiled in): rl.advantage_estimator = grpo (above) | rloo
    (``advantages.rloo_advantages``) | reinforce_pp (``advantages.reinforce_pp_advantages``);
    rl.policy_loss = clipped (above) | gspo (``losses.gspo_surrogate``) | cispo
    (``losses.cispo_objective``); rl.tis_cap > 0 multiplies the policy term by
    ``losses.tis_weights`` (π_θold against the sampler's log-probs).
    """

    name: str = "grpo"
    data_source: DataSource = POLICY
    reward: str = "model"

    def needs_reference(self, cfg: Config) -> bool:
        return _switch(cfg, "kl_penalty")

    def logprob_temperature(self, hp):
        return hp.temperature

    def needs_old_logprobs(self, cfg: Config) -> bool:
        return cfg.rl.num_updates > 1 and not _sampler_was_older(cfg)

    def group_advantages(self, batch, cfg: Config, group_size: int):
        """(advantages [B, Tc], group varies [P]) from outcome rewards (rl.advantage_estimator,
        rl.scale_by_std) or process rewards (rl.supervision=process)."""
        rows, tc = batch.tokens.shape
        if group_size < 1 or rows % group_size:
            raise ValueError(f"GRPO batch of {rows} rows is not a whole number of groups of "
                             f"{group_size} outputs")
        num_p, rl = rows // group_size, cfg.rl
        if rl.supervision == "process":
            shape = (num_p, group_size, batch.step_rewards.shape[1])
            step_rewards = losses.as_float(batch.step_rewards).reshape(shape)
            step_mask = batch.step_mask.astype(bool).reshape(shape)
            adv = adv_lib.process_advantages(
                step_rewards, batch.step_end.astype(jnp.int32).reshape(shape), step_mask, tc,
                scale_by_std=rl.scale_by_std)
            return adv.reshape(rows, tc), _process_groups_vary(step_mask, step_rewards)
        rewards = losses.as_float(batch.rewards).reshape(num_p, group_size)
        if rl.advantage_estimator == "rloo":
            outcome = adv_lib.rloo_advantages(rewards)
        elif rl.advantage_estimator == "reinforce_pp":
            outcome = adv_lib.reinforce_pp_advantages(rewards)
        else:
            outcome = adv_lib.group_relative_advantages(rewards, scale_by_std=rl.scale_by_std)
        adv = jnp.broadcast_to(outcome.reshape(rows, 1), (rows, tc))
        return adv, adv_lib.nonconstant_groups(rewards)

    def extras_from_logprobs(self, batch, cfg, hp=None, *, group_size=None, old_logp=None,
                             ref_logp=None, old_values=None):
        group_size = cfg.rl.group_size if group_size is None else group_size
        adv, varies = self.group_advantages(batch, cfg, group_size)
        kept = varies if cfg.rl.skip_zero_variance_groups else jnp.ones_like(varies)
        loss_mask = _truncation_mask(batch, cfg) & jnp.repeat(kept, group_size)[:, None]
        adv = jnp.where(loss_mask, adv, 0.0)
        adv_mean, adv_std = _masked_mean_std(adv, loss_mask)
        metrics = {"adv_mean": adv_mean, "adv_std": adv_std,
                   "groups_varying_fraction": jnp.mean(varies.astype(jnp.float32)),
                   "groups_kept_fraction": jnp.mean(kept.astype(jnp.float32))}
        if old_logp is None and (_sampler_truncates(cfg) or _sampler_was_older(cfg)):
            old_logp = batch.sample_logprobs
        if self.needs_reference(cfg) and ref_logp is None:
            raise ValueError("GRPO with rl.beta > 0 needs reference log-probs")
        extras = Extras(loss_mask=loss_mask, advantages=adv,
                        old_logp=None if old_logp is None else losses.as_float(old_logp),
                        ref_logp=losses.as_float(ref_logp) if self.needs_reference(cfg) else None)
        return extras, metrics

    def loss_parts_from_logprobs(self, logp, batch, extras, cfg, hp=None, *, values=None,
                                 entropy=None):
        hp = _hp(cfg, hp)
        mask, adv = extras.loss_mask, extras.advantages
        old_logp = extras.old_logp
        if old_logp is None:  # μ = 1: π_θold = π_θ
            old_logp = jax.lax.stop_gradient(logp)
        surrogate, policy_metrics = _policy_objective(logp, old_logp, adv, mask, batch, cfg, hp)
        per_token = -surrogate
        metrics: Metrics = {}
        if self.needs_reference(cfg):
            kl = _kl(logp, extras.ref_logp, cfg)
            per_token = per_token + hp.beta * kl
            metrics["kl"] = _token_mean_parts(kl, mask)
        num, den = _aggregate_parts(per_token, mask, cfg)
        pg_num, _ = _aggregate_parts(-surrogate, mask, cfg)
        metrics.update({"loss": (num, den), "pg_loss": (pg_num, den)})
        metrics.update(policy_metrics)
        metrics.update(_common_loss_metrics(self, logp, batch, entropy))
        return num, den, metrics


# ----------------------------------------------------------------- registry

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (SFT(), RFT(), OnlineRFT(), DPO(), PPO(), GRPO())}


def get_algorithm(name: str) -> Algorithm:
    """The algorithm registered under ``name`` (rl.algorithm); ValueError lists the names."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; known algorithms: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


def algorithm_of(cfg: Config) -> Algorithm:
    """The algorithm a run of ``cfg`` trains with (rl.algorithm)."""
    return get_algorithm(cfg.rl.algorithm)
