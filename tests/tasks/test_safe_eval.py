"""The whitelisted expression evaluator: values, precedence, refusals and bounds."""
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from grpo_jax.tasks import safe_eval
from grpo_jax.tasks.safe_eval import Limits, parse, safe_eval as ev


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1+2*3", Fraction(7)),
        ("(1+2)*3", Fraction(9)),
        ("10-4-3", Fraction(3)),  # left-associative
        ("8/4/2", Fraction(1)),
        ("6/4*2", Fraction(3)),  # exact rationals, not floor division
        ("7/2", Fraction(7, 2)),
        ("-3+5", Fraction(2)),
        ("--3", Fraction(3)),
        ("-(2-5)", Fraction(3)),
        ("2.5*4", Fraction(10)),
        (" ( 44 + 19 ) * 2 - 35 ", Fraction(91)),
        (".5+.5", Fraction(1)),
    ],
)
def test_plain_values(text, expected):
    assert ev(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os')",
        "os.system('ls')",
        "open('/etc/passwd')",
        "lambda: 1",
        "1j",
        "0x10",
        "1_000",
        "1e5",
        "2**3",  # power needs allow_pow
        "[1, 2]",
        "'1'+'2'",
        "1 if 1 else 2",
        "abs(-1)",
        "1/0",
        "(1",
        "1)",
        "",
        "   ",
        "1 2",
        "+",
        "1..2",
        "١+٢",  # non-ASCII digits are not digits here
        "2²",
    ],
)
def test_plain_refuses(text):
    assert ev(text) is None


def test_limits_length_depth_digits_magnitude():
    assert ev("1+" * 100 + "1") == 101  # flat chains are fine
    assert ev("1+" * 200 + "1") is None  # longer than max_chars (256)
    assert ev("(" * 20 + "1" + ")" * 20) == 1
    assert ev("(" * 30 + "1" + ")" * 30) is None  # deeper than max_depth (24)
    assert ev("-" * 30 + "1") is None
    assert ev("9" * 24) == int("9" * 24)
    assert ev("9" * 25) is None  # literal longer than max_digits
    assert ev("999999999999999999*999999999999999999") is None  # |v| > 1e30
    assert ev("1/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3") is None  # denominator bound
    tight = Limits(max_chars=5)
    assert ev("1+2+3", limits=tight) == 6
    assert ev("1+2+34", limits=tight) is None


def test_power_bounds():
    pow_ok = Limits(allow_pow=True)
    assert ev("2**10", limits=pow_ok) == 1024
    assert ev("2^10", limits=pow_ok) == 1024
    assert ev("2**3**2", limits=pow_ok) == 512  # right-associative
    assert ev("-2**2", limits=pow_ok) == -4  # sign binds looser than power
    assert ev("2**-2", limits=pow_ok) == Fraction(1, 4)
    assert ev("9**9**9**9", limits=pow_ok) is None  # exponent bound at the first power
    assert ev("10**100000", limits=pow_ok) is None
    assert ev("2**33", limits=pow_ok) is None  # |exponent| > 32
    assert ev("10**31", limits=pow_ok) is None  # |value| > 1e30
    assert ev("0**-1", limits=pow_ok) is None
    assert ev("2**0.5", limits=pow_ok) == pytest.approx(2**0.5)  # p/q: a q-th root
    assert ev("4**0.5", limits=pow_ok) == 2  # exact when the root is
    assert ev("2**0.123", limits=pow_ok) is None  # q = 1000 > 32


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"\frac{1}{2}", Fraction(1, 2)),
        (r"\frac{\frac{1}{2}}{3}", Fraction(1, 6)),
        (r"\sqrt{16}", Fraction(4)),
        (r"\sqrt{\frac{9}{4}}", Fraction(3, 2)),
        (r"\sqrt[3]{27}", Fraction(3)),
        (r"\sqrt[3]{-8}", Fraction(-2)),
        (r"8^{1/3}", Fraction(2)),
        (r"2^{10}", Fraction(1024)),
        (r"2^23", Fraction(12)),  # TeX: the exponent is one digit, "2^2 * 3"
        (r"3\cdot4", Fraction(12)),
        (r"3\times4\div6", Fraction(2)),
        (r"2(3+4)", Fraction(14)),  # implicit multiplication
        (r"(1+1)(2+2)", Fraction(8)),
        (r"{2}+{3}", Fraction(5)),
    ],
)
def test_latex_values(text, expected):
    assert ev(text, latex=True) == expected


def test_latex_irrational_values_are_floats():
    assert ev(r"\sqrt{2}", latex=True) == pytest.approx(2**0.5)
    assert ev(r"2\pi", latex=True) == pytest.approx(6.283185307179586)
    assert ev(r"\sqrt{-1}", latex=True) is None
    assert ev(r"\frac{1}{0}", latex=True) is None


def test_latex_variables_words_and_unknown_commands():
    tree = parse(r"2x^2+xy", latex=True)
    assert tree is not None and safe_eval.variables(tree) == {"x", "y"}
    env = {"x": Fraction(3), "y": Fraction(5)}
    assert safe_eval.evaluate(tree, env) == 2 * 9 + 15
    assert safe_eval.evaluate(tree, {"x": Fraction(3)}) is None  # unbound y
    assert parse("Monday", latex=True) is None  # words are not products
    assert parse(r"\infty", latex=True) is None
    assert parse(r"\input{/etc/passwd}", latex=True) is None
    assert parse(r"x=3", latex=True) is None
    assert parse("2x", latex=False) is None  # plain dialect has no variables


def test_literals_in_reading_order():
    tree = parse("(44 + 19) * 2 - 35")
    assert safe_eval.literals(tree) == [44, 19, 2, 35]
    tree = parse("-(3 - 1) / 7")
    assert safe_eval.literals(tree) == [3, 1, 7]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/().^ \\{}xfracsqt", max_size=300))
def test_random_text_never_raises(text):
    for latex in (False, True):
        for limits in (None, Limits(allow_pow=True)):
            value = ev(text, latex=latex, limits=limits)
            assert value is None or isinstance(value, (Fraction, float))


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.integers(0, 99).map(str),
    lambda inner: st.tuples(inner, st.sampled_from("+-*"), inner).map(lambda t: f"({t[0]}{t[1]}{t[2]})"),
    max_leaves=12,
))
def test_agrees_with_integer_arithmetic(text):
    # Independent reference: evaluate the fully parenthesised tree by hand.
    def reference(s: str) -> int:
        if s.isdigit():
            return int(s)
        body, depth = s[1:-1], 0
        for i, ch in enumerate(body):
            depth += (ch == "(") - (ch == ")")
            if depth == 0 and ch in "+-*" and i > 0:
                a, b = reference(body[:i]), reference(body[i + 1 :])
                return a + b if ch == "+" else a - b if ch == "-" else a * b
        raise AssertionError(s)

    expected = reference(text)
    got = ev(text)
    if len(text) <= 256 and text.count("(") <= 24:
        assert got == expected
