"""The modular-chain testbed: exact values worked by hand, held-out sets no training draw
reaches, and a best shortcut under 0.10 on every shipped study regime's held-out set."""
import collections

import pytest

from grpo_jax.config import ConfigError, apply_overrides, get_preset
from grpo_jax.tasks.shortcuts import shortcut_baselines
from grpo_jax.tasks import get_task, split_of
from grpo_jax.tasks.arithmetic import ArithmeticTask as ArithmeticFormat
from grpo_jax.tasks.modular import ModularTask
from grpo_jax.tools import PythonTool

from tests.cli.test_evaluate import script

# 9+4-5+10-8+0 modulo 11, by hand: 9+4=13->2, 2-5=-3->8, 8+10=18->7, 7-8=-1->10, 10+0=10.
OPERANDS, OPS = [9, 4, 5, 10, 8, 0], ["+", "-", "+", "-", "+"]
RIGHT = "9+4=2\n2-5=8\n8+10=7\n7-8=10\n10+0=10\nA: 10\n"
# Every "-" read as "+": 9+4=2, 2+5=7, 7+10=17->6, 6+8=14->3, 3+0=3 (the lines keep their "-").
ALL_SLIPS = "9+4=2\n2-5=7\n7+10=6\n6-8=3\n3+0=3\nA: 3\n"


@pytest.fixture
def task():
    return ModularTask(modulus=11, num_operands=6, num_subtractions=2)


@pytest.fixture
def example(task):
    return task.make_example(OPERANDS, OPS)


def test_question_answer_and_worked_solutions_by_hand(task, example):
    assert example.prompt == "Q: 9+4-5+10-8+0 mod 11=?\n" and example.answer == "10"
    assert task.chain_values(example) == [2, 8, 7, 10, 10]
    assert task.sft_text(example, 0, wrong_step_prob=0.0) == RIGHT
    assert task.sft_text(example, 0, wrong_step_prob=1.0) == ALL_SLIPS
    assert task.reward(RIGHT, example) == 1.0 and task.reward(ALL_SLIPS, example) == 0.0  # correctness only
    assert get_task("modular", modulus=11).name == "modular"


def test_the_corpus_slips_at_subtractions_only_at_the_asked_rate(task):
    examples = task.examples("train", 400, seed=3)
    slipped = total = 0
    for i, ex in enumerate(examples):
        text = task.sft_text(ex, i, wrong_step_prob=0.6)
        lines = text.splitlines()[:-1]
        for line, op, truth_ok in zip(lines, ex.meta["ops"], task.step_rewards(text, ex)):
            a, rest = line.split(op, 1)
            b, c = map(int, rest.split("="))
            if op == "+":
                assert c == (int(a) + b) % 11
            else:
                total += 1
                slipped += c == (int(a) + b) % 11 and c != (int(a) - b) % 11
    # 800 subtractions, a slip wherever b != 0 (b = 0 reads the same either way): 0.6 * 10/11.
    assert abs(slipped / total - 0.6 * 10 / 11) < 0.06


def test_lookup_errors_write_wrong_values_carried_on_at_the_asked_rate(task):
    examples = task.examples("train", 400, seed=3)
    wrong = carried = total = 0
    for i, ex in enumerate(examples):
        # a slip-free corpus draws the same text whatever the seed of its generator
        assert task.sft_text(ex, i, wrong_step_prob=0.0, lookup_error_prob=0.0) == task.sft_text(ex, i + 1)
        text = task.sft_text(ex, i, wrong_step_prob=0.0, lookup_error_prob=0.3)
        previous = ex.meta["operands"][0]
        for line, op, b in zip(text.splitlines(), ex.meta["ops"], ex.meta["operands"][1:]):
            a, rest = line.split(op, 1)
            carried += int(a) == previous  # each line starts from the value the last one wrote
            assert int(rest.split("=")[0]) == b
            c = int(rest.split("=")[1])
            wrong += c != ((int(a) + b) if op == "+" else (int(a) - b)) % 11
            total += 1
            previous = c
        assert text.splitlines()[-1] == f"A: {previous}"
    assert carried == total == 2000
    # each wrong value is drawn from the 10 others: no wrong draw writes the right one
    assert abs(wrong / total - 0.3) < 0.03


def test_progress_labels_and_local_checks_by_hand(task, example):
    assert task.step_rewards(RIGHT, example) == [(6, 1.0), (12, 1.0), (19, 1.0), (26, 1.0), (34, 1.0), (40, 1.0)]
    # The slip at line 2 zeroes it and every later line that carries it on, however locally right.
    assert [r for _, r in task.step_rewards(ALL_SLIPS, example)] == [1.0, 0, 0, 0, 0, 0]
    # A compensating slip: line 3 writes the true value 7 again and scores 1 (progress, not locality).
    mended = "9+4=2\n2-5=7\n7+10=7\n7-8=10\n10+0=10\nA: 10\n"
    assert [r for _, r in task.step_rewards(mended, example)] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert task.locally_right(ALL_SLIPS, example) == (3, 5)  # lines 1, 3, 5: their own sums are right
    assert task.lookups_right(ALL_SLIPS, example) == (5, 5)  # every line a right lookup of + or -
    assert task.locally_right(mended, example) == (3, 5)  # 2-5=7 and 7+10=7 are not
    assert task.locally_right("9+4=2\nA: 2\n", example) == (1, 5)  # lines left out count as wrong
    assert task.locally_right("9+5=3\n", example) == (0, 5)  # the wrong operand copied


def test_shortcut_rules_by_hand(task, example):
    rules = task.shortcuts(task.examples("train", 200, seed=0))
    guesses = {name: rule(example) for name, rule in rules.items()}
    expected = {
        "every subtraction read as +": "3",  # 9+4+5+10+8+0 = 36 -> 3, the all-slips answer
        "subtraction 1 read as +": "9",  # 9+4+5+10-8+0 = 20
        "subtraction 2 read as +": "4",  # 9+4-5+10+8+0 = 26
        "every sign flipped": "8",  # 9-4+5-10+8-0 = 8
        "operand 2 dropped": "6",  # 9-5+10-8+0
        "operand 6 dropped": "10",  # 9+4-5+10-8
        "chain stopped after 1 operand": "9",
        "chain stopped after 3 operands": "8",  # 9+4-5
        "last operand": "0",
        # 13 wraps -> 3; 3-5 = -2 wraps -> 10; 10+10 = 20 wraps -> 10; 10-8 = 2; 2+0 = 2
        "every wrapping step one too high": "2",
    }
    assert {k: guesses[k] for k in expected} == expected


def test_held_out_sets_are_distinct_and_never_drawn_for_training(task):
    held_out = task.examples("test", 512, seed=0)
    prompts = {ex.prompt for ex in held_out}
    assert len(prompts) == 512 and all(split_of(p) == "test" for p in prompts)
    trained = {ex.prompt for seed in range(5) for ex in task.examples("train", 2000, seed)}
    assert not prompts & trained
    assert all(ex.meta["ops"].count("-") == 2 for ex in held_out)
    # Answers spread over every residue (none above twice its share of 1/11).
    counts = collections.Counter(ex.answer for ex in held_out)
    assert set(counts) == {str(v) for v in range(11)} and max(counts.values()) < 2 * 512 / 11


def test_every_shipped_study_regime_has_a_best_shortcut_under_ten_percent():
    common = script("common")
    for name, regime in common.STUDY_REGIMES.items():
        cfg = apply_overrides(get_preset("cpu-tiny"), common.CPU_DEFAULTS + regime).validate()
        task = common.make_task(cfg.data.task, cfg.data)
        held_out = task.examples("test", cfg.data.eval_size, cfg.data.seed)
        baselines = shortcut_baselines(task, held_out)
        assert baselines.distinct_questions >= 512, name
        assert baselines.best[1] <= 0.10, (name, baselines.scores)
        assert len(baselines.scores) >= 15  # the constant and the task's own rules were all scored


def test_composite_moduli_are_refused():
    with pytest.raises(ValueError, match="prime"):
        ModularTask(modulus=10)
    with pytest.raises(ConfigError, match="prime"):
        apply_overrides(get_preset("cpu-tiny"), ["data.task=modular", "data.modulus=10"]).validate()
    with pytest.raises(ConfigError, match="num_subtractions"):
        apply_overrides(get_preset("cpu-tiny"), ["data.task=modular", "data.num_subtractions=6",
                                                 "data.num_operands=6"]).validate()


def test_modular_knobs_given_to_another_task_are_named_as_ignored():
    from grpo_jax.config import ConfigWarning

    with pytest.warns(ConfigWarning, match="data.modulus=11 is ignored by data.task=arithmetic"):
        apply_overrides(get_preset("cpu-tiny"), ["data.modulus=11"]).validate()


# The corpora of the default task before data.tool_prob existed (sha256 of the joined texts):
# every study's SFT start and tokenizer are trained on exactly these.
CORPUS_SHA256 = "3bd304f4c034cf1f778f23b27b74660df00ae2a92aaed2e1ab390e81d1088f62"
SFT_SHA256 = "d5b30e4c2f6f4f6b124ca26d2ec32b71ff79f38cc65f74af3c68b83e83e0a54c"
TOOL_RIGHT = "```python\nprint((9+4-5+10-8+0) % 11)\n```\n```output\n10\n```\nA: 10\n"


def _sha256(text):
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def test_without_tool_solutions_the_corpora_are_the_ones_before_byte_for_byte():
    for task in (ModularTask(), ModularTask(tool_prob=0.0)):
        assert _sha256("".join(task.text_corpus(2000, seed=0))) == CORPUS_SHA256
        sft = task.sft_examples("train", 2000, 0, wrong_step_prob=0.6)
        assert _sha256("".join(ex.prompt + text for ex, text in sft)) == SFT_SHA256
        assert task.tool is None
    cfg = apply_overrides(get_preset("cpu-tiny"), ["data.task=modular"]).validate()
    assert script("common").make_task(cfg.data.task, cfg.data).tool is None


def test_tool_solutions_by_hand_at_the_asked_share(example):
    task = ModularTask(modulus=11, tool_prob=0.25)
    assert task.tool_text(example) == TOOL_RIGHT and task.reward(TOOL_RIGHT, example) == 1.0
    pairs = task.sft_examples("train", 2000, 0, wrong_step_prob=0.6)
    tool = [(ex, text) for ex, text in pairs if text.startswith("```")]
    assert abs(len(tool) / len(pairs) - 0.25) < 0.03
    assert all(text == task.tool_text(ex) for ex, text in tool)
    # the other solutions are the chain with its slips: step lines, then the answer line
    chains = [(ex, text) for ex, text in pairs if not text.startswith("```")]
    assert all(ArithmeticFormat.format_ok(task, text) for _, text in chains)
    assert 0.2 < sum(task.reward(text, ex) == 0 for ex, text in chains) / len(chains) < 0.95  # slips
    assert task.lookups_right(TOOL_RIGHT, example) == (0, 0)  # no lookups in a tool solution


def test_a_tool_solutions_code_prints_the_answer_in_the_sandbox():
    from grpo_jax.sampler.turns import ToolUse

    task = ModularTask(tool_prob=0.5)
    examples = task.examples("train", 24, seed=4) + task.examples("test", 24, seed=4)
    results = ToolUse(task.tool, None, 1, (), 4).run([task.tool_code(ex) for ex in examples])
    for ex, result in zip(examples, results):
        assert result.status == "ok" and result.stdout == ex.answer + "\n", (ex.prompt, result)
        # the corpus's output block is exactly what the tool gives back for this run
        assert task.tool_text(ex) == (f"```python\n{task.tool_code(ex)}\n```" + task.tool.output(result)
                                      + f"A: {ex.answer}\n")


def test_the_reward_reads_the_models_own_answer_line(example):
    task = ModularTask(modulus=11, tool_prob=0.25)
    code, output = "```python\nprint((9+4-5+10-8+0) % 11)\n```", "\n```output\n10\n```\n"
    assert task.reward(code + output + "A: 4\n", example) == 0.0  # the tool's 10 is not the answer
    assert task.reward(code + "\n```output\n3\n```\n" + "A: 10\n", example) == 1.0  # the model's 10 is
    assert task.reward(code + "\n" + output + "A: 10", example) == 1.0  # a fence token that holds a newline
    assert task.reward(code + output, example) == 0.0  # no answer line of its own
    # code that could print an answer line is not the tool form
    printed = "```python\nprint('A: 10')\n```\n```output\nA: 10\n```\nA: 10\n"
    assert not task.format_ok(printed) and task.reward(printed, example) == 0.0
    assert task.reward("```python\nprint(1)\n```\n```output\n1\n```\n9+4=2\nA: 10\n", example) == 0.0  # one form
    assert ModularTask(modulus=11).reward(TOOL_RIGHT, example) == 0.0  # the format as before without tool_prob


def test_the_tokenizer_corpus_holds_the_fence_with_tool_solutions():
    from grpo_jax.sampler.turns import ToolUse
    from grpo_jax.text.tokenizer import train_sentencepiece

    task = ModularTask(tool_prob=0.25)
    corpus = list(task.text_corpus(2000, seed=0))
    assert sum("```python\n" in doc and "```output\n" in doc for doc in corpus) > 300
    assert not any("`" in doc for doc in ModularTask().text_corpus(2000, seed=0))
    tok = train_sentencepiece(corpus, vocab_size=64)
    ex = task.examples("test", 1, 0)[0]
    assert tok.decode(tok.encode(task.tool_text(ex))) == task.tool_text(ex)
    assert ToolUse.build(task.tool, tok, 1).fence_ids  # a token that closes a block


def test_data_tool_prob_reaches_the_task_and_is_checked():
    cfg = apply_overrides(get_preset("cpu-tiny"), ["data.task=modular", "data.tool_prob=0.25"]).validate()
    task = script("common").make_task(cfg.data.task, cfg.data)
    assert task.tool_prob == 0.25 and isinstance(task.tool, PythonTool)
    for bad in ("1.5", "-0.1"):
        with pytest.raises(ConfigError, match=r"data.tool_prob must be in \[0, 1\]"):
            apply_overrides(get_preset("cpu-tiny"), ["data.task=modular", f"data.tool_prob={bad}"]).validate()
    with pytest.raises(ValueError, match=r"tool_prob .* must be in \[0, 1\]"):
        ModularTask(tool_prob=2)
    from grpo_jax.config import ConfigWarning

    with pytest.warns(ConfigWarning, match="data.tool_prob=0.25 is ignored by data.task=arithmetic"):
        apply_overrides(get_preset("cpu-tiny"), ["data.tool_prob=0.25"]).validate()
