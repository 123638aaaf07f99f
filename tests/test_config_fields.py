"""Every config field changes the run for at least one algorithm, or is refused (issue 18, 6).

For each field, a cheap deterministic probe of what the field feeds (the loss, gradient
and metrics of the chosen algorithm on a fixed tiny batch of log-probs; the compiled
step's static key; the optimiser's applied updates; the model's parameter shapes and
logits; the mesh shape; the task's examples) is computed at the default and at another
value; the two must differ, or ``Config.validate`` must refuse the value. Fields whose
only effect is on the loop's bookkeeping are listed in ``ELSEWHERE`` with the test that
shows their effect, and the walk checks that those tests exist.
"""

import dataclasses
import os
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import algorithms as alg
from grpo_jax.config import Config, ConfigError, ConfigWarning, apply_overrides
from grpo_jax.rl.batching import make_batch
from grpo_jax.rl.train_step import static_config_key

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, TC, G = 8, 6, 4

# field -> (other value, algorithm it is probed with, extra overrides for both runs)
CHANGES = {
    "rl.algorithm": ("sft", "grpo", {}),
    "rl.group_size": (2, "grpo", {}),
    "rl.beta": (0.5, "grpo", {}),
    "rl.kl_estimator": ("k1", "grpo", {}),
    "rl.eps_low": (0.01, "grpo", {"rl.num_updates": 2}),
    "rl.eps_high": (0.01, "grpo", {"rl.num_updates": 2}),
    "rl.num_updates": (2, "grpo", {}),
    "rl.scale_by_std": (False, "grpo", {}),
    "rl.supervision": ("process", "grpo", {}),
    "rl.skip_zero_variance_groups": (True, "grpo", {}),
    "rl.mask_truncated": (True, "grpo", {}),
    "rl.aggregation": ("token_mean", "grpo", {}),
    "rl.gamma": (0.5, "ppo", {}),
    "rl.lam": (0.5, "ppo", {}),
    "rl.value_clip": (0.0, "ppo", {}),
    "rl.whiten_advantages": (False, "ppo", {}),
    "rl.dpo_beta": (1.0, "dpo", {}),
    "rl.temperature": (0.7, "grpo", {}),
    "rl.top_k": (5, "grpo", {}),
    "rl.top_p": (0.9, "grpo", {}),
    "rl.num_micro_batches": (2, "grpo", {}),
    "rl.logprob_chunk_size": (16, "grpo", {}),
    "rl.logprob_keep_probs": (True, "grpo", {}),  # same values; test_train_step shows the program
    "rl.pack": (True, "grpo", {}),  # same values; test_packing shows the same step from fewer rows
    "rl.advantage_estimator": ("rloo", "grpo", {}),
    "rl.policy_loss": ("cispo", "grpo", {}),
    "rl.tis_cap": (0.5, "grpo", {}),
    "rl.async_steps": (1, "grpo", {}),  # the sampler's log-probs become π_θold; test_async_steps shows the loop
    "optimizer.peak_lr": (0.5, "grpo", {}),
    "optimizer.warmup_steps": (3, "grpo", {}),
    "optimizer.schedule": ("constant", "grpo", {}),
    "optimizer.b1": (0.5, "grpo", {}),
    "optimizer.b2": (0.5, "grpo", {}),
    "optimizer.eps": (1e-2, "grpo", {}),
    "optimizer.weight_decay": (0.5, "grpo", {}),
    "optimizer.grad_clip": (0.1, "grpo", {}),
    "optimizer.grad_accum_steps": (2, "grpo", {}),
    "optimizer.value_lr_scale": (0.5, "ppo", {}),
    "run.steps": (20, "grpo", {}),
    "model.vocab_size": (256, "grpo", {}),
    "model.embed_dim": (64, "grpo", {}),
    "model.num_layers": (1, "grpo", {}),
    "model.num_heads": (2, "grpo", {}),
    "model.num_kv_heads": (1, "grpo", {}),
    "model.head_dim": (16, "grpo", {}),
    "model.mlp_dim": (64, "grpo", {}),
    "model.rope_theta": (100.0, "grpo", {}),
    "model.rope_scaling_factor": (4.0, "grpo", {}),
    "model.rms_eps": (0.5, "grpo", {}),
    "model.tie_embeddings": (False, "grpo", {}),
    "model.attention_bias": (True, "grpo", {}),
    "model.max_seq_len": (32, "grpo", {"rl.max_new_tokens": 32}),
    "model.dtype": ("bfloat16", "grpo", {}),
    "model.param_dtype": ("bfloat16", "grpo", {}),
    "model.scan_layers": (False, "grpo", {}),
    "model.remat": ("full", "grpo", {}),
    "model.unembed_dtype": ("bfloat16", "grpo", {}),
    "model.lora_rank": (8, "grpo", {}),
    "model.lora_alpha": (32.0, "grpo", {"model.lora_rank": 8}),
    "model.lora_targets": ("q,v", "grpo", {"model.lora_rank": 8}),
    "mesh.ici_data": (2, "grpo", {}),
    "mesh.ici_fsdp": (2, "grpo", {"mesh.ici_data": 2}),
    "mesh.ici_tensor": (2, "grpo", {}),
    "mesh.dcn_data": (2, "grpo", {}),
    "mesh.dcn_fsdp": (2, "grpo", {}),
    "mesh.dcn_tensor": (2, "grpo", {}),
    "mesh.slice": ("v4-8", "grpo", {}),
    "data.task": ("countdown", "grpo", {}),
    "data.batch_size": (3, "grpo", {}),
    "data.num_operands": (4, "grpo", {}),
    "data.max_digits": (3, "grpo", {}),
    "data.eval_size": (3, "grpo", {}),
    "data.wrong_step_prob": (0.9, "grpo", {}),
    "data.slip": ("carry", "grpo", {}),
    "data.min_carries": (2, "grpo", {}),
    "data.modulus": (11, "grpo", {"data.task": "modular"}),
    "data.num_subtractions": (3, "grpo", {"data.task": "modular"}),
    "data.tool_prob": (0.5, "grpo", {"data.task": "modular"}),
    "data.seed": (5, "grpo", {}),
    "data.skip_bad_rows": (True, "grpo", {}),  # refused (warned) for the generated default task
}

# Fields that act on the loop (sampling length, files, logging cadence): the test that shows it.
ELSEWHERE = {
    "rl.max_new_tokens": "sampler/test_sampling.py::test_rollout_layout",
    "rl.max_tool_calls": "rl/test_tool_rollouts.py::test_grpo_trains_on_rollouts_that_call_the_tool",
    "rl.tool_workers": "rl/test_tool_rollouts.py::test_rl_tool_workers_sizes_the_runs_sandbox_pool",
    "rl.tool_backend_stop_share":
        "rl/test_tool_rollouts.py::test_the_stop_threshold_is_a_share_of_a_steps_calls_for_some_steps_in_a_row",
    "rl.tool_backend_stop_steps": "rl/test_tool_rollouts.py::test_a_backend_failing_on_every_call_stops_the_run_with_one_line",
    "rl.reward_model": "rl/test_options.py::test_reward_model_with_a_rule_reward_algorithm_is_refused",
    "rl.sample_prompts": "rl/test_trainer.py::test_rollout_in_calls_of_a_few_questions_equals_one_call",
    "rl.sample_dtype": "rl/test_trainer.py::test_bfloat16_sampling_copy_reaches_the_sampler",
    "rl.decode": "rl/test_programs.py::test_the_trainer_runs_the_programs_the_aot_check_lowers",
    "rl.kv_dtype": "rl/test_programs.py::test_the_trainer_samples_with_rl_kv_dtype_and_decode_phases",
    "rl.decode_phases": "rl/test_programs.py::test_the_trainer_samples_with_rl_kv_dtype_and_decode_phases",
    "rl.decode_slots": "rl/test_trainer.py::test_the_slot_engine_trains_on_the_static_engines_rows",
    "mesh.sample_tensor": "parallel/test_sharding.py::test_sample_mesh_tensor_degree",
    "mesh.sample_devices": "parallel/test_split_mesh.py::test_the_split_loop_trains_what_the_one_mesh_loop_trains",
    "model.attention": "model/test_splash.py::test_train_step_with_splash_compiles_for_a_tpu",
    "data.data_dir": "tasks/test_tasks_datasets.py::test_gsm8k_examples",
    "data.format_reward": "tasks/test_tasks_arithmetic.py::test_format_reward_from_the_config_is_the_wrong_answers_reward",
    "run.run_dir": "rl/test_trainer.py::test_kill_and_resume_matches_an_uninterrupted_run",
    "run.seed": "rl/test_trainer.py::test_kill_and_resume_matches_an_uninterrupted_run",
    "run.checkpoint_every": "rl/test_trainer.py::test_kill_and_resume_matches_an_uninterrupted_run",
    "run.keep_checkpoints": "checkpoints/test_checkpointing.py::test_keep_last_n_and_corrupted_latest_falls_back",
    "run.eval_every": "eval/test_evaluation.py",
    "run.log_every": "rl/test_trainer.py::test_grpo_reward_goes_up",
    "run.max_bad_steps": "rl/test_trainer.py::test_non_finite_updates_are_skipped_then_stop_the_run",
    "run.restart_unreadable": "rl/test_trainer.py::test_every_checkpoint_unreadable_stops_or_starts_over",
    "run.allow_config_changes": "cli/test_resume_changes.py::test_a_changed_resume_is_refused_allowed_and_recorded_then_shown_by_grpo_evaluate",
    "run.pretrained": "model/test_pretrained.py",
    "run.chat_format": "text/test_chat_templates.py::test_a_named_format_is_used_trained_and_exported",
}


def _all_fields():
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
            for f in dataclasses.fields(s.type if not isinstance(s.type, str) else
                                        type(getattr(Config(), s.name)))]


def _batch():
    rng = np.random.default_rng(0)
    lens = rng.integers(2, TC + 1, B)
    lens[0] = TC
    mask = np.arange(TC)[None] < lens[:, None]
    rewards = rng.normal(size=B)
    rewards[:G] = 1.0  # one zero-variance group
    return make_batch(np.ones((B, 2), np.int32), np.ones((B, 2), bool), rng.integers(0, 50, (B, TC)),
                      mask, sample_logprobs=np.where(mask, -rng.uniform(0.1, 3, (B, TC)), 0.0),
                      rewards=rewards, correct=rng.random(B) < 0.5, truncated=lens == TC,
                      step_rewards=rng.normal(size=(B, 3)),
                      step_end=np.sort(rng.integers(0, TC, (B, 3)), axis=1),
                      step_mask=rng.random((B, 3)) < 0.8)


def _loss_probe(cfg, field):
    batch, rng = _batch(), np.random.default_rng(1)
    noisy = lambda: jnp.asarray(np.where(batch.mask, -rng.uniform(0.1, 3, batch.mask.shape), 0.0),
                                jnp.float32)
    logp, old, ref, values, old_values = noisy(), noisy(), noisy(), noisy(), noisy()
    algo = alg.get_algorithm(cfg.rl.algorithm)
    hp = alg.RLHParams.from_config(cfg.rl)
    extras, prep = algo.extras_from_logprobs(
        batch, cfg, hp, old_logp=old if algo.needs_old_logprobs(cfg) else None,
        ref_logp=ref if algo.needs_reference(cfg) else None,
        old_values=old_values if algo.needs_value_model else None)

    def loss(lp, v):
        num, den, metrics = algo.loss_parts_from_logprobs(lp, batch, extras, cfg, hp, values=v)
        return num / den, metrics

    (value, metrics), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        logp, values if algo.needs_value_model else None)
    out = [float(value), float(algo.logprob_temperature(hp))]
    out += [float(np.sum(np.abs(np.asarray(g)))) for g in jax.tree.leaves(grads)]
    out += [float(v) for v in jax.tree.leaves((prep, metrics))]
    return out


def _optimizer_probe(cfg, field):
    from grpo_jax.rl.optimizer import make_optimizer, value_optimizer_config

    opt = value_optimizer_config(cfg.optimizer) if cfg.rl.algorithm == "ppo" else cfg.optimizer
    tx, lr = make_optimizer(opt, cfg.run.steps, updates_per_step=cfg.rl.num_updates)
    params = {"w": jnp.ones((2, 2)), "norm": jnp.ones(2)}
    state, out = tx.init(params), []
    for i in range(4):
        grads = {"w": jnp.full((2, 2), 0.3 * (i + 1)), "norm": jnp.full(2, -0.2)}
        updates, state = tx.update(grads, state, params)
        params = jax.tree.map(jnp.add, params, updates)
        out.append(np.asarray(params["w"]).ravel().tolist())
    return out, [float(lr(n)) for n in range(0, 3 * cfg.run.steps, 3)]


NUMERIC_MODEL_FIELDS = ("model.rope_theta", "model.rope_scaling_factor", "model.rms_eps",
                        "model.dtype", "model.remat", "model.unembed_dtype")


def _model_probe(cfg, field):
    from grpo_jax.model import transformer as model_lib

    shapes = jax.tree.map(lambda s: (s.shape, str(s.dtype)), model_lib.param_shapes(cfg.model))
    if field.startswith("model.lora_"):  # the adapters' shapes and the merged weights
        from grpo_jax.model import lora

        adapters = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), lora.adapter_shapes(cfg.model))
        merged = lora.merge(model_lib.init_params(cfg.model, jax.random.key(0)), adapters, cfg.model)
        return (jax.tree.map(lambda x: x.shape, adapters),
                [float(jnp.sum(x)) for x in jax.tree.leaves(merged)])
    if field not in NUMERIC_MODEL_FIELDS:  # the parameter shapes show the others
        return shapes
    params = model_lib.init_params(cfg.model, jax.random.key(0))
    tokens = jnp.arange(1, 9, dtype=jnp.int32)[None] % cfg.model.vocab_size
    f = lambda p: jnp.sum(model_lib.forward_logits(cfg.model, p, tokens))
    if field == "model.remat":  # same values by design; the program differs
        return str(jax.make_jaxpr(jax.grad(f))(params)).count("remat")
    return shapes, float(f(params))


def _mesh_probe(cfg, field):
    from grpo_jax.parallel.sharding import resolve_mesh_shape

    try:
        return resolve_mesh_shape(cfg.mesh, 8)
    except Exception as e:  # a mesh that cannot be built is refused at start-up
        return ("refused", type(e).__name__)


def _data_probe(cfg, field):
    from grpo_jax.cli.runs import make_task

    task = make_task(cfg.data.task, cfg.data)
    d = cfg.data
    train = [ex.prompt for ex in task.examples("train", d.batch_size, d.seed)]
    test = [ex.prompt for ex in task.examples("test", d.eval_size, d.seed)]
    sft = []
    if hasattr(task, "sft_examples"):
        sft = [t for _, t in task.sft_examples("train", 8, d.seed, wrong_step_prob=d.wrong_step_prob)]
    return train, test, sft


SECTION_PROBES = {"rl": (_loss_probe,), "optimizer": (_optimizer_probe,), "run": (_optimizer_probe,),
                  "model": (_model_probe,), "mesh": (_mesh_probe,), "data": (_data_probe,)}


def _config(algorithm, extra, field=None, value=None):
    settings = {"rl.algorithm": algorithm}
    if algorithm != "sft":  # SFT samples nothing: a group size would be an unread option
        settings["rl.group_size"] = G
    settings.update(extra)
    if field is not None:
        settings[field] = value
    return apply_overrides(Config(), [f"{k}={v}" for k, v in settings.items()])


def _probe(cfg, field):
    section = field.split(".")[0]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConfigWarning)
            cfg.validate()
    except (ConfigError, ConfigWarning) as e:
        return ("refused", str(e))
    out = [static_config_key(cfg)]
    for probe in SECTION_PROBES[section]:
        out.append(probe(cfg, field))
    return out


def test_every_field_is_walked():
    fields = set(_all_fields())
    assert fields == set(CHANGES) | set(ELSEWHERE), fields ^ (set(CHANGES) | set(ELSEWHERE))
    assert not set(CHANGES) & set(ELSEWHERE)
    for where in ELSEWHERE.values():
        path, _, name = where.partition("::")
        text = (ROOT / "tests" / path).read_text()
        assert not name or f"def {name}(" in text, where


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_field_changes_the_run_or_is_refused(field):
    value, algorithm, extra = CHANGES[field]
    base = _probe(_config(algorithm, extra), field)
    assert base[0] != "refused", base
    changed = _probe(_config(algorithm, extra, field, value), field)
    assert repr(changed) != repr(base), field


@pytest.mark.parametrize("field,value,algorithm", [
    ("rl.skip_zero_variance_groups", True, "ppo"), ("rl.scale_by_std", False, "ppo"),
    ("rl.mask_truncated", True, "dpo"), ("rl.beta", 0.5, "dpo"), ("rl.gamma", 0.5, "grpo"),
    ("rl.top_k", 5, "sft")])
def test_options_the_algorithm_never_reads_are_named(field, value, algorithm):
    cfg = _config(algorithm, {}, field, value)
    with pytest.warns(ConfigWarning, match=f"{field}=.*ignored by rl.algorithm={algorithm}"):
        cfg.validate()


@pytest.mark.parametrize("algorithm", ["ppo", "rft", "online_rft", "dpo", "sft"])
def test_process_supervision_without_grpo_is_refused(algorithm):
    with pytest.raises(ConfigError, match="rl.supervision=process"):
        _config(algorithm, {}, "rl.supervision", "process").validate()


def test_data_sft_examples_is_gone():
    with pytest.raises(ConfigError, match="unknown config key 'data.sft_examples'"):
        apply_overrides(Config(), ["data.sft_examples=10"])


@pytest.mark.parametrize("preset", ["cpu-tiny", "smollm2-135m", "qwen2.5-1.5b", "deepseekmath-rl-7b"])
def test_presets_warn_about_nothing(preset):
    from grpo_jax.config import get_preset

    assert get_preset(preset).unused_options() == []
