"""Where the project's answer checker and Hugging Face's math-verify disagree, on the GSM8K
and MATH fixtures (tests/fixtures) and on hand-written equivalent / different answers.

    python experiments/math_verify_report.py                    # print the report
    python experiments/math_verify_report.py --write docs/math_verify.md

For each fixture problem the completions are the reference solution itself and its final
answer written other ways a model writes it (unboxed, a decimal for a fraction, a sentence,
a wrong value). "ours" is the training reward (`rewards.gsm8k_reward` / `math_reward` against
the dataset's answer field); math-verify runs in its worker process
(`grpo_jax.eval.math_verify_check`). A case where only math-verify is correct is a right answer
the project's reward scores 0, or math-verify being lenient: the table shows which.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from fractions import Fraction

from grpo_jax import cli
from grpo_jax.tasks import rewards
from grpo_jax.eval.math_verify_check import MathVerify, disagreements, format_report

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")

# (label, completion, MATH-style reference solution): equivalent answers first, then different.
HAND = [
    ("set order", "The solutions are $\\boxed{3, -1}$.", "so $x = \\boxed{-1, 3}$."),
    ("set braces", "$\\boxed{\\{2, 1\\}}$", "$\\boxed{\\{1,2\\}}$"),
    ("x in interval", "So $x \\in \\boxed{[2,5]}$.", "$\\boxed{[2,5]}$"),
    ("interval written x in", "$\\boxed{x \\in [2,5]}$", "$\\boxed{[2,5]}$"),
    ("identity", "$\\boxed{\\sin^2 x + \\cos^2 x}$", "$\\boxed{1}$"),
    ("log", "$\\boxed{\\log_2 8}$", "$\\boxed{3}$"),
    ("unboxed sentence", "Adding them, the answer is 72.", "$\\boxed{72}$"),
    ("dfrac vs decimal", "$\\boxed{\\dfrac{3}{4}}$", "$\\boxed{0.75}$"),
    ("sqrt forms", "$\\boxed{\\frac{\\sqrt{2}}{2}}$", "$\\boxed{\\frac{1}{\\sqrt{2}}}$"),
    ("degrees", "$\\boxed{30^\\circ}$", "$\\boxed{30}$"),
    ("percent", "$\\boxed{25\\%}$", "$\\boxed{25}$"),
    ("x = prefix", "$\\boxed{x = 5}$", "$\\boxed{5}$"),
    ("pi multiple", "$\\boxed{2\\pi}$", "$\\boxed{6.283185307179586}$"),
    ("polynomial order", "$\\boxed{x^2 + 2x + 1}$", "$\\boxed{(x+1)^2}$"),
    ("thousands comma", "$\\boxed{1,000}$", "$\\boxed{1000}$"),
    ("different value", "$\\boxed{\\frac{3}{5}}$", "$\\boxed{\\frac{3}{4}}$"),
    ("different interval", "$\\boxed{(2,5)}$", "$\\boxed{[2,5]}$"),
]


def gsm8k_cases():
    """(label, completion, reference solution, final answer) for each fixture problem."""
    out = []
    for path in sorted(glob.glob(os.path.join(DATA, "gsm8k", "*.jsonl"))):
        split = os.path.basename(path).split(".")[0]
        for i, line in enumerate(open(path, encoding="utf-8")):
            row = json.loads(line)
            ref = row["answer"]
            final = ref.rsplit("####", 1)[1].strip()
            value = Fraction(final.replace(",", ""))
            name = f"gsm8k {split}[{i}]"
            out += [(f"{name} solution", ref, ref, final),
                    (f"{name} sentence", f"So the answer is {final}.", ref, final),
                    (f"{name} dollars", f"The total is ${final}.00", ref, final),
                    (f"{name} boxed", f"The answer is $\\boxed{{{final}}}$.", ref, final),
                    (f"{name} off by one", f"#### {rewards.format_number(value + 1)}", ref, final)]
    return out


def math_cases():
    out = []
    for path in sorted(glob.glob(os.path.join(DATA, "math", "*", "*", "*.json"))):
        row = json.load(open(path, encoding="utf-8"))
        sol = row["solution"]
        final = rewards.last_boxed(sol)
        name = "math " + "/".join(path.split(os.sep)[-3:]).removesuffix(".json")
        out += [(f"{name} solution", sol, sol, final),
                (f"{name} unboxed", f"The answer is ${final}$.", sol, final),
                (f"{name} boxed twice", f"First $\\boxed{{0}}$, then finally $\\boxed{{{final}}}$.", sol, final),
                (f"{name} wrong", "$\\boxed{" + final + "+1}$", sol, final)]
        value = rewards.safe_eval.safe_eval(rewards.normalize_math_answer(final), latex=True)
        # A fraction with a short decimal: the same answer as a decimal.
        if isinstance(value, Fraction) and value.denominator in (2, 4, 5, 8, 10, 20, 25):
            out.append((f"{name} decimal", f"$\\boxed{{{float(value)}}}$", sol, final))
    return out


def hand_cases():
    return [(label, c, ref, rewards.last_boxed(ref)) for label, c, ref in HAND]


def report(checker: MathVerify) -> dict:
    """{section: Disagreements} for the GSM8K fixture, the MATH fixture and the hand cases."""
    sections = {}
    for title, cases, reward in (("GSM8K fixture", gsm8k_cases(), rewards.gsm8k_reward),
                                 ("MATH fixture", math_cases(), rewards.math_reward),
                                 ("Hand-written MATH-style answers", hand_cases(), rewards.math_reward)):
        rows = [(c, final, reward(c, ref) == 1.0) for _, c, ref, final in cases]
        sections[title] = disagreements(rows, checker, labels=[label for label, *_ in cases])
    return sections


def markdown(sections: dict) -> str:
    return "\n".join(format_report(title, rep) for title, rep in sections.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--write", default=None, help="replace the generated part of this markdown file")
    args = p.parse_args(argv)
    with MathVerify() as checker:
        text = markdown(report(checker))
    if args.write:
        doc = open(args.write, encoding="utf-8").read()
        head, _, _ = doc.partition(BEGIN)
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(f"{head}{BEGIN}\n{text}")
    print(text)
    return 0


BEGIN = "<!-- generated by experiments/math_verify_report.py: do not edit below -->"

if __name__ == "__main__":
    cli.run(main)
