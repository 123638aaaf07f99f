"""Pass@K, Maj@K, greedy accuracy against brute-force enumeration."""
import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from grpo_jax.eval.evaluation import (
    greedy_accuracy,
    maj_at_k,
    maj_at_k_curve,
    majority_vote,
    pass_at_k,
    pass_at_k_curve,
)


def brute_pass_at_k(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)), abs=1e-12)


def test_pass_at_k_edges_and_stability():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # Large n: the product form agrees with exact binomials where those are huge.
    n, c, k = 1000, 7, 64
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    for bad in [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_majority_vote():
    assert majority_vote(["3", "5", "5", "3", None, "5"]) == "5"
    assert majority_vote(["3", "5", "5", "3"]) == "3"  # tie: first occurrence wins
    assert majority_vote(["5", "3", "3", "5"]) == "5"
    assert majority_vote([None, "7", None]) == "7"  # None never wins
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None
    # key merges equivalent answers; the first member of the winning class is returned.
    assert majority_vote(["0.5", "1/2", "2", "2"], key=lambda a: Fraction(a)) == "0.5"
    assert majority_vote(["x", "y"], key=lambda a: None) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.sampled_from("abcd")), max_size=20))
def test_majority_vote_is_a_most_frequent_answer(answers):
    winner = majority_vote(answers)
    present = [a for a in answers if a is not None]
    if not present:
        assert winner is None
        return
    counts = {a: present.count(a) for a in present}
    best = max(counts.values())
    assert counts[winner] == best
    assert winner == next(a for a in present if counts[a] == best)


def test_greedy_accuracy():
    assert greedy_accuracy([True, False, True, True]) == 0.75
    assert greedy_accuracy([1.0, 0.0]) == 0.5
    with pytest.raises(ValueError):
        greedy_accuracy([])


def test_pass_at_k_curve():
    correct = [[True, False, False, False], [False] * 4, [True] * 4]
    curve = pass_at_k_curve(correct, ks=range(1, 10))
    assert sorted(curve) == [1, 2, 3, 4]  # K > n skipped
    for k, value in curve.items():
        expected = (float(brute_pass_at_k(4, 1, k)) + 0.0 + 1.0) / 3
        assert value == pytest.approx(expected)
    values = [curve[k] for k in sorted(curve)]
    assert values == sorted(values)  # non-decreasing in K


def brute_maj_at_k(answers, correct_answer, k):
    subsets = list(itertools.combinations(range(len(answers)), k))
    hits = sum(majority_vote([answers[i] for i in s]) == correct_answer for s in subsets)
    return hits / len(subsets)


def test_maj_at_k_exact_and_sampled():
    answers = ["7", "5", "7", None, "5", "7"]
    right = lambda a: a == "7"
    assert maj_at_k(answers, right, 6) == 1.0  # all samples: "7" has 3 votes
    assert maj_at_k(["5", "7"], right, 2) == 0.0  # tie -> first ("5")
    for k in (1, 2, 3, 4):
        estimate = maj_at_k(answers, right, k, num_subsets=3000, seed=1)
        assert estimate == pytest.approx(brute_maj_at_k(answers, "7", k), abs=0.04)
    assert maj_at_k(answers, right, 3, seed=5) == maj_at_k(answers, right, 3, seed=5)
    with pytest.raises(ValueError):
        maj_at_k(answers, right, 7)


def test_maj_at_k_curve():
    answers = [["1", "1", "2"], ["3", "4", "4"]]
    refs = ["1", "3"]
    curve = maj_at_k_curve(answers, [lambda a, r=r: a == r for r in refs], ks=(1, 3, 64))
    assert sorted(curve) == [1, 3]
    assert curve[3] == pytest.approx((1.0 + 0.0) / 2)
    by_index = maj_at_k_curve(answers, lambda q, a: a == refs[q], ks=(3,))
    assert by_index == {3: curve[3]}
    # Maj@1 is the mean single-sample accuracy (up to subset sampling).
    assert curve[1] == pytest.approx((2 / 3 + 1 / 3) / 2, abs=0.2)
