"""Benchmark evaluation: metrics from per-question records, and the SmolLM2 run on the shipped
GSM8K / MATH fixtures (hand computation from the JSONL, resume, shards)."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from grpo_jax.eval import evaluate_run, evaluation
from grpo_jax.model import pretrained
from grpo_jax.config import Config
from grpo_jax.errors import ConfigError
from grpo_jax.sampler import Sampler
from grpo_jax.tasks import get_task
from tests.xla_flags import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")

# n = 3 samples per question; hand-computed values below.
RECORDS = [
    {"index": 0, "greedy_correct": True, "answers": ["1", "2", "1"], "correct": [True, False, True]},
    {"index": 1, "greedy_correct": False, "answers": ["3", "3", None], "correct": [False, False, False]},
    {"index": 2, "greedy_correct": False, "answers": ["5", "4", "4"], "correct": [True, False, False]},
]


def test_wilson_interval_known_values():
    # 7/10: the textbook Wilson 95% interval is [0.3968, 0.8922].
    lo, hi = evaluation.wilson_interval(7, 10)
    assert lo == pytest.approx(0.39677, abs=1e-4) and hi == pytest.approx(0.89222, abs=1e-4)
    # 0/3: centre = half = (z²/6) / (1 + z²/3)
    z2 = 1.959964 ** 2
    assert evaluation.wilson_interval(0, 3) == (0.0, pytest.approx(2 * (z2 / 6) / (1 + z2 / 3)))
    with pytest.raises(ValueError, match="n >= 1"):
        evaluation.wilson_interval(0, 0)


def test_bootstrap_interval():
    assert evaluation.bootstrap_interval([0.25] * 7) == (0.25, 0.25)
    values = [0.0] * 5 + [1.0] * 5
    lo, hi = evaluation.bootstrap_interval(values, seed=3)
    assert (lo, hi) == evaluation.bootstrap_interval(values, seed=3)
    assert 0.0 < lo < 0.5 < hi < 1.0


def test_summarize_matches_hand_computation():
    s = evaluation.summarize(RECORDS)
    assert s["num_questions"] == 3 and s["samples_per_question"] == 3
    assert s["greedy"]["accuracy"] == pytest.approx(1 / 3)
    # pass@k = 1 - C(n-c, k)/C(n, k) per question, c = (2, 0, 1)
    assert s["pass@k"]["1"]["value"] == pytest.approx((2 / 3 + 0 + 1 / 3) / 3)
    assert s["pass@k"]["2"]["value"] == pytest.approx((1 + 0 + (1 - 1 / 3)) / 3)
    assert s["pass@k"]["3"]["value"] == pytest.approx(2 / 3)
    # maj@3 is exact: votes "1" (right), "3" (wrong), "4" (wrong)
    assert s["maj@k"]["3"]["value"] == pytest.approx(1 / 3)
    # and every K agrees with evaluation.py's curve functions (Maj@K's seed is seed + index)
    right = [{a for a, c in zip(r["answers"], r["correct"]) if c} for r in RECORDS]
    maj = evaluation.maj_at_k_curve([r["answers"] for r in RECORDS], lambda q, a: a in right[q], (1, 2, 3))
    pas = evaluation.pass_at_k_curve([r["correct"] for r in RECORDS], (1, 2, 3))
    for k in (1, 2, 3):
        assert s["maj@k"][str(k)]["value"] == pytest.approx(maj[k])
        assert s["pass@k"][str(k)]["value"] == pytest.approx(pas[k])


# ============================================================================ SmolLM2

@pytest.fixture(scope="module")
def smollm2():
    try:
        return pretrained.load("smollm2-135m")
    except pretrained.PretrainedError as e:
        pytest.skip(f"SmolLM2 unavailable: {str(e)[:200]}")


@pytest.fixture(scope="module", params=["gsm8k", "math"])
def bench(request, tmp_path_factory):
    task = get_task(request.param, data_dir=str(tmp_path_factory.mktemp("tfds")),
                    manual_dir=os.path.join(FIXTURES, request.param))
    return task, task.examples("test", -1, 0)


SETTINGS = evaluate_run.EvalSettings(num_samples=2, temperature=1.0, chunk_rows=2, prompt="paper")


def sampler_of(model_cfg, tok, max_new_tokens: int = 4) -> Sampler:
    """The sampler a run of the pretrained model would build, with max_new_tokens."""
    return Sampler.for_run(Config(model=model_cfg).replace(rl={"max_new_tokens": max_new_tokens}), None, tok)


def run(smollm2, bench, out, **kw):
    cfg, params, tok = smollm2
    task, examples = bench
    return evaluate_run.evaluate_shard(sampler_of(cfg, tok), params, tok, task, examples, str(out), SETTINGS,
                                       progress=False, **kw)


def records(out):
    return sorted((r for p in sorted(os.listdir(out)) if p.endswith(".jsonl")
                   for r in evaluate_run.read_records(os.path.join(out, p))), key=lambda r: r["index"])


@pytest.fixture(scope="module")
def whole(smollm2, bench, tmp_path_factory):
    """One uninterrupted single-process evaluation: (folder, summary)."""
    out = tmp_path_factory.mktemp("whole")
    run(smollm2, bench, out)
    return out, evaluate_run.merge_and_summarize(str(out))


def test_summary_is_the_jsonl_by_hand(bench, whole):
    task, examples = bench
    out, summary = whole
    recs = records(out)
    assert [r["index"] for r in recs] == list(range(len(examples)))
    for r, ex in zip(recs, examples):
        # the record's answers and correctness are the task's, recomputed from its text
        assert task.paper_prompt.format(question=ex.meta["question"]) in r["prompt"]
        assert r["greedy_answer"] == task.extract_answer(r["greedy_completion"])
        assert r["greedy_correct"] == task.is_correct(r["greedy_answer"], ex)
        assert len(r["completions"]) == 2
        assert r["answers"] == [task.extract_answer(c) for c in r["completions"]]
        assert r["correct"] == [task.is_correct(a, ex) for a in r["answers"]]
    q = len(recs)
    assert summary["greedy"]["accuracy"] == sum(r["greedy_correct"] for r in recs) / q
    for k in (1, 2):
        by_hand = sum(1 - math.comb(2 - sum(r["correct"]), k) / math.comb(2, k) for r in recs) / q
        assert summary["pass@k"][str(k)]["value"] == pytest.approx(by_hand)
    # Maj@2 with 2 samples: the first-listed most frequent answer decides
    maj2 = 0
    for r in recs:
        winner = evaluation.majority_vote(r["answers"])
        maj2 += winner is not None and r["correct"][r["answers"].index(winner)]
    assert summary["maj@k"]["2"]["value"] == pytest.approx(maj2 / q)
    assert summary["settings"]["num_samples"] == 2


def _one_dataset(bench):
    """Sharding and resuming do not depend on the dataset: one is enough for them."""
    if bench[0].name != "gsm8k":
        pytest.skip("the mechanics are the same on every dataset; gsm8k covers them")


def test_killed_and_resumed_gives_the_same_summary(smollm2, bench, whole, tmp_path):
    _one_dataset(bench)
    whole, expected = whole
    cut = tmp_path / "cut"
    # A kill while writing the second line: the first question is on disk, the second torn.
    os.makedirs(cut)
    shutil.copy(whole / "settings.json", cut / "settings.json")
    lines = (whole / "shard-00000-of-00001.jsonl").read_text().splitlines(keepends=True)
    (cut / "shard-00000-of-00001.jsonl").write_text(lines[0] + lines[1][:40])
    with pytest.raises(ValueError, match="not evaluated yet"):
        evaluate_run.merge_and_summarize(str(cut))
    times = run(smollm2, bench, cut)
    assert times["questions"] == len(bench[1]) - 1  # only the missing questions were sampled
    assert evaluate_run.merge_and_summarize(str(cut)) == expected


def test_two_shards_give_the_same_summary_as_one(smollm2, bench, whole, tmp_path):
    _one_dataset(bench)
    one, expected = whole
    for i in range(2):
        run(smollm2, bench, tmp_path, shard=i, num_shards=2)
    assert evaluate_run.merge_and_summarize(str(tmp_path)) == expected
    assert records(tmp_path) == records(one)


def test_other_settings_in_the_same_folder_are_an_error(smollm2, bench, whole):
    cfg, params, tok = smollm2
    task, examples = bench
    other = evaluate_run.EvalSettings(num_samples=3, chunk_rows=2, prompt="paper")
    # Every difference named, in key order, and the way out; one line from grpo-evaluate (a ConfigError).
    with pytest.raises(ConfigError, match=r"holds an evaluation with other settings \(max_new_tokens 4 -> 8, "
                                          r"num_samples 2 -> 3, temperature 1.0 -> 0.7\); use another --out or delete it"):
        evaluate_run.evaluate_shard(sampler_of(cfg, tok, 8), params, tok, task, examples, str(whole[0]), other,
                                    progress=False)


def test_cli_help():
    # PYTHONPATH: the script must import this checkout's package, not an installed one.
    out = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "evaluate.py"), "--help"],
                         capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert "--model" in out and "--k" in out and "--shard" in out and "--step" in out


def test_two_processes_give_the_same_records_as_one(bench, whole, tmp_path):
    """Two live evaluate.py processes, one shard each, running at the same time, then a
    --merge-only: the per-question records equal the single-process run's."""
    _one_dataset(bench)
    out = tmp_path / "out"
    # One CPU device per process (no fake 8-device mesh): the single-process run's program,
    # compiled as the suite compiles it.
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "evaluate.py"), "--model", "smollm2-135m",
           "--task", "gsm8k", "--data-dir", os.path.join(FIXTURES, "gsm8k"), "--k", "2",
           "--temperature", "1.0", "--max-new-tokens", "4", "--chunk-rows", "2", "--prompt", "paper",
           "--out", str(out), "--no-progress"]
    procs = [subprocess.Popen(cmd + ["--shard", f"{i}/2", "--tfds-dir", str(tmp_path / f"tfds{i}")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    assert sorted(os.listdir(out)) == ["settings.json", "shard-00000-of-00002.jsonl", "shard-00001-of-00002.jsonl"]
    merged = subprocess.run(cmd + ["--merge-only"], env=env, capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert records(out) == records(whole[0])
    summary = json.loads((out / "summary.json").read_text())
    assert {k: summary[k] for k in ("greedy", "pass@k", "maj@k")} == {k: whole[1][k] for k in ("greedy", "pass@k", "maj@k")}


@pytest.mark.parametrize("k, top_p, header", [
    (1, 1.0, "16 questions; greedy top-1 at temperature 0; pass@k and maj@k from 1 sample each at temperature 0.7"),
    (4, 0.9, "16 questions; greedy top-1 at temperature 0; pass@k and maj@k from 4 samples each at temperature 0.7, "
             "top-p 0.9"),
    (0, 1.0, "16 questions; greedy top-1 only (--k 0)")])
def test_the_table_says_what_each_row_was_drawn_at(k, top_p, header):
    """A greedy 0% beside a pass@1 of 6.2% (issue 86): the pass@1 sample is drawn at T = 0.7."""
    records = [{"index": q, "greedy_correct": False, "answers": ["1"] * k, "correct": [i == 0 for i in range(k)]}
               for q in range(16)]
    summary = {"settings": {"temperature": 0.7, "top_p": top_p},
               **evaluation.summarize(records, seed=0)}
    assert evaluate_run.format_summary(summary).splitlines()[0] == header
