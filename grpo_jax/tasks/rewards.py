"""Rule-based rewards (host-side Python): Countdown, GSM8K and MATH.

Model outputs are untrusted input. Nothing here calls eval/exec: expressions go through
:mod:`grpo_jax.tasks.safe_eval`, string scanning uses ``str.find``/``rfind`` and regular
expressions without nested or overlapping quantifiers (linear time), and every function
returns a float from a small fixed set, never raises, and finishes within 100 ms on any
string (tested with hostile inputs). Completions longer than ``MAX_COMPLETION_CHARS``
score 0.0 outright: no real completion is that long, and it bounds the work.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Sequence

from grpo_jax.tasks import safe_eval

MAX_COMPLETION_CHARS = 100_000
# Longest \boxed{...} content or number we look at; real answers are far shorter.
MAX_ANSWER_CHARS = 512
MAX_NUMBER_CHARS = 40

COUNTDOWN_FORMAT_REWARD = 0.1
COUNTDOWN_ANSWER_REWARD = 1.0


def _too_long(text) -> bool:
    return not isinstance(text, str) or len(text) > MAX_COMPLETION_CHARS


# ------------------------------------------------------------------------ Countdown
_COUNTDOWN_ANSWER_CHARS = re.compile(r"[0-9+\-*/() ]+")


def countdown_format_ok(completion: str) -> bool:
    """``<think>…</think>`` then ``<answer>…</answer>``, only whitespace around and between.

    The Countdown prompt ends with ``<think>`` (TinyZero style), so the completion
    usually starts mid-think. Both are accepted: if the completion (after leading
    whitespace) does not open with ``<think>``, the prompt's is assumed. Each tag must
    occur exactly once.
    """
    text = completion.strip()
    if not text.startswith("<think>"):
        text = "<think>" + text
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    if any(text.count(tag) != 1 for tag in tags):
        return False
    think_end = text.find("</think>")
    answer_start = text.find("<answer>")
    answer_end = text.find("</answer>")
    if not think_end < answer_start < answer_end:
        return False
    between = text[think_end + len("</think>") : answer_start]
    return between.strip() == "" and text.endswith("</answer>")


def countdown_answer(completion: str) -> str | None:
    """Content of the last ``<answer>…</answer>`` (stripped), or None."""
    end = completion.rfind("</answer>")
    if end < 0:
        return None
    start = completion.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return completion[start + len("<answer>") : end].strip()


def countdown_answer_correct(answer: str, numbers: Sequence[int], target: int) -> bool:
    """The expression uses each number exactly once (as a multiset) and equals ``target``.

    Allowed: integer literals, ``+ - * /``, parentheses, spaces. Arithmetic is exact
    (rationals), so ``6/4*2`` equals 3 but ``7/2`` never equals 3.
    """
    if not answer or len(answer) > safe_eval.PLAIN.max_chars:
        return False
    if _COUNTDOWN_ANSWER_CHARS.fullmatch(answer) is None:
        return False
    tree = safe_eval.parse(answer)
    if tree is None:
        return False
    used = safe_eval.literals(tree)
    if sorted(used) != sorted(Fraction(int(x)) for x in numbers):
        return False
    value = safe_eval.evaluate(tree, limits=safe_eval.PLAIN)
    return value is not None and value == target


def countdown_reward(completion: str, numbers: Sequence[int], target: int) -> float:
    """r = 0.1·[format followed] + 1.0·[answer uses each number once and equals target].

    Returns 0.0, 0.1, 1.0 or 1.1 (TinyZero / GRPO-Zero). The answer is read from the last
    ``<answer>…</answer>`` whether or not the format is followed, so 1.0 means a correct
    answer in a malformed completion. The completion may start with or without the
    ``<think>`` that the prompt already opened (see :func:`countdown_format_ok`).
    """
    try:
        if _too_long(completion):
            return 0.0
        reward = COUNTDOWN_FORMAT_REWARD if countdown_format_ok(completion) else 0.0
        answer = countdown_answer(completion)
        if answer is not None and countdown_answer_correct(answer, numbers, target):
            reward += COUNTDOWN_ANSWER_REWARD
        return reward
    except Exception:  # noqa: BLE001 - a reward must never take down the trainer
        return 0.0


# --------------------------------------------------------------------------- GSM8K
# A number: optional sign (only when not glued to a preceding word/number, so "10-3"
# reads 3), optional "$", thousands groups "1,234" or a plain digit run, optional
# decimals. No nested quantifiers, so matching is linear.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w.])-)?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
)


def parse_number(token: str) -> Fraction | None:
    """``"-$1,234.50."`` -> Fraction(-2469, 2): strip ``$``, commas, trailing ``.``."""
    token = token.strip().rstrip(".").replace("$", "").replace(",", "")
    if not token or len(token) > MAX_NUMBER_CHARS:
        return None
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


_NUMBER_CHARS = frozenset("0123456789,.$-")


def _last_number(text: str) -> Fraction | None:
    """The last number, found from the end so the cost does not grow with the text:
    locate the last digit, back up over the run of number characters around it (a
    run longer than 4 * MAX_NUMBER_CHARS is not a number), and tokenize only that."""
    end = max(text.rfind(digit) for digit in "0123456789") + 1
    if end == 0:
        return None
    start, limit = end, max(0, end - 4 * MAX_NUMBER_CHARS)
    while start > limit and text[start - 1] in _NUMBER_CHARS:
        start -= 1
    if start == limit and start > 0 and text[start - 1] in _NUMBER_CHARS:
        return None
    last = None
    for last in _NUMBER_RE.finditer(text, start, end):
        pass
    return None if last is None else parse_number(last.group())


def gsm8k_extract(text: str) -> Fraction | None:
    """The number after the last ``####`` if there is one, else the last number."""
    if _too_long(text):
        return None
    marker = text.rfind("####")
    if marker >= 0:
        found = _NUMBER_RE.search(text, marker + 4, marker + 4 + 64)
        if found is not None:  # re-match without the window's end, which could cut it
            return parse_number(_NUMBER_RE.match(text, found.start()).group())
    return _last_number(text)


def format_number(value: Fraction) -> str:
    """Canonical text of a number: ``72``, ``-2.5``, or ``1/3`` for non-terminating."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    while den % 2 == 0:
        den //= 2
    while den % 5 == 0:
        den //= 5
    if den == 1:  # terminating decimal: write it exactly, without float rounding
        digits = 0
        while (value * 10**digits).denominator != 1:
            digits += 1
        scaled = abs(value.numerator * 10**digits // value.denominator)
        whole, frac = divmod(scaled, 10**digits)
        return f"{'-' if value < 0 else ''}{whole}.{frac:0{digits}d}"
    return str(value)


def gsm8k_reward(completion: str, reference: str) -> float:
    """1.0 if the completion's number equals the reference's ``#### N`` exactly, else 0.0.

    The completion's number is the one after its last ``####`` if any, else its last
    number (commas, ``$`` and a trailing ``.`` stripped); compared as exact rationals,
    so ``18.00`` equals ``18``.
    """
    try:
        predicted = gsm8k_extract(completion)
        expected = gsm8k_extract(reference)
        return float(predicted is not None and expected is not None and predicted == expected)
    except Exception:  # noqa: BLE001
        return 0.0


# ---------------------------------------------------------------------------- MATH
def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (or ``\\fbox{…}``), nested braces handled.

    Also accepts the ``\\boxed 5`` form (content up to the next ``$`` or space).
    Returns None if there is none, or it is unclosed / longer than MAX_ANSWER_CHARS.
    """
    if not isinstance(text, str):
        return None
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    i = idx + (len("\\boxed") if text.startswith("\\boxed", idx) else len("\\fbox"))
    if text.startswith(" ", i):
        rest = text[i + 1 : i + 1 + MAX_ANSWER_CHARS].split("$", 1)[0].split()
        return rest[0] if rest else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, min(len(text), i + MAX_ANSWER_CHARS + 2)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        args = []
        rest = part
        for _ in range(2):
            if rest.startswith("{"):
                depth = 0
                for j, ch in enumerate(rest):
                    depth += (ch == "{") - (ch == "}")
                    if depth == 0:
                        args.append(rest[: j + 1])
                        rest = rest[j + 1 :]
                        break
                else:
                    return s  # unbalanced: leave it alone
            elif rest:
                args.append("{" + rest[0] + "}")
                rest = rest[1:]
            else:
                return s
        out += "".join(args) + rest
    return out


_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")
_SQRT_BARE = re.compile(r"\\sqrt(\w)")
_INT_RATIO = re.compile(r"^(-?\d+)/(\d+)$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_TRAILING_ZEROS = re.compile(r"(\d)\.0+(?!\d)")


_UNIT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ^0123456789")


def _strip_glued_unit(s: str) -> str:
    """``5\\text{cm}`` -> ``5``: a final text group of letters right after a digit."""
    if not s.endswith("}"):
        return s
    for command in ("\\text{", "\\mbox{", "\\mathrm{"):
        start = s.rfind(command)
        if start > 0 and s[start - 1].isdigit():
            content = s[start + len(command) : -1]
            if content.strip() and all(ch in _UNIT_CHARS for ch in content):
                return s[:start]
    return s


def normalize_math_answer(answer: str) -> str:
    """Canonical string of a MATH answer, following the MATH authors' checker's rules.

    Drops line breaks, ``\\!``, spacing commands, ``\\left``/``\\right``, degrees
    (``^\\circ``), dollars, percent, trailing units (``\\text{ cm}``, ``5\\text{cm}``);
    unwraps ``\\text{X}``; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``x = 5`` -> ``5`` when
    the left side has at most 2 characters, ``x \\in [2,5]`` -> ``[2,5]``; ``\\sqrt3`` -> ``\\sqrt{3}``; removes spaces;
    ``\\frac12`` -> ``\\frac{1}{2}``; ``a/b`` of integers -> ``\\frac{a}{b}``; ``.5`` ->
    ``0.5``; ``1,000`` -> ``1000``; trailing ``.0`` and a final ``.`` dropped.
    """
    s = answer[: 2 * MAX_ANSWER_CHARS].strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    for spacing in ("\\displaystyle", "\\,", "\\;", "\\:", "\\ ", "~", "{,}"):
        s = s.replace(spacing, "" if spacing == "{,}" else " ")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    for degree in ("^{\\circ}", "^\\circ", "\\circ", "\\degree", "°"):
        s = s.replace(degree, "")
    s = s.replace("\\$", "").replace("$", "")
    for unit in ("\\text{ ", "\\mbox{ "):
        cut = s.find(unit)
        if cut > 0:
            s = s[:cut]
    s = s.strip()
    s = _strip_glued_unit(s)
    s = _TEXT_WRAP.sub(r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:
        s = s.split("=")[1]
    s = _IN_PREFIX.sub("", s)  # "x \\in [2,5]" -> "[2,5]", as "x = 5" -> "5"
    s = _SQRT_BARE.sub(r"\\sqrt{\1}", s)
    s = "".join(s.split())
    s = _fix_fracs(s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = _TRAILING_ZEROS.sub(r"\1", s)
    s = s.rstrip(".")
    ratio = _INT_RATIO.match(s)
    if ratio:
        s = f"\\frac{{{ratio.group(1)}}}{{{ratio.group(2)}}}"
    return s


_IN_PREFIX = re.compile(r"^\s*[A-Za-z]\s*\\in(?![A-Za-z])\s*")


def _split_commas(s: str) -> list[str] | None:
    """Split on commas outside brackets; None if the brackets do not balance."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return None
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    if depth != 0:
        return None
    parts.append(s[start:])
    return parts


def _split_top_level(s: str) -> tuple[str, list[str], str] | None:
    """``(a,b]`` -> ('(', ['a', 'b'], ']'); bare ``a,b`` -> ('', ['a', 'b'], '').

    Outer brackets count as delimiters only if what they enclose balances, so
    ``(x+1)(x-1)`` stays one part. None if the brackets do not balance at all.
    """
    if s[:2] == "\\{" and s[-2:] == "\\}":
        inner = _split_commas(s[2:-2])
        if inner is not None:
            return "\\{", inner, "\\}"
    elif len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        inner = _split_commas(s[1:-1])
        if inner is not None:
            return s[0], inner, s[-1]
    parts = _split_commas(s)
    return None if parts is None else ("", parts, "")


# Fixed positive rationals at which expressions with variables are compared (identity
# testing: two different low-degree expressions almost never agree at all of them).
_PROBE_VALUES = (
    Fraction(7, 3), Fraction(5, 11), Fraction(13, 4), Fraction(2, 17), Fraction(19, 6),
    Fraction(23, 9), Fraction(3, 29), Fraction(31, 8), Fraction(11, 37),
)
_MAX_VARIABLES = 3
_NUM_PROBES = 3


def _values_close(a, b) -> bool:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)


def _numerically_equal(a: str, b: str) -> bool:
    ta = safe_eval.parse(a, latex=True)
    tb = safe_eval.parse(b, latex=True) if ta is not None else None
    if ta is None or tb is None:
        return False
    names = sorted(safe_eval.variables(ta) | safe_eval.variables(tb))
    if len(names) > _MAX_VARIABLES:
        return False
    probes = [{}] if not names else [
        {name: _PROBE_VALUES[(k * len(names) + i) % len(_PROBE_VALUES)] for i, name in enumerate(names)}
        for k in range(_NUM_PROBES)
    ]
    for env in probes:
        va = safe_eval.evaluate(ta, env, limits=safe_eval.LATEX)
        vb = safe_eval.evaluate(tb, env, limits=safe_eval.LATEX)
        if va is None or vb is None or not _values_close(va, vb):
            return False
    return True


def math_equivalent(answer: str, reference: str) -> bool:
    """Normalised strings equal, or equal as (tuples of) bounded expressions.

    After :func:`normalize_math_answer`, tuples / intervals / sets are compared part by
    part with the same brackets (sets and bare lists in any order, tuples and intervals in
    theirs), and each part by the string or, failing that, by value:
    exact rationals must be equal, irrational values agree to 1e-9 (relative), and
    expressions in up to 3 variables must agree at 3 fixed rational points. All parsing
    is the whitelisted, bounded :mod:`grpo_jax.tasks.safe_eval` (no sympy, whose parsers call
    eval and whose simplification has no time bound).
    """
    na, nb = normalize_math_answer(answer), normalize_math_answer(reference)
    if not na or not nb:
        return False
    if na == nb:
        return True
    sa, sb = _split_top_level(na), _split_top_level(nb)
    if sa is None or sb is None:
        return False
    (oa, pa, ca), (ob, pb, cb) = sa, sb
    if (oa, ca) != (ob, cb) or len(pa) != len(pb):
        return False
    if oa in ("", "\\{"):
        # A bare list ("-1, 3": all the solutions) or a set is unordered: "3, -1" is the same
        # answer. Tuples and intervals keep their order.
        left = list(pb)
        for x in pa:
            j = next((j for j, y in enumerate(left) if x == y or _numerically_equal(x, y)), None)
            if j is None:
                return False
            left.pop(j)
        return True
    return all(x == y or _numerically_equal(x, y) for x, y in zip(pa, pb))


def canonical_math_answer(answer: str) -> str:
    """Normalised answer, with constant rationals written one way (for majority votes)."""
    s = normalize_math_answer(answer)
    value = safe_eval.safe_eval(s, latex=True)
    if isinstance(value, Fraction):
        return format_number(value)
    return s


def math_reward(completion: str, reference: str) -> float:
    """1.0 if the last ``\\boxed{}`` of the completion is equivalent to the reference's.

    ``reference`` is MATH's full solution (its last ``\\boxed{}`` is the answer); a bare
    answer without ``\\boxed`` is also accepted as reference. See :func:`math_equivalent`.
    """
    try:
        if _too_long(completion) or not isinstance(reference, str):
            return 0.0
        predicted = last_boxed(completion)
        expected = last_boxed(reference)
        if expected is None and "\\boxed" not in reference:
            expected = reference
        if predicted is None or expected is None:
            return 0.0
        return float(math_equivalent(predicted, expected))
    except Exception:  # noqa: BLE001
        return 0.0
