"""Evaluation metrics (pure host-side functions): greedy accuracy, Pass@K, Maj@K.

Inputs are per-question lists of sampled answers / correctness flags produced by the
sampler and a task's ``extract_answer`` / ``reward``; writing curves to PNG/JSON is the
caller's business.
"""
from __future__ import annotations

import random
from typing import Callable, Hashable, Iterable, Sequence, TypeVar

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
