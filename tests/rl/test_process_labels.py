"""Step labels that mean progress: the arithmetic rule, the Monte-Carlo estimate it is the
limit of, and what process supervision's advantage does with them.

The group below is the case that a line-local label gets wrong: a slip followed by locally
right steps, and compensating slips that end right, beside the true chain. With labels that
mean "the right answer is still reachable from here", every right-answer output must get a
larger token-0 advantage (the sum of its normalised step rewards, Â_t at t = 0) than every
wrong-answer output.
"""
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl.advantages import process_advantages
from grpo_jax.rl.reward_models.progress import labelling_cost, monte_carlo_step_labels
from grpo_jax.tasks.arithmetic import ArithmeticTask, apply_op, solution_steps

TASK = ArithmeticTask(num_operands=8, max_digits=1)
OPERANDS, OPS = [7, 5, 8, 9, 3, 6, 4, 2], list("+++-+-+")


def chain(values):
    """Step lines writing ``values`` (the value after each step), then ``A: last``."""
    lines, previous = [], OPERANDS[0]
    for (op, b), c in zip(zip(OPS, OPERANDS[1:]), values):
        lines.append(f"{previous}{op}{b}={c}\n")
        previous = c
    return "".join(lines) + f"A: {values[-1]}\n"


def locally_right_after(slip_at: int, delta: int) -> list[int]:
    """Values of a chain that slips by ``delta`` at step ``slip_at`` and computes every
    other step right from the value written before it."""
    values, value = [], OPERANDS[0]
    for j, (op, b) in enumerate(zip(OPS, OPERANDS[1:])):
        value = apply_op(value, op, b) + (delta if j == slip_at else 0)
        values.append(value)
    return values


EX = TASK.make_example(OPERANDS, OPS)
TRUTH = [c for *_, c in solution_steps(OPERANDS, OPS)]
SLIP_EARLY = locally_right_after(0, -10)            # drops the first carry, then right locally
COMPENSATING = TRUTH[:1] + [v - 10 for v in TRUTH[1:6]] + TRUTH[6:]  # off at 2..6, back at 7
GROUP = {
    "true chain": chain(TRUTH),
    "slip, then locally right": chain(SLIP_EARLY),
    "compensating slips": chain(COMPENSATING),
    "slip at step 2, locally right": chain(locally_right_after(1, -10)),
}
# The true chain's lines with its answer line missing, or wrong. (Not in GROUP: an output
# that stays on the true chain until its last line rightly earns more for those lines than
# one that was off it for five steps.)
ENDINGS = {
    "no answer line": chain(TRUTH[:-1] + [TRUTH[-1] + 1])[: -len(f"A: {TRUTH[-1] + 1}\n")],
    "wrong answer line": chain(TRUTH[:-1] + [TRUTH[-1]]).replace(f"A: {TRUTH[-1]}", f"A: {TRUTH[-1] + 1}"),
}


# One compiled program for every group: process_advantages ignores masked step slots and
# tokens past the last step's end, so padding to fixed sizes leaves Â_i,0 as it is.
_jit_process_advantages = jax.jit(process_advantages, static_argnums=3)


def token0_advantages(step_lists, slots: int | None = None, tokens: int | None = None):
    """Process advantages Â_i,0 of one group (character ends stand for token ends); ``slots``
    and ``tokens``, when given, pad the step slots and token positions to that many (masked
    slots; tokens after every end), so groups of different sizes share one compile."""
    s = max(len(x) for x in step_lists)
    assert slots is None or slots >= s, (slots, s)
    s = slots or s
    rewards = np.zeros((1, len(step_lists), s), np.float32)
    ends = np.zeros((1, len(step_lists), s), np.int32)
    mask = np.zeros((1, len(step_lists), s), bool)
    for g, steps in enumerate(step_lists):
        for j, (end, r) in enumerate(steps):
            rewards[0, g, j], ends[0, g, j], mask[0, g, j] = r, end - 1, True
    assert tokens is None or tokens > ends.max(), (tokens, ends.max())
    tokens = tokens or int(ends.max()) + 1
    adv = _jit_process_advantages(jnp.asarray(rewards), jnp.asarray(ends), jnp.asarray(mask), tokens)
    return np.asarray(adv[0, :, 0])


def test_the_group_is_what_its_names_say():
    right = {name: TASK.is_correct(TASK.extract_answer(text), EX) for name, text in {**GROUP, **ENDINGS}.items()}
    assert right == {"true chain": True, "slip, then locally right": False, "compensating slips": True,
                     "slip at step 2, locally right": False, "no answer line": False,
                     "wrong answer line": False}
    # The compensating chain really is off the true chain in the middle and locally wrong twice.
    assert COMPENSATING[-1] == TRUTH[-1] and COMPENSATING[3] != TRUTH[3]


def test_rule_labels_follow_the_true_chain():
    labels = {name: [r for _, r in TASK.step_rewards(text, EX)] for name, text in {**GROUP, **ENDINGS}.items()}
    assert labels["true chain"] == [1.0] * 8
    assert labels["slip, then locally right"] == [0.0] * 8
    assert labels["compensating slips"] == [1, 0, 0, 0, 0, 0, 1, 1]
    assert labels["slip at step 2, locally right"] == [1.0] + [0.0] * 7
    assert labels["no answer line"] == [1.0] * 6 + [0.0, 0.0]  # its last line and the missing answer
    assert labels["wrong answer line"] == [1.0] * 7 + [0.0]


def test_every_right_output_gets_a_larger_token0_advantage_than_every_wrong_one():
    names = list(GROUP)
    adv = dict(zip(names, token0_advantages([TASK.step_rewards(GROUP[n], EX) for n in names])))
    right = [adv[n] for n in names if TASK.is_correct(TASK.extract_answer(GROUP[n]), EX)]
    wrong = [adv[n] for n in names if not TASK.is_correct(TASK.extract_answer(GROUP[n]), EX)]
    assert min(right) > max(wrong), adv


def test_no_answer_line_never_outscores_a_wrong_answer_line():
    """The same lines with the answer line dropped, or replaced by a wrong one: over many
    random solutions, the output without an answer never gets the larger advantage."""
    task = ArithmeticTask(num_operands=(2, 6), max_digits=2)
    rng = random.Random(0)
    for ex in task.examples("train", 200, seed=4):
        text = task.sft_text(ex, rng, wrong_step_prob=0.3)
        body = text[: text.rindex("A: ")]
        wrong_answer = body + f"A: {int(ex.answer) + 1}\n"
        # 2-6 operands: at most 5 step lines and the answer line, each under 24 characters.
        a_none, a_wrong = token0_advantages([task.step_rewards(body, ex), task.step_rewards(wrong_answer, ex),
                                             task.step_rewards(text, ex)], slots=6, tokens=144)[:2]
        assert a_none <= a_wrong + 1e-6, (text, a_none, a_wrong)


def drifting_completer(q: float, seed: int = 0):
    """A policy stand-in: continues the chain from the prefix's last written value, each step
    right with probability ``q``, else one too high (a drift that never comes back)."""
    rng = random.Random(seed)

    def complete(prompts, prefixes, n):
        out = []
        for prefix in prefixes:
            lines = [line for line in prefix.split("\n") if line]
            done, value = len(lines), int(lines[-1].split("=")[1]) if lines else OPERANDS[0]
            texts = []
            for _ in range(n):
                v, parts = value, []
                for op, b in zip(OPS[done:], OPERANDS[done + 1:]):
                    c = apply_op(v, op, b) + (0 if rng.random() < q else 1)
                    parts.append(f"{v}{op}{b}={c}\n")
                    v = c
                texts.append("".join(parts) + f"A: {v}\n")
            out.append(texts)
        return out

    return complete


def test_monte_carlo_labels_reach_the_exact_rule_as_n_grows():
    completions = list(GROUP.values()) + [ENDINGS["wrong answer line"]]
    exact = [[r for _, r in TASK.step_rewards(c, EX)] for c in completions]
    many = monte_carlo_step_labels(TASK, [EX] * len(completions), completions, drifting_completer(0.5), n=256)
    assert [list(x.hard) for x in many] == exact
    # On the true chain, the soft label is the chance of finishing right: q ** (steps left).
    soft = np.array(many[0].soft[:-1])
    np.testing.assert_allclose(soft, [0.5 ** (7 - j) for j in range(1, 8)], atol=0.09)
    # One continuation per step misses good steps: hard 0 where the exact rule says 1.
    few = monte_carlo_step_labels(TASK, [EX] * len(completions), completions, drifting_completer(0.5, 1), n=1)
    assert sum(h < e for x, ex in zip(few, exact) for h, e in zip(x.hard, ex)) > 0
    assert all(h <= e for x, ex in zip(few, exact) for h, e in zip(x.hard, ex))  # never a false 1


def test_monte_carlo_cost_and_the_final_step_is_the_outcome():
    completions = [GROUP["true chain"], ENDINGS["wrong answer line"]]
    labels = monte_carlo_step_labels(TASK, [EX, EX], completions, drifting_completer(1.0), n=4)
    assert [x.sampled for x in labels] == [(True,) * 7 + (False,)] * 2
    assert labels[0].hard[-1] == 1.0 and labels[1].hard[-1] == 0.0  # the answer line: the outcome itself
    assert labelling_cost(labels, 4) == {"completions": 2, "steps": 16, "prefixes_continued": 14,
                                         "continuations": 56}
    assert labels[1].step_labels("soft")[:7] == tuple((e, 1.0) for e, _ in TASK.step_rewards(completions[1], EX)[:7])


def test_monte_carlo_checks_the_completer():
    with pytest.raises(ValueError, match="continuations"):
        monte_carlo_step_labels(TASK, [EX], [GROUP["true chain"]], lambda p, x, n: [["A: 1"]] * len(p), n=2)
    with pytest.raises(ValueError, match="n"):
        monte_carlo_step_labels(TASK, [EX], [GROUP["true chain"]], drifting_completer(1.0), n=0)
