"""experiments/iterative_grpo.py: a reward model trained elsewhere comes with its samples."""
import sys

import pytest

from tests.cli.test_evaluate import script


@pytest.fixture
def it(monkeypatch):
    monkeypatch.setitem(sys.modules, "common", script("common"))  # the script's sibling, not benchmarks'
    return script("iterative_grpo")


@pytest.mark.parametrize("argv, message", [
    (["--reward-model", "rm/{draw}"], "--reward-model and --rm-samples go together"),
    (["--rm-samples", "train.jsonl"], "--reward-model and --rm-samples go together"),
    (["--reward-model", "rm", "--rm-samples", "t.jsonl", "--rm-draws", "0"], "--rm-draws must be >= 1"),
    (["--rm-no-answer-check"], "--rm-no-answer-check needs --reward-model"),
])
def test_reward_model_options_are_checked_before_any_training(it, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        it.main(argv + ["--out", str(tmp_path)])
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # stopped before the tokenizer or the SFT start
