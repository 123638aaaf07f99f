"""Rule rewards: hand-written completions, and hostile inputs (never raise, < 100 ms)."""
import random
import statistics
import time

import pytest
from hypothesis import given, settings, strategies as st

from grpo_jax.tasks import rewards
from grpo_jax.tasks.rewards import countdown_reward, gsm8k_reward, math_reward
from grpo_jax.tasks import Example
from grpo_jax.tasks.arithmetic import ArithmeticTask
from grpo_jax.tasks.countdown import CountdownTask
from grpo_jax.tasks.gsm8k import Gsm8kTask
from grpo_jax.tasks.math_task import MathTask

# ------------------------------------------------------------------------ Countdown
NUMS, TARGET = [44, 19, 35], 98  # (44 + 19) - 35 = 28; 44 + 19 + 35 = 98


@pytest.mark.parametrize(
    "completion, expected",
    [
        # The prompt ends with "<think>": the completion continues the thought.
        (" 44+19=63, 63+35=98.</think>\n<answer>44 + 19 + 35</answer>", 1.1),
        # ... or opens its own <think>; both are accepted.
        ("<think>add them</think>\n<answer>(44 + 19) + 35</answer>", 1.1),
        ("\n<think>add them</think> <answer>35+44+19</answer>\n", 1.1),
        # Format followed, answer wrong value / wrong numbers / illegal characters.
        ("hmm</think>\n<answer>44 + 19 - 35</answer>", 0.1),
        ("hmm</think>\n<answer>44 + 54</answer>", 0.1),  # 54 is not a given number
        ("hmm</think>\n<answer>44 + 19 + 35 + 0</answer>", 0.1),  # extra number
        ("hmm</think>\n<answer>44 + 44 + 10</answer>", 0.1),  # 44 used twice
        ("hmm</think>\n<answer>44 + 19 + 35 = 98</answer>", 0.1),  # '=' not allowed
        ("hmm</think>\n<answer>__import__('os').system('true')</answer>", 0.1),
        ("hmm</think>\n<answer></answer>", 0.1),
        # Right answer, broken format: answer reward only.
        ("<answer>44 + 19 + 35</answer>", 1.0),  # no </think>
        ("hmm</think>\n<answer>44 + 19 + 35</answer> and more text", 1.0),
        ("hmm</think>\n<answer>1</answer><answer>44 + 19 + 35</answer>", 1.0),  # last one counts
        ("<think><think>x</think>\n<answer>44 + 19 + 35</answer>", 1.0),
        ("hmm</think> text <answer>44 + 19 + 35</answer>", 1.0),
        # Nothing.
        ("44 + 19 + 35", 0.0),
        ("", 0.0),
        ("hmm</think>\n<answer>44 + 19 + 35", 0.0),
    ],
)
def test_countdown_reward(completion, expected):
    assert countdown_reward(completion, NUMS, TARGET) == pytest.approx(expected)


def test_countdown_exact_rational_arithmetic():
    assert countdown_reward("</think><answer>6 / 4 * 2</answer>", [6, 4, 2], 3) == pytest.approx(1.1)
    assert countdown_reward("</think><answer>7 / 2</answer>", [7, 2], 3) == pytest.approx(0.1)
    assert countdown_reward("</think><answer>(9 - 3) / (4 - 2)</answer>", [9, 3, 4, 2], 3) == pytest.approx(1.1)
    assert countdown_reward("</think><answer>-(3 - 9) / 2</answer>", [3, 9, 2], 3) == pytest.approx(1.1)
    assert countdown_reward("</think><answer>6 / (2 - 2)</answer>", [6, 2, 2], 3) == pytest.approx(0.1)


# --------------------------------------------------------------------------- GSM8K
REF = "She baked 12 * 8 = <<12*8=96>>96 rolls.\nThen 96 - 70 = <<96-70=26>>26 are left.\n#### 26"


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("12*8 = 96 and 96-70 = 26.\n#### 26", REF, 1.0),
        ("So 26 rolls are left.", REF, 1.0),  # no ####: last number
        ("So the answer is 26.00", REF, 1.0),
        ("#### 26 (I first thought 30)", REF, 1.0),  # #### wins over the last number
        ("I think 26, no wait, 25", REF, 0.0),
        ("#### 25", REF, 0.0),
        ("no numbers at all", REF, 0.0),
        ("", REF, 0.0),
        ("The total is $1,234.", "#### 1234", 1.0),
        ("#### $1,234.50", "#### 1234.5", 1.0),
        ("so 1,000 in all", "#### 1000", 1.0),
        ("10 - 3 = 7", "#### 7", 1.0),  # the '-' of 10-3 is an operator
        ("it drops to x = -4", "#### -4", 1.0),
        ("it is 4", "#### -4", 0.0),
        ("#### 26", "no marker, final 26", 1.0),  # reference falls back to last number too
        ("#### 26", "", 0.0),
    ],
)
def test_gsm8k_reward(completion, reference, expected):
    assert gsm8k_reward(completion, reference) == expected


# ---------------------------------------------------------------------------- MATH
def boxed(s):
    return "We compute carefully. The answer is $\\boxed{" + s + "}$."


@pytest.mark.parametrize(
    "answer, reference",
    [
        ("5", "5"),
        ("0.5", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\dfrac{1}{2}", r"\tfrac{1}{2}"),
        ("1/2", r"\frac{1}{2}"),
        (r"\sqrt{4}", "2"),
        (r"2\sqrt{2}", r"\sqrt{8}"),
        (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"),
        ("x = 5", "5"),
        (r"10\text{ cm}", "10"),
        (r"10\text{cm}", "10"),
        (r"50\%", "50"),
        (r"90^\circ", "90"),
        (r"\$5.00", "5"),
        ("5.0", "5"),
        ("1,000", "1000"),
        (r"\left(1, 2\right)", "(1,2)"),
        (r"\left[0,\frac12\right)", "[0,0.5)"),
        (r"\text{(A)}", "(A)"),
        ("2x+1", "1+2x"),
        ("x^2+2x+1", "(x+1)^2"),
        (r"\pi/2", r"\frac{\pi}{2}"),
        (r"\frac{3}{\sqrt{3}}", r"\sqrt{3}"),
        (r"\sqrt[3]{8}", "2"),
        (".5", "0.5"),
        ("(x+1)(x-1)", "x^2-1"),  # outer brackets that are not delimiters
        ("(1)+(2)", "3"),
        (r"\{1,2\}", r"\{1, 2\}"),
        (r"(1,\frac{1}{2})", "(1,0.5)"),
        # Where math-verify showed the reward wrong (experiments/math_verify_report.py):
        ("3, -1", "-1, 3"),  # all the solutions, in another order
        (r"\{2, 1\}", r"\{1,2\}"),  # a set
        (r"x \in [2,5]", "[2,5]"),
    ],
)
def test_math_equivalent_answers(answer, reference):
    assert math_reward(boxed(answer), boxed(reference)) == 1.0


@pytest.mark.parametrize(
    "answer, reference",
    [
        ("6", "5"),
        ("0.33", r"\frac{1}{3}"),
        (r"\sqrt{2}", "1.41"),
        ("(1,2)", "(2,1)"),  # an ordered pair keeps its order
        ("1, 1, 2", "1, 2, 2"),  # a list in another order, not another multiset
        (r"x \in (2,5)", "[2,5]"),
        ("(1,2)", "[1,2]"),
        ("(1,2)", "(1,2,3)"),
        ("x^2", "x^3"),
        ("x+1", "y+1"),
        ("Monday", "Tuesday"),
        (r"\infty", "-\\infty"),
        ("", "5"),
    ],
)
def test_math_different_answers(answer, reference):
    assert math_reward(boxed(answer), boxed(reference)) == 0.0


def test_math_boxed_extraction():
    ref = boxed(r"\frac{3}{2}")
    assert math_reward(r"first \boxed{7} then \boxed{\frac{3}{2}}", ref) == 1.0  # last box
    assert math_reward(r"first \boxed{\frac{3}{2}} then \boxed{7}", ref) == 0.0
    assert math_reward(r"so $\boxed 1.5$.", ref) == 1.0  # "\boxed 5" form
    assert math_reward(r"\fbox{1.5}", ref) == 1.0
    assert math_reward("the answer is 1.5", ref) == 0.0  # no box
    assert math_reward(r"\boxed{1.5", ref) == 0.0  # unclosed
    assert rewards.last_boxed(r"\boxed{\frac{a}{b^{2}}} x") == r"\frac{a}{b^{2}}"
    assert rewards.last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert math_reward(boxed("5"), "5") == 1.0  # a bare reference answer
    assert math_reward(boxed("5"), r"see \boxed{") == 0.0


def test_normalize_math_answer_examples():
    n = rewards.normalize_math_answer
    assert n(r"\dfrac12") == r"\frac{1}{2}"
    assert n(r"\frac1{72}") == r"\frac{1}{72}"
    assert n(r"\sqrt3") == r"\sqrt{3}"
    assert n(r"\left( 3, 4 \right)") == "(3,4)"
    assert n(r"x = \frac{3}{4}") == r"\frac{3}{4}"
    assert n("3/4") == r"\frac{3}{4}"
    assert n(r"12\text{ inches}") == "12"
    assert n("2.50") == "2.50"  # only all-zero decimals are dropped
    assert n("7.000") == "7"


# ------------------------------------------------------- hostile inputs, time bound
HOSTILE = [
    "",
    "\x00" * 1000,
    "\xff\xfe" * 5000,
    "__import__('os').system('echo pwned')",
    "9**9**9**9",
    "9^9^9^9",
    "10**100000",
    "(" * 100_000,
    ")" * 100_000,
    "(" * 50_000 + ")" * 50_000,
    "(" * 100_000 + "1" + ")" * 100_000,  # longer than MAX_COMPLETION_CHARS
    "-" * 100_000,
    "," * 100_000,
    "1," * 50_000,
    "9" * 100_000,
    "#### " + "9" * 99_000,
    "#" * 100_000,
    "$" * 100_000,
    " " * 100_000,
    "\n" * 100_000,
    "x" * 100_000,
    "<think>" * 14_000,
    "<answer>" * 12_000,
    "</answer>" * 11_000,
    "<answer>" + "(" * 200 + "1" + ")" * 200 + "</answer>",
    "</think><answer>" + "1+" * 5000 + "1</answer>",
    "</think><answer>" + "9" * 5000 + "</answer>",
    "</think><answer>9**9**9**9</answer>",
    "</think><answer>1/0</answer>",
    "\\boxed{" * 14_000,
    "\\boxed{" + "{" * 40_000 + "}" * 40_000 + "}",
    "\\boxed{" + "\\frac" * 2000 + "}",
    "\\boxed{" + "\\frac{1}{" * 100 + "2" + "}" * 101,
    "\\boxed{" + "\\sqrt{" * 300 + "2" + "}" * 301,
    "\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}",
    "\\boxed{x^{x^{x^{x}}}}",
    "\\boxed{" + "9" * 400 + "}",
    "\\boxed{" + "1+" * 250 + "1}",
    "\\boxed{" + "x" * 400 + "}",
    "\\boxed{" + "(" * 200 + ")" * 200 + "}",
    "\\boxed{" + "," * 500 + "}",
    "\\boxed{" + "\\text{ " * 100 + "}",
    "\\boxed{\\frac{1}{0}}",
    "\\boxed{0^{-1}}",
    "\\boxed{\\sqrt{-1}}",
    "\\boxed{10^{10^{10}}}",
    "\\boxed{\\sqrt[1000000]{2}}",
    "\\boxed{" + "0." + "0" * 400 + "1}",
    "\\boxed{1e308*1e308}",
    "\\boxed{inf} \\boxed{nan}",
    "\\boxed{\u0663\u00b2\u2460\u202e\U0001F600}",
    "1+1=2\n" * 16_000,
    "A: " * 30_000,
    "A: 5\n" * 20_000,
    "1+1=2\n" * 100 + "A: 4\n",
    "\r\n" * 50_000,
    "\u2028" * 50_000,
]

ALLOWED = {
    "countdown": {0.0, 0.1, 1.0, 1.1},
    "binary": {0.0, 1.0},
    "arithmetic": {0.0, 0.1, 1.0},
}

ARITH = ArithmeticTask(num_operands=3)
ARITH_EX = ARITH.examples("train", 1, 0)[0]
CD = CountdownTask()
CD_EX = CD.examples("train", 1, 0)[0]
GSM = Gsm8kTask()  # no data is touched: scoring needs only the example
GSM_EX = Example(prompt="", answer=REF, meta={"final_answer": "26"})
MATH = MathTask()
MATH_EX = Example(prompt="", answer=boxed("5"), meta={"final_answer": "5"})


def _scorers():
    """(name, fn(text) -> value, check(value) -> bool) for every scoring entry point."""
    in_set = lambda allowed: (lambda v: isinstance(v, float) and any(v == pytest.approx(a) for a in allowed))
    steps_ok = lambda text: (
        lambda v: isinstance(v, list)
        and len(v) >= 1
        and all(isinstance(e, int) and r in (0.0, 1.0) for e, r in v)
        and all(0 <= e <= len(text) for e, _ in v)
        and [e for e, _ in v] == sorted(e for e, _ in v)
    )
    answer_ok = lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= rewards.MAX_ANSWER_CHARS)
    return [
        ("countdown_reward", lambda t: countdown_reward(t, NUMS, TARGET), lambda t: in_set(ALLOWED["countdown"])),
        ("gsm8k_reward", lambda t: gsm8k_reward(t, REF), lambda t: in_set(ALLOWED["binary"])),
        ("gsm8k_reward(ref)", lambda t: gsm8k_reward("#### 26", t), lambda t: in_set(ALLOWED["binary"])),
        ("math_reward", lambda t: math_reward(t, boxed("5")), lambda t: in_set(ALLOWED["binary"])),
        ("math_reward(ref)", lambda t: math_reward(boxed("5"), t), lambda t: in_set(ALLOWED["binary"])),
        ("arithmetic.reward", lambda t: ARITH.reward(t, ARITH_EX), lambda t: in_set(ALLOWED["arithmetic"])),
        ("arithmetic.step_rewards", lambda t: ARITH.step_rewards(t, ARITH_EX), steps_ok),
        ("arithmetic.extract_answer", ARITH.extract_answer, lambda t: answer_ok),
        ("countdown.reward", lambda t: CD.reward(t, CD_EX), lambda t: in_set(ALLOWED["countdown"])),
        ("countdown.step_rewards", lambda t: CD.step_rewards(t, CD_EX), lambda t: (lambda v: len(v) == 1)),
        ("countdown.extract_answer", CD.extract_answer, lambda t: answer_ok),
        ("gsm8k.extract_answer", GSM.extract_answer, lambda t: answer_ok),
        ("gsm8k.reward", lambda t: GSM.reward(t, GSM_EX), lambda t: in_set(ALLOWED["binary"])),
        ("math.extract_answer", MATH.extract_answer, lambda t: answer_ok),
        ("math.reward", lambda t: MATH.reward(t, MATH_EX), lambda t: in_set(ALLOWED["binary"])),
        ("math.is_correct", lambda t: MATH.is_correct(t, MATH_EX), lambda t: (lambda v: isinstance(v, bool))),
    ]


SCORERS = _scorers()


def _timed(fn, text, repeats=3):
    """Min wall time and max thread CPU time over a few calls (the min filters out
    preemption by other processes on a shared machine; CPU time is immune to it)."""
    walls, cpus, value = [], [], None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.thread_time()
        value = fn(text)
        cpus.append(time.thread_time() - c0)
        walls.append(time.perf_counter() - w0)
    return value, min(walls), max(cpus)


@pytest.mark.parametrize("name, fn, check", SCORERS, ids=[s[0] for s in SCORERS])
def test_hostile_strings(name, fn, check):
    fn("warm-up </think><answer>1</answer> \\boxed{1} #### 1")
    walls, cpus = [], []
    for text in HOSTILE:
        value, wall, cpu = _timed(fn, text)
        assert check(text)(value), (name, text[:80], value)
        walls.append(wall)
        cpus.append(cpu)
    # The contract is 100 ms per call; typical calls are well under 10 ms.
    assert max(cpus) < 0.1, (name, HOSTILE[cpus.index(max(cpus))][:80], max(cpus))
    assert max(walls) < 0.1, (name, HOSTILE[walls.index(max(walls))][:80], max(walls))
    assert statistics.median(walls) < 0.02


TOKENS = [
    "<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "{", "}", "\\frac", "\\sqrt",
    "####", "A: ", "\n", " ", "=", "+", "-", "*", "/", "**", "^", "(", ")", ",", ".", "$",
    "0", "1", "7", "12", "99", "x", "\\left(", "\\right)", "\\text{ cm}", "%", "__import__",
]


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(
        st.text(max_size=2000),
        st.binary(max_size=2000).map(lambda b: b.decode("latin-1")),
        st.lists(st.sampled_from(TOKENS), max_size=400).map("".join),
    )
)
def test_random_strings(text):
    for name, fn, check in SCORERS:
        value, wall, cpu = _timed(fn, text, repeats=1)
        assert check(text)(value), (name, text[:80], value)
        assert cpu < 0.1, (name, text[:80], cpu)


def test_random_countdown_completions_against_reference_solver():
    """Random well-formed answers: the reward agrees with an independent evaluation."""
    rng = random.Random(0)
    for _ in range(300):
        nums = [rng.randint(1, 20) for _ in range(3)]
        ops = [rng.choice("+-*") for _ in range(2)]
        perm = rng.sample(nums, 3)
        expr = f"({perm[0]} {ops[0]} {perm[1]}) {ops[1]} {perm[2]}"
        a = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
        value = a[ops[1]](a[ops[0]](perm[0], perm[1]), perm[2])
        completion = f"ok</think>\n<answer>{expr}</answer>"
        target = rng.choice([value, value + 1])
        expected = 1.1 if target == value else 0.1
        assert countdown_reward(completion, nums, target) == pytest.approx(expected)
