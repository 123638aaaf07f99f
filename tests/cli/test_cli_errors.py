"""A corpus of bad inputs run through the real entry points (issue 21): each exits 2 with one
`<prog>: error:` line on stderr naming the problem, no traceback, and a run dir that held
checkpoints is byte-identical afterwards."""
import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from tests.checkpoint_files import damage
from tests.xla_flags import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
TRAIN = ["experiments/train.py", "--no-progress"]
# The real run the run-dir cases resume: SFT (no sampler to compile), one layer, one step.
TINY_RUN = ["rl.algorithm=sft", "run.steps=1", "run.checkpoint_every=1", "run.eval_every=0",
            "model.num_layers=1", "data.batch_size=2"]


def _run(argv, env, devices=1):
    env = {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _tree_digest(folder):
    """Every file's relative path and bytes: any write, new file or deletion changes it."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            digest.update(os.path.relpath(path, folder).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _bad_inputs(tmp):
    """(prog, argv, distinctive part of the message, devices) per case, and the files they read."""
    empty = tmp / "empty"
    empty.mkdir()
    truncated = tmp / "gsm8k_truncated"
    shutil.copytree(os.path.join(FIXTURES, "gsm8k"), truncated)
    lines = (truncated / "train.jsonl").read_text().splitlines(keepends=True)
    (truncated / "train.jsonl").write_text(lines[0] + lines[1][:40] + "\n" + "".join(lines[2:]))
    no_test = tmp / "gsm8k_no_test"
    shutil.copytree(os.path.join(FIXTURES, "gsm8k"), no_test)
    (no_test / "test.jsonl").unlink()
    bad_math = tmp / "math_bad"
    shutil.copytree(os.path.join(FIXTURES, "math"), bad_math)
    (bad_math / "test" / "algebra" / "9.json").write_text('{"problem": "1+1", "level": "Level 1"}')
    not_gguf = tmp / "model.gguf"
    not_gguf.write_text("this is not a GGUF file\n")
    garbled_rm = tmp / "rm_garbled"
    garbled_rm.mkdir()
    (garbled_rm / "reward_model.json").write_text('{"format": "grpo_jax.reward_model/1", "kind": ')
    small_rm = tmp / "rm_small_vocab"  # metadata of a reward model too small for the policy's tokens
    small_rm.mkdir()
    model = {"vocab_size": 8, "embed_dim": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
             "head_dim": 16, "mlp_dim": 64, "max_seq_len": 64}
    (small_rm / "reward_model.json").write_text(json.dumps(
        {"format": "grpo_jax.reward_model/1", "kind": "outcome", "loss": "pairwise", "transform": "sigmoid",
         "process_reduce": "min", "tokenizer": "none", "model": model}))
    fresh = f"run.run_dir={tmp / 'fresh'}"
    ev = ["experiments/evaluate.py", "--no-progress", "--out", str(tmp / "eval")]
    return [
        ("train.py", TRAIN + ["rl.foo=1"], "unknown config key 'rl.foo'", 1),
        ("train.py", TRAIN + ["rl.group_size=0"], "rl.group_size must be >= 1, got 0", 1),
        ("train.py", TRAIN + ["rl.beta=abc"], "rl.beta expects float", 1),
        ("train.py", TRAIN + ["rl.beta"], "'rl.beta' is not of the form section.field=value", 1),
        ("train.py", TRAIN + ["--preset", "nope"], "argument --preset: invalid choice: 'nope'", 1),
        ("train.py", TRAIN + ["rl.algorithm=ppo", "rl.gamma=2"], "rl.gamma", 1),
        ("train.py", TRAIN + [fresh, "mesh.ici_fsdp=3"], "mesh asks for 3 devices", 8),
        ("train.py", TRAIN + [fresh, "data.task=gsm8k", f"data.data_dir={empty}"], "is missing or empty", 1),
        ("train.py", TRAIN + [fresh, "data.task=gsm8k", f"data.data_dir={truncated}"],
         f"{truncated / 'train.jsonl'}:2: not a GSM8K row (invalid JSON", 1),
        ("train.py", TRAIN + [fresh, "data.task=gsm8k", f"data.data_dir={no_test}"],
         f"'{no_test / 'test.jsonl'}' not found", 1),
        ("train.py", TRAIN + [fresh, "data.task=math", f"data.data_dir={bad_math}"],
         f"{bad_math / 'test' / 'algebra' / '9.json'}: not a MATH problem (missing field 'solution')", 1),
        ("train.py", TRAIN + [fresh, f"run.pretrained={not_gguf}"], "model.gguf is not a GGUF file", 1),
        ("train.py", TRAIN + [fresh, f"run.pretrained={tmp / 'missing.gguf'}"],
         "missing.gguf' is neither a GGUF file", 1),
        ("train.py", TRAIN + [fresh, "rl.algorithm=grpo", f"rl.reward_model={tmp / 'no_rm'}"],
         "no_rm' is not a directory", 1),
        ("train.py", TRAIN + [fresh, "rl.algorithm=grpo", f"rl.reward_model={garbled_rm}"],
         "reward_model.json: not valid JSON", 1),
        ("train.py", TRAIN + [fresh, "rl.algorithm=grpo", f"rl.reward_model={small_rm}"],
         "has a vocabulary of 8 tokens, the policy's tokenizer", 1),
        ("evaluate.py", ev + ["--model", str(not_gguf), "--task", "arithmetic", "--limit", "2"],
         "model.gguf is not a GGUF file", 1),
        ("evaluate.py", ev + ["--model", "smollm2-135m", "--task", "nope"], "unknown task 'nope'", 1),
        ("evaluate.py", ev + ["--model", "smollm2-135m", "--task", "arithmetic", "--shard", "3/2"],
         "--shard 3/2: need 0 <= i < n", 1),
        ("evaluate.py", ev + ["--model", "smollm2-135m", "--task", "arithmetic"], "give --limit N", 1),
        ("gsm8k_grpo.py", ["experiments/gsm8k_grpo.py", fresh, "data.task=countdown"],
         "data.task=countdown is not run by this script", 1),
        ("smollm2_grpo.py", ["experiments/smollm2_grpo.py", fresh, f"data.data_dir={empty}"],
         "data.data_dir is not read by data.task=chat_arithmetic", 1),
    ]


def _run_dir_cases(run_dir, no_config_dir, damaged_dir):
    """Resuming checkpoints with a different setup: the saved config names the field; without a
    saved config the stored shapes name the parameter. Checkpoints of which none is readable
    are named, with the switch that starts over."""
    return [
        ("train.py", TRAIN + TINY_RUN + [f"run.run_dir={run_dir}", "model.num_layers=2"],
         "model.num_layers: saved 1, requested 2", 1),
        ("train.py", TRAIN + [f"run.run_dir={run_dir}", "model.num_layers=1", "data.batch_size=2",
                              "rl.algorithm=grpo"],
         "rl.algorithm: saved 'sft', requested 'grpo'", 1),
        ("train.py", TRAIN + TINY_RUN + [f"run.run_dir={no_config_dir}", "model.mlp_dim=96"],
         "['state'].params['layers']['mlp']['down'] is stored as (1, 384, 128), the model expects (1, 96, 128)", 1),
        ("train.py", TRAIN + TINY_RUN + [f"run.run_dir={damaged_dir}", "run.steps=2"],
         f"set run.restart_unreadable=true to move them into {damaged_dir / 'checkpoints'}/unreadable/ "
         f"and start {damaged_dir} over from step 0", 1),
    ]


def test_bad_inputs_exit_2_with_one_line_and_leave_run_dirs_untouched(tmp_path):
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "GRPO_JAX_DEBUG": "",
           "TFDS_DATA_DIR": str(tmp_path / "tfds")}  # prepared datasets stay in tmp_path
    run_dir, no_config_dir, damaged_dir = tmp_path / "run", tmp_path / "run_no_config", tmp_path / "run_damaged"
    cases = _bad_inputs(tmp_path)
    outcomes = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        made = pool.submit(_run, TRAIN + TINY_RUN + [f"run.run_dir={run_dir}"], env)
        outcomes += [(case, pool.submit(_run, case[1], env, case[3])) for case in cases]
        done = made.result()
        assert done.returncode == 0, done.stderr[-2000:]
        # The same checkpoint as written by a version that saved no config with it.
        shutil.copytree(run_dir, no_config_dir)
        meta_file = no_config_dir / "checkpoints" / "1" / "meta" / "metadata"
        meta = json.loads(meta_file.read_text())
        assert meta.pop("config")["model"]["num_layers"] == 1
        meta_file.write_text(json.dumps(meta))
        shutil.copytree(run_dir, damaged_dir)
        damage(damaged_dir / "checkpoints")
        digests = {d: _tree_digest(d) for d in (run_dir, no_config_dir, damaged_dir)}
        run_dir_cases = _run_dir_cases(run_dir, no_config_dir, damaged_dir)
        outcomes += [(case, pool.submit(_run, case[1], env, case[3])) for case in run_dir_cases]
        results = [(case, future.result()) for case, future in outcomes]
    assert len(results) >= 15
    wrong = [f"{argv} -> exit {out.returncode}: {out.stderr[-3000:]}"
             for (prog, argv, expected, _), out in results
             if not (out.returncode == 2 and "Traceback" not in out.stderr
                     and out.stderr.count("\n") == 1 and out.stderr.endswith("\n")
                     and out.stderr.startswith(f"{prog}: error: ") and expected in out.stderr)]
    assert not wrong, "\n".join(wrong)
    for folder, digest in digests.items():
        assert _tree_digest(folder) == digest, folder
    print(f"{len(results)} bad inputs in {time.perf_counter() - t0:.0f} s")
