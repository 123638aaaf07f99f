"""grpo-export (grpo_jax.export_cli) on a full fine-tune's run dir; the LoRA case (adapters
merged into the checked base) is in tests/test_lora.py."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from grpo_jax import config, export_cli, pretrained, train_cli
from grpo_jax.errors import CheckpointError, ConfigError


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = config.load_config("cpu-tiny", [
        "rl.algorithm=sft", "run.steps=1", "run.checkpoint_every=1", "run.eval_every=0",
        "data.batch_size=4", "rl.max_new_tokens=8", f"run.run_dir={run_dir}"])
    trainer = train_cli.train(cfg, progress=False)
    return str(run_dir), trainer


def test_export_is_the_checkpoints_policy_in_sharded_safetensors(run, tmp_path):
    run_dir, trainer = run
    out = tmp_path / "hf"
    record = export_cli.main([run_dir, "--out", str(out), "--max-shard-gb", "0.001"])
    assert record["step"] == 1 and record["lora"] is None
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).stat().st_size <= 1e6 + 1e5 for f in files)
    cfg, params, tok = pretrained.load_hf(out)
    assert tok is None and cfg.num_layers == trainer.cfg.model.num_layers
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params),
                 jax.tree.map(np.asarray, trainer.params))
    assert json.loads((out / export_cli.PROVENANCE_FILE).read_text()) == record
    assert (out / "tokenizer.model").read_bytes() == (Path(run_dir) / "tokenizer.model").read_bytes()


@pytest.mark.parametrize("argv, error, match", [
    (["{tmp}", "--out", "{tmp}/x"], ConfigError, "is not a training run dir"),
    (["{run}", "--out", "{tmp}/x", "--step", "7"], CheckpointError, r"no checkpoint step 7; saved steps: \[1\]"),
    (["{run}", "--out", "{tmp}/x", "--max-shard-gb", "0"], ConfigError, "--max-shard-gb must be > 0"),
])
def test_bad_requests_are_refused_in_one_line(run, tmp_path, argv, error, match):
    argv = [a.format(tmp=tmp_path, run=run[0]) for a in argv]
    with pytest.raises(error, match=match) as e:
        export_cli.main(argv)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "x" / "config.json").exists()
