"""experiments/reward_model_ceilings.py: line-by-line errors and the rule scores' pairwise
accuracy, on hand-made testbed samples whose answers are computed here."""
import numpy as np
import pytest

from tests.cli.test_evaluate import script

from grpo_jax.rl.reward_models import LabelledSample, pairwise_from_scores

ceilings = script("reward_model_ceilings")
PROMPT = "Q: 5+4-4-10 mod 13=?\n"  # 5+4=9, 9-4=5, 5-10=8


def test_each_kind_of_wrong_line_is_found():
    assert ceilings.question(PROMPT) == ([5, 4, 4, 10], ["+", "-", "-"], 13)
    cases = {
        "5+4=9\n9-4=5\n5-10=8\nA: 8\n": [False, False, False, False],
        "5+4=9\n9-4=0\n0-10=3\nA: 3\n": [False, True, False, False],   # a slip, carried on correctly
        "5+4=9\n9-4=5\n5-11=7\nA: 7\n": [False, False, True, False],   # a copied operand
        "5+4=9\n9-4=5\n6-10=9\nA: 9\n": [False, False, True, False],   # a carried value
        "5+4=9\n9-4=5\n5-10=8\nA: 7\n": [False, False, False, True],   # the answer line
        "5+4=9\n9-4=5\nA: 5\n": [False, False, True, True],            # a missing line
    }
    for completion, errors in cases.items():
        assert ceilings.line_errors(PROMPT, completion) == errors, completion
    with pytest.raises(ValueError, match="not a modular testbed prompt"):
        ceilings.question("Q: 2+2=?\n")


def test_two_cancelling_errors_make_a_right_answer_the_checkers_cannot_see():
    right = LabelledSample(PROMPT, "5+4=9\n9-4=5\n5-10=8\nA: 8\n", True, ((6, 1.0), (12, 1.0), (19, 1.0), (24, 1.0)))
    # 9-4 slipped to 0 (+8), then 0-10 written as 8 (a wrong lookup, -8): the answer is right again.
    lucky = LabelledSample(PROMPT, "5+4=9\n9-4=0\n0-10=8\nA: 8\n", True, ((6, 1.0), (12, 0.0), (19, 1.0), (24, 1.0)))
    one = LabelledSample(PROMPT, "5+4=9\n9-4=0\n0-10=3\nA: 3\n", False, ((6, 1.0), (12, 0.0), (19, 0.0), (24, 0.0)))
    out = ceilings.report([right, lucky, one], [right, lucky, one])
    assert out["right_through_a_wrong_line"] == 0.5
    # pairs (right, one): clean 1 > 0; (lucky, one): both have errors, a tie for "clean" ...
    assert out["pairwise_clean"] == (1 + 0.5) / 2
    # ... and -errors ranks the 2-error right answer below the 1-error wrong one
    assert out["pairwise_minus_errors"] == (1 + 0) / 2
    # P(right | 2 errors) = 1 > P(right | 1 error) = 0 on the fitted samples
    assert out["pairwise_p_right_given_errors"] == 1.0
    # "right until the first wrong line": wrong on lucky's steps 3-4 (back to right), right elsewhere
    assert out["step_accuracy_until_first_wrong_line"] == 10 / 12
    assert out["step_majority"] == 8 / 12


def test_pairwise_by_kind_splits_pairs_by_the_right_and_wrong_samples_wrong_lines():
    other = "Q: 1+1-1-1 mod 13=?\n"
    samples = [LabelledSample(PROMPT, "clean", True, ()), LabelledSample(PROMPT, "lucky", True, ()),
               LabelledSample(PROMPT, "one", False, ()), LabelledSample(PROMPT, "three", False, ()),
               LabelledSample(other, "right", True, ()), LabelledSample(other, "wrong", False, ())]
    errors = [0, 2, 1, 3, 0, 1]
    scores = [5.0, 1.0, 2.0, 1.0, 0.0, 0.0]
    out = ceilings.pairwise_by_kind(samples, scores, errors)
    assert out == {
        # (clean 5 > one 2) and, on the other prompt, a tie (0 = 0): (1 + ½) / 2
        "clean vs 1 wrong line": [2, 0.75],
        "clean vs 2+ wrong lines": [1, 1.0],                # 5 > 1
        "through a wrong line vs 1 wrong line": [1, 0.0],   # lucky 1 < one 2
        "through a wrong line vs 2+ wrong lines": [1, 0.5],  # 1 = 1
    }
    # the split covers every same-prompt pair: its pair-weighted mean is the pairwise accuracy
    total = sum(n * a for n, a in out.values()) / sum(n for n, _ in out.values())
    assert total == pytest.approx(pairwise_from_scores(samples, scores))


def test_likelihood_parts_add_up_to_the_models_own_score(tmp_path):
    """head + scale x Σ log π over the completion reproduces `RewardModel.score`, and the head
    alone is the score of the same model without its scale: the split is the model's score."""
    import jax

    from grpo_jax.config import ModelConfig
    from grpo_jax.model import transformer as model_lib
    from grpo_jax.rl.reward_models import RewardModel
    from grpo_jax.rl.reward_models.scorer import LIKELIHOOD_SCALE, add_likelihood_scale
    from grpo_jax.text.tokenizer import train_sentencepiece

    completions = ["5+4=9\n9-4=5\n5-10=8\nA: 8\n", "5+4=9\n9-4=0\n0-10=3\nA: 3\n", "5+4=9\n9-4=0\n0-10=8\nA: 8\n"]
    tok = train_sentencepiece([PROMPT + c for c in completions] * 20, vocab_size=32)
    cfg = ModelConfig(vocab_size=tok.vocab_size, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, mlp_dim=64, max_seq_len=48)
    params = add_likelihood_scale(model_lib.init_params(cfg, jax.random.key(0), value_head=True), 0.6)
    model = RewardModel(cfg, params, tok, "outcome")
    samples = [LabelledSample(PROMPT, c, i != 1, ()) for i, c in enumerate(completions)]
    head, logps, scale = ceilings.likelihood_parts(model, samples, rows=2)  # two batches, one padded
    assert scale == pytest.approx(0.6)
    assert [len(lp) for lp in logps] == [len(tok.encode(c)) + 1 for c in completions]  # + eos
    prompts, comps = [s.prompt for s in samples], [s.completion for s in samples]
    np.testing.assert_allclose(head + scale * np.array([lp.sum() for lp in logps]), model.score(prompts, comps),
                               rtol=1e-5, atol=1e-5)
    plain = RewardModel(cfg, {k: v for k, v in params.items() if k != LIKELIHOOD_SCALE}, tok, "outcome")
    np.testing.assert_allclose(head, plain.score(prompts, comps), rtol=1e-5, atol=1e-5)
    assert all((lp <= 0).all() for lp in logps)
    with pytest.raises(ValueError, match="likelihood-aware outcome"):
        ceilings.likelihood_parts(plain, samples)


def test_answer_check_ranks_by_agreement_with_the_trunks_answer_then_by_the_score(monkeypatch):
    """The trunk's greedy answers are stubbed (decoding is `sample_and_score`'s, tested with
    the sampler): the questions it is asked are the prompts' own, agreement ranks first, and the
    model's score orders only samples that agree alike."""
    other = "Q: 1+1-1-1 mod 13=?\n"  # 1+1-1-1 = 0
    samples = [LabelledSample(PROMPT, "A: 8\n", True, ()), LabelledSample(PROMPT, "A: 3\n", False, ()),
               LabelledSample(PROMPT, "A: 7\n", False, ()),
               LabelledSample(other, "A: 0\n", True, ()), LabelledSample(other, "A: 5\n", False, ())]
    scores = [0.0, 2.0, 1.0, 1.0, 1.0]
    asked = {}

    def trunk_answers(sampler, weights, task, tokenizer, examples, prompts, *, key):
        asked.update({p: (ex.prompt, ex.answer) for p, ex in zip(prompts, examples)})
        greedy = {PROMPT: "3", other: "0"}  # wrong on the first question, right on the other
        return [{"greedy_answer": greedy[p], "greedy_correct": greedy[p] == ex.answer} for p, ex in zip(prompts, examples)]

    class Model:  # what the report reads of a reward model before it decodes
        tokenizer = type("Tok", (), {"stop_ids": (2,), "pad_id": 0, "add_bos": False,
                                     "encode": lambda self, text, add_bos=False: [1] * len(text)})()
        cfg = type("Cfg", (), {"max_seq_len": 48})()
        params = None

    monkeypatch.setattr(ceilings, "sample_and_score", trunk_answers)
    monkeypatch.setattr(ceilings, "Sampler", lambda cfg, mesh, settings: type("S", (), {"copy": lambda self, p: p})())
    out = ceilings.answer_check_report(samples, Model(), scores)
    assert asked == {PROMPT: (PROMPT, "8"), other: (other, "0")}
    assert out["trunk_greedy_accuracy"] == 0.5 and out["questions"] == 2
    # PROMPT: right (disagrees) vs 3 (agrees): lost; vs 7 (disagrees): a tie. other: right agrees, wrong not: won.
    assert out["pairwise_agreement"] == pytest.approx((0 + 0.5 + 1) / 3)
    # ties among disagreeing samples go to the score: right 0.0 < 7's 1.0, lost.
    assert out["pairwise_agreement_then_score"] == pytest.approx((0 + 0 + 1) / 3)


@pytest.mark.parametrize("flag", ["--likelihood-parts", "--answer-check"])
def test_a_model_option_without_a_model_is_named(flag, capsys):
    with pytest.raises(SystemExit):
        ceilings.main(["samples.jsonl", flag])
    assert f"{flag} needs --reward-model" in capsys.readouterr().err
