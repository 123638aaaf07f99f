"""`grpo-evaluate --model <run dir>`: one curve point per saved checkpoint step, each equal
to `evaluation.evaluate` on that step's params restored the Trainer's way (full state)."""
import json

import jax
import pytest

from grpo_jax import checkpointing, config, evaluate_cli, evaluation, sampling, train_cli
from grpo_jax.errors import CheckpointError
from grpo_jax.sharding import make_mesh
from grpo_jax.tasks import get_task

LIMIT, K = 8, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = config.load_config("cpu-tiny", [
        "rl.algorithm=sft", "run.steps=2", "run.checkpoint_every=1", "run.eval_every=0", "data.task=arithmetic",
        "data.batch_size=4", "rl.max_new_tokens=12", "rl.decode=shared", f"run.run_dir={run_dir}"])
    trainer = train_cli.train(cfg, progress=False)
    return str(run_dir), trainer


def test_run_dir_curve_has_one_point_per_step_equal_to_evaluate(run, tmp_path):
    run_dir, trainer = run
    out = tmp_path / "eval"
    # --chunk-rows 16: all 8 questions in one sampler call, as evaluate samples them.
    curve = evaluate_cli.main(["--model", run_dir, "--task", "arithmetic", "--limit", str(LIMIT), "--k", str(K),
                               "--chunk-rows", "16", "--no-progress", "--out", str(out)])
    assert [p["step"] for p in curve["points"]] == [1, 2]
    assert json.loads((out / "curve.json").read_text()) == curve
    assert (out / "curve.png").stat().st_size > 0

    cfg = trainer.cfg
    task = get_task("arithmetic")
    examples = task.examples("test", LIMIT, 0)
    mesh = make_mesh(config.MeshConfig(), jax.local_devices())
    ckpt = checkpointing.Checkpointer(f"{run_dir}/checkpoints")
    sampled = []
    for point in curve["points"]:
        step, tree, _ = ckpt.restore(checkpointing.abstract_like(trainer._checkpoint_tree()), step=point["step"])
        # The CLI's key for question chunk 0: fold_in(PRNGKey(seed), 0); evaluate samples with fold_in(key, 1) too.
        want = evaluation.evaluate(cfg, tree["state"].params, task, trainer.tokenizer, examples, mesh=mesh,
                                   key=jax.random.fold_in(jax.random.PRNGKey(0), 0), num_samples=K,
                                   temperature=0.7, ks=[K], texts=True)
        assert point["greedy"] == want["accuracy"]
        assert point[f"pass@{K}"] == pytest.approx(want[f"pass@{K}"])
        summary = json.loads((out / f"step-{step}" / "summary.json").read_text())
        assert summary["settings"]["step"] == step and summary["num_questions"] == LIMIT
        lines = (out / f"step-{step}" / "shard-00000-of-00001.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert want["texts"] == [r["greedy_completion"] for r in records]
        assert want["correct"] == [r["greedy_correct"] for r in records]
        sampled.append([r["completions"] for r in records])
    ckpt.close()
    # Same keys, different checkpoints: the steps were really evaluated on their own params.
    assert sampled[0] != sampled[1]


def test_step_option_and_missing_checkpoints(run, tmp_path, monkeypatch):
    """--step evaluates one checkpoint, with the run's decode engine (rl.decode) unless
    --decode names another."""
    run_dir, _ = run
    common = ["--task", "arithmetic", "--limit", "2", "--k", "0", "--no-progress"]
    engines = []
    sample = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda *a, **kw: engines.append(kw["engine"]) or sample(*a, **kw))
    curve = evaluate_cli.main(["--model", run_dir, "--step", "2", "--out", str(tmp_path / "one"), *common])
    evaluate_cli.main(["--model", run_dir, "--step", "2", "--out", str(tmp_path / "two"), "--decode", "scan", *common])
    assert engines == ["shared", "scan"]
    assert [p["step"] for p in curve["points"]] == [2] and set(curve["points"][0]) == {"step", "greedy", "greedy_ci95"}
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.json").write_text(config.load_config("cpu-tiny").to_json())
    with pytest.raises(CheckpointError, match=f"{empty} is a training run dir with no checkpoints"):
        evaluate_cli.main(["--model", str(empty), "--out", str(tmp_path / "none"), *common])
