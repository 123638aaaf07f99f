"""LoRA policies (grpo_jax.model.lora): the policy starts as the base, only adapters train, the
reference is the base, the merge is W + (α/r)·A·B, and the train step needs less memory."""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax import aot
from grpo_jax.rl import batching
from grpo_jax.model import lora, transformer as model
from grpo_jax.rl import train_step as ts
from grpo_jax.rl.algorithms import get_algorithm
from grpo_jax.config import Config, ConfigError, ConfigWarning, ModelConfig, RLConfig, load_config
from grpo_jax.model.logprobs import sequence_logprobs
from grpo_jax.parallel.sharding import mesh_from_shape
from grpo_jax.tasks.arithmetic import ArithmeticTask

TINY = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64, max_seq_len=64, lora_rank=4, lora_alpha=8.0)
P, G, TP, TC = 2, 4, 8, 8
TOKENS = jnp.arange(1, 17, dtype=jnp.int32)[None] % TINY.vocab_size
_logits = jax.jit(model.forward_logits, static_argnums=0)


@jax.jit
def _perturbed(adapters, seed=1):
    """Adapters with every leaf (B too) random, so the policy differs from the base (jitted:
    op by op, each leaf's shape would compile its own random kernel)."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def _cfg(**rl) -> Config:
    rl = RLConfig(**{"group_size": G, "max_new_tokens": TC, "logprob_chunk_size": 4, **rl})
    return Config(model=TINY, rl=rl).validate()


def _batch() -> batching.Batch:
    rng = np.random.default_rng(0)
    pmask = np.ones((P * G, TP), bool)
    cmask = np.arange(TC)[None] < np.array([8, 3, 6, 2, 8, 5, 4, 7])[:, None]
    rewards = np.array([1.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.3, 0.0])
    return batching.make_batch(rng.integers(1, 64, (P * G, TP)), pmask,
                               np.where(cmask, rng.integers(1, 64, (P * G, TC)), 0), cmask,
                               rewards=rewards, correct=rewards > 0.4, truncated=cmask.all(1))


def test_zero_b_gives_the_base_logits_exactly():
    base = model.init_params(TINY, jax.random.key(0))
    adapters = lora.init_adapters(TINY, jax.random.key(1))
    assert all(not np.any(np.asarray(b)) for m in adapters["layers"].values()
               for k, b in m.items() if k.endswith("_lora_b"))
    want = _logits(TINY, base, TOKENS)
    np.testing.assert_array_equal(_logits(TINY, lora.policy_params(base, adapters), TOKENS), want)
    moved = _logits(TINY, lora.policy_params(base, _perturbed(adapters)), TOKENS)
    assert float(jnp.max(jnp.abs(moved - want))) > 1e-3


def test_merge_is_base_plus_scaled_product_and_matches_the_in_layer_merge():
    cfg = dataclasses.replace(TINY, lora_targets="q,o,down")
    base = model.init_params(cfg, jax.random.key(0))
    adapters = _perturbed(lora.init_adapters(cfg, jax.random.key(1)))
    merged = lora.merge(base, adapters, cfg)
    scale = cfg.lora_alpha / cfg.lora_rank
    for module, name in (("attn", "q"), ("attn", "o"), ("mlp", "down")):
        a = np.asarray(adapters["layers"][module][f"{name}_lora_a"], np.float64)
        b = np.asarray(adapters["layers"][module][f"{name}_lora_b"], np.float64)
        w = np.asarray(base["layers"][module][name], np.float64)
        a2 = a.reshape(a.shape[0], -1, a.shape[-1])  # [layers, in, r]
        b2 = b.reshape(b.shape[0], b.shape[1], -1)  # [layers, r, out]
        want = w + scale * np.einsum("lir,lro->lio", a2, b2).reshape(w.shape)
        np.testing.assert_allclose(np.asarray(merged["layers"][module][name]), want, rtol=1e-5, atol=1e-6)
    untouched = [("attn", "k"), ("attn", "v"), ("mlp", "gate"), ("mlp", "up")]
    assert all(merged["layers"][m][n] is base["layers"][m][n] for m, n in untouched)
    assert set(adapters["layers"]["attn"]) == {"q_lora_a", "q_lora_b", "o_lora_a", "o_lora_b"}
    np.testing.assert_allclose(_logits(cfg, merged, TOKENS),
                               _logits(cfg, lora.policy_params(base, adapters), TOKENS),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("targets", [None, "q,o,gate,down"])
def test_adapter_gradients_equal_the_merged_weights_and_form_no_weight_gradient(targets):
    """The layers compute x·W + s·(x·A)·B (`model.adapted_product`, `model.swiglu_lora`'s
    written-out backward): the adapters' gradients equal autodiff through the merged weights
    W + s·A·B, and the compiled gradient holds no product shaped like a full weight (the
    work a merged weight's gradient would cost)."""
    cfg = TINY if targets is None else dataclasses.replace(TINY, lora_targets=targets)
    base = model.init_params(cfg, jax.random.key(0))
    adapters = _perturbed(lora.init_adapters(cfg, jax.random.key(1)))
    weights = jax.random.normal(jax.random.key(2), (1, TOKENS.shape[1], cfg.vocab_size))

    def loss(params):
        return jnp.sum(jax.nn.log_softmax(model.forward_logits(cfg, params, TOKENS)) * weights)

    in_layer = jax.jit(jax.grad(lambda ad: loss(lora.policy_params(base, ad))))
    merged = jax.jit(jax.grad(lambda ad: loss(lora.merge(base, ad, cfg))))
    got, want = in_layer(adapters), merged(adapters)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5), got, want)
    assert float(jnp.max(jnp.abs(jax.tree.leaves(got)[0]))) > 1e-3
    full = {tuple(int(d) for d in x.shape[1:]) for x in jax.tree.leaves(base["layers"]) if x.ndim >= 3}

    def weight_shaped_products(fn):
        hlo = fn.lower(adapters).compile().as_text()
        return {tuple(int(d) for d in dims.split(",")) for dims in
                re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} dot\(", hlo)} & full

    assert weight_shaped_products(merged)  # the merge and dW' = xᵀ·dy: seen when formed
    assert not weight_shaped_products(in_layer)


def test_only_adapters_are_trained_and_the_reference_is_the_base():
    cfg = _cfg(beta=0.04)
    mesh = mesh_from_shape((1, 1, 1))
    tx = optax.adamw(1e-2)
    base = model.init_params(TINY, jax.random.key(0), mesh)
    state = ts.init_train_state(cfg, base, tx)
    assert state.ref_params is None  # no second copy of the weights
    adapter_shapes = {(x.shape, x.dtype) for x in jax.tree.leaves(lora.adapter_shapes(TINY))}
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert moments and {(x.shape, x.dtype) for x in moments} == adapter_shapes
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(state.params))
    before_base = jax.tree.map(np.asarray, state.base_params)
    before = jax.tree.map(np.asarray, state.params)
    step = ts.make_train_step(cfg, tx, mesh)
    state, metrics = step(state, _batch())
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.base_params), before_base)
    for m, leaves in state.params["layers"].items():
        for k, x in leaves.items():
            assert not np.array_equal(np.asarray(x), before["layers"][m][k]), (m, k)


def test_reference_logprobs_are_the_base_models():
    cfg = _cfg(beta=0.04)
    base = model.init_params(TINY, jax.random.key(0))
    adapters = _perturbed(lora.init_adapters(TINY, jax.random.key(1)))
    state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=adapters, opt_state=None,
                          base_params=base)
    batch, kw = _batch(), dict(temperature=1.0, chunk_size=cfg.rl.logprob_chunk_size)
    prepare = jax.jit(lambda s, b: get_algorithm("grpo").prepare(lora.model_view(s), b, cfg)[0])
    extras = prepare(state, batch)
    want = sequence_logprobs(TINY, base, batch, **kw)
    np.testing.assert_allclose(extras.ref_logp, want, rtol=1e-6, atol=1e-6)
    policy = sequence_logprobs(TINY, lora.policy_params(base, adapters), batch, **kw)
    assert float(jnp.max(jnp.abs(policy - want))) > 1e-3


def test_train_step_peak_bytes_are_lower_with_lora():
    mesh = mesh_from_shape((1, 1, 1))
    peaks = {}
    for rank in (0, 8):
        cfg = load_config("cpu-tiny", [f"model.lora_rank={rank}", "rl.max_new_tokens=16"])
        compiled, _ = aot.compile_train_step(cfg, mesh, rows=16, prompt_len=32)
        peaks[rank] = aot.memory(compiled)
    assert peaks[8]["argument_bytes"] < peaks[0]["argument_bytes"] / 2, peaks
    assert peaks[8]["peak_bytes"] < peaks[0]["peak_bytes"], peaks


class _DigitShare(ArithmeticTask):
    """The arithmetic task's questions, rewarded by the share of digits in the completion:
    an untrained model's outputs differ in it, so every group has advantages to learn from."""

    def reward(self, completion, example):
        return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def _lora_trainer(cfg, tokenizer, seed=0, mesh_shape=(1, 1, 1)):
    from grpo_jax.rl.trainer import Trainer

    params = model.init_params(cfg.model, jax.random.key(seed))
    return Trainer(cfg, task=_DigitShare(), tokenizer=tokenizer, params=params,
                   mesh=mesh_from_shape(mesh_shape), progress=False)


def _small_lora_run(run_dir, rank: int):
    """(cfg, tokenizer) of a two-step GRPO run of a 1-layer LoRA policy in ``run_dir``."""
    from grpo_jax.cli.runs import shared_tokenizer

    cfg = load_config("cpu-tiny", [
        f"model.lora_rank={rank}", "model.embed_dim=32", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=16", "model.mlp_dim=64", "model.max_seq_len=64",
        "run.steps=2", "run.eval_every=0", "run.checkpoint_every=0", "data.batch_size=2",
        "rl.group_size=4", "rl.max_new_tokens=8", f"run.run_dir={run_dir}"])
    tokenizer = shared_tokenizer(_DigitShare(), str(run_dir), vocab_size=64)
    return cfg.replace(model={"vocab_size": tokenizer.vocab_size}), tokenizer


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(cfg, tokenizer, trainer): two GRPO steps of a LoRA policy on the arithmetic
    questions, checkpointed at the end."""
    cfg, tokenizer = _small_lora_run(tmp_path_factory.mktemp("lora_run"), rank=8)
    trainer = _lora_trainer(cfg, tokenizer)
    trainer.train()
    trainer.close()
    return cfg, tokenizer, trainer


def test_a_short_lora_grpo_run_trains_its_adapters(lora_run):
    _, _, trainer = lora_run
    assert all(np.isfinite(h["loss"]) for h in trainer.history)
    assert trainer.state.ref_params is None and trainer.state.base_params is not None
    b = [x for m in trainer.state.params["layers"].values() for k, x in m.items() if k.endswith("_lora_b")]
    assert len(b) == 7 and all(np.any(np.asarray(x)) for x in b)  # B left 0: gradients reached it


def test_lora_checkpoint_holds_adapters_and_restores_onto_another_mesh(lora_run):
    cfg, tokenizer, trainer = lora_run
    stored = trainer.ckpt.stored_metadata(2)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(stored)[0]]
    params = [p for p in paths if p.startswith("['state']['params']")]
    assert params and all("_lora_" in p for p in params) and not any("base_params" in p for p in paths)
    resumed = _lora_trainer(cfg, tokenizer, mesh_shape=(1, 2, 1))
    assert resumed.start_step == 2 and resumed.state.base_params is not None
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, resumed.state.params),
                 jax.tree.map(np.asarray, trainer.state.params))
    resumed.close()


def test_lora_checkpoint_refuses_another_base_in_one_line(lora_run):
    from grpo_jax.errors import CheckpointError

    cfg, tokenizer, _ = lora_run
    with pytest.raises(CheckpointError, match="holds LoRA adapters of another base") as e:
        _lora_trainer(cfg, tokenizer, seed=1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override,match", [
    ("model.lora_targets=q,x", "model.lora_targets='q,x' must name"),
    ("model.lora_targets=q,q", "model.lora_targets='q,q' must name"),
    ("model.lora_rank=-1", "model.lora_rank must be >= 0"),
])
def test_bad_lora_settings_are_refused_in_one_line(override, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config("cpu-tiny", [override])
    assert "\n" not in str(e.value)


def test_lora_settings_without_a_rank_are_named():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config("cpu-tiny", ["model.lora_alpha=32"])
    assert any(issubclass(w.category, ConfigWarning) and "model.lora_alpha=32.0 is ignored" in str(w.message)
               for w in caught)


def test_evaluation_reads_a_lora_run_as_its_merged_policy(lora_run):
    """grpo-evaluate on a LoRA run dir: each step's weights are the checkpoint's adapters
    merged into the run's base (the policy the Trainer sampled with), and a checkpoint over
    another base is refused in one line."""
    from grpo_jax.cli import runs
    from grpo_jax.errors import CheckpointError

    cfg, tokenizer, trainer = lora_run
    mesh = mesh_from_shape((1, 1, 1))
    run = runs.open_run(runs.run_config(cfg.run.run_dir), _DigitShare(), mesh)
    assert run.steps == [2] and run.cfg.model == cfg.model
    got = run.params(2, mesh)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, trainer.params))
    other = model.init_params(cfg.model, jax.random.key(1), mesh)
    with pytest.raises(CheckpointError, match="holds LoRA adapters of another base") as e:
        dataclasses.replace(run, base=other, pointer=lora.base_pointer(run.cfg, other)).params(2, mesh)
    assert "\n" not in str(e.value)
    run.close()


def test_export_writes_the_merged_policy_and_keeps_an_export_in_place(lora_run, tmp_path):
    """grpo-export on a LoRA run dir: the HF folder holds the adapters merged into the base
    (read back by our HF loader, every weight equals the Trainer's policy), the run's
    sentencepiece tokenizer and the provenance; a second export into the same folder is
    refused unless asked to overwrite."""
    from grpo_jax.cli import export as export_cli
    from grpo_jax.model import pretrained
    from grpo_jax.errors import CheckpointError, ConfigError
    from grpo_jax.text.tokenizer import SentencePieceTokenizer

    cfg, tokenizer, trainer = lora_run
    out = tmp_path / "exported"
    record = export_cli.main([cfg.run.run_dir, "--out", str(out)])
    assert record["step"] == 2 and record["lora"]["rank"] == 8
    assert record["lora"]["base"] == lora.base_pointer(cfg, trainer.state.base_params)
    got_cfg, params, hf_tok = pretrained.load_hf(out)
    assert hf_tok.model_proto == tokenizer.model_proto  # the run's own sentencepiece model
    assert got_cfg.embed_dim == cfg.model.embed_dim and got_cfg.lora_rank == 0
    # The export merges on all 8 devices, the trainer on one: A·B is summed in another order.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9),
                 params, trainer.params)
    saved = SentencePieceTokenizer.load(out / "tokenizer.model")
    assert saved.encode("12+3=") == tokenizer.encode("12+3=")
    with pytest.raises(ConfigError, match="already holds a model .*config.json.*--overwrite"):
        export_cli.main([cfg.run.run_dir, "--out", str(out)])
    with pytest.raises(CheckpointError, match="no checkpoint step 5"):
        export_cli.main([cfg.run.run_dir, "--out", str(out), "--overwrite", "--step", "5"])


def test_reset_reference_merges_the_adapters_into_the_base_and_keeps_the_policy():
    """π_ref ← π_θ under LoRA: the base becomes the merged policy, B returns to 0 (A and the
    optimizer state carry on), so the policy's logits do not move and the reference's are
    the old policy's."""
    cfg = _cfg(beta=0.04)
    tx = optax.adamw(1e-2)
    state = ts.init_train_state(cfg, model.init_params(TINY, jax.random.key(0)), tx)
    state = state.replace(params=_perturbed(state.params))
    before = _logits(TINY, lora.policy_params(state.base_params, state.params), TOKENS)
    with pytest.raises(ValueError, match="needs its model config"):
        ts.reset_reference(state)
    reset = ts.reset_reference(state, TINY)
    after = lora.model_view(reset)
    np.testing.assert_allclose(_logits(TINY, after.params, TOKENS), before, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_logits(TINY, after.ref_params, TOKENS), before, rtol=1e-5, atol=1e-5)
    for m, leaves in reset.params["layers"].items():
        for k, x in leaves.items():
            want = np.zeros_like(x) if k.endswith("_lora_b") else state.params["layers"][m][k]
            np.testing.assert_array_equal(np.asarray(x), np.asarray(want))
    assert reset.opt_state is state.opt_state


def test_a_reset_lora_run_saves_its_new_base_and_resumes_and_evaluates_over_it(tmp_path):
    """Trainer.reset_reference under LoRA saves the merged base into the run (bases/step-N);
    the checkpoints after it point there, so a resumed Trainer and grpo-evaluate read the
    policy the run trained, not the adapters over the original base."""
    from grpo_jax.cli import runs

    cfg, tokenizer = _small_lora_run(tmp_path, rank=4)
    trainer = _lora_trainer(cfg, tokenizer)
    original = lora.base_pointer(cfg, trainer.state.base_params)
    trainer.train(steps=1)
    trainer.reset_reference()
    assert (tmp_path / "bases" / "step-1" / "model_config.json").exists()
    assert trainer.base_pointer["merged_at"] == 1 and trainer.base_pointer["fingerprint"] != original["fingerprint"]
    trainer.train(steps=2)
    trainer.close()
    want = jax.tree.map(np.asarray, trainer.params)
    resumed = _lora_trainer(cfg, tokenizer)
    assert resumed.start_step == 2 and resumed.base_pointer == trainer.base_pointer
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, resumed.params), want)
    resumed.close()
    mesh = mesh_from_shape((1, 1, 1))
    run = runs.open_run(runs.run_config(str(tmp_path)), _DigitShare(), mesh)
    got = run.params(run.steps[-1], mesh)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got), want)
    run.close()
