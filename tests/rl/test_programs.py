"""The programs a run executes are the ones the ahead-of-time check lowers (grpo_jax.rl.programs)."""


import dataclasses

import jax
import jax.numpy as jnp
import pytest
from tests.rl.test_trainer import SevensTask, tok  # noqa: F401  (tok: the fixture)

from grpo_jax import aot, sampler
from grpo_jax.sampler.calls import OnMesh
from grpo_jax import config as config_lib
from grpo_jax.model.transformer import init_params
from grpo_jax.parallel.sharding import make_mesh
from grpo_jax.rl.train_step import TrainStep
from grpo_jax.rl.trainer import Trainer


def _cfg(tmp_path, vocab, *overrides):
    cfg = config_lib.apply_overrides(config_lib.get_preset("cpu-tiny"), [
        "model.max_seq_len=64", "rl.group_size=4", "rl.max_new_tokens=8", "data.batch_size=4",
        "run.eval_every=0", "run.checkpoint_every=0", "run.steps=1", f"run.run_dir={tmp_path}", *overrides])
    return cfg.replace(model={"vocab_size": vocab}).validate()


def _record(monkeypatch) -> dict:
    """Lowered HLO text and abstract arguments of every sampler and train-step program the
    trainer calls, recorded as it calls them: the rollout's sampler calls ("prefill",
    "decode") and, made inside `Trainer.evaluate_held_out`, the in-run evaluation's
    ("eval_prefill", "eval_decode")."""
    seen, evaluating = {}, []
    real_call, real_lower, real_evaluate = OnMesh.__call__, TrainStep.lower, Trainer.evaluate_held_out

    def evaluate_held_out(self, done):
        evaluating.append(done)
        try:
            return real_evaluate(self, done)
        finally:
            evaluating.pop()

    def call(self, *args, **kwargs):
        kind = "prefill" if "cache_len" in kwargs else "decode"
        kind = f"eval_{kind}" if evaluating else kind
        seen.setdefault(kind, (self.lower(*args, **kwargs).as_text(), args))
        return real_call(self, *args, **kwargs)

    def lower(self, state, batch):
        lowered = real_lower(self, state, batch)
        seen.setdefault("train_step", (lowered.as_text(), batch))
        return lowered

    monkeypatch.setattr(OnMesh, "__call__", call)
    monkeypatch.setattr(TrainStep, "lower", lower)
    monkeypatch.setattr(Trainer, "evaluate_held_out", evaluate_held_out)
    return seen


@pytest.mark.parametrize("overrides", [[], ["rl.top_k=5", "rl.decode=shared"]])
def test_the_trainer_runs_the_programs_the_aot_check_lowers(tmp_path, monkeypatch, tok, overrides):
    """cpu-tiny on 8 fake devices: the sampler's prefill and decode, the train step and the
    in-run evaluation's prefill and decode (other rows and prompts: data.eval_size greedy
    questions), as one trainer step calls them, lower to the same HLO as `aot` lowers them
    for the same config and mesh; the decode engine is rl.decode's (unrolled is auto's on a
    CPU mesh)."""
    cfg = _cfg(tmp_path, tok.vocab_size, "run.eval_every=1", "data.eval_size=3", *overrides)
    seen = _record(monkeypatch)
    trainer = Trainer(cfg, task=SevensTask(), tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                      progress=False, resume=False)
    assert trainer.mesh.size == 8
    assert trainer.sampler.engine.name == ("shared" if "rl.decode=shared" in overrides else "unrolled")
    trainer.train(1)
    trainer.close()
    prompt_len = seen["prefill"][1][1].shape[1]
    assert seen["decode"][1][1].k.dtype == jnp.float32 and seen["decode"][1][1].k_scale is None
    lowered = aot.lower_sampler(cfg, trainer.sampler.mesh, cfg.data.batch_size, cfg.rl.group_size, prompt_len)
    for name in ("prefill", "decode"):
        assert lowered[name].as_text() == seen[name][0], name
    eval_len = seen["eval_prefill"][1][1].shape[1]
    lowered = aot.lower_sampler(cfg, trainer.sampler.mesh, cfg.data.eval_size, 1, eval_len, evaluation=True)
    for name in ("prefill", "decode"):
        assert lowered[name].as_text() == seen[f"eval_{name}"][0], name
    assert seen["eval_decode"][1][3].row_ids.shape != seen["decode"][1][3].row_ids.shape
    rows = cfg.data.batch_size * cfg.rl.group_size
    assert aot.lower_train_step(cfg, trainer.mesh, rows, prompt_len).as_text() == seen["train_step"][0]


def test_the_trainer_samples_with_rl_kv_dtype_and_decode_phases(tmp_path, monkeypatch, tok):
    """rl.kv_dtype=int8 and rl.decode_phases reach the trainer's sampler call; the programs
    the run (and the AOT check) builds carry an int8 cache with its scales, and the check
    decodes in the phases rl.decode_phases gives."""
    cfg = _cfg(tmp_path, tok.vocab_size, "rl.kv_dtype=int8", "rl.decode_phases=2")
    asked = {}

    class Sampled(Exception):
        pass

    def sample_to_host(cfg, params, prompts, settings, **kwargs):
        asked.update(dataclasses.asdict(settings))
        raise Sampled

    monkeypatch.setattr(sampler.host, "sample_to_host", sample_to_host)
    trainer = Trainer(cfg, task=SevensTask(), tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                      progress=False, resume=False)
    with pytest.raises(Sampled):
        trainer.train(1)
    trainer.close()
    assert asked["kv_dtype"] == "int8" and trainer.sampler.engine.name == "unrolled"
    assert asked["decode_phases"] == 2
    cache = aot.sampler_calls(cfg, trainer.sampler.mesh, cfg.data.batch_size, cfg.rl.group_size, 16)["decode"][1][1]
    assert cache.k.dtype == cache.v.dtype == jnp.int8 and cache.k_scale.shape == cache.k.shape[:3] + (16 + 16,)
    for phases, windows in ((2, (64, 128)), (4, (32, 64, 96, 128))):
        shared = cfg.replace(rl={"decode": "shared", "max_new_tokens": 128, "decode_phases": phases})
        calls = aot.sampler_calls(shared, trainer.sampler.mesh, cfg.data.batch_size, cfg.rl.group_size, 16)
        assert calls["decode"][2]["windows"] == windows


def test_aot_sampler_arguments_are_the_trainers_on_a_tpu_topology(tmp_path, monkeypatch, tok):
    """On a v5e:2x2 topology (no trainer can run there): the arguments `aot` builds for the
    sampler have the shapes, dtypes and partition specs of a trainer's calls on a 4-device
    CPU mesh of the same shape (the trainer there set to the engine auto picks on TPU:
    shared)."""
    if not aot.libtpu_available():
        pytest.skip("libtpu not installed")
    cfg = _cfg(tmp_path, tok.vocab_size, "mesh.ici_fsdp=4", "rl.decode=shared")
    seen = _record(monkeypatch)
    trainer = Trainer(cfg, task=SevensTask(), tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                      mesh=make_mesh(cfg.mesh, jax.devices()[:4]), progress=False, resume=False)
    trainer.train(1)
    trainer.close()
    tpu_mesh, _ = aot.topology_mesh(cfg, "v5e:2x2")
    auto = config_lib.apply_overrides(cfg, ["rl.decode=auto"])
    assert aot.run_sampler(auto, tpu_mesh).engine.name == "shared"
    assert aot.run_sampler(auto, trainer.mesh).engine.name == "unrolled"
    prompt_len = seen["prefill"][1][1].shape[1]
    calls = aot.sampler_calls(cfg, tpu_mesh, cfg.data.batch_size, cfg.rl.group_size, prompt_len)
    for name in ("prefill", "decode"):
        ran, built = jax.tree.leaves(seen[name][1]), jax.tree.leaves(calls[name][1])
        assert [(x.shape, x.dtype) for x in ran] == [(x.shape, x.dtype) for x in built], name
        def spec(x):  # trailing Nones say nothing
            parts = tuple(getattr(getattr(x, "sharding", None), "spec", ()) or ())
            while parts and parts[-1] is None:
                parts = parts[:-1]
            return parts
        assert [spec(x) for x in ran] == [spec(x) for x in built], name
    lowered = aot.lower_sampler(cfg, tpu_mesh, cfg.data.batch_size, cfg.rl.group_size, prompt_len)
    assert "while" in lowered["decode"].as_text()


def test_grpo_evaluate_runs_the_programs_the_aot_check_lowers(tmp_path, monkeypatch, tok):
    """grpo-evaluate on a run dir samples its questions in chunks (--chunk-rows) on this
    host's mesh: each chunk's greedy call and its --k draws (other rows than the run's
    calls: 2 questions, then the last 1) lower to the HLO `aot` lowers for the run's
    evaluation sampler on that mesh."""
    from grpo_jax.cli import evaluate as evaluate_cli
    from grpo_jax.config import MeshConfig

    cfg = _cfg(tmp_path, tok.vocab_size)
    trainer = Trainer(cfg, task=SevensTask(), tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                      progress=False, resume=False)
    trainer.save(1)
    trainer.close()
    seen, real_call = [], OnMesh.__call__

    def call(self, *args, **kwargs):
        seen.append(("prefill" if "cache_len" in kwargs else "decode", self.lower(*args, **kwargs).as_text(), args))
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(OnMesh, "__call__", call)
    evaluate_cli.main(["--model", str(tmp_path), "--task", "tests.rl.test_trainer:SevensTask", "--limit", "3", "--k", "2",
                       "--chunk-rows", "4", "--temperature", "1.0", "--no-progress", "--out", str(tmp_path / "eval")])
    mesh = make_mesh(MeshConfig(), jax.local_devices())
    prompt_len = seen[0][2][1].shape[1]
    # (questions, rows per question) of each call: chunk [0, 1] greedy, drawn; chunk [2] greedy, drawn.
    shapes = [(2, 1), (2, 2), (1, 1), (1, 2)]
    assert [name for name, _, _ in seen] == ["prefill", "decode"] * len(shapes)
    for (prompts, group), pair in zip(shapes, zip(seen[::2], seen[1::2])):
        lowered = aot.lower_sampler(cfg, mesh, prompts, group, prompt_len, evaluation=True)
        for name, text, _ in pair:
            assert lowered[name].as_text() == text, (name, prompts, group)


def test_a_tool_rollout_runs_the_continuations_the_aot_check_lowers(tmp_path, monkeypatch, tok):
    """rl.max_tool_calls=2, cpu-tiny on 8 fake devices: after a tool call (or a fence that
    opened no block) the rollout continues its running rows with sampler calls of their own
    (every row its own prompt, its context prefilled afresh, the rest of the budget
    decoded). Each continuation one trainer step makes lowers to the HLO
    `aot.lower_tool_turn` lowers for its rows, longest context and tokens used, and is no
    larger than the largest the check compiles (``turns.continuation_rows`` rows,
    ``turns.continuation_shapes``' buckets); the train step, whose batch now holds the
    tool's tokens' mask, lowers as `aot.lower_train_step` lowers it."""
    from grpo_jax.sampler import Sampler, turns
    from grpo_jax.shapes import bucket_length
    from tests.rl.test_tool_rollouts import SevensWithTool

    cfg = _cfg(tmp_path, tok.vocab_size, "rl.max_tool_calls=2", "rl.max_new_tokens=16")
    seen = _record(monkeypatch)  # the first call's programs and the train step
    programs, asked, real_call, real_generate = [], [], OnMesh.__call__, Sampler.generate

    def call(self, *args, **kwargs):
        programs.append(self.lower(*args, **kwargs).as_text())
        return real_call(self, *args, **kwargs)

    def generate(self, weights, prompts, **kwargs):
        asked.append((len(prompts), max(map(len, prompts)), self.settings.max_new_tokens))
        return real_generate(self, weights, prompts, **kwargs)

    monkeypatch.setattr(OnMesh, "__call__", call)
    monkeypatch.setattr(Sampler, "generate", generate)
    trainer = Trainer(cfg, task=SevensWithTool(), tokenizer=tok, params=init_params(cfg.model, jax.random.key(0)),
                      progress=False, resume=False)
    trainer.train(1)
    trainer.close()
    budget, g = cfg.rl.max_new_tokens, cfg.rl.group_size
    assert len(asked) > 1  # rows continued (the random policy writes fences; it may run no block)
    assert len(programs) == 2 * len(asked)  # sample_prompts=0: one prefill and one decode per call
    prompt_len = bucket_length(asked[0][1])
    most = turns.continuation_rows(cfg.data.batch_size * g, cfg.rl.sample_prompts, g)
    largest = [(bucket_length(prompt_len + u), bucket_length(budget - u))
               for u in turns.continuation_shapes(prompt_len, budget)]
    for k, (rows, context_len, new_tokens) in enumerate(asked[1:], start=1):
        used = budget - new_tokens
        lowered = aot.lower_tool_turn(cfg, trainer.sampler.mesh, rows, context_len, used)
        assert [lowered[name].as_text() for name in ("prefill", "decode")] == programs[2 * k:2 * k + 2], k
        assert rows <= most and any(bucket_length(context_len) <= c and bucket_length(new_tokens) <= n
                                    for c, n in largest), (k, rows, context_len, new_tokens)
    rows = cfg.data.batch_size * g
    assert seen["train_step"][1].tool_mask is not None
    assert aot.lower_train_step(cfg, trainer.mesh, rows, prompt_len).as_text() == seen["train_step"][0]


@pytest.mark.parametrize("algorithm, batch_size, group_size, num, fits", [
    ("grpo", 3, 4, 5, [1, 2, 3, 4, 6, 12]),   # 12 rows
    ("online_rft", 2, 3, 4, [1, 2, 3, 6]),    # 6 rows
    ("dpo", 3, 8, 2, [1, 3]),                 # 3 pairs: a pair is never split
    ("sft", 6, 8, 4, [1, 2, 3, 6]),           # one row per question
])
def test_micro_batches_that_do_not_split_the_batch_are_refused_at_start_up(algorithm, batch_size, group_size, num, fits):
    """Refused when the train step is built, naming the rows and the values that do split
    them; before, the first step's trace failed after its rollout."""
    from grpo_jax.errors import ConfigError
    from grpo_jax.rl import programs

    def cfg(n):
        return config_lib.apply_overrides(config_lib.get_preset("cpu-tiny"), [
            f"rl.algorithm={algorithm}", f"data.batch_size={batch_size}", f"rl.group_size={group_size}",
            f"rl.num_micro_batches={n}"]).validate()

    with pytest.raises(ConfigError, match=rf"rl.num_micro_batches={num} does not split .*values that do: "
                                          + ", ".join(map(str, fits)) + "$"):
        programs.check_micro_batches(cfg(num))
    with pytest.raises(ConfigError, match="does not split"):
        programs.train_step(cfg(num), make_mesh(cfg(num).mesh))
    rows = batch_size * {"dpo": 2, "sft": 1}.get(algorithm, group_size)
    unit = 2 if algorithm == "dpo" else 1
    for n in range(1, rows + 1):  # every value listed splits the rows, and no other does
        if n in fits:
            programs.check_micro_batches(cfg(n))
            assert rows % (n * unit) == 0
        else:
            with pytest.raises(ConfigError):
                programs.check_micro_batches(cfg(n))
