"""Reward models must fit data whose label is in plain sight, whatever the task.

A completion is a few lines of random letters; exactly one line may read ``no``. The outcome
label is "no such line"; a step's progress label is "no such line so far". A model that reads
the right tokens ranks every held-out pair right (ORM) and labels every step right (PRM), in a
few hundred steps of a tiny trunk from random. If this fails, the reward model is mis-built
(where the head reads, what the loss sees), not under-trained for a hard task.
"""

import random

import pytest

from grpo_jax.config import ModelConfig
from grpo_jax.rl import reward_models as rm_lib
from grpo_jax.rl.reward_models import LabelledSample
from grpo_jax.text.tokenizer import train_sentencepiece
from tests.xla_flags import optimised

LETTERS = "abcdefgh"


def planted(n: int, seed: int) -> list[LabelledSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = f"Q{rng.randint(0, 99)}:\n"
        lines = ["".join(rng.choice(LETTERS) for _ in range(3)) for _ in range(4)]
        bad = rng.randrange(len(lines)) if i % 2 else None  # half the samples carry the mark
        if bad is not None:
            lines[bad] = "no"
        completion = "".join(line + "\n" for line in lines)
        ends = rm_lib.line_step_ends(completion)
        labels = [(e, 0.0 if bad is not None and j >= bad else 1.0) for j, e in enumerate(ends)]
        out.append(LabelledSample(prompt, completion, bad is None, tuple(labels)))
    return out


@pytest.fixture(scope="module")
def tok():
    corpus = [s.prompt + s.completion for s in planted(200, 0)]
    return train_sentencepiece(corpus, vocab_size=40)


@pytest.fixture(scope="module")
def cfg(tok):
    return ModelConfig(vocab_size=tok.vocab_size, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=32)


def test_the_planted_mark_is_one_token_of_its_own(tok):
    """The mark must be visible to the model as itself, not split or merged with letters."""
    ids = tok.encode("abc\nno\n")
    assert tok.encode("no") and len(tok.encode("no")) <= 2
    assert tok.decode(ids) == "abc\nno\n"


def test_an_orm_ranks_every_held_out_pair_of_planted_data(tok, cfg):
    train, held_out = planted(512, 1), planted(128, 2)
    for kind_loss in ("pairwise", "pointwise"):
        with optimised():
            rm, history = rm_lib.train_reward_model(cfg, tok, train, kind="outcome", loss=kind_loss, steps=250,
                                                    batch_size=32, seed=0, progress=False)
        assert rm_lib.pairwise_accuracy(rm, held_out) == 1.0, kind_loss
        assert history[-1]["accuracy"] == 1.0, kind_loss


def test_a_prm_labels_every_held_out_step_of_planted_data(tok, cfg):
    train, held_out = planted(512, 3), planted(128, 4)
    with optimised():
        rm, _ = rm_lib.train_reward_model(cfg, tok, train, kind="process", steps=250, batch_size=32, seed=0,
                                          progress=False)
    accuracy, majority = rm_lib.step_accuracy(rm, held_out)
    assert majority < 0.8  # the labels are not one class: accuracy 1.0 means reading the mark
    assert accuracy == 1.0
    assert rm_lib.pairwise_accuracy(rm, held_out) == 1.0


def flipped(samples: list[LabelledSample]) -> list[LabelledSample]:
    """The same samples with the outcome label inverted."""
    return [LabelledSample(s.prompt, s.completion, not s.correct, s.step_labels) for s in samples]


def test_validation_keeps_the_best_evaluations_model_not_the_last(tok, cfg):
    """Against a validation set labelled the other way round, the more the model learns the
    worse it scores, so the model kept must be the first evaluation's, and score exactly what
    that evaluation logged."""
    validation = flipped(planted(96, 5))
    rm, history = rm_lib.train_reward_model(cfg, tok, planted(512, 1), kind="outcome", steps=60, batch_size=32,
                                            seed=0, progress=False, validation=validation, eval_every=4)
    logged = {h["step"] + 1: h["validation_pairwise"] for h in history if "validation_pairwise" in h}
    assert sorted(logged) == list(range(4, 61, 4))
    best = max(logged.values())
    assert logged[60] < best  # it did learn the training labels, so the flipped ones got worse
    assert rm.trained_steps == min(step for step, v in logged.items() if v == best)
    assert rm_lib.pairwise_accuracy(rm, validation) == best


def test_validation_without_a_same_prompt_pair_is_refused(tok, cfg):
    one_label = [s for s in planted(64, 6) if s.correct]
    with pytest.raises(ValueError, match="no prompt with both a correct and an incorrect"):
        rm_lib.train_reward_model(cfg, tok, planted(64, 1), kind="outcome", steps=2, batch_size=8,
                                  progress=False, validation=one_label)
