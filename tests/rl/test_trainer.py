"""The trainer end to end on tiny configs: learning, exact resume, every algorithm, bad configs,
damaged checkpoints and saves that fail."""
import contextlib
import os
import re
import shutil
import subprocess
import time
import zlib

import jax
import numpy as np
import pytest

from grpo_jax.checkpoints import checkpointing
from grpo_jax import config as config_lib
from grpo_jax.config import ConfigError
from grpo_jax.errors import CheckpointError
from grpo_jax.rl.metrics import read_jsonl
from grpo_jax.model.transformer import init_params
from grpo_jax.rl.optimizer import make_optimizer
from grpo_jax.tasks import Example, Task
from grpo_jax.text.tokenizer import train_sentencepiece
from grpo_jax.rl.train_step import init_train_state, make_train_step
from grpo_jax.rl.trainer import Trainer
from tests.checkpoint_files import damage, files


class SevensTask(Task):
    """Reward = share of '7' characters in the completion: learnable from scratch in a few steps."""

    name = "sevens"

    def examples(self, split, n, seed):
        # crc32, not hash(): str hashes change with every interpreter (PYTHONHASHSEED), which
        # gave each test process other questions and so another training run.
        rng = np.random.default_rng([zlib.crc32(split.encode()) % 1000, seed])
        return [Example(prompt=f"Q: {int(x)}\n", answer="7") for x in rng.integers(0, 100, n)]

    def reward(self, completion, example):
        return completion.count("7") / max(len(completion), 1)

    def extract_answer(self, completion):
        return completion.strip()[:1] or None

    def is_correct(self, answer, example):
        return answer == "7"

    def sft_text(self, example, rng=0, wrong_step_prob=0.0):
        return "7 7 7\n"


@pytest.fixture(scope="module")
def tok():
    corpus = [f"Q: {i}\n{i % 10} {i % 7} 7\n" for i in range(200)]
    return train_sentencepiece(corpus, vocab_size=32)


def _cfg(tmp_path, tok, *overrides):
    cfg = config_lib.apply_overrides(config_lib.get_preset("cpu-tiny"), [
        "model.embed_dim=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.head_dim=16", "model.mlp_dim=64", "model.max_seq_len=32",
        "rl.group_size=4", "rl.max_new_tokens=8", "data.batch_size=4", "data.eval_size=4",
        "optimizer.peak_lr=3e-3", "optimizer.warmup_steps=0", "optimizer.schedule=constant",
        "run.eval_every=0", "run.checkpoint_every=2", f"run.run_dir={tmp_path}", *overrides])
    return cfg.replace(model={"vocab_size": tok.vocab_size}).validate()


def _trainer(cfg, tok, **kw):
    params = init_params(cfg.model, jax.random.key(0))
    sft_data = lambda step: (["Q: 1\n", "Q: 2\n", "Q: 3\n", "Q: 4\n"], ["7 7\n"] * 4)
    return Trainer(cfg, task=SevensTask(), tokenizer=tok, params=params, progress=False,
                   sft_data=sft_data, **kw)


def test_grpo_reward_goes_up(tmp_path, tok):
    cfg = _cfg(tmp_path, tok, "run.steps=24", "rl.beta=0", "run.checkpoint_every=0",
               "rl.group_size=8", "optimizer.peak_lr=1e-2")
    trainer = _trainer(cfg, tok)
    history = trainer.train()
    trainer.close()
    first = np.mean([h["reward_mean"] for h in history[:4]])
    last = np.mean([h["reward_mean"] for h in history[-4:]])
    assert last > first + 0.15, (first, last)
    assert len(history) == 24 and all(np.isfinite(h["loss"]) for h in history)


def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path, tok):
    full_cfg = _cfg(tmp_path / "full", tok, "run.steps=4")
    full = _trainer(full_cfg, tok)
    uninterrupted = full.train()
    full.close()
    part_cfg = _cfg(tmp_path / "part", tok, "run.steps=4")
    first = _trainer(part_cfg, tok)
    first.train(steps=2)  # "killed" after the checkpoint at step 2
    first.close()
    resumed = _trainer(part_cfg, tok)
    assert resumed.start_step == 2
    rest = resumed.train()
    resumed.close()
    keys = ("loss", "reward_mean", "kl", "grad_norm")
    for a, b in zip(uninterrupted[2:], rest):
        assert a["step"] == b["step"]
        for k in keys:
            assert a[k] == b[k], (k, a[k], b[k])
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), full.params, resumed.params)


def test_a_run_cut_before_its_first_checkpoint_starts_over_with_only_its_own_metrics(tmp_path, tok):
    """The metrics of the steps before the cut are not the new run's: they were sampled and
    trained again from step 0, so the file holds each step once, as an uninterrupted run's."""
    cfg = _cfg(tmp_path, tok, "run.steps=3", "run.checkpoint_every=3")
    first = _trainer(cfg, tok)
    first.save = lambda step: None  # "killed" after step 2, before its first checkpoint
    first.train(steps=2)
    first.close()
    assert not list((tmp_path / "checkpoints").glob("[0-9]*"))
    again = _trainer(cfg, tok)
    assert again.start_step == 0
    history = again.train()
    again.close()
    logged = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in logged] == [1, 2, 3]
    assert [m["loss"] for m in logged] == [h["loss"] for h in history]


def test_train_in_segments_continues_one_run(tmp_path, tok):
    """Iterative GRPO calls train(2) then train(4) on one Trainer: the second call must take
    steps 3-4 with the questions, RNG and optimizer state of an uninterrupted train(4)."""
    one = _trainer(_cfg(tmp_path / "one", tok, "run.steps=4", "run.checkpoint_every=0"), tok)
    whole = one.train()
    one.close()
    seg = _trainer(_cfg(tmp_path / "seg", tok, "run.steps=4", "run.checkpoint_every=0"), tok)
    seg.train(steps=2)
    assert seg.next_step == 2 and seg.start_step == 0
    history = seg.train(steps=4)
    seg.close()
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    for a, b in zip(whole, history):
        for k in ("loss", "reward_mean", "kl", "grad_norm", "lr"):
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), one.params, seg.params)


@pytest.mark.parametrize("algorithm", ["sft", "rft", "online_rft", "dpo", "ppo", "grpo"])
def test_every_algorithm_runs_two_steps(tmp_path, tok, algorithm):
    cfg = _cfg(tmp_path, tok, f"rl.algorithm={algorithm}", "run.steps=2", "run.checkpoint_every=0")
    trainer = _trainer(cfg, tok)
    before = jax.tree.map(np.asarray, trainer.params)
    t0 = time.perf_counter()
    history = trainer.train()
    wall = time.perf_counter() - t0
    trainer.close()
    assert [h["step"] for h in history] == [1, 2]
    # The step's time splits into disjoint phases (SFT reads a dataset: nothing is scored).
    phases = [h[k] for h in history for k in ("sample_time_s", "score_time_s", "update_time_s") if k in h]
    assert min(phases) >= 0 and sum(phases) <= wall
    assert all(("score_time_s" in h) == (algorithm != "sft") for h in history)
    assert all(np.isfinite(h["loss"]) for h in history)
    moved = max(float(np.abs(np.asarray(a) - b).max()) for a, b in
                zip(jax.tree.leaves(trainer.params), jax.tree.leaves(before)))
    if algorithm == "dpo":  # DPO learns only from questions with a correct and an incorrect sample
        assert moved > 0 or all(h["pairs_fraction"] == 0 for h in history)
    else:
        assert moved > 0, algorithm


def test_rollout_in_calls_of_a_few_questions_equals_one_call(tmp_path, tok):
    """rl.sample_prompts=1 samples the step's 4 questions in 4 calls (on the trainer's mesh of 8
    CPU devices, static ones): same rows as one call."""
    batches = []
    for per_call in (0, 1):
        trainer = _trainer(_cfg(tmp_path / str(per_call), tok, f"rl.sample_prompts={per_call}"), tok)
        batches.append(trainer.make_batch(0, jax.random.key(3))[0])
        trainer.close()
    one, calls = batches
    assert one.tokens.shape == (16, 8)  # 4 questions x G=4 rows, rl.max_new_tokens columns
    for name in ("prompt_tokens", "prompt_mask", "tokens", "mask", "rewards", "truncated"):
        np.testing.assert_array_equal(getattr(one, name), getattr(calls, name), err_msg=name)
    np.testing.assert_allclose(one.sample_logprobs, calls.sample_logprobs, atol=1e-5)
    assert len({tuple(r) for r in np.asarray(one.tokens)}) > 4  # the group's samples differ


def test_the_slot_engine_trains_on_the_static_engines_rows(tmp_path, tok):
    """rl.decode=slots with 3 slots (rl.decode_slots) over the step's 16 rows: the batch of
    the static engine, and two GRPO steps with the same metrics to the log-prob tolerance."""
    runs = []
    for name, overrides in (("static", ()), ("slots", ("rl.decode=slots", "rl.decode_slots=3"))):
        trainer = _trainer(_cfg(tmp_path / name, tok, "rl.sample_prompts=1", *overrides), tok)
        assert trainer.sampler.settings.slots == (3 if overrides else 0)
        assert trainer.sampler.engine.refills == bool(overrides)  # auto on the trainer's CPU mesh: static
        batch = trainer.make_batch(0, jax.random.key(3))[0]
        runs.append((batch, trainer.train(steps=2)))
        trainer.close()
    (static, static_history), (slotted, slot_history) = runs
    for name in ("prompt_tokens", "prompt_mask", "tokens", "mask", "rewards", "truncated"):
        np.testing.assert_array_equal(getattr(static, name), getattr(slotted, name), err_msg=name)
    np.testing.assert_allclose(static.sample_logprobs, slotted.sample_logprobs, atol=1e-5)
    assert [h["step"] for h in static_history] == [h["step"] for h in slot_history] == [1, 2]
    for a, b in zip(static_history, slot_history):
        for key in ("loss", "reward_mean", "kl", "grad_norm"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("overrides, engine", [
    (("rl.sample_prompts=1",), "slots"),  # 4 calls' rows: the slots refill from the queue
    (("rl.sample_prompts=4",), "feature_major"),  # one call's rows: nothing to refill
    ((), "feature_major"),
    (("rl.sample_prompts=1", "rl.decode=unrolled"), "unrolled"),  # asked for by name
])
def test_auto_takes_the_slot_engine_where_a_step_spans_calls_on_one_cpu_device(tmp_path, tok, overrides, engine):
    from grpo_jax.parallel.sharding import mesh_from_shape
    from grpo_jax.sampler import Sampler

    cfg = _cfg(tmp_path, tok, *overrides)
    assert Sampler.for_run(cfg, None, tok).engine.name == engine
    on_mesh = Sampler.for_run(cfg, mesh_from_shape((1, 2, 1), jax.devices()[:2]), tok)
    assert not on_mesh.engine.refills  # a CPU mesh: not measured, static


def test_the_last_in_run_evaluation_is_kept_per_question_as_evaluate_gives_it(tmp_path, tok):
    """Trainer.last_evaluation: the step and the per-question output (texts, correct) of its
    newest held-out evaluation, equal to `evaluate` of the trained params afterwards (what
    experiments/gsm8k_grpo.py reports as "after" without decoding again)."""
    from grpo_jax.eval.evaluation import evaluate

    cfg = _cfg(tmp_path, tok, "run.steps=3", "run.eval_every=2", "run.checkpoint_every=0")
    examples = SevensTask().examples("test", 4, 0)
    trainer = _trainer(cfg, tok, eval_examples=examples)
    assert trainer.last_evaluation is None
    history = trainer.train()
    step, kept = trainer.last_evaluation
    again = evaluate(trainer.sampler, trainer.params, trainer.task, tok, examples, key=jax.random.key(1), texts=True)
    trainer.close()
    assert step == 3 and [h["step"] for h in history if "eval_accuracy" in h] == [2, 3]
    assert kept["texts"] == again["texts"] and kept["correct"] == again["correct"]
    assert kept["accuracy"] == again["accuracy"] == history[-1]["eval_accuracy"]


def test_bfloat16_sampling_copy_reaches_the_sampler(tmp_path, tok, monkeypatch):
    """rl.sample_dtype=bfloat16: the sampler reads bf16 weights, so its log-probs differ
    from the float32 trainer's (logprob_mismatch_*); with float32 they agree. With
    mesh.slice the copy lives on the slice's sampling mesh (v5litepod-8: 2 replicas x
    tensor 4), the train state on its train mesh (fsdp 8)."""
    from grpo_jax import sampler
    from grpo_jax.parallel.sharding import mesh_of

    seen, sample_to_host = [], sampler.sample_to_host

    def spy(cfg, params, *args, **kw):
        seen.append(({str(x.dtype) for x in jax.tree.leaves(params)}, dict(mesh_of(params).shape)))
        return sample_to_host(cfg, params, *args, **kw)

    monkeypatch.setattr(sampler.host, "sample_to_host", spy)
    mismatch = {}
    for dtype in ("float32", "bfloat16"):
        trainer = _trainer(_cfg(tmp_path / dtype, tok, f"rl.sample_dtype={dtype}", "mesh.slice=v5litepod-8"), tok)
        metrics = trainer.train_step(0)
        assert {str(x.dtype) for x in jax.tree.leaves(trainer.params)} == {"float32"}  # master weights
        assert dict(mesh_of(trainer.params).shape) == {"data": 1, "fsdp": 8, "tensor": 1}
        trainer.close()
        assert seen.pop() == ({dtype}, {"data": 2, "fsdp": 1, "tensor": 4})
        mismatch[dtype] = (metrics["logprob_mismatch_mean"], metrics["logprob_mismatch_max"])
    # Measured: bf16 mean 2.2e-4, f32 max 4.8e-7 (rounding of the batch shapes only).
    assert mismatch["float32"][1] < 1e-5, mismatch
    assert mismatch["bfloat16"][0] > 50 * mismatch["float32"][1], mismatch


def test_bad_configs_fail_clearly(tmp_path, tok):
    with pytest.raises(ConfigError, match="rl.algorithm='reinforce' is not one of"):
        _cfg(tmp_path, tok, "rl.algorithm=reinforce")
    with pytest.raises(ConfigError, match="group_size=1 with rl.scale_by_std=true"):
        _cfg(tmp_path, tok, "rl.group_size=1")
    with pytest.raises(ConfigError, match="rl.sample_prompts=3 must divide data.batch_size=4"):
        _cfg(tmp_path, tok, "rl.sample_prompts=3")
    with pytest.raises(ConfigError, match="rl.sample_dtype='float16' is not one of"):
        _cfg(tmp_path, tok, "rl.sample_dtype=float16")
    cfg0 = _cfg(tmp_path, tok, "rl.beta=0")
    cfg1 = cfg0.replace(rl={"beta": 0.04})
    tx, _ = make_optimizer(cfg0.optimizer, 10)
    state = init_train_state(cfg0, init_params(cfg0.model, jax.random.key(0)), tx)
    assert state.ref_params is None  # β = 0 keeps no reference model at all
    step = make_train_step(cfg1, tx, _trainer(cfg0, tok).mesh)
    with pytest.raises(ValueError, match="needs reference"):
        step(state, None)  # the state is checked before the batch is read
    with pytest.raises(ValueError, match="pass sft_data"):
        Trainer(_cfg(tmp_path, tok, "rl.algorithm=sft"), task=SevensTask(), tokenizer=tok,
                params=init_params(cfg0.model, jax.random.key(0)), progress=False)


def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path, tok):
    cfg = _cfg(tmp_path, tok, "run.steps=5", "run.max_bad_steps=2", "run.checkpoint_every=0", "rl.beta=0")
    trainer = _trainer(cfg, tok)
    params0 = jax.tree.map(np.asarray, trainer.params)
    real_make_batch = trainer.make_batch

    def poisoned(step, key):  # NaN rewards -> NaN advantages -> NaN loss and gradients
        batch, info = real_make_batch(step, key)
        return batch.replace(rewards=np.full(np.shape(batch.rewards), np.nan, np.float32)), info

    trainer.make_batch = poisoned
    with pytest.raises(FloatingPointError, match="2 consecutive non-finite"):
        trainer.train()
    assert trainer.bad_steps == 2 and len(trainer.history) == 2
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), trainer.params, params0)


def _saved_steps(run_dir):
    ckpt = checkpointing.Checkpointer(run_dir / "checkpoints")
    steps = ckpt.all_steps()
    ckpt.close()
    return steps


def test_every_checkpoint_unreadable_stops_or_starts_over(tmp_path, tok, caplog):
    first = _trainer(_cfg(tmp_path, tok, "run.steps=4"), tok)
    first.train()
    first.close()
    ckpts = tmp_path / "checkpoints"
    damage(ckpts)
    damaged = files(ckpts)
    with pytest.raises(CheckpointError, match=(
            f"no readable checkpoint in {re.escape(str(ckpts))}: steps 2, 4 are unreadable .*set "
            f"run.restart_unreadable=true to move them into {re.escape(str(ckpts))}/unreadable/ and start "
            f"{re.escape(str(tmp_path))} over from step 0")):
        _trainer(_cfg(tmp_path, tok, "run.steps=6"), tok)
    assert files(ckpts) == damaged  # nothing moved or written without the switch

    with caplog.at_level("WARNING"):
        again = _trainer(_cfg(tmp_path, tok, "run.steps=6", "run.restart_unreadable=true"), tok)
    assert again.start_step == 0
    assert "moved unreadable checkpoint steps 2, 4 into" in caplog.text and "starts over from step 0" in caplog.text
    assert files(ckpts / "unreadable") == damaged  # kept byte for byte
    again.train()
    again.close()
    assert _saved_steps(tmp_path) == [2, 4, 6]  # every save of the new run is written
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    resumed = _trainer(_cfg(tmp_path, tok, "run.steps=6"), tok)
    resumed.close()
    assert resumed.start_step == 6
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), again.params, resumed.params)


@pytest.mark.parametrize("item", ["state", "meta"])
def test_unreadable_newest_step_is_set_aside_and_saved_again(tmp_path, tok, caplog, item):
    """Step 4's arrays, or only its JSON meta (config, bad-step count), cut short: the run
    resumes from step 2, and its own step 4 is written, not skipped as "already there"."""
    first = _trainer(_cfg(tmp_path, tok, "run.steps=4"), tok)
    first.train()
    first.close()
    step4 = jax.tree.map(np.asarray, first.state.params)
    ckpts = tmp_path / "checkpoints"
    damage(ckpts / "4" / item)
    damaged = files(ckpts / "4")
    with caplog.at_level("WARNING"):
        resumed = _trainer(_cfg(tmp_path, tok, "run.steps=6"), tok)
    assert resumed.start_step == 2
    assert "moved unreadable checkpoint step 4 into" in caplog.text and "resumes from step 2" in caplog.text
    assert files(ckpts / "unreadable" / "4") == damaged
    resumed.train()
    tree = resumed.ckpt.restore(checkpointing.abstract_like(resumed.checkpoint_tree()), step=4)[1]
    resumed.close()
    assert _saved_steps(tmp_path) == [2, 4, 6]
    # The new step 4 is the old one redone: resume is exact.
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), step4, tree["state"].params)


def _writable(folder) -> bool:
    probe = folder / ".write-probe"
    try:
        probe.touch()
    except OSError:
        return False
    probe.unlink()
    return True


def _immutable(folder, chattr) -> bool:
    return bool(chattr) and subprocess.run([chattr, "+i", str(folder)], capture_output=True).returncode == 0


@contextlib.contextmanager
def _read_only(folder):
    """`folder` refusing new entries. Root ignores the mode bits, so there the immutable
    attribute (chattr +i) stands in for them; where that is refused too, the test skips."""
    folder.chmod(0o555)
    chattr = shutil.which("chattr")
    try:
        if _writable(folder) and not (_immutable(folder, chattr) and not _writable(folder)):
            pytest.skip("cannot make a folder read-only here: root ignores its mode and chattr +i is refused")
        yield
    finally:
        if chattr:
            subprocess.run([chattr, "-i", str(folder)], capture_output=True)
        folder.chmod(0o755)


def test_a_save_that_fails_stops_the_run(tmp_path, tok):
    trainer = _trainer(_cfg(tmp_path, tok, "run.steps=4"), tok)
    ckpts = tmp_path / "checkpoints"
    with _read_only(ckpts):
        with pytest.raises(CheckpointError, match=f"could not save checkpoint step 2 in {re.escape(str(ckpts))} "):
            trainer.train()
    trainer.close()
    assert [h["step"] for h in trainer.history] == [1, 2]  # no step trained past the failed save
    assert _saved_steps(tmp_path) == []
