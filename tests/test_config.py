"""Presets validate; bad keys, types and values fail with messages that name them."""

import argparse
import dataclasses
import re

import pytest

from grpo_jax import config
from grpo_jax.config import ConfigError


@pytest.mark.parametrize("name", sorted(config.PRESETS))
def test_every_preset_validates(name):
    cfg = config.load_config(name)
    assert isinstance(cfg, config.Config)


def test_paper_recipe_preset_holds_the_paper_numbers():
    cfg = config.load_config("deepseekmath-rl-7b")
    assert (cfg.optimizer.peak_lr, cfg.rl.beta, cfg.rl.group_size, cfg.rl.max_new_tokens,
            cfg.data.batch_size, cfg.rl.num_updates, cfg.rl.kl_estimator) == (1e-6, 0.04, 64, 1024, 1024, 1, "k3")
    assert (cfg.optimizer.b1, cfg.optimizer.b2, cfg.optimizer.weight_decay) == (0.9, 0.95, 0.1)


@pytest.mark.parametrize("preset, changes", [
    ("deepseekmath-rl-7b-v5p-128", ["model.remat=none", "rl.sample_prompts=64", "rl.kv_dtype=int8",
                                    "rl.decode_phases=16", "rl.pack=true"]),
    ("deepseekmath-rl-7b-v4-32", ["rl.sample_prompts=8", "rl.kv_dtype=int8", "rl.num_micro_batches=1024"]),
    ("deepseekmath-rl-7b-v5litepod-256", ["model.remat=dots", "rl.sample_prompts=64", "rl.kv_dtype=int8"]),
])
def test_a_slices_preset_is_the_recipe_with_its_speed_settings_only(preset, changes):
    """Everything the paper fixes stays; only how the step runs on the slice changes."""
    fast, recipe = config.load_config(preset), config.load_config("deepseekmath-rl-7b")
    assert fast == config.apply_overrides(recipe, changes + [f"run.run_dir=runs/{preset}"])


# Qwen2.5-1.5B-Instruct's config.json (the fields the importer reads).
QWEN2_5_1_5B_JSON = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
    "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "sliding_window": 32768}


def test_qwen_preset_is_the_imported_shape_with_the_paper_recipe():
    import dataclasses

    import jax
    import numpy as np

    from grpo_jax.model import transformer as model_lib
    from grpo_jax.model import pretrained

    cfg = config.load_config("qwen2.5-1.5b")
    imported = pretrained.config_from_hf(QWEN2_5_1_5B_JSON)
    # Runtime fields (dtype, remat, max_seq_len, ...) are the preset's choice for TPU
    # training; every other field must be what loading the checkpoint would give.
    runtime = dataclasses.replace(imported, **{k: getattr(cfg.model, k) for k in pretrained.RUNTIME_FIELDS})
    assert cfg.model == runtime
    assert (cfg.model.dtype, cfg.model.param_dtype, cfg.model.remat) == ("bfloat16", "float32", "full")
    assert (cfg.optimizer.peak_lr, cfg.rl.beta, cfg.rl.kl_estimator, cfg.rl.num_updates,
            cfg.data.task, cfg.rl.sample_dtype) == (1e-6, 0.04, "k3", 1, "gsm8k", "bfloat16")
    assert cfg.rl.group_size >= 16
    # By hand: tied 151936 x 1536 embedding; per layer q (1536x1536 + 1536 bias), k and v
    # (1536x256 + 256 each: 2 kv heads x 128), o (1536x1536), gate/up/down (3 x 1536x8960)
    # and two 1536 norms; the final norm.
    layer = (1536 * 1536 + 1536) + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960 + 2 * 1536
    expected = 151936 * 1536 + 28 * layer + 1536
    assert expected == 1_543_714_304
    shapes = model_lib.param_shapes(cfg.model)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == expected


def test_overrides_are_typed_and_applied_in_order():
    cfg = config.load_config("cpu-tiny", ["model.num_layers=4", "rl.group_size=8", "rl.beta=0",
                                          "rl.scale_by_std=false", "run.run_dir=/tmp/x", "rl.group_size=4"])
    assert cfg.model.num_layers == 4 and cfg.rl.group_size == 4 and cfg.rl.beta == 0.0
    assert cfg.rl.scale_by_std is False and cfg.run.run_dir == "/tmp/x"
    assert isinstance(cfg.rl.beta, float)


@pytest.mark.parametrize("override,message", [
    ("model.nmu_layers=4", "unknown config key 'model.nmu_layers'"),
    ("modle.num_layers=4", "unknown config key 'modle.num_layers'"),
    ("model.num_layers=four", "model.num_layers expects int, got 'four'"),
    ("rl.scale_by_std=maybe", "rl.scale_by_std expects bool"),
    ("rl.algorithm=reinforce", "rl.algorithm='reinforce' is not one of"),
    ("model.num_heads=5", "multiple of model.num_kv_heads=2"),
    ("rl.temperature=-1", "rl.temperature must be >= 0"),
    ("rl.group_size=0", "rl.group_size must be >= 1"),
    ("rl.decode_phases=0", "rl.decode_phases must be >= 1"),
    ("rl.pack=sometimes", "rl.pack expects bool"),
    ("rl.group_size=1", "group_size=1 with rl.scale_by_std=true"),
    ("mesh.ici_data=-1", "at most one ICI axis may be -1"),
    ("rl.max_new_tokens=1000", "leaves no room"),
    ("data.slip=sometimes", "data.slip='sometimes' is not one of"),
    ("num_layers", "not of the form section.field=value"),
    ("run.eval_every=-1", "run.eval_every must be >= 0 (0: never), got -1"),
    ("run.checkpoint_every=-2", "run.checkpoint_every must be >= 0 (0: never), got -2"),
    ("run.log_every=0", "run.log_every must be >= 1, got 0"),
])
def test_bad_overrides_fail_clearly(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.load_config("cpu-tiny", [override])


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="cpu-tiny"):
        config.load_config("gpt-5")


def test_json_round_trip_and_argparse():
    cfg = config.load_config("smollm2-135m", ["rl.beta=0.1"])
    again = config.Config.from_dict(cfg.to_dict()).validate()
    assert again == cfg
    parser = argparse.ArgumentParser()
    config.add_config_args(parser)
    args = parser.parse_args(["--preset", "cpu-tiny", "rl.group_size=16"])
    assert config.config_from_args(args).rl.group_size == 16
    with pytest.raises(ConfigError, match="expects int"):
        config.Config.from_dict({"model": {"num_layers": "x"}})


def test_choice_lists_are_the_implementations():
    # config keeps the names jax-free; the modules that implement them must offer exactly those.
    from grpo_jax.rl import algorithms, losses
    from grpo_jax.parallel import sharding

    assert tuple(algorithms.ALGORITHMS) == config.ALGORITHM_NAMES
    assert losses.KL_KINDS is config.KL_KINDS and losses.AGGREGATION_MODES is config.AGGREGATION_MODES
    assert tuple(sharding.DTYPES) == config.DTYPE_NAMES
    for name in config.ALGORITHM_NAMES:
        config.load_config("cpu-tiny", [f"rl.algorithm={name}"])
    with pytest.raises(config.ConfigError, match="rl.algorithm"):
        config.load_config("cpu-tiny", ["rl.algorithm=reinforce"])


def test_every_section_is_frozen_and_variants_are_new_configs():
    """What `validate` checked is what runs: no section can change after it; a variant is a
    new Config (overrides and `Config.replace`), the original untouched."""
    cfg = config.load_config("cpu-tiny")
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        name = dataclasses.fields(value)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, getattr(value, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rl = config.RLConfig()
    other = config.apply_overrides(cfg, ["rl.beta=0.5"])
    assert other.rl.beta == 0.5 and cfg.rl.beta == 0.04 and other.model is cfg.model
    small = cfg.replace(rl={"beta": 0.0, "group_size": 4}, model=config.ModelConfig(num_layers=1))
    assert (small.rl.beta, small.rl.group_size, small.model.num_layers) == (0.0, 4, 1)
    assert small.rl.kl_estimator == cfg.rl.kl_estimator and cfg.rl.group_size == 8
    assert hash(small) != hash(cfg) and config.Config.from_dict(small.to_dict()) == small


def test_rl_fields_have_one_role_and_the_tables_derive_from_it():
    """Each rl.* field is a mode (compiled in), a number (RLHParams data) or a sampling
    setting; RLHParams holds exactly the numbers, RLModes the modes plus the switches, and
    the reader table names a field only when some algorithm ignores it."""
    from grpo_jax.rl import algorithms

    fields = dataclasses.fields(config.RLConfig)
    roles = {f.name: f.metadata["role"] for f in fields}
    assert set(roles.values()) == {"mode", "number", "sampling"}
    assert [f.name for f in dataclasses.fields(algorithms.RLHParams)] == [n for n, r in roles.items() if r == "number"]
    modes = config.RLConfig().modes()
    assert [f.name for f in dataclasses.fields(modes)] == (
        [n for n, r in roles.items() if r == "mode"] + list(config.RL_SWITCHES))
    assert hash(modes) == hash(config.RLConfig(beta=0.5, temperature=0.7).modes())
    assert config.RLConfig(beta=0.0).modes().kl_penalty is False and modes.kl_penalty is True
    assert config.RLConfig(top_p=0.9).modes() != modes and config.RLConfig().modes(group_size=4).group_size == 4
    assert config.RL_READERS["gamma"] == ("ppo",) and "max_new_tokens" not in config.RL_READERS
    assert all(set(r) < set(config.ALGORITHM_NAMES) for r in config.RL_READERS.values())
