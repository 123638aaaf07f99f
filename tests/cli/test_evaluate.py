"""`grpo-evaluate --model <run dir>`: one curve point per saved checkpoint step, each equal
to `evaluation.evaluate` on that step's params restored the Trainer's way (full state); the
run dirs of the quickstart and of a chat-model run are read with the run's own task, prompt
and lengths, and give the run's own evaluation. `--tools python` (the tool-integrated
protocol) on a run dir and its grpo-export, and the options it refuses."""
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import jax
import pytest

from grpo_jax.checkpoints import checkpointing
from grpo_jax import config, sampler
from grpo_jax.cli import evaluate as evaluate_cli, export as export_cli, runs, train as train_cli
from grpo_jax.eval import evaluation
from grpo_jax.model import pretrained
from grpo_jax.tasks import prompts
from grpo_jax.text.bpe_tokenizer import BPETokenizer
from grpo_jax.errors import CheckpointError, ConfigError
from grpo_jax.model.transformer import init_params
from grpo_jax.sampler import Sampler
from grpo_jax.parallel.sharding import make_mesh
from grpo_jax.tasks import get_task
from grpo_jax.tasks.chat import chat_task
from grpo_jax.rl.trainer import Trainer
from grpo_jax.tasks.shortcuts import shortcut_baselines
from grpo_jax.tools import SandboxLimits

from tests.text.test_bpe_tokenizer import tiny_meta

LIMIT, K = 8, 2
EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


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
        step, tree, _ = ckpt.restore(checkpointing.abstract_like(trainer.checkpoint_tree()), step=point["step"])
        # The CLI's key for question chunk 0: fold_in(PRNGKey(seed), 0); evaluate samples with fold_in(key, 1) too.
        want = evaluation.evaluate(Sampler.for_run(cfg, mesh, trainer.tokenizer), tree["state"].params, task,
                                   trainer.tokenizer, examples, key=jax.random.fold_in(jax.random.PRNGKey(0), 0),
                                   num_samples=K, temperature=0.7, ks=[K], texts=True)
        assert point["greedy"] == want["accuracy"]
        assert point[f"pass@{K}"] == pytest.approx(want[f"pass@{K}"])
        summary = json.loads((out / f"step-{step}" / "summary.json").read_text())
        assert summary["settings"]["step"] == step and summary["num_questions"] == LIMIT
        # The set's shortcut baselines beside the accuracy, as the library computes them.
        assert summary["shortcuts"] == shortcut_baselines(task, examples).to_dict()
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
    sample = sampler.sample
    monkeypatch.setattr(sampler.host, "sample", lambda *a, **kw: engines.append(a[3].engine) or sample(*a, **kw))
    curve = evaluate_cli.main(["--model", run_dir, "--step", "2", "--out", str(tmp_path / "one"), *common])
    evaluate_cli.main(["--model", run_dir, "--step", "2", "--out", str(tmp_path / "two"), "--decode", "scan", *common])
    assert engines == ["shared", "scan"]
    assert [p["step"] for p in curve["points"]] == [2] and set(curve["points"][0]) == {"step", "greedy", "greedy_ci95"}
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.json").write_text(config.load_config("cpu-tiny").to_json())
    with pytest.raises(CheckpointError, match=f"{empty} is a training run dir with no checkpoints"):
        evaluate_cli.main(["--model", str(empty), "--out", str(tmp_path / "none"), *common])


# ------------------------------------------------------------------ what the run itself measured

def script(name: str):
    """experiments/<name>.py as a module (the scripts import their siblings by name)."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "shard-00000-of-00001.jsonl").read_text().splitlines()]


def greedy_calls(monkeypatch) -> list[dict]:
    """Every greedy `sampler.sample` call from now on: its prompt ids and stop/length settings."""
    calls, sample = [], sampler.sample

    def spy(model_cfg, params, prompt_ids, settings, **kw):
        if settings.temperature == 0.0:
            calls.append({"prompts": [list(p) for p in prompt_ids], "stop_tokens": list(settings.stop_tokens),
                          "max_new_tokens": settings.max_new_tokens})
        return sample(model_cfg, params, prompt_ids, settings, **kw)

    monkeypatch.setattr(sampler.host, "sample", spy)
    return calls


def test_quickstart_run_dir_gives_the_accuracy_the_demo_printed(tmp_path, monkeypatch):
    """The demo's command on a tiny quickstart: `evaluate.py --model <root>/seed0/grpo --task
    modular` reads the run dir and reproduces the run's final evaluation, completion for
    completion; `grpo-train` on the same run dir resumes it."""
    monkeypatch.setitem(sys.modules, "common", script("common"))
    quickstart = script("quickstart")
    run_evals = []
    monkeypatch.setattr(quickstart, "evaluate",
                        lambda *a, **kw: run_evals.append(evaluation.evaluate(*a, **kw, texts=True)) or run_evals[-1])
    summary = quickstart.main([
        "--sft-steps", "2", "--sft-batch", "4", "--no-progress", f"run.run_dir={tmp_path / 'quickstart'}",
        "model.embed_dim=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "model.mlp_dim=64", "run.steps=1", "run.eval_every=1", "rl.group_size=2", "rl.beta=0", "data.batch_size=2",
        "data.eval_size=8", "rl.max_new_tokens=12"])
    run_dir = tmp_path / "quickstart" / "seed0" / "grpo"
    out = tmp_path / "eval"
    curve = evaluate_cli.main(["--model", str(run_dir), "--task", "modular", "--k", "0", "--no-progress",
                               "--out", str(out)])
    assert [p["step"] for p in curve["points"]] == [1]
    assert curve["points"][0]["greedy"] == summary["accuracy_after"] == summary["eval_history"][-1]["accuracy"]
    records = records_of(out / "step-1")
    assert [r["greedy_completion"] for r in records] == run_evals[-1]["texts"]
    cfg = config.Config.from_dict(json.loads((run_dir / "config.json").read_text()))
    task = runs.make_task(cfg.data.task, cfg.data)  # the testbed's knobs (modulus, operands), the quickstart's questions
    assert task.name == "modular" and summary["best_shortcut"] == summary["shortcuts"]["best_score"]
    assert summary["sft_until"]["steps"] == 2 and not summary["sft_until"]["reached"]  # stopped at its cap
    assert [r["prompt"] for r in records] == [ex.prompt for ex in task.examples("test", 8, cfg.data.seed)]
    tokenizer = (run_dir / "tokenizer.model").read_bytes()
    assert tokenizer == (tmp_path / "quickstart" / "seed0" / "tokenizer.model").read_bytes()
    resumed = train_cli.train(cfg, progress=False)
    assert resumed.start_step == 1 and resumed.history == []
    assert (run_dir / "tokenizer.model").read_bytes() == tokenizer


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random model with a ChatML tokenizer (SmolLM2's template and special tokens),
    saved as a pretrained folder: (folder, tokenizer)."""
    tok = BPETokenizer.from_gguf_metadata(tiny_meta())
    model_cfg = config.ModelConfig(vocab_size=tok.vocab_size, embed_dim=32, num_layers=1, num_heads=2,
                                   num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=256)
    folder = tmp_path_factory.mktemp("tiny_chat_model")
    pretrained.save_converted(folder, model_cfg, init_params(model_cfg, jax.random.key(0)), tok)
    return str(folder), tok


def test_chat_run_dir_asks_as_the_run_did(chat_model, tmp_path, monkeypatch):
    """A SmolLM2-style run (experiments/smollm2_grpo.py's way: chat_arithmetic asked as the
    bare question in the chat template): the evaluator sends exactly the prompt ids, stop
    tokens and length the run's own evaluation sent, and gets its accuracy. On the bare
    model, the default prompt is that same training prompt."""
    folder, tok = chat_model
    cfg = config.load_config("cpu-tiny", [
        f"run.pretrained={folder}", "data.task=chat_arithmetic", "data.eval_size=4", "rl.max_new_tokens=6", "run.steps=1",
        "model.max_seq_len=256", f"run.run_dir={tmp_path / 'run'}"])
    mesh = make_mesh(cfg.mesh)
    model_cfg, params, tokenizer = pretrained.load(folder, mesh=mesh)
    cfg = dataclasses.replace(cfg, model=model_cfg).validate()
    calls = greedy_calls(monkeypatch)
    trainer = Trainer(cfg, task=chat_task(get_task("chat_arithmetic"), tokenizer), tokenizer=tokenizer,
                      params=params, mesh=mesh, progress=False)
    # The run's own evaluation: what `Trainer.train` computes every run.eval_every steps (a
    # train step first would change the params, not what is asked), then the checkpoint.
    accuracy = evaluation.evaluate(trainer.sampler, trainer.params, trainer.task, tokenizer, trainer.eval_examples,
                                   key=jax.random.key(0))["accuracy"]
    trainer.save(1)
    trainer.close()
    curve = evaluate_cli.main(["--model", cfg.run.run_dir, "--k", "0", "--no-progress", "--out", str(tmp_path / "ev")])
    trained, evaluated = calls
    assert evaluated == trained
    assert evaluated["max_new_tokens"] == 6 and tok.token_to_id("<|im_end|>") in evaluated["stop_tokens"]
    question = get_task("chat_arithmetic").examples("test", 4, 0)[0].meta["question"]
    text = tok.decode(evaluated["prompts"][0], skip_special_tokens=False)
    assert text == prompts.build_prompt(question, tok, task="arithmetic")
    assert f"<|im_start|>user\n{question}<|im_end|>" in text
    assert curve["points"] == [{"step": 1, "greedy": accuracy, "greedy_ci95": curve["points"][0]["greedy_ci95"]}]

    bare = evaluate_cli.main(["--model", folder, "--task", "chat_arithmetic", "--limit", "4", "--k", "0",
                              "--max-new-tokens", "6", "--no-progress", "--out", str(tmp_path / "bare")])
    assert calls[-1] == trained
    assert bare["settings"]["prompt"] == "arithmetic"
    resumed = train_cli.train(cfg, progress=False)
    assert resumed.start_step == 1 and resumed.task.prompt_form == "arithmetic"  # grpo-train asks the same way


# ------------------------------------------------------------------ --tools python

@pytest.mark.parametrize("extra, match", [
    (["--max-tool-calls", "2"], "--max-tool-calls is for --tools python"),
    (["--tools", "python", "--max-tool-calls", "0"], "--max-tool-calls must be >= 1"),
    (["--tools", "python", "--prompt", "paper"], "--prompt paper and --tools python do not combine"),
    (["--tools", "python", "--math-verify"], "--math-verify and --tools python do not combine"),
    (["--tools", "python", "--task", "arithmetic"], "task 'arithmetic' has none"),
])
def test_tools_options_that_do_not_combine_are_refused_before_loading(extra, match, tmp_path):
    argv = ["--model", "smollm2-135m", "--task", "gsm8k_synth", "--limit", "2", "--no-progress",
            "--out", str(tmp_path / "ev"), *extra]
    with pytest.raises(ConfigError, match=match) as e:
        evaluate_cli.main(argv)
    assert "\n" not in str(e.value) and not (tmp_path / "ev").exists()


def test_an_unknown_tool_and_a_vocabulary_that_cannot_close_a_block(capsys):
    with pytest.raises(SystemExit) as e:
        evaluate_cli.main(["--model", "smollm2-135m", "--task", "gsm8k", "--tools", "bash"])
    assert e.value.code == 2 and "argument --tools: invalid choice: 'bash'" in capsys.readouterr().err

    class NoBacktick:  # the tiny sentencepiece models of the arithmetic tasks have no "`"
        vocab_size = 4

        def decode(self, ids):
            return "a"

    args = evaluate_cli.build_parser().parse_args(["--model", "m", "--tools", "python"])
    evaluate_cli.check_tools(args)
    assert args.max_tool_calls == evaluate_cli.DEFAULT_TOOL_CALLS == 4
    with pytest.raises(ConfigError, match="--tools python: no token of the vocabulary holds '`'"):
        evaluate_cli.tool_use(args, NoBacktick())


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    """A run dir of a tiny random chat model (byte-level BPE, so it can write a backtick) with
    room for a GSM8K question in the tool prompt, its checkpoint at step 1 as the chat test
    above saves it, and its grpo-export: (run dir, export folder)."""
    root = tmp_path_factory.mktemp("tool_run")
    tok = BPETokenizer.from_gguf_metadata(tiny_meta())
    model_cfg = config.ModelConfig(vocab_size=tok.vocab_size, embed_dim=32, num_layers=1, num_heads=2,
                                   num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=512)
    pretrained.save_converted(root / "model", model_cfg, init_params(model_cfg, jax.random.key(0)), tok)
    cfg = config.load_config("cpu-tiny", [
        f"run.pretrained={root / 'model'}", "data.task=chat_arithmetic", "rl.max_new_tokens=16",
        "model.max_seq_len=512", f"run.run_dir={root / 'run'}"])
    mesh = make_mesh(cfg.mesh)
    model_cfg, params, tokenizer = pretrained.load(root / "model", mesh=mesh)
    cfg = dataclasses.replace(cfg, model=model_cfg).validate()
    trainer = Trainer(cfg, task=chat_task(get_task("chat_arithmetic"), tokenizer), tokenizer=tokenizer,
                      params=params, mesh=mesh, progress=False)
    trainer.save(1)
    trainer.close()
    export_cli.main([str(root / "run"), "--out", str(root / "hf")])
    return root / "run", root / "hf"


def test_tools_python_on_a_run_dir_and_its_export(tool_run, tmp_path):
    """The protocol on a run dir (each step) and on the Hugging Face folder grpo-export wrote
    of it: the tool prompt in the chat template, the settings recorded, the summary's tool
    counts equal to a count of the JSONL, and the same completions from both."""
    run_dir, hf = tool_run
    common = ["--task", "gsm8k_synth", "--tools", "python", "--limit", "2", "--k", "0", "--no-progress"]
    curve = evaluate_cli.main(["--model", str(run_dir), "--out", str(tmp_path / "run"), *common])
    assert [p["step"] for p in curve["points"]] == [1]
    bare = evaluate_cli.main(["--model", str(hf), "--out", str(tmp_path / "hf"), *common])
    question = get_task("gsm8k_synth").examples("test", 2, 0)[0].meta["question"]
    for out in (tmp_path / "run" / "step-1", tmp_path / "hf"):
        settings = json.loads((out / "settings.json").read_text())
        assert (settings["tools"], settings["max_tool_calls"], settings["prompt"]) == ("python", 4, "tool")
        assert settings["sandbox"] == {"kind": "LocalSandbox", **json.loads(json.dumps(
            dataclasses.asdict(SandboxLimits())))}
        records = records_of(out)
        assert f"<|im_start|>user\n{question}\nPlease integrate natural language reasoning with programs" \
            in records[0]["prompt"]
        calls = [len(r["greedy_tool_calls"]) for r in records]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["tools"]["greedy"]["calls"] == sum(calls) and summary["tools"]["greedy"]["calls_histogram"] \
            == {str(c): calls.count(c) for c in range(5)}
        for r in records:
            if not r["greedy_tool_calls"]:  # no tool output: the model's own text is the completion
                assert r["greedy_answer"] == evaluation.final_answer(get_task("gsm8k_synth"), r["greedy_completion"])
    assert [r["greedy_completion"] for r in records_of(tmp_path / "hf")] == \
        [r["greedy_completion"] for r in records_of(tmp_path / "run" / "step-1")]
    assert bare["tools"] == json.loads((tmp_path / "run" / "step-1" / "summary.json").read_text())["tools"]
