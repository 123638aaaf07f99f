"""grpo-export (grpo_jax.cli.export) on a full fine-tune's run dir; the LoRA case (adapters
merged into the checked base) is in tests/model/test_lora.py."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from grpo_jax import config
from grpo_jax.cli import evaluate as evaluate_cli, export as export_cli, runs, train as train_cli
from grpo_jax.model import pretrained
from grpo_jax.model import transformer as model_lib
from grpo_jax.errors import CheckpointError, ConfigError
from grpo_jax.text.tokenizer import encode_prompt


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
    assert (record["tokenizer"], record["max_new_tokens"]) == ("sentencepiece", 8)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).stat().st_size <= 1e6 + 1e5 for f in files)
    cfg, params, tok = pretrained.load_hf(out)
    assert tok.model_proto == trainer.tokenizer.model_proto and cfg.num_layers == trainer.cfg.model.num_layers
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


# ----------------------------------------------------------------------------- the export read back

@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    export_cli.main([run[0], "--out", str(out)])
    return out


CHATS = [[{"role": "user", "content": "Q: 3+4-5=\n"}],
         [{"role": "system", "content": "Q: 1+1=\n"}, {"role": "user", "content": "Q: 12-7=\n"}]]


def test_transformers_encodes_the_export_as_the_run_did(run, exported):
    """AutoTokenizer on the export gives the run's ids: BOS first, the dummy-prefix "▁" piece,
    the same special ids, for the run's own prompts, odd text, and chat prompts through the
    exported template."""
    transformers = pytest.importorskip("transformers")
    tok = run[1].tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(exported)
    assert (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
    texts = [ex.prompt for ex in runs.make_task(run[1].cfg.data.task, run[1].cfg.data).examples("test", 16, 3)]
    texts += ["Q: 3+4-5=\n", "\nQ: 1+1=", "  two  spaces \n\n", "ünïcödé ☃ Q", "", "12345678901234"]
    for text in texts:
        ids = encode_prompt(tok, text)
        assert ref(text)["input_ids"] == ids, text
    first = ref("Q: 3+4-5=\n")["input_ids"]
    assert first[0] == 1 and ref.convert_ids_to_tokens(first[1]).startswith("▁")
    for messages in CHATS:
        theirs = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert list(theirs) == encode_prompt(tok, tok.apply_chat_template(messages))


def _summary_and_records(out):
    records = [json.loads(line) for f in sorted(out.glob("shard-*.jsonl")) for line in f.read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), sorted(records, key=lambda r: r["index"])


def test_evaluate_reads_the_export_and_reproduces_the_run(run, exported, tmp_path):
    """grpo-evaluate on the export: the run dir's prompts, greedy completions and accuracy on
    the same held-out questions; transformers on the export: the same greedy completions,
    and the run's logits over varied text (each question's prompt and worked answer)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    run_dir, trainer = run
    # --max-new-tokens left out: the export's record holds the run's rl.max_new_tokens.
    same = ["--task", "arithmetic", "--limit", "4", "--seed", "5", "--k", "0",
            "--decode", "shared", "--prompt", "task", "--no-progress"]
    evaluate_cli.main(["--model", run_dir, *same, "--out", str(tmp_path / "run")])
    evaluate_cli.main(["--model", str(exported), *same, "--math-verify", "--out", str(tmp_path / "export")])
    run_summary, run_records = _summary_and_records(tmp_path / "run" / "step-1")
    summary, records = _summary_and_records(tmp_path / "export")
    for key in ("prompt", "greedy_completion", "greedy_answer"):
        assert [r[key] for r in records] == [r[key] for r in run_records], key
    assert summary["greedy"] == run_summary["greedy"]
    assert summary["settings"]["max_new_tokens"] == run_summary["settings"]["max_new_tokens"] == 8
    second = json.loads((tmp_path / "export" / "math_verify.json").read_text())  # --math-verify's report
    assert second["questions"] == 4 and second["greedy_accuracy"]["ours"] == summary["greedy"]["accuracy"]
    assert sum(second["counts"].values()) == 4

    tok, cfg = trainer.tokenizer, trainer.cfg.model
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    params = pretrained.load(exported)[1]
    examples = runs.make_task(trainer.cfg.data.task, trainer.cfg.data).examples("test", 4, 5)
    assert [ex.prompt for ex in examples] == [r["prompt"] for r in records]
    # One compiled forward: every text right-padded to one length (padding does not change
    # the logits before it).
    forward = jax.jit(lambda p, t, m: model_lib.forward_logits(cfg, p, t, m))
    task = runs.make_task(trainer.cfg.data.task, trainer.cfg.data)
    for rec, ex in zip(records, examples):
        ids = encode_prompt(tok, rec["prompt"])
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_id,
                                 eos_token_id=tok.stop_ids)
        assert tok.decode(out[0, len(ids):].tolist()) == rec["greedy_completion"]
        full = encode_prompt(tok, task.sft_text(ex))
        assert len(full) <= 96
        tokens = np.full((1, 96), tok.pad_id, np.int32)
        tokens[0, :len(full)] = full
        ours = np.asarray(forward(params, tokens, np.arange(96)[None] < len(full)))[0, :len(full)]
        with torch.no_grad():
            theirs = model(torch.tensor([full])).logits[0].numpy()
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_evaluate_defaults_an_export_to_the_runs_task_and_held_out_questions(run, exported, tmp_path):
    """No --task, --limit, --seed or --prompt: the export is evaluated as its run dir is, on the
    run's task (its data.* knobs) and its data.eval_size held-out questions drawn with data.seed."""
    run_dir, trainer = run
    record = pretrained.export_record(exported)
    assert record["task"] == {"task": trainer.task.name, "prompt": "task"}
    assert record["data"]["eval_size"] == trainer.cfg.data.eval_size
    same = ["--k", "0", "--decode", "shared", "--no-progress"]
    evaluate_cli.main(["--model", run_dir, *same, "--out", str(tmp_path / "run")])
    evaluate_cli.main(["--model", str(exported), *same, "--out", str(tmp_path / "export")])
    run_summary, run_records = _summary_and_records(tmp_path / "run" / "step-1")
    summary, records = _summary_and_records(tmp_path / "export")
    held_out = trainer.task.examples("test", trainer.cfg.data.eval_size, trainer.cfg.data.seed)
    assert [r["prompt"] for r in records] == [r["prompt"] for r in run_records] == [ex.prompt for ex in held_out]
    assert summary["greedy"] == run_summary["greedy"]
