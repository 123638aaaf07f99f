"""Shortcut baselines: the rules are fitted on training questions only, scored with the
task's own check, and their scores are what an independent count of the same sets gives."""
import collections
import random

import pytest

from grpo_jax.tasks.shortcuts import commonest, lookup_rule, shortcut_baselines
from grpo_jax.tasks import Example, get_task, split_of
from grpo_jax.tasks.arithmetic import ArithmeticTask, carry_dropped_value
from grpo_jax.tasks.custom import CustomTask, RewardFunctionError


def test_commonest_and_lookup_rule_hand_computed():
    assert commonest([3, 1, 3, 1, 2]) == 3  # a tie goes to the first seen
    assert commonest([]) is None
    train = [Example(p, a, {"k": k}) for p, a, k in
             [("a", "10", "x"), ("b", "10", "x"), ("c", "20", "x"), ("d", "30", "y"), ("e", "20", "z"), ("f", "20", "z")]]
    rule = lookup_rule(train, key=lambda ex: ex.meta["k"], target=lambda ex: ex.answer,
                       answer=lambda ex, v: f"={v}")
    assert [rule(Example("q", "", {"k": k})) for k in "xyzw"] == ["=10", "=30", "=20", "=20"]  # w unseen: overall


def test_carry_dropped_chain_is_the_all_slips_solution():
    """Independently: the carry slip's SFT solution at p = 1 ends in the same answer."""
    task = ArithmeticTask(num_operands=5, max_digits=2, slip="carry")
    for ex in task.examples("train", 300, seed=2):
        text = task.sft_text(ex, random.Random(0), wrong_step_prob=1.0)
        assert task.extract_answer(text) == str(carry_dropped_value(ex.meta["operands"], ex.meta["ops"]))


def test_arithmetic_shortcut_scores_match_a_direct_count():
    task = ArithmeticTask(num_operands=3, max_digits=1)
    train, held_out = task.examples("train", 2000, seed=1), task.examples("test", 150, seed=1)
    b = shortcut_baselines(task, held_out, train)
    top = collections.Counter(ex.answer for ex in train).most_common(1)[0][0]
    assert b.scores["constant"] == sum(ex.answer == top for ex in held_out) / 150
    # Units digit + the tens of the commonest training answer's tens, counted by hand.
    tens = collections.Counter(int(ex.answer) // 10 for ex in train).most_common(1)[0][0]
    assert b.scores["units digit + commonest rest overall"] == sum(int(ex.answer) // 10 == tens for ex in held_out) / 150
    dropped = sum(str(carry_dropped_value(ex.meta["operands"], ex.meta["ops"])) == ex.answer for ex in held_out)
    assert b.scores["carry-dropped chain"] == dropped / 150
    # Per operator order: a finer key can only fit training better, and here it also scores higher.
    assert b.scores["units digit + commonest rest by operator order"] >= b.scores["units digit + commonest rest overall"]
    assert b.best[1] == max(b.scores.values()) and b.distinct_questions == 150 and b.fit_questions == 2000


def test_chat_arithmetic_a_plus_b_scores_the_share_of_additions():
    task = get_task("chat_arithmetic")
    held_out = task.examples("test", 100, seed=0)
    b = shortcut_baselines(task, held_out)
    additions = sum(ex.meta["kind"] == "+" for ex in held_out)
    # a + b is also right on a - b questions with b = 0 (none: b >= 1) and a * b with a = b = 2.
    twos = sum(ex.meta["operands"] == (2, "*", 2) for ex in held_out)
    assert b.scores["a + b whatever the operator"] == (additions + twos) / 100


def test_held_out_arithmetic_questions_are_distinct_and_a_too_large_request_is_refused():
    task = ArithmeticTask(num_operands=2, max_digits=1)  # 81 + 45 questions in all, ~10% in test
    held_out = task.examples("test", 10, seed=0)
    assert len({ex.prompt for ex in held_out}) == 10
    with pytest.raises(RuntimeError, match="distinct test"):
        task.examples("test", 40, seed=0)
    assert len(task.examples("train", 400, seed=0)) == 400  # training questions may repeat


def _digits(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b)


def test_custom_task_held_out_prompts_are_distinct_and_never_drawn_for_training():
    task = CustomTask(_digits, lambda p, c, a: float(c.strip() == a))
    held_out = task.examples("test", 200, seed=0)
    prompts = {ex.prompt for ex in held_out}
    assert len(prompts) == 200 and all(split_of(p) == "test" for p in prompts)
    trained = {ex.prompt for s in range(20) for ex in task.examples("train", 64, seed=s)}
    assert not prompts & trained and all(split_of(p) == "train" for p in trained)


def test_custom_task_too_small_a_space_is_a_clear_error_and_user_rules_are_scored():
    small = CustomTask(lambda rng: (f"{rng.randint(0, 9)}+1=", "x"), lambda p, c, a: 0.0)
    with pytest.raises(RewardFunctionError, match="too few distinct"):
        small.examples("test", 64, seed=0)
    task = CustomTask(_digits, lambda p, c, a: float(c.strip() == a),
                      shortcuts=lambda train: {"first operand": lambda ex: ex.prompt.split("+")[0]})
    held_out = task.examples("test", 100, seed=0)
    b = shortcut_baselines(task, held_out)
    assert b.scores["first operand"] == sum(ex.prompt.endswith("+0=") for ex in held_out) / 100


def test_a_chat_wrapped_task_keeps_its_rules_and_a_task_without_training_data_reports_none(caplog):
    from grpo_jax.tasks.shortcuts import try_shortcut_baselines
    from grpo_jax.tasks.chat import ChatPromptTask
    from grpo_jax.text.tokenizer import train_sentencepiece

    base = get_task("chat_arithmetic")
    tok = train_sentencepiece(["What is 2 + 3? 5"] * 50, vocab_size=40)
    wrapped = ChatPromptTask(base, tok, "arithmetic")
    held_out = wrapped.examples("test", 50, seed=0)
    assert shortcut_baselines(wrapped, held_out).scores == shortcut_baselines(base, base.examples("test", 50, 0)).scores

    class NoTraining(ArithmeticTask):
        def examples(self, split, n, seed):
            if split == "train":
                raise OSError("train.jsonl not found")
            return super().examples(split, n, seed)

    task = NoTraining()
    assert try_shortcut_baselines(task, task.examples("test", 10, 0)) is None
    assert "train.jsonl not found" in caplog.text


def test_clears_needs_ten_points_over_the_best_shortcut_in_every_seed():
    from grpo_jax.tasks.shortcuts import clears

    assert clears({0: 0.86, 1: 0.95}, bar=0.75) and clears([0.86, 0.95], bar=0.75)
    assert not clears({0: 0.86, 1: 0.84}, bar=0.75)  # one seed short is not learning
    assert not clears({}, bar=0.0)


def test_guesses_are_scored_as_the_task_s_answers_even_where_the_reward_reads_an_answer_line():
    """A reward that reads an `A:` line scores a bare completion 0; the constant guess is an
    answer, and scores the share of held-out answers equal to the commonest training one."""
    def question(rng):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"{a}+{b} mod 7=", str((a + b) % 7)

    task = CustomTask(question, lambda p, c, a: float(f"A:{a}" in c.splitlines()))
    held_out = task.examples("test", 200, seed=0)
    train = task.examples("train", 1000, seed=1)
    top = collections.Counter(ex.answer for ex in train).most_common(1)[0][0]
    b = shortcut_baselines(task, held_out, train)
    assert b.scores["constant"] == sum(ex.answer == top for ex in held_out) / 200 > 0.05


def test_numeric_rules_score_the_readme_task_s_units_digit_with_the_commonest_tens():
    from grpo_jax.tasks.shortcuts import numeric_rules

    task = CustomTask(_readme_question, lambda p, c, a: float(c.strip() == a), shortcuts=numeric_rules)
    held_out = task.examples("test", 64, seed=0)
    b = shortcut_baselines(task, held_out)
    # Sums of three digits: 10..19 is the commonest tens (0.66 of all 1000 triples), so the rule
    # is right exactly where the answer's tens digit is 1.
    assert sum(10 <= a + b + c <= 19 for a in range(10) for b in range(10) for c in range(10)) == 660
    assert b.scores["units digit + commonest rest overall"] == sum(int(ex.answer) // 10 == 1 for ex in held_out) / 64
    assert b.best[1] >= b.scores["units digit + commonest rest overall"] > 0.5
    assert numeric_rules(held_out)["units digit + commonest rest by prompt shape"](Example("1+2+3=", "x")) is None


def _readme_question(rng):
    a, b, c = rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 9)
    return f"{a}+{b}+{c}=", str(a + b + c)
