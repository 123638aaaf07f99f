"""The answer check (`reward_models.answer_check`): the trunk's greedy answer, agreement with it,
how it enters the score, what training fits, save / load, and the trainer's extraction."""
import jax
import numpy as np
import pytest

from grpo_jax.config import ModelConfig
from grpo_jax.errors import RewardModelError
from grpo_jax.eval.evaluation import completion_texts
from grpo_jax.model import transformer as model_lib
from grpo_jax.rl import reward_models as rm_lib
from grpo_jax.rl.reward_models import AnswerCheck, LabelledSample, RewardModel
from grpo_jax.rl.reward_models.answer_check import GreedyAnswers, agreement, combine, spread_margin
from grpo_jax.sampler.host import Sampler
from grpo_jax.sampler.settings import SamplingParams
from grpo_jax.tasks.arithmetic import ArithmeticTask, tokenizer_corpus
from grpo_jax.text.tokenizer import encode_prompt, train_sentencepiece

TASK_KW = dict(num_operands=3, max_digits=1, operations="+")


@pytest.fixture(scope="module")
def task():
    return ArithmeticTask(**TASK_KW)


@pytest.fixture(scope="module")
def tok():
    return train_sentencepiece(tokenizer_corpus(200, **TASK_KW), vocab_size=32)


@pytest.fixture(scope="module")
def cfg(tok):
    return ModelConfig(vocab_size=tok.vocab_size, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=16, mlp_dim=64, max_seq_len=48)


@pytest.fixture(scope="module")
def params(cfg):
    return model_lib.init_params(cfg, jax.random.key(3), value_head=True)


def _model(cfg, params, tok, kind="outcome", check=None, **kw):
    return RewardModel(cfg, params, tok, kind, answer_check=check, **kw)


def test_combine_puts_agreement_first_and_keeps_the_order_within_each_side():
    scores, agree = np.array([0.5, -3.0, 2.0, -1.0], np.float32), np.array([1, 0, 0, 1], np.float32)
    np.testing.assert_allclose(combine(scores, agree, "identity", 10.0), [10.5, -3.0, 2.0, 9.0])
    sig = np.array([0.2, 0.9, 0.6], np.float32)
    got = combine(sig, np.array([1, 0, 1], np.float32), "sigmoid", 7.0)  # the margin is the identity's
    np.testing.assert_allclose(got, [0.6, 0.45, 0.8], rtol=1e-6)
    assert got.min() > 0 and got.max() < 1 and got[[0, 2]].min() > 0.5 > got[1]


def test_spread_margin_is_the_scores_range_at_least_one():
    assert spread_margin([-3.0, 2.0, 0.5]) == 5.0
    assert spread_margin([0.1, 0.2]) == 1.0
    for bad in ([], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="finite scores"):
            spread_margin(bad)
    with pytest.raises(ValueError, match="margin must be a finite number > 0"):
        AnswerCheck(str, "arithmetic", 0.0, 8)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        AnswerCheck(str, "arithmetic", 1.0, 0)


def test_agreement_needs_an_answer_on_both_sides(task):
    got = agreement(["6", None, "4", "4"], ["1+2=3\n3+3=6\nA: 6", "A: 6", "A: 5", "no answer"], task.extract_answer)
    np.testing.assert_array_equal(got, [1.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="2 greedy answers for 1 completions"):
        agreement(["1", "2"], ["A: 1"], task.extract_answer)


def test_greedy_answers_are_the_package_samplers_greedy_text_decoded_once(cfg, params, tok, monkeypatch):
    # extract = the identity: the answer is the whole greedy completion, so it can be compared
    # with the sampler's greedy rollout, drawn here on its own.
    check = AnswerCheck(lambda text: text, "arithmetic", 1.0, 12)
    greedy = GreedyAnswers(cfg, params, tok, check, prompts_per_call=2)
    prompts = ["Q: 1+2+3=?\n", "Q: 4+0+2=?\n", "Q: 9+9+9=?\n"]
    sampler = Sampler(cfg, None, SamplingParams(12, temperature=0.0, stop_tokens=tok.stop_ids, pad_id=tok.pad_id))
    rollout = sampler.generate(sampler.copy(params), [encode_prompt(tok, p) for p in prompts], key=jax.random.key(5))
    want = completion_texts(rollout, tok)
    assert any(want)  # a random trunk still writes something
    asked, decode = [], GreedyAnswers._decode
    monkeypatch.setattr(GreedyAnswers, "_decode", lambda self, ps: asked.append(ps) or decode(self, ps))
    # A group's completions share their question: each question is decoded once.
    assert greedy([prompts[2], prompts[0], prompts[1], prompts[0]]) == [want[2], want[0], want[1], want[0]]
    assert asked == [sorted(prompts)]
    decoded = []
    monkeypatch.setattr(GreedyAnswers, "_decode", lambda self, ps: decoded.extend(ps) or ["x"] * len(ps))
    assert greedy(prompts) == want and decoded == []  # cached
    assert greedy(["Q: 1+1+1=?\n", prompts[1]]) == ["x", want[1]] and decoded == ["Q: 1+1+1=?\n"]


def test_a_question_with_no_room_to_answer_has_no_answer(cfg, params, tok):
    check = AnswerCheck(lambda text: text, "arithmetic", 1.0, 12)
    long = "Q: " + "+".join(["1"] * 40) + "=?\n"
    assert len(encode_prompt(tok, long)) >= cfg.max_seq_len
    assert GreedyAnswers(cfg, params, tok, check)([long]) == [None]


def _stub_answers(monkeypatch, answers: dict):
    monkeypatch.setattr(GreedyAnswers, "_decode", lambda self, ps: [answers[p] for p in ps])


@pytest.mark.parametrize("kind", ["outcome", "process"])
def test_the_score_is_the_models_own_combined_with_agreement(cfg, params, tok, task, kind, monkeypatch):
    _stub_answers(monkeypatch, {"Q: 1+2+3=?\n": "6", "Q: 2+2+2=?\n": None})
    plain = _model(cfg, params, tok, kind)
    checked = _model(cfg, params, tok, kind, AnswerCheck(task.extract_answer, "arithmetic", 4.0, 12))
    prompts = ["Q: 1+2+3=?\n"] * 3 + ["Q: 2+2+2=?\n"]
    comps = ["1+2=3\n3+3=6\nA: 6\n", "1+2=3\n3+3=7\nA: 7\n", "A: 6\n", "2+2=4\n4+2=6\nA: 6\n"]
    own = plain.score(prompts, comps)
    agree = np.array([1, 0, 1, 0], np.float32)
    np.testing.assert_array_equal(checked.agreement(prompts, comps), agree)
    np.testing.assert_array_equal(checked.score(prompts, comps, check=False), own)
    want = (own + agree) / 2 if plain.transform == "sigmoid" else own + 4.0 * agree
    np.testing.assert_allclose(checked.score(prompts, comps), want, rtol=1e-6)
    if kind == "process":  # a PRM's steps stay its own: the check is about the answer
        assert checked.step_scores(prompts, comps) == plain.step_scores(prompts, comps)
    else:  # an ORM's one step is its score
        assert checked.step_scores(prompts, comps) == [[(len(c), float(r))] for c, r in zip(comps, want)]
    with pytest.raises(RewardModelError, match="no answer check"):
        plain.agreement(prompts, comps)


def test_training_with_an_answer_task_fits_the_margin_on_its_own_training_scores(cfg, params, tok, task,
                                                                                 monkeypatch):
    _stub_answers(monkeypatch, {})  # never decoded here: fitting reads the model's own scores alone
    train = rm_lib.labelled_samples(task, "train", 16, seed=0, samples_per_prompt=2)
    model, _ = rm_lib.train_reward_model(cfg, tok, train, kind="outcome", steps=2, batch_size=4,
                                         init_params=params, progress=False, answer_task=task)
    own = model.score([s.prompt for s in train], [s.completion for s in train], check=False)
    assert model.answer_check.margin == pytest.approx(max(1.0, float(own.max() - own.min())))
    assert model.answer_check.max_new_tokens == max(len(tok.encode(s.completion)) for s in train) + 1
    assert (model.answer_check.task, model.answer_check.extract) == ("arithmetic", task.extract_answer)
    again, _ = rm_lib.train_reward_model(cfg, tok, train, kind="outcome", steps=1, batch_size=4,
                                         init_params=model, progress=False)
    assert again.answer_check is not None and again.answer_check.task == "arithmetic"  # kept when continued
    plain, _ = rm_lib.train_reward_model(cfg, tok, train, kind="outcome", steps=1, batch_size=4,
                                         init_params=params, progress=False)
    assert plain.answer_check is None


def test_save_load_keeps_the_check_and_rebuilds_the_extraction(cfg, params, tok, task, tmp_path, monkeypatch):
    _stub_answers(monkeypatch, {"Q: 1+2+3=?\n": "6"})
    model = _model(cfg, params, tok, check=AnswerCheck(task.extract_answer, "arithmetic", 3.5, 9))
    model.save(tmp_path / "rm")
    again = RewardModel.load(tmp_path / "rm")
    assert (again.answer_check.task, again.answer_check.margin, again.answer_check.max_new_tokens) == \
        ("arithmetic", 3.5, 9)
    prompts, comps = ["Q: 1+2+3=?\n"] * 2, ["A: 6\n", "A: 5\n"]
    np.testing.assert_array_equal(again.score(prompts, comps), model.score(prompts, comps))

    def mine(text):
        return "6"

    assert RewardModel.load(tmp_path / "rm", extract_answer=mine).answer_check.extract is mine
    _model(cfg, params, tok, check=AnswerCheck(task.extract_answer, "no_such_task", 1.0, 9)).save(tmp_path / "odd")
    with pytest.raises(RewardModelError, match="'no_such_task''s extraction, which could not be rebuilt.*"
                                               "extract_answer=task.extract_answer"):
        RewardModel.load(tmp_path / "odd")
    assert RewardModel.load(tmp_path / "odd", extract_answer=mine).answer_check.task == "no_such_task"
    _model(cfg, params, tok).save(tmp_path / "plain")
    assert RewardModel.load(tmp_path / "plain").answer_check is None


def test_the_trainer_loads_a_checking_model_with_its_tasks_extraction(cfg, params, tok, task, tmp_path):
    from grpo_jax import config as config_lib
    from grpo_jax.rl.algorithms import algorithm_of
    from grpo_jax.rl.trainer import _reward_model

    _model(cfg, params, tok, check=AnswerCheck(str, "no_such_task", 1.0, 9)).save(tmp_path / "rm")
    run = config_lib.apply_overrides(config_lib.get_preset("cpu-tiny"),
                                     ["rl.algorithm=grpo", f"rl.reward_model={tmp_path / 'rm'}"])
    loaded = _reward_model(run, algorithm_of(run), None, tok, task)
    assert loaded.answer_check.extract == task.extract_answer


def test_pairwise_follows_the_trunks_answers_whatever_the_models_own_score(cfg, params, tok, task, monkeypatch):
    """One right and one wrong sample per question: with the trunk right on 3 of 4 questions,
    the checked score ranks exactly those 3 pairs right, whatever the (random) model's own
    score says, since the margin exceeds its spread."""
    questions = [f"Q: {a}+{b}+1=?\n" for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
    right = {q: str(sum(int(x) for x in q[3:-3].split("+"))) for q in questions}
    samples = [LabelledSample(q, f"A: {int(right[q]) + d}\n", d == 0, ()) for q in questions for d in (0, 1)]
    trunk = dict(right, **{questions[2]: str(int(right[questions[2]]) + 1)})  # wrong on one question
    _stub_answers(monkeypatch, trunk)
    plain = _model(cfg, params, tok)
    own = plain.score([s.prompt for s in samples], [s.completion for s in samples])
    checked = _model(cfg, params, tok, check=AnswerCheck(task.extract_answer, "arithmetic",
                                                         spread_margin(own) + 1.0, 9))
    assert rm_lib.pairwise_accuracy(checked, samples) == 0.75
    assert rm_lib.pairwise_accuracy(plain, samples) == rm_lib.pairwise_from_scores(samples, own)
