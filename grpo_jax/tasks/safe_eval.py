"""Bounded evaluation of untrusted arithmetic (model outputs): no eval/exec, ever.

Model text is parsed by a small hand-written tokenizer and recursive-descent parser into
a tree of whitelisted nodes, which is then walked to compute a value. Anything outside
the whitelist (names, calls, attributes, strings, ...) makes the parser return ``None``.
Every stage is bounded, so the cost of a call is bounded whatever the input:

- the text is rejected before tokenizing if longer than ``Limits.max_chars``;
- numeric literals have at most ``max_digits`` digits;
- parentheses / unary signs / powers nest at most ``max_depth`` deep (``+``/``-`` and
  ``*``/``/`` chains are flat n-ary nodes, so tree height is bounded by ``max_depth``,
  not by the length of the text);
- every intermediate value must satisfy ``|v| <= max_abs`` and, for exact rationals,
  ``denominator <= max_denominator``; exponents must be rationals ``p/q`` with
  ``|p|, q <= max_exponent``; so ``9**9**9**9`` is refused at its first power.

Two dialects share the parser:

``plain`` (Countdown answers, the arithmetic task): non-negative decimal literals,
  ``+ - * /``, unary ``+``/``-``, parentheses, and ``**`` / ``^`` only if
  ``Limits.allow_pow``.
``latex`` (MATH answers, after normalisation): additionally ``\\frac{a}{b}``,
  ``\\sqrt{x}``, ``\\sqrt[n]{x}``, ``x^{e}`` (``x^23`` means ``x^2 * 3`` as in TeX),
  ``\\cdot``, ``\\times``, ``\\div``, ``\\pi``, ``{...}`` groups, implicit multiplication
  (``2x``, ``3\\sqrt{2}``, ``(a)(b)``) and single-letter variables (a run of three or more
  letters is refused, so words such as ``Monday`` are not read as products).

Values are exact ``Fraction`` while every operation is rational, and ``float`` once an
irrational operation (a non-perfect root, ``\\pi``) is involved.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Mapping, Union

Value = Union[Fraction, float]


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds applied to one parse + evaluation."""

    max_chars: int = 256
    max_depth: int = 24
    max_digits: int = 24
    max_abs: int = 10**30
    max_denominator: int = 10**30
    allow_pow: bool = False
    max_exponent: int = 32


PLAIN = Limits()
LATEX = Limits(max_chars=512, allow_pow=True)


class _Invalid(Exception):
    """Raised internally for anything outside the whitelist or the limits."""


# --------------------------------------------------------------------------- nodes
# Chains (Sum, Product) are n-ary so that "1+1+...+1" is one node, not a deep tree.


@dataclasses.dataclass(frozen=True)
class Num:
    value: Fraction
    text: str


@dataclasses.dataclass(frozen=True)
class Var:
    name: str


@dataclasses.dataclass(frozen=True)
class Pi:
    pass


@dataclasses.dataclass(frozen=True)
class Neg:
    operand: "Node"


@dataclasses.dataclass(frozen=True)
class Sum:
    terms: tuple  # ((sign '+'|'-', Node), ...)


@dataclasses.dataclass(frozen=True)
class Product:
    factors: tuple  # ((op '*'|'/', Node), ...); the first op is always '*'


@dataclasses.dataclass(frozen=True)
class Pow:
    base: "Node"
    exponent: "Node"


@dataclasses.dataclass(frozen=True)
class Root:
    radicand: "Node"
    index: "Node | None"  # None means square root


Node = Union[Num, Var, Pi, Neg, Sum, Product, Pow, Root]

# ----------------------------------------------------------------------- tokenizer
_DIGITS = frozenset("0123456789")
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_LATEX_COMMANDS = {
    "frac": ("frac",),
    "sqrt": ("sqrt",),
    "cdot": ("op", "*"),
    "times": ("op", "*"),
    "div": ("op", "/"),
    "pi": ("pi",),
}


def _tokenize(text: str, latex: bool, limits: Limits) -> list[tuple]:
    """Split ``text`` into tokens: ('num', str), ('op', c), ('var', c), ('frac',), ..."""
    tokens: list[tuple] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\n\r":
            i += 1
        elif c in _DIGITS or (c == "." and i + 1 < n and text[i + 1] in _DIGITS):
            j = i
            while j < n and text[j] in _DIGITS:
                j += 1
            if j < n and text[j] == "." and j + 1 < n and text[j + 1] in _DIGITS:
                j += 1
                while j < n and text[j] in _DIGITS:
                    j += 1
            literal = text[i:j]
            if len(literal) > limits.max_digits:
                raise _Invalid("literal too long")
            # TeX: a bare "^23" raises to the first digit only ("x^23" is x^2 * 3).
            if latex and tokens and tokens[-1] == ("op", "^") and literal[0] in _DIGITS:
                literal = literal[0]
                j = i + 1
            tokens.append(("num", literal))
            i = j
        elif c == "*" and i + 1 < n and text[i + 1] == "*":
            tokens.append(("op", "^"))
            i += 2
        elif c in "+-*/()":
            tokens.append(("op", c))
            i += 1
        elif c == "^":
            tokens.append(("op", "^"))
            i += 1
        elif latex and c in "{}[]":
            tokens.append(("op", c))
            i += 1
        elif latex and c in _LETTERS:
            j = i
            while j < n and text[j] in _LETTERS:
                j += 1
            if j - i > 2:
                raise _Invalid("word, not a product of variables")
            tokens.extend(("var", ch) for ch in text[i:j])
            i = j
        elif latex and c == "\\":
            j = i + 1
            while j < n and text[j] in _LETTERS:
                j += 1
            command = _LATEX_COMMANDS.get(text[i + 1 : j])
            if command is None:
                raise _Invalid("command not whitelisted")
            tokens.append(command)
            i = j
        else:
            raise _Invalid(f"character {c!r} not whitelisted")
    return tokens


# -------------------------------------------------------------------------- parser
class _Parser:
    """Recursive descent; depth counts nested parentheses, groups, signs and powers."""

    def __init__(self, tokens: list[tuple], latex: bool, limits: Limits):
        self.tokens = tokens
        self.pos = 0
        self.latex = latex
        self.limits = limits
        self.depth = 0

    def peek(self) -> tuple | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> tuple:
        tok = self.peek()
        if tok is None:
            raise _Invalid("unexpected end")
        self.pos += 1
        return tok

    def expect(self, op: str) -> None:
        if self.take() != ("op", op):
            raise _Invalid(f"expected {op}")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > self.limits.max_depth:
            raise _Invalid("nested too deep")

    def parse(self) -> Node:
        node = self.expr()
        if self.pos != len(self.tokens):
            raise _Invalid("trailing tokens")
        return node

    def expr(self) -> Node:
        terms = [("+", self.term())]
        while self.peek() in (("op", "+"), ("op", "-")):
            sign = self.take()[1]
            terms.append((sign, self.term()))
        return terms[0][1] if len(terms) == 1 else Sum(tuple(terms))

    def _starts_atom(self, tok: tuple | None) -> bool:
        if tok is None:
            return False
        return tok[0] in ("num", "var", "frac", "sqrt", "pi") or tok in (
            ("op", "("),
            ("op", "{"),
        )

    def term(self) -> Node:
        factors = [("*", self.signed())]
        while True:
            tok = self.peek()
            if tok in (("op", "*"), ("op", "/")):
                self.take()
                factors.append((tok[1], self.signed()))
            elif self.latex and self._starts_atom(tok):
                factors.append(("*", self.power()))  # implicit multiplication
            else:
                break
        return factors[0][1] if len(factors) == 1 else Product(tuple(factors))

    def signed(self) -> Node:
        tok = self.peek()
        if tok in (("op", "+"), ("op", "-")):
            self.take()
            self.enter()
            operand = self.signed()
            self.depth -= 1
            return Neg(operand) if tok[1] == "-" else operand
        return self.power()

    def power(self) -> Node:
        base = self.atom()
        if self.peek() == ("op", "^"):
            if not self.limits.allow_pow:
                raise _Invalid("power not allowed")
            self.take()
            self.enter()
            # Right-associative, and binds tighter than a leading sign: -2^2 = -(2^2).
            exponent = self.group() if self.latex else self.signed()
            self.depth -= 1
            return Pow(base, exponent)
        return base

    def group(self) -> Node:
        """A TeX argument: ``{expr}`` or a single atom (``\\frac12``, ``x^2``)."""
        if self.peek() == ("op", "{"):
            return self.atom()
        tok = self.peek()
        if tok in (("op", "+"), ("op", "-")):  # "x^-1" is sloppy TeX but unambiguous
            return self.signed()
        return self.atom()

    def atom(self) -> Node:
        tok = self.take()
        kind = tok[0]
        if kind == "num":
            return Num(Fraction(tok[1]), tok[1])
        if kind == "var":
            return Var(tok[1])
        if kind == "pi":
            return Pi()
        if tok in (("op", "("), ("op", "{")):
            self.enter()
            inner = self.expr()
            self.expect(")" if tok[1] == "(" else "}")
            self.depth -= 1
            return inner
        if kind == "frac":
            self.enter()
            num, den = self.group(), self.group()
            self.depth -= 1
            return Product((("*", num), ("/", den)))
        if kind == "sqrt":
            self.enter()
            index = None
            if self.peek() == ("op", "["):
                self.take()
                index = self.expr()
                self.expect("]")
            radicand = self.group()
            self.depth -= 1
            return Root(radicand, index)
        raise _Invalid(f"unexpected token {tok}")


def parse(text: str, *, latex: bool = False, limits: Limits | None = None) -> Node | None:
    """Parse ``text`` into a whitelisted expression tree, or ``None`` if it is not one."""
    limits = limits or (LATEX if latex else PLAIN)
    if not isinstance(text, str) or len(text) > limits.max_chars:
        return None
    try:
        tokens = _tokenize(text, latex, limits)
        if not tokens:
            return None
        return _Parser(tokens, latex, limits).parse()
    except (_Invalid, ValueError, ZeroDivisionError, RecursionError):
        return None


# ----------------------------------------------------------------------- evaluator
def _checked(v: Value, limits: Limits) -> Value:
    if isinstance(v, Fraction):
        if abs(v.numerator) > limits.max_abs * v.denominator or v.denominator > limits.max_denominator:
            raise _Invalid("value out of bounds")
    elif not math.isfinite(v) or abs(v) > limits.max_abs:
        raise _Invalid("value out of bounds")
    return v


def _int_root(n: int, k: int) -> int | None:
    """Exact k-th root of a non-negative int, or None."""
    r = round(n ** (1.0 / k)) if n < 2**1000 else None
    if r is None:
        return None
    for c in (r - 1, r, r + 1):
        if c >= 0 and c**k == n:
            return c
    return None


def _root(x: Value, k: int, limits: Limits) -> Value:
    if k < 1 or k > limits.max_exponent:
        raise _Invalid("root index out of bounds")
    negative = x < 0
    if negative and k % 2 == 0:
        raise _Invalid("even root of a negative number")
    ax = -x if negative else x
    if isinstance(ax, Fraction):
        num, den = _int_root(ax.numerator, k), _int_root(ax.denominator, k)
        if num is not None and den is not None:
            r: Value = Fraction(num, den)
            return -r if negative else r
        ax = float(ax)
    r = ax ** (1.0 / k)
    return -r if negative else r


def _power(base: Value, exponent: Value, limits: Limits) -> Value:
    if not isinstance(exponent, Fraction):
        # A float exponent would need a float power with no exactness; refuse it.
        raise _Invalid("irrational exponent")
    p, q = exponent.numerator, exponent.denominator
    if abs(p) > limits.max_exponent or q > limits.max_exponent:
        raise _Invalid("exponent out of bounds")
    if base == 0 and p < 0:
        raise _Invalid("zero to a negative power")
    if q != 1:
        base = _root(base, q, limits)
    # Bound the magnitude before computing it, so huge bases cannot blow up the work.
    if base != 0 and abs(p) * math.log10(abs(float(base)) or 1e-300) > math.log10(limits.max_abs) + 1:
        raise _Invalid("power too large")
    return base**p


def evaluate(
    node: Node,
    env: Mapping[str, Value] | None = None,
    *,
    limits: Limits = LATEX,
) -> Value | None:
    """Value of a parsed tree (variables looked up in ``env``), or None when out of bounds."""
    env = env or {}

    def walk(n: Node) -> Value:
        if isinstance(n, Num):
            return _checked(n.value, limits)
        if isinstance(n, Var):
            if n.name not in env:
                raise _Invalid(f"unbound variable {n.name}")
            return env[n.name]
        if isinstance(n, Pi):
            return math.pi
        if isinstance(n, Neg):
            return -walk(n.operand)
        if isinstance(n, Sum):
            total: Value = Fraction(0)
            for sign, term in n.terms:
                v = walk(term)
                total = _checked(total + v if sign == "+" else total - v, limits)
            return total
        if isinstance(n, Product):
            acc: Value = Fraction(1)
            for op, factor in n.factors:
                v = walk(factor)
                if op == "/" and v == 0:
                    raise _Invalid("division by zero")
                acc = _checked(acc * v if op == "*" else acc / v, limits)
            return acc
        if isinstance(n, Pow):
            return _checked(_power(walk(n.base), walk(n.exponent), limits), limits)
        if isinstance(n, Root):
            k: Value = 2 if n.index is None else walk(n.index)
            if not isinstance(k, int) and not (isinstance(k, Fraction) and k.denominator == 1):
                raise _Invalid("root index must be an integer")
            return _checked(_root(walk(n.radicand), int(k), limits), limits)
        raise _Invalid(f"node {type(n).__name__} not whitelisted")

    try:
        return walk(node)
    except (_Invalid, ValueError, ZeroDivisionError, OverflowError, RecursionError, TypeError):
        return None


def _children(n: Node) -> list[Node]:
    """Direct subtrees in reading order (a root's index first: ``\\sqrt[3]{8}``)."""
    if isinstance(n, Neg):
        return [n.operand]
    if isinstance(n, Sum):
        return [t for _, t in n.terms]
    if isinstance(n, Product):
        return [f for _, f in n.factors]
    if isinstance(n, Pow):
        return [n.base, n.exponent]
    if isinstance(n, Root):
        return [n.radicand] if n.index is None else [n.index, n.radicand]
    return []


def _leaves(node: Node, kind: type) -> list:
    """Every ``kind`` node of a tree in reading order; iterative, so depth costs no stack."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, kind):
            out.append(n)
        stack.extend(reversed(_children(n)))
    return out


def literals(node: Node) -> list[Fraction]:
    """Numeric literals of a tree in reading order (Countdown: which numbers were used)."""
    return [n.value for n in _leaves(node, Num)]


def variables(node: Node) -> set[str]:
    """Names of the free variables of a tree."""
    return {n.name for n in _leaves(node, Var)}


def safe_eval(text: str, *, latex: bool = False, limits: Limits | None = None) -> Value | None:
    """Value of a constant expression (no variables), or None if invalid / out of bounds.

    >>> safe_eval("(3 + 5) / 2")
    Fraction(4, 1)
    >>> safe_eval("__import__('os')") is None
    True
    """
    limits = limits or (LATEX if latex else PLAIN)
    node = parse(text, latex=latex, limits=limits)
    if node is None:
        return None
    return evaluate(node, limits=limits)
