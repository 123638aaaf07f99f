"""Evaluation: greedy accuracy, Pass@K and Maj@K, their 95% intervals, `sample_and_score`
(sample a policy on questions and score it: the one evaluation, in-run and benchmark) and
`evaluate` (its metrics on held-out questions; the trainer's periodic eval).

The metric functions are pure host-side Python over per-question lists of sampled answers
/ correctness flags (from the sampler and a task's ``extract_answer`` / ``is_correct``).
95% intervals: Wilson score interval for the greedy accuracy (a binomial proportion over
questions); percentile bootstrap over questions (seeded) for Pass@K and Maj@K, whose
per-question values are not 0/1. `grpo_jax.eval.evaluate_run` runs a whole benchmark through
`sample_and_score`, chunked, with resumable per-question JSONL; writing curves to PNG/JSON is the caller's business.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Hashable, Iterable, Sequence, TypeVar

A = TypeVar("A", bound=Hashable)

DEFAULT_KS = tuple(range(1, 65))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021).

        pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)

    The product form avoids huge binomials. It is the probability that a uniformly
    random k-subset of the n samples contains at least one correct one.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def majority_vote(answers: Iterable[A | None], key: Callable[[A], Hashable] | None = None) -> A | None:
    """The most frequent answer; None answers are ignored (None if nothing is left).

    Ties go to the answer whose class occurs first in ``answers`` (deterministic, and
    independent of hashing). ``key`` maps answers to classes of equal answers (default:
    the answer itself); the returned answer is the class's first occurrence.
    """
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, A] = {}
    order: list[Hashable] = []
    for answer in answers:
        if answer is None:
            continue
        cls = answer if key is None else key(answer)
        if cls is None:
            continue
        if cls not in counts:
            counts[cls] = 0
            first[cls] = answer
            order.append(cls)
        counts[cls] += 1
    if not order:
        return None
    best = order[0]
    for cls in order[1:]:
        if counts[cls] > counts[best]:  # strict: earlier classes win ties
            best = cls
    return first[best]


def greedy_accuracy(correct: Sequence[bool | float]) -> float:
    """Fraction of questions whose greedy (temperature 0) answer is correct."""
    if len(correct) == 0:
        raise ValueError("no questions")
    return sum(1.0 for c in correct if c) / len(correct)


def pass_at_k_curve(correct: Sequence[Sequence[bool]], ks: Iterable[int] = DEFAULT_KS) -> dict[int, float]:
    """Mean over questions of :func:`pass_at_k` for each K (K larger than n skipped).

    ``correct[q][j]`` says whether sample j of question q is correct. Only Ks with
    K <= min_q n_q are reported, so every question contributes to every point.
    """
    if len(correct) == 0:
        raise ValueError("no questions")
    n_min = min(len(samples) for samples in correct)
    curve = {}
    for k in ks:
        if 1 <= k <= n_min:
            curve[k] = sum(pass_at_k(len(s), sum(bool(x) for x in s), k) for s in correct) / len(correct)
    return curve


def maj_at_k(
    answers: Sequence[A | None],
    is_correct: Callable[[A], bool],
    k: int,
    *,
    num_subsets: int = 32,
    seed: int = 0,
    key: Callable[[A], Hashable] | None = None,
) -> float:
    """Maj@k of one question: P[majority vote of k random samples is correct].

    With k == n there is one subset (all samples) and the value is exact (0 or 1);
    otherwise it is the mean over ``num_subsets`` k-subsets drawn without replacement
    by a ``random.Random(seed)``, so it is deterministic for a given seed.
    """
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")

    def vote_correct(subset: Sequence[A | None]) -> float:
        winner = majority_vote(subset, key=key)
        return float(winner is not None and bool(is_correct(winner)))

    if k == n:
        return vote_correct(answers)
    rng = random.Random(seed)
    total = 0.0
    for _ in range(num_subsets):
        idx = sorted(rng.sample(range(n), k))  # sorted: keep tie-breaking by sample order
        total += vote_correct([answers[i] for i in idx])
    return total / num_subsets


def maj_at_k_curve(
    answers: Sequence[Sequence[A | None]],
    is_correct: Sequence[Callable[[A], bool]] | Callable[[int, A], bool],
    ks: Iterable[int] = DEFAULT_KS,
    *,
    num_subsets: int = 32,
    seed: int = 0,
    key: Callable[[A], Hashable] | None = None,
) -> dict[int, float]:
    """Mean over questions of :func:`maj_at_k` for each K (K larger than min n skipped).

    ``is_correct`` is either one predicate per question, or ``f(question_index, answer)``.
    """
    if len(answers) == 0:
        raise ValueError("no questions")
    if callable(is_correct):
        predicates = [lambda a, q=q: is_correct(q, a) for q in range(len(answers))]
    else:
        predicates = list(is_correct)
    n_min = min(len(a) for a in answers)
    curve = {}
    for k in ks:
        if 1 <= k <= n_min:
            curve[k] = sum(
                maj_at_k(a, p, k, num_subsets=num_subsets, seed=seed + q, key=key)
                for q, (a, p) in enumerate(zip(answers, predicates))
            ) / len(answers)
    return curve


# ============================================================================ intervals

def wilson_interval(successes: float, n: int, *, z: float = 1.959964) -> tuple[float, float]:
    """95% (z = 1.96) Wilson score interval of a proportion successes / n.

        centre = (p + z²/2n) / (1 + z²/n),  half = z sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n)

    Unlike the normal interval it stays inside [0, 1] and is not empty at p = 0 or 1.
    """
    if n <= 0:
        raise ValueError(f"wilson_interval needs n >= 1, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(values: Sequence[float], *, num_resamples: int = 1000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-question ``values`` [Q]: resample Q
    questions with replacement ``num_resamples`` times (``random.Random(seed)``), take the
    (1-level)/2 and (1+level)/2 quantiles (nearest rank) of the resampled means."""
    q = len(values)
    if q == 0:
        raise ValueError("bootstrap_interval: no values")
    rng = random.Random(seed)
    means = sorted(sum(values[rng.randrange(q)] for _ in range(q)) / q for _ in range(num_resamples))
    lo = means[max(0, math.ceil((1 - level) / 2 * num_resamples) - 1)]
    hi = means[min(num_resamples - 1, math.ceil((1 + level) / 2 * num_resamples) - 1)]
    return lo, hi


def summarize(records: Sequence[dict], ks: Iterable[int] | None = None, *, seed: int = 0,
              num_subsets: int = 32, num_resamples: int = 1000, max_calls: int | None = None) -> dict[str, Any]:
    """The benchmark's metrics from per-question records (`grpo_jax.eval.evaluate_run`'s JSONL).

    Each record has ``index`` (the question's position in the benchmark: Maj@K's subset
    seed is ``seed + index``, so a shard scores a question exactly as the whole run does),
    ``greedy_correct`` (bool), and ``answers`` / ``correct`` (one per sample, [n]). A vote's
    winner is correct iff the samples with that answer were marked correct (the task's
    ``is_correct`` depends on the canonical answer string only). Ks default to 1..n_min.

    Returns {"num_questions", "samples_per_question", "greedy": {"accuracy", "ci95"},
    "pass@k": {k: {"value", "ci95"}}, "maj@k": {k: {"value", "ci95"}}} (string keys k), and
    "tools" (`tool_summary`, histograms up to ``max_calls``) when the records hold tool runs.
    """
    if not records:
        raise ValueError("summarize: no records")
    records = sorted(records, key=lambda r: r["index"])
    greedy = [bool(r["greedy_correct"]) for r in records]
    out: dict[str, Any] = {"num_questions": len(records)}
    out["greedy"] = {"accuracy": greedy_accuracy(greedy), "ci95": list(wilson_interval(sum(greedy), len(greedy)))}
    n_min = min(len(r["correct"]) for r in records)
    out["samples_per_question"] = n_min
    if "greedy_tool_calls" in records[0]:
        out["tools"] = tool_summary(records, max_calls)
    if n_min == 0:
        return out
    ks = [k for k in (range(1, n_min + 1) if ks is None else ks) if 1 <= k <= n_min]
    out["pass@k"], out["maj@k"] = {}, {}
    for k in ks:
        per_q = [pass_at_k(len(r["correct"]), sum(map(bool, r["correct"])), k) for r in records]
        out["pass@k"][str(k)] = {"value": sum(per_q) / len(per_q),
                                 "ci95": list(bootstrap_interval(per_q, num_resamples=num_resamples, seed=seed))}
        per_q = []
        for r in records:
            right = {a for a, c in zip(r["answers"], r["correct"]) if c and a is not None}
            per_q.append(maj_at_k(r["answers"], right.__contains__, k, num_subsets=num_subsets,
                                  seed=seed + r["index"]))
        out["maj@k"][str(k)] = {"value": sum(per_q) / len(per_q),
                                "ci95": list(bootstrap_interval(per_q, num_resamples=num_resamples, seed=seed))}
    return out


def tool_counts(completions: Sequence[Sequence[dict]], max_calls: int | None = None) -> dict[str, Any]:
    """The tool use of some completions, each a list of its runs ({"status", ...}, `tool_runs`):
    {"completions", "calls" (all runs), "calls_mean" (per completion), "calls_histogram"
    ({"0": completions with no call, "1": with one, ... up to ``max_calls`` or the most seen}),
    "with_call" (the share with at least one call), "statuses" (runs per sandbox status, every
    status of ``sandbox.STATUSES`` listed), "failures" (runs not "ok")}."""
    from grpo_jax.tools.sandbox import STATUSES

    n = len(completions)
    calls = [len(c) for c in completions]
    top = max([*calls, 0] if max_calls is None else [*calls, max_calls])
    statuses = dict.fromkeys(STATUSES, 0)
    for runs in completions:
        for run in runs:
            statuses[run["status"]] = statuses.get(run["status"], 0) + 1
    total = sum(calls)
    return {"completions": n, "calls": total, "calls_mean": total / n if n else 0.0,
            "calls_histogram": {str(c): calls.count(c) for c in range(top + 1)},
            "with_call": sum(c > 0 for c in calls) / n if n else 0.0,
            "statuses": statuses, "failures": total - statuses["ok"]}


def tool_summary(records: Sequence[dict], max_calls: int | None = None) -> dict[str, Any]:
    """`tool_counts` of the greedy completions ("greedy": one per question) and, when there
    are samples, of all sampled completions ("samples")."""
    out = {"greedy": tool_counts([r["greedy_tool_calls"] for r in records], max_calls)}
    sampled = [runs for r in records for runs in r.get("tool_calls", [])]
    if sampled:
        out["samples"] = tool_counts(sampled, max_calls)
    return out


# ============================================================================ policy evaluation

def completion_texts(rollout, tokenizer) -> list[str]:
    """Decoded completion of every rollout row [B], without its trailing stop token."""
    return [tokenizer.decode(rollout.completion_ids(r, tokenizer.stop_ids))
            for r in range(rollout.tokens.shape[0])]


def own_text(rollout, row: int, tokenizer) -> str:
    """The model's own text of one rollout row: its completion without the tokens a tool
    wrote (``rollout.tool_mask``, `grpo_jax.sampler.turns`) and without its trailing stop
    token. Each run of the model's tokens is decoded on its own; the runs are joined by a
    newline where a tool's output stood."""
    return "\n".join(tokenizer.decode(run) for run in _spans(rollout, row, tokenizer, by_tool=False))


def tool_text(rollout, row: int, tokenizer) -> str:
    """The text the tool wrote into one rollout row, its outputs in order: what
    `grpo_jax.tools.statuses` reads, since a status line or an ```output block in the
    model's own text is the model's, not the tool's."""
    return "".join(tokenizer.decode(run) for run in _spans(rollout, row, tokenizer, by_tool=True))


def _spans(rollout, row: int, tokenizer, *, by_tool: bool) -> list[list[int]]:
    """The runs of consecutive tokens of one row written by the tool (``by_tool``) or by the
    model, without the model's trailing stop token."""
    import numpy as np

    mask = np.asarray(rollout.mask[row])
    ids = np.asarray(rollout.tokens[row])[mask].tolist()
    tool = ([False] * len(ids) if rollout.tool_mask is None
            else np.asarray(rollout.tool_mask[row])[mask].tolist())
    if ids and not tool[-1] and ids[-1] in tokenizer.stop_ids:
        ids, tool = ids[:-1], tool[:-1]
    runs, current = [], []
    for token, written_by_tool in zip(ids, tool):
        if written_by_tool != by_tool:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(token)
    if current:
        runs.append(current)
    return runs


def final_answer(task, text: str):
    """The answer of the tool-integrated protocol: the task's ``extract_answer`` of the last
    ``\\boxed{}`` in ``text`` (the model's own text, `own_text`) alone, None without one:
    a number the model wrote elsewhere, in its code say, is not its answer."""
    from grpo_jax.tasks import rewards

    boxed = rewards.last_boxed(text) if isinstance(text, str) and len(text) <= rewards.MAX_COMPLETION_CHARS else None
    return None if boxed is None else task.extract_answer("\\boxed{" + boxed + "}")


def tool_runs(runs) -> list[dict]:
    """What the JSONL keeps of one completion's tool runs (``sandbox.ExecutionResult``): each
    run's status, its detail and its seconds, in order."""
    return [{"status": r.status, "detail": r.detail, "seconds": round(float(r.seconds), 3)} for r in runs]


def sample_and_score(sampler, params, task, tokenizer, examples: Sequence, prompts: Sequence[str], *, key,
                     num_samples: int = 0, temperature: float = 1.0, top_p: float = 1.0, tools=None) -> list[dict]:
    """The one evaluation of a policy on questions, in-run and benchmark alike: ``params``
    (in ``sampler``'s weights form, ``Sampler.copy``) answers ``examples`` [Q], asked as
    ``prompts`` [Q] (texts), greedily with ``key``, then ``num_samples`` times each at
    ``temperature`` and ``top_p`` with ``fold_in(key, 1)``, all questions in one call each
    (``Sampler.evaluation``: the run's engine, cache and lengths, untruncated). Decoding,
    answer extraction and scoring are host-side Python on untrusted model text.

    One record per question: ``prompt``, ``reference`` (the task's canonical final answer),
    ``greedy_completion``, ``greedy_answer``, ``greedy_correct``, and ``completions`` /
    ``answers`` / ``correct`` (``num_samples`` each).

    With ``tools`` (a `grpo_jax.sampler.turns.ToolUse`) every completion is a multi-turn
    rollout (``turns.generate_with_tools``: the model's code blocks run in the tool's
    sandbox, their output joins the completion); a completion's text holds both, and its
    answer is `final_answer` of the model's own text (`own_text`), never of a tool's output.
    The record also holds ``greedy_tool_calls`` and ``tool_calls`` (one list per sample):
    each run's status, detail and seconds (`tool_runs`); and ``greedy_own_text`` and
    ``own_texts``, the model's own text of each completion, which a second checker reads
    (`math_verify_check.second_opinion`) so that no answer is read from a tool's output."""
    import jax  # sampling is device-side; the metrics above stay importable without it

    from grpo_jax.parallel.sharding import to_host
    from grpo_jax.text.tokenizer import encode_prompt

    ids = [encode_prompt(tokenizer, p) for p in prompts]

    def draw(this, key, group_size):
        """(completion texts, texts the answer is read from, tool runs) of one sampler."""
        if tools is None:
            rollout = jax.tree.map(to_host, this.sample(params, ids, key=key, group_size=group_size))
            texts = completion_texts(rollout, tokenizer)
            return texts, texts, None
        from grpo_jax.sampler.turns import generate_with_tools

        rollout, runs = generate_with_tools(this, params, ids, key=key, group_size=group_size, tools=tools)
        own = [own_text(rollout, r, tokenizer) for r in range(len(runs))]
        return completion_texts(rollout, tokenizer), own, [tool_runs(row) for row in runs]

    extract = task.extract_answer if tools is None else (lambda text: final_answer(task, text))
    greedy, greedy_own, greedy_runs = draw(sampler.evaluation(), key, 1)
    drawn, drawn_own, drawn_runs = [], [], None
    if num_samples:
        drawn, drawn_own, drawn_runs = draw(sampler.evaluation(temperature, top_p), jax.random.fold_in(key, 1),
                                            num_samples)
    records = []
    for j, ex in enumerate(examples):
        answer = extract(greedy_own[j])
        rows = slice(j * num_samples, (j + 1) * num_samples)
        answers = [extract(t) for t in drawn_own[rows]]
        record = {"prompt": prompts[j], "reference": ex.meta.get("final_answer", ex.answer),
                  "greedy_completion": greedy[j], "greedy_answer": answer,
                  "greedy_correct": bool(task.is_correct(answer, ex)), "completions": drawn[rows],
                  "answers": answers, "correct": [bool(task.is_correct(a, ex)) for a in answers]}
        if tools is not None:
            record["greedy_tool_calls"] = greedy_runs[j]
            record["tool_calls"] = drawn_runs[rows] if drawn_runs is not None else []
            record["greedy_own_text"], record["own_texts"] = greedy_own[j], drawn_own[rows]
        records.append(record)
    return records


def evaluate(sampler, params, task, tokenizer, examples: Sequence, *, key, num_samples: int = 0,
             temperature: float = 1.0, ks: Sequence[int] = (), texts: bool = False) -> dict:
    """Greedy accuracy of ``params`` on ``examples`` (`sample_and_score` with ``sampler``,
    the run's: ``Sampler.for_run``); with ``num_samples`` > 0 also Pass@K and Maj@K (K in
    ``ks``, via :func:`pass_at_k_curve` and :func:`maj_at_k_curve`) from that many samples
    per question at ``temperature`` (the paper's Figure 7 setting). Returns {"accuracy",
    "reward" (the task's mean greedy reward), "pass@K", "maj@K"}, and with ``texts`` also
    "texts" (the greedy completions) and "correct" (whether each is right), per example.

    The trainer's periodic evaluation: its sampler and the rollout's policy copy, all
    questions in one call, the call ``aot.sampler_calls(..., evaluation=True)`` lowers for
    the ahead-of-time check. For a whole benchmark with intervals, JSONL and resume, use
    `grpo_jax.eval.evaluate_run`."""
    records = sample_and_score(sampler, params, task, tokenizer, examples, [ex.prompt for ex in examples], key=key,
                               num_samples=num_samples, temperature=temperature)
    right = [r["greedy_correct"] for r in records]
    out = {"accuracy": greedy_accuracy(right),
           "reward": sum(task.reward(r["greedy_completion"], ex) for r, ex in zip(records, examples)) / len(examples)}
    if texts:
        out.update(texts=[r["greedy_completion"] for r in records], correct=right)
    if num_samples > 0:
        out.update({f"pass@{k}": v for k, v in pass_at_k_curve([r["correct"] for r in records], ks).items()})
        out.update({f"maj@{k}": v for k, v in maj_at_k_curve(
            [r["answers"] for r in records], lambda q, a: task.is_correct(a, examples[q]), ks).items()})
    return out
