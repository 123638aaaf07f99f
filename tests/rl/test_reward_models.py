"""Reward models: losses, batching, replay mixing, learning on the arithmetic task, save/load.

The learning tests follow the paper's recipe at toy scale: a base model first (next-token
training on worked solutions, `pretrain_trunk`), then the ORM / PRM trained from it on
solutions whose steps are wrong with probability 0.5, evaluated on held-out questions
(the task's test split). A reward model trained from a random trunk stays at chance on
this data for thousands of steps: it would have to discover arithmetic from one bit per
sample.
"""

import json
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import reward_models as rm_lib
from grpo_jax.rl.reward_models import scorer as rm_scorer, training as rm_training
from grpo_jax.config import ModelConfig
from grpo_jax.errors import RewardModelError
from grpo_jax.model.transformer import add_value_head, init_params
from grpo_jax.rl.reward_models import LabelledSample, ReplayBuffer, RewardModel
from grpo_jax.tasks.arithmetic import ArithmeticTask, tokenizer_corpus
from grpo_jax.text.tokenizer import train_sentencepiece
from tests.xla_flags import optimised

TASK_KW = dict(num_operands=3, max_digits=1, operations="+")
TRUNK_STEPS, ORM_STEPS, PRM_STEPS = 500, 300, 500


@pytest.fixture(scope="module")
def task():
    return ArithmeticTask(**TASK_KW)


@pytest.fixture(scope="module")
def tok():
    return train_sentencepiece(tokenizer_corpus(300, **TASK_KW), vocab_size=32)


@pytest.fixture(scope="module")
def cfg(tok):
    return ModelConfig(vocab_size=tok.vocab_size, embed_dim=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, mlp_dim=128, max_seq_len=48)


@pytest.fixture(scope="module")
def data(task):
    train = rm_lib.labelled_samples(task, "train", 2000, seed=0, samples_per_prompt=4)
    held_out = rm_lib.labelled_samples(task, "test", 64, seed=1, samples_per_prompt=4)  # of 79 distinct
    return train, held_out


@pytest.fixture(scope="module")
def trunk(task, tok, cfg):
    docs = [ex.prompt + sol for ex, sol in task.sft_examples("train", 2000, seed=0)]
    with optimised():
        params, history = rm_lib.pretrain_trunk(cfg, tok, docs, steps=TRUNK_STEPS, batch_size=32, lr=3e-3,
                                                progress=False)
    assert "value_head" not in params
    assert np.mean([h["loss"] for h in history[-20:]]) < 0.5 * history[0]["loss"]
    return params


@pytest.fixture(scope="module")
def orm(cfg, tok, data, trunk):
    with optimised():
        model, history = rm_lib.train_reward_model(cfg, tok, data[0], kind="outcome", loss="pairwise",
                                                   steps=ORM_STEPS, batch_size=32, lr=3e-4,
                                                   init_params=trunk, progress=False)
    return model, history


@pytest.fixture(scope="module")
def prm(cfg, tok, data, trunk):
    with optimised():
        model, history = rm_lib.train_reward_model(cfg, tok, data[0], kind="process", steps=PRM_STEPS,
                                                   batch_size=32, lr=3e-4, init_params=trunk,
                                                   progress=False)
    return model, history


def _sample(prompt="Q: 1+2+3=?\n", completion="1+2=3\n3+3=6\nA: 6\n", correct=True, steps=None):
    ends = rm_lib.line_step_ends(completion)
    return LabelledSample(prompt, completion, correct,
                          tuple((e, 1.0) for e in ends) if steps is None else steps)


# ------------------------------------------------------------------ losses
def test_bradley_terry_loss_hand_computed():
    chosen = jnp.array([2.0, 0.0, -1.0])
    rejected = jnp.array([1.0, 0.0, 1.0])
    # −log σ(1), −log σ(0), −log σ(−2)
    want = [math.log1p(math.exp(-1.0)), math.log(2.0), math.log1p(math.exp(2.0))]
    np.testing.assert_allclose(rm_lib.bradley_terry_loss(chosen, rejected), want, rtol=1e-6)
    np.testing.assert_allclose(want, [0.31326169, 0.69314718, 2.12692801], rtol=1e-7)
    # d/dr⁺ = −σ(r⁻ − r⁺): pushes the chosen score up, the rejected one down.
    g = jax.grad(lambda c: rm_lib.bradley_terry_loss(c, rejected).sum())(chosen)
    np.testing.assert_allclose(g, -jax.nn.sigmoid(rejected - chosen), rtol=1e-6)
    assert np.isfinite(rm_lib.bradley_terry_loss(jnp.array([-1e4]), jnp.array([1e4]))).all()


def test_pointwise_loss_hand_computed():
    scores = jnp.array([0.0, 2.0, -3.0, 1.0])
    labels = jnp.array([1.0, 0.0, 1.0, 0.25])
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    want = [-(y * math.log(sig(r)) + (1 - y) * math.log(1 - sig(r)))
            for r, y in zip(scores.tolist(), labels.tolist())]
    np.testing.assert_allclose(rm_lib.pointwise_loss(scores, labels), want, rtol=1e-6)
    np.testing.assert_allclose(want[:3], [0.69314718, 2.12692801, 3.04858735], rtol=1e-7)
    g = jax.grad(lambda s: rm_lib.pointwise_loss(s, labels).sum())(scores)
    np.testing.assert_allclose(g, jax.nn.sigmoid(scores) - labels, rtol=1e-6)  # σ(r) − y


# ------------------------------------------------------------------ data and batching
def test_labelled_samples_agree_with_the_rule_reward(task):
    samples = rm_lib.labelled_samples(task, "train", 50, seed=3, samples_per_prompt=4)
    assert len(samples) == 200
    examples = {ex.prompt: ex for ex in task.examples("train", 50, 3)}
    for s in samples:
        ex = examples[s.prompt]
        assert s.correct == (task.reward(s.completion, ex) == 1.0)
        assert list(s.step_labels) == task.step_rewards(s.completion, ex)
    frac = np.mean([s.correct for s in samples])
    assert 0.1 < frac < 0.6  # wrong_step_prob=0.5 over two steps
    assert samples == rm_lib.labelled_samples(task, "train", 50, seed=3, samples_per_prompt=4)


def test_step_ends_map_to_the_newline_tokens(tok):
    s = _sample()
    enc = rm_scorer.encode(tok, s.prompt, s.completion, [e for e, _ in s.step_labels], 48)
    assert enc.tokens[0] == tok.bos_id and enc.tokens[-1] == tok.eos_id
    prompt_len = len(tok.encode(s.prompt, add_bos=True))
    for (end, _), idx in zip(s.step_labels, enc.step_index):
        assert tok.decode(enc.tokens[prompt_len: idx + 1]) == s.completion[:end]
    # Left truncation keeps the end; a step whose end token falls off is marked -1.
    for keep in (20, 13, 12, 7):
        short = rm_scorer.encode(tok, s.prompt, s.completion, [e for e, _ in s.step_labels], keep)
        assert len(short.tokens) == keep and short.tokens == enc.tokens[-keep:]
        cut = len(enc.tokens) - keep
        assert list(short.step_index) == [i - cut if i >= cut else -1 for i in enc.step_index]
    assert -1 in short.step_index


def test_pairwise_interval_resamples_whole_questions():
    def samples(*questions):  # each question: (right scores, wrong scores)
        out, scores = [], []
        for q, (pos, neg) in enumerate(questions):
            for r in pos:
                out.append(_sample(prompt=f"Q{q}", correct=True)), scores.append(r)
            for r in neg:
                out.append(_sample(prompt=f"Q{q}", correct=False)), scores.append(r)
        return out, scores

    # One pair won, one lost: a resample holds 0, 1 or 2 wins of 2 (1/4, 1/2, 1/4).
    assert rm_lib.pairwise_interval(*samples(([1.0], [0.0]), ([0.0], [1.0]))) == (0.0, 1.0)
    assert rm_lib.pairwise_interval(*samples(([1.0], [0.0]), ([2.0], [0.5]))) == (1.0, 1.0)
    # Pairs weigh as pairs: 4 won in one question and 1 lost in another is 0.8, inside its interval.
    many, scores = samples(([1.0, 2.0], [0.0, 0.5]), ([0.0], [1.0]))
    assert rm_lib.pairwise_from_scores(many, scores) == 0.8
    lo, hi = rm_lib.pairwise_interval(many, scores)
    assert (lo, hi) == (0.0, 1.0) and rm_lib.pairwise_interval(many, scores, level=0.4) == (0.8, 0.8)
    assert all(math.isnan(x) for x in rm_lib.pairwise_interval(*samples(([1.0], []))))


def test_pairs_prefer_the_same_prompt():
    a_good, a_bad = _sample("A", "x", True), _sample("A", "y", False)
    b_good, c_bad = _sample("B", "x", True), _sample("C", "y", False)
    pairs, same = rm_training.labelled_pairs([a_good, a_bad, b_good, c_bad], random.Random(0))
    assert same == 1 and pairs[0] == (0, 1)
    samples = [a_good, a_bad, b_good, c_bad]
    assert all(samples[c].correct and not samples[w].correct for c, w in pairs)
    assert {c for c, _ in pairs[1:]} | {w for _, w in pairs[1:]} >= {2, 3}  # B and C get partners


def test_line_step_ends():
    assert rm_lib.line_step_ends("1+2=3\n3+3=6\nA: 6\n") == [6, 12, 17]
    assert rm_lib.line_step_ends("1+2=3\n\nA: 3") == [6, 11]
    assert rm_lib.line_step_ends("") == [0] and rm_lib.line_step_ends("  \n") == [3]


def test_samples_file_round_trip(tmp_path):
    samples = [LabelledSample("Q: 1+2=?\n", "1+2=3\nA: 3\n", True, ((6, 1.0), (11, 1.0))),
               LabelledSample("Q: 9+5=?\n", "9+5=4\nA: 4\n", False, ((6, 0.0), (11, 0.0))),
               LabelledSample("Q: 2+2=?\n", "", False)]
    path = tmp_path / "samples.jsonl"
    assert rm_lib.write_samples(path, samples) == 3
    lines = path.read_text().splitlines()
    assert json.loads(lines[1]) == {"prompt": "Q: 9+5=?\n", "completion": "9+5=4\nA: 4\n", "correct": False,
                                    "step_labels": [[6, 0.0], [11, 0.0]]}
    assert rm_lib.read_samples(path) == samples


# ------------------------------------------------------------------ replay
def test_split_by_prompt_holds_back_whole_questions(data):
    train = data[0][:400]  # 100 questions x 4
    kept, held = rm_lib.split_by_prompt(train, 0.1, seed=3)
    kept_prompts, held_prompts = {s.prompt for s in kept}, {s.prompt for s in held}
    assert not kept_prompts & held_prompts
    assert len(held_prompts) == math.ceil(0.1 * len({s.prompt for s in train}))
    assert sorted(map(repr, kept + held)) == sorted(map(repr, train))
    assert kept == [s for s in train if s.prompt in kept_prompts]  # order kept
    assert rm_lib.split_by_prompt(train, 0.1, seed=3) == (kept, held)
    assert rm_lib.split_by_prompt(train, 0.1, seed=4) != (kept, held)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="validation fraction"):
            rm_lib.split_by_prompt(train, bad, seed=0)
    with pytest.raises(ValueError, match="leaves none to train on"):
        rm_lib.split_by_prompt(train[:4], 0.5, seed=0)  # one question


def test_replay_buffer_mixes_exact_counts():
    old = [_sample(completion=f"old{i}") for i in range(30)]
    new = [_sample(completion=f"new{i}") for i in range(50)]
    buf = ReplayBuffer(seed=0)
    buf.add(old)
    for n, fraction, k in [(20, 0.1, 2), (16, 0.1, 2), (8, 0.1, 1), (10, 0.5, 5), (7, 0.0, 0)]:
        assert rm_lib.replay_count(n, fraction) == k
        batch = buf.mix(new, n, fraction, random.Random(n))
        assert len(batch) == n
        assert sum(s.completion.startswith("old") for s in batch) == k
    assert ReplayBuffer().mix(new, 10, 0.1) and all(  # an empty buffer replays nothing
        s.completion.startswith("new") for s in ReplayBuffer().mix(new, 10, 0.1))
    with pytest.raises(ValueError, match="replay_fraction"):
        rm_lib.replay_count(10, 1.5)


def test_replay_buffer_capacity_keeps_a_uniform_reservoir():
    buf = ReplayBuffer(capacity=100, seed=0)
    buf.add(_sample(completion=str(i)) for i in range(1000))
    assert len(buf) == 100
    kept = [int(s.completion) for s in buf.samples]
    assert len(set(kept)) == 100 and 300 < np.mean(kept) < 700  # not just the first or last 100


def test_training_batches_hold_the_replay_fraction(tok, data):
    """Every batch of continued training is exactly 10% history (items: samples or pairs)."""
    train, _ = data
    new, old = train[:400], train[400:1200]
    for kind, loss, batch_size, want in [("outcome", "pointwise", 20, 2), ("process", "pointwise", 32, 3),
                                         ("outcome", "pairwise", 20, 1), ("outcome", "pairwise", 64, 3)]:
        source = rm_training.BatchSource(tok, new, old, kind=kind, loss=loss, batch_size=batch_size,
                                    replay_fraction=0.1, max_len=48, seed=0)
        for _ in range(5):
            batch, from_history = source.next()
            assert from_history == want
            assert batch["tokens"].shape[0] == batch_size
            if loss == "pairwise":  # rows [0, P) chosen, [P, 2P) rejected
                p = batch_size // 2
                assert batch["label"][:p].all() and not batch["label"][p:].any()
    source = rm_training.BatchSource(tok, new, [], kind="outcome", loss="pointwise", batch_size=20,
                                     replay_fraction=0.1, max_len=48, seed=0)
    assert source.next()[1] == 0  # no history: nothing to mix


def test_continued_training_with_a_replay_buffer(cfg, tok, data, orm):
    train, _ = data
    buffer = ReplayBuffer(seed=1)
    buffer.add(train[400:1200])
    cont, history = rm_lib.train_reward_model(cfg, tok, train[:400], kind="outcome", steps=3,
                                              batch_size=20, init_params=orm[0], replay=buffer,
                                              replay_fraction=0.1, progress=False)
    assert [h["replay_items"] for h in history] == [1] * 3
    assert cont.trained_steps == orm[0].trained_steps + 3
    assert all(np.isfinite(h["loss"]) for h in history)
    # the caller's params were copied, not donated to the update
    assert np.isfinite(np.asarray(orm[0].params["value_head"])).all()
    assert not np.array_equal(cont.params["value_head"], orm[0].params["value_head"])


# ------------------------------------------------------------------ learning
def test_orm_ranks_correct_above_incorrect_on_held_out_questions(orm, data):
    model, history = orm
    train, held_out = data
    assert {s.prompt for s in train}.isdisjoint({s.prompt for s in held_out})
    assert np.mean([h["loss"] for h in history[-30:]]) < np.mean([h["loss"] for h in history[:30]])
    acc = rm_lib.pairwise_accuracy(model, held_out)
    print(f"ORM held-out pairwise accuracy: {acc:.3f}")
    assert acc >= 0.65
    assert model.kind == "outcome" and model.transform == "identity"


def test_prm_step_accuracy_beats_the_majority_baseline(prm, data):
    model, history = prm
    _, held_out = data
    acc, baseline = rm_lib.step_accuracy(model, held_out)
    print(f"PRM held-out step accuracy: {acc:.3f} (majority baseline {baseline:.3f})")
    assert acc >= baseline + 0.05
    assert model.kind == "process" and model.transform == "sigmoid"


def test_a_prm_trained_on_progress_labels_ranks_right_outputs_above_wrong_ones(task, tok):
    """A PRM trained on the progress labels of one fixed question's solutions (random slips
    of ±1, ±2, ±10 at either step, so slips carried on and compensating slips both occur):
    the true chain and compensating slips that end right get a larger token-0 process
    advantage than every slip followed by locally right steps, which the old line-local label
    paid as much as a right answer."""
    from tests.rl.test_process_labels import token0_advantages

    ex = task.make_example([7, 5, 8], ["+", "+"])
    rng = random.Random(0)
    texts = [task.sft_text(ex, rng, wrong_step_prob=0.5) for _ in range(600)]
    samples = rm_lib.label_completions(task, [ex] * len(texts), texts)
    small = ModelConfig(vocab_size=tok.vocab_size, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16, mlp_dim=64, max_seq_len=48)
    with optimised():
        model, _ = rm_lib.train_reward_model(small, tok, samples, kind="process", steps=300, batch_size=32,
                                             lr=3e-3, progress=False)
    group = {"7+5=12\n12+8=20\nA: 20\n": True, "7+5=11\n11+8=20\nA: 20\n": True,
             "7+5=13\n13+8=20\nA: 20\n": True, "7+5=11\n11+8=19\nA: 19\n": False,
             "7+5=13\n13+8=21\nA: 21\n": False, "7+5=2\n2+8=10\nA: 10\n": False}
    assert {c: task.is_correct(task.extract_answer(c), ex) for c in group} == group
    adv = token0_advantages(model.step_scores([ex.prompt] * len(group), list(group)))
    right = [a for a, ok in zip(adv, group.values()) if ok]
    wrong = [a for a, ok in zip(adv, group.values()) if not ok]
    assert min(right) > max(wrong), dict(zip(group, adv))


def test_scores_do_not_depend_on_batch_padding(orm, prm, data):
    _, held_out = data
    batch = held_out[:5]
    prompts, comps = [s.prompt for s in batch], [s.completion for s in batch]
    for model in (orm[0], prm[0]):
        together = model.score(prompts, comps)
        alone = np.concatenate([model.score([p], [c]) for p, c in zip(prompts, comps)])
        assert together.shape == (5,) and together.dtype == np.float32
        np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-5)


def test_step_scores_format(orm, prm, data):
    _, held_out = data
    s = held_out[0]
    steps = prm[0].step_scores([s.prompt], [s.completion])[0]
    assert [e for e, _ in steps] == [e for e, _ in s.step_labels]  # lines = the task's steps
    assert all(0.0 < r < 1.0 for _, r in steps)
    assert prm[0].score([s.prompt], [s.completion])[0] == pytest.approx(min(r for _, r in steps))
    given = prm[0].step_scores([s.prompt], [s.completion], [[5, len(s.completion)]])[0]
    assert [e for e, _ in given] == [5, len(s.completion)]
    last = RewardModel(prm[0].cfg, prm[0].params, prm[0].tokenizer, "process", process_reduce="last")
    assert last.score([s.prompt], [s.completion])[0] == pytest.approx(steps[-1][1])
    outcome = orm[0].step_scores([s.prompt], [s.completion])
    assert outcome == [[(len(s.completion), pytest.approx(float(orm[0].score([s.prompt], [s.completion])[0])))]]
    # untrusted text: empty and very long completions still score
    out = prm[0].score([s.prompt] * 2, ["", "9" * 500])
    assert out.shape == (2,) and np.isfinite(out).all()


# ------------------------------------------------------------------ persistence
def test_save_load_round_trip(orm, prm, data, tmp_path):
    _, held_out = data
    prompts = [s.prompt for s in held_out[:6]]
    comps = [s.completion for s in held_out[:6]]
    for model in (orm[0], prm[0]):
        path = tmp_path / model.kind
        model.save(path)
        again = RewardModel.load(path)  # the tokenizer is saved alongside
        assert (again.kind, again.transform, again.loss) == (model.kind, model.transform, model.loss)
        assert again.trained_steps == model.trained_steps and again.cfg == model.cfg
        np.testing.assert_array_equal(again.score(prompts, comps), model.score(prompts, comps))
        assert again.step_scores(prompts, comps) == model.step_scores(prompts, comps)
        with pytest.raises(FileExistsError):
            model.save(path)
    with pytest.raises(RewardModelError, match="nothing' is not a directory"):
        RewardModel.load(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RewardModelError, match=r"empty' is not a saved reward model \(no reward_model.json\)"):
        RewardModel.load(tmp_path / "empty")


def test_a_saved_model_reads_text_with_its_own_tokenizer_whatever_it_is_given(cfg, tok, tmp_path):
    """The trainer hands the policy's tokenizer to `load`: one of the same size but other pieces
    would pass every check and score other tokens, so a model saved with one keeps its own."""
    other = train_sentencepiece(tokenizer_corpus(300, seed=5, num_operands=3, max_digits=2, operations="+"),
                                vocab_size=tok.vocab_size)
    text = "Q: 7+8+9=?\n7+8=15\n15+9=24\nA: 24\n"
    assert other.vocab_size == tok.vocab_size and other.encode(text) != tok.encode(text)
    model = RewardModel(cfg, init_params(cfg, jax.random.key(0), value_head=True), tok, "outcome")
    model.save(tmp_path / "rm")
    again = RewardModel.load(tmp_path / "rm", other)
    assert again.tokenizer.encode(text) == tok.encode(text)
    np.testing.assert_array_equal(again.score(["Q: 7+8+9=?\n"], [text[11:]]), model.score(["Q: 7+8+9=?\n"], [text[11:]]))


def test_reward_model_metadata_that_does_not_match_its_checkpoint_names_the_parameter(orm, tmp_path):
    path = tmp_path / "rm"
    orm[0].save(path)
    meta = json.loads((path / "reward_model.json").read_text())
    meta["model"]["mlp_dim"] *= 2
    (path / "reward_model.json").write_text(json.dumps(meta))
    with pytest.raises(RewardModelError, match=r"\['params'\]\['layers'\]\['mlp'\]\['down'\] is stored as") as err:
        RewardModel.load(path)
    assert "strict" not in str(err.value)
    (path / "reward_model.json").write_text(json.dumps(meta)[:-10])
    with pytest.raises(RewardModelError, match="reward_model.json: not valid JSON"):
        RewardModel.load(path)


# ------------------------------------------------------------------ errors
def test_bad_inputs_are_clear_errors(cfg, tok, trunk):
    good, bad = _sample(correct=True), _sample(completion="1+2=4\n4+3=7\nA: 7\n", correct=False)
    train = rm_lib.train_reward_model
    with pytest.raises(ValueError, match="no samples"):
        train(cfg, tok, [], steps=1, progress=False)
    with pytest.raises(ValueError, match="step labels"):
        train(cfg, tok, [good, LabelledSample("Q", "A: 1\n", False)], kind="process", steps=1,
              progress=False)
    with pytest.raises(ValueError, match="per-step BCE"):
        train(cfg, tok, [good, bad], kind="process", loss="pairwise", steps=1, progress=False)
    with pytest.raises(ValueError, match="correct and incorrect"):
        train(cfg, tok, [good, good], kind="outcome", loss="pairwise", steps=1, progress=False)
    with pytest.raises(ValueError, match="kind"):
        train(cfg, tok, [good, bad], kind="value", steps=1, progress=False)
    with pytest.raises(ValueError, match="loss"):
        train(cfg, tok, [good, bad], loss="listwise", steps=1, progress=False)
    with pytest.raises(ValueError, match="step labels"):
        train(cfg, tok, [good, bad], kind="process", replay=[LabelledSample("Q", "x", True)], steps=1,
              progress=False)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        train(cfg, tok, [_sample(steps=((3, 2.0),))], kind="process", steps=1, progress=False)
    with pytest.raises(ValueError, match="replay_fraction"):
        train(cfg, tok, [good, bad], replay=[good, bad], replay_fraction=2.0, steps=1, progress=False)
    with pytest.raises(TypeError, match="LabelledSample"):
        train(cfg, tok, [("Q", "A", True)], steps=1, progress=False)
    with pytest.raises(ValueError, match="no value head"):
        RewardModel(cfg, trunk, tok, "outcome")
    model = RewardModel(cfg, add_value_head(cfg, trunk, jax.random.key(0)), tok, "outcome")
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        model.score(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="process reward model"):
        rm_lib.step_accuracy(model, [good])
