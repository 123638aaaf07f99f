"""Synthetic grade-school word problems in GSM8K's format (a stand-in for GSM8K offline).

Each problem comes from a template (shopping, change, ages, speeds, rates, sharing,
discounts, ...) with 2–3 arithmetic operations on small integers. Records look exactly
like GSM8K's: a question, and a worked solution whose lines carry calculator
annotations and whose last line is ``#### N``::

    question: "Maya buys 3 notebooks at $4 each and 2 pens at $2 each. How many dollars
               does she spend in total?"
    answer:   "The notebooks cost 3 * 4 = <<3*4=12>>12 dollars.
               The pens cost 2 * 2 = <<2*2=4>>4 dollars.
               In total she spends 12 + 4 = <<12+4=16>>16 dollars.
               #### 16"

so everything that reads GSM8K (``rewards.gsm8k_reward``, the ``gsm8k`` task's answer
extraction, its SFT text) reads these unchanged. These are NOT GSM8K problems: they are
generated here, easier and far less varied, and results on them are not GSM8K results.

Determinism and splits: ``examples(split, n, seed)`` draws from ``random.Random`` seeded
with ``"gsm8k_synth/{split}/{seed}"``; a question belongs to the split given by a crc32
bucket of its text (10% test, 10% validation, 80% train), so splits never share a
question, whatever the seeds. Every intermediate value is a positive integer and every
division is exact. ``Example.meta`` holds the template name and its drawn values
(``meta["template"]``, ``meta["values"]``) so the answer can be recomputed independently.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from grpo_jax.tasks import rewards
from grpo_jax.tasks import Example, draw_distinct
from grpo_jax.tasks.arithmetic import apply_op
from grpo_jax.tasks.gsm8k import PROMPT, Gsm8kTask

_PEOPLE = (("Maya", "she"), ("Liam", "he"), ("Sofia", "she"), ("Noah", "he"), ("Ava", "she"),
           ("Ethan", "he"), ("Zoe", "she"), ("Omar", "he"), ("Priya", "she"), ("Lucas", "he"),
           ("Hana", "she"), ("Mateo", "he"))
_ITEMS = ("notebook", "pen", "apple", "sticker", "candle", "mug", "ticket", "cupcake",
          "marker", "plant")
_FOODS = ("cookies", "muffins", "brownies", "pancakes", "dumplings")


# ============================================================================ solution lines

def _op(a: int, op: str, b: int) -> int:
    """``apply_op``, but a template that divides inexactly is a bug here, not a slip."""
    value = apply_op(a, op, b)
    if value is None:
        raise ValueError(f"inexact division {a}/{b}")
    return value


class _Solution:
    """Builds GSM8K-style lines: ``{before}{a} {op} {b} = <<{a}{op}{b}={c}>>{c}{after}``."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def step(self, before: str, a: int, op: str, b: int, after: str) -> int:
        return self.chain(before, (a, op, b), after)

    def chain(self, before: str, terms: tuple, after: str) -> int:
        """``a op b op c ...`` evaluated left to right (only * and / are chained, so this is
        also the usual precedence); every partial result must be a positive integer."""
        value = terms[0]
        for op, b in zip(terms[1::2], terms[2::2]):
            value = _op(value, op, b)
            if value <= 0:
                raise ValueError(f"non-positive intermediate in {terms}")
        shown = " ".join(str(t) for t in terms)
        compact = "".join(str(t) for t in terms)
        self.lines.append(f"{before}{shown} = <<{compact}={value}>>{value}{after}")
        return value

    def text(self, final: int) -> str:
        return "\n".join(self.lines + [f"#### {final}"])


# ============================================================================ templates

@dataclass(frozen=True)
class Template:
    """``draw(rng)`` -> values (ints and names); ``write(values)`` -> (question, solution, answer)."""

    name: str
    draw: Callable[[random.Random], dict]
    write: Callable[[dict], tuple[str, str, int]]


def _person(rng: random.Random) -> dict:
    name, pron = rng.choice(_PEOPLE)
    return {"name": name, "pron": pron}


def _draw_shopping(rng):
    item1, item2 = rng.sample(_ITEMS, 2)
    return {**_person(rng), "item1": item1, "item2": item2, "n1": rng.randint(2, 9),
            "p1": rng.randint(2, 15), "n2": rng.randint(2, 9), "p2": rng.randint(2, 15)}


def _write_shopping(v):
    s = _Solution()
    c1 = s.step(f"The {v['item1']}s cost ", v["n1"], "*", v["p1"], " dollars.")
    c2 = s.step(f"The {v['item2']}s cost ", v["n2"], "*", v["p2"], " dollars.")
    total = s.step(f"In total {v['pron']} spends ", c1, "+", c2, " dollars.")
    q = (f"{v['name']} buys {v['n1']} {v['item1']}s at ${v['p1']} each and {v['n2']} "
         f"{v['item2']}s at ${v['p2']} each. How many dollars does {v['pron']} spend in total?")
    return q, s.text(total), total


def _draw_change(rng):
    n, p = rng.randint(2, 8), rng.randint(3, 20)
    return {**_person(rng), "item": rng.choice(_ITEMS), "n": n, "p": p,
            "m": n * p + rng.randint(1, 60)}


def _write_change(v):
    s = _Solution()
    cost = s.step(f"The {v['item']}s cost ", v["n"], "*", v["p"], " dollars.")
    left = s.step(f"{v['name']} has ", v["m"], "-", cost, " dollars left.")
    q = (f"{v['name']} has ${v['m']}. {v['pron'].capitalize()} buys {v['n']} {v['item']}s that "
         f"cost ${v['p']} each. How many dollars does {v['pron']} have left?")
    return q, s.text(left), left


def _draw_ages(rng):
    a, b = rng.sample(_PEOPLE, 2)
    return {"name": a[0], "other": b[0], "k": rng.randint(2, 5), "b": rng.randint(3, 15),
            "y": rng.randint(2, 20)}


def _write_ages(v):
    s = _Solution()
    now = s.step(f"{v['name']} is ", v["k"], "*", v["b"], " years old now.")
    later = s.step(f"In {v['y']} years {v['name']} will be ", now, "+", v["y"], " years old.")
    q = (f"{v['name']} is {v['k']} times as old as {v['other']}. {v['other']} is {v['b']} years "
         f"old. How old will {v['name']} be in {v['y']} years?")
    return q, s.text(later), later


def _draw_age_sum(rng):
    a, b = rng.sample(_PEOPLE, 2)
    return {"name": a[0], "other": b[0], "d": rng.randint(2, 30), "b": rng.randint(5, 40)}


def _write_age_sum(v):
    s = _Solution()
    older = s.step(f"{v['name']} is ", v["b"], "+", v["d"], " years old.")
    total = s.step("Together they are ", older, "+", v["b"], " years old.")
    q = (f"{v['name']} is {v['d']} years older than {v['other']}, who is {v['b']} years old. "
         f"What is the sum of their ages?")
    return q, s.text(total), total


def _draw_trip(rng):
    return {"s1": rng.randint(20, 70), "h1": rng.randint(2, 6), "s2": rng.randint(20, 70),
            "h2": rng.randint(1, 5)}


def _write_trip(v):
    s = _Solution()
    d1 = s.step("The first part of the trip is ", v["s1"], "*", v["h1"], " miles.")
    d2 = s.step("The second part is ", v["s2"], "*", v["h2"], " miles.")
    total = s.step("The car travels ", d1, "+", d2, " miles in total.")
    q = (f"A car drives at {v['s1']} miles per hour for {v['h1']} hours, then at {v['s2']} miles "
         f"per hour for {v['h2']} hours. How many miles does it travel in total?")
    return q, s.text(total), total


def _draw_reading(rng):
    p, d = rng.randint(5, 40), rng.randint(2, 9)
    return {**_person(rng), "p": p, "d": d, "total": p * d + rng.randint(10, 200)}


def _write_reading(v):
    s = _Solution()
    read = s.step(f"In {v['d']} days {v['name']} reads ", v["p"], "*", v["d"], " pages.")
    left = s.step("There are ", v["total"], "-", read, " pages left.")
    q = (f"{v['name']} reads {v['p']} pages every day. {v['pron'].capitalize()} is reading a book "
         f"with {v['total']} pages. How many pages are left after {v['d']} days?")
    return q, s.text(left), left


def _draw_sharing(rng):
    k, each, e = rng.randint(2, 8), rng.randint(2, 12), rng.randint(1, 10)
    return {**_person(rng), "food": rng.choice(_FOODS), "k": k, "e": e, "n": k * each + e}


def _write_sharing(v):
    s = _Solution()
    rest = s.step(f"{v['name']} has ", v["n"], "-", v["e"], f" {v['food']} left to share.")
    each = s.step("Each friend gets ", rest, "/", v["k"], f" {v['food']}.")
    q = (f"{v['name']} baked {v['n']} {v['food']}, ate {v['e']} of them, and shared the rest "
         f"equally among {v['k']} friends. How many {v['food']} did each friend get?")
    return q, s.text(each), each


def _draw_wages(rng):
    return {**_person(rng), "w": rng.randint(8, 25), "h": rng.randint(2, 8), "d": rng.randint(2, 6)}


def _write_wages(v):
    s = _Solution()
    daily = s.step(f"Each day {v['name']} earns ", v["w"], "*", v["h"], " dollars.")
    total = s.step(f"In {v['d']} days {v['pron']} earns ", daily, "*", v["d"], " dollars.")
    q = (f"{v['name']} earns ${v['w']} per hour and works {v['h']} hours a day. How many dollars "
         f"does {v['pron']} earn in {v['d']} days?")
    return q, s.text(total), total


def _draw_discount(rng):
    pct = rng.choice((10, 20, 25, 50))
    return {**_person(rng), "item": rng.choice(_ITEMS), "pct": pct, "p": 20 * rng.randint(1, 10),
            "n": rng.randint(2, 6)}


def _write_discount(v):
    s = _Solution()
    off = s.chain("The discount is ", (v["p"], "*", v["pct"], "/", 100), " dollars per item.")
    price = s.step("Each one costs ", v["p"], "-", off, " dollars.")
    total = s.step(f"{v['name']} pays ", price, "*", v["n"], " dollars.")
    q = (f"A {v['item']} costs ${v['p']}. This week it is {v['pct']}% off. {v['name']} buys "
         f"{v['n']} of them. How many dollars does {v['pron']} pay?")
    return q, s.text(total), total


def _draw_boxes(rng):
    b, a = rng.randint(3, 12), rng.randint(6, 24)
    return {"b": b, "a": a, "r": rng.randint(1, b * a - 1), "fruit": rng.choice(("apples", "oranges", "pears"))}


def _write_boxes(v):
    s = _Solution()
    total = s.step("There are ", v["b"], "*", v["a"], f" {v['fruit']} at first.")
    left = s.step("After throwing some away there are ", total, "-", v["r"], f" {v['fruit']}.")
    q = (f"A shop has {v['b']} boxes with {v['a']} {v['fruit']} in each box. {v['r']} {v['fruit']} "
         f"are rotten and thrown away. How many {v['fruit']} are left?")
    return q, s.text(left), left


TEMPLATES: dict[str, Template] = {t.name: t for t in (
    Template("shopping", _draw_shopping, _write_shopping),
    Template("change", _draw_change, _write_change),
    Template("ages", _draw_ages, _write_ages),
    Template("age_sum", _draw_age_sum, _write_age_sum),
    Template("trip", _draw_trip, _write_trip),
    Template("reading", _draw_reading, _write_reading),
    Template("sharing", _draw_sharing, _write_sharing),
    Template("wages", _draw_wages, _write_wages),
    Template("discount", _draw_discount, _write_discount),
    Template("boxes", _draw_boxes, _write_boxes),
)}


def generate_record(rng: random.Random, template: str | None = None) -> dict:
    """One GSM8K-format record ``{"question", "answer", "template", "values"}``."""
    t = TEMPLATES[template] if template is not None else rng.choice(list(TEMPLATES.values()))
    values = t.draw(rng)
    question, solution, _ = t.write(values)
    return {"question": question, "answer": solution, "template": t.name, "values": values}


# ============================================================================ the task

class Gsm8kSynthTask(Gsm8kTask):
    """Generated GSM8K-format problems, scored exactly like the ``gsm8k`` task.

    ``Example.prompt`` is the ``gsm8k`` task's plain-text prompt; ``meta["question"]``
    holds the bare question (for chat-formatted prompts, see ``grpo_jax.tasks.prompts``).
    """

    name = "gsm8k_synth"

    def __init__(self, templates: tuple[str, ...] | None = None):
        super().__init__()
        names = tuple(templates) if templates else tuple(TEMPLATES)
        unknown = set(names) - set(TEMPLATES)
        if unknown:
            raise ValueError(f"unknown templates {sorted(unknown)}; known: {sorted(TEMPLATES)}")
        self.templates = names

    def to_example(self, record: dict) -> Example:
        final = rewards.gsm8k_extract(record["answer"])
        return Example(
            prompt=PROMPT.format(question=record["question"]),
            answer=record["answer"],
            meta={"final_answer": rewards.format_number(final), "question": record["question"],
                  "template": record["template"], "values": dict(record["values"])},
        )

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` distinct problems of ``split``; the same (split, n, seed) gives the same list."""
        rng = random.Random(f"gsm8k_synth/{split}/{seed}")
        records = draw_distinct(lambda: generate_record(rng, rng.choice(self.templates)),
                                lambda r: r["question"], split, n, tries=200 * n + 1000)
        return [self.to_example(r) for r in records]

    def loader(self, *args, **kwargs):
        raise NotImplementedError("gsm8k_synth is generated: use examples()")
