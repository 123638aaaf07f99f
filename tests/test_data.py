"""TFDS builders (from the hand-written fixtures, no network) and Grain loading:
content round trip, seeded shuffling, host sharding, checkpointable iterator state."""
import glob
import json
import os

import pytest

from grpo_jax.data import loading

FIXTURES = os.path.join(os.path.dirname(__file__), "data")


def fixture_gsm8k(split):
    with open(os.path.join(FIXTURES, "gsm8k", f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def fixture_math(split):
    out = []
    for path in glob.glob(os.path.join(FIXTURES, "math", split, "*", "*.json")):
        with open(path) as f:
            out.append(json.load(f))
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tfds"))
    for name in ("gsm8k", "math"):
        loading.build(name, path, os.path.join(FIXTURES, name))
    return path


def source(name, split, data_dir):
    return loading.data_source(name, split, data_dir, os.path.join(FIXTURES, name))


@pytest.mark.parametrize("split", ["train", "test"])
def test_gsm8k_round_trip(data_dir, split):
    src = source("gsm8k", split, data_dir)
    records = [loading.decode_record(src[i]) for i in range(len(src))]
    expected = fixture_gsm8k(split)
    assert len(records) == len(expected)
    assert sorted((r["question"], r["answer"]) for r in records) == sorted(
        (e["question"], e["answer"]) for e in expected
    )
    assert isinstance(src[0]["question"], bytes)  # TFDS gives bytes; decode_record fixes it


@pytest.mark.parametrize("split", ["train", "test"])
def test_math_round_trip(data_dir, split):
    src = source("math", split, data_dir)
    records = [loading.decode_record(src[i]) for i in range(len(src))]
    expected = fixture_math(split)
    assert len(records) == len(expected)
    fields = ("problem", "solution", "level", "type")
    assert sorted(tuple(r[k] for k in fields) for r in records) == sorted(
        tuple(e[k] for k in fields) for e in expected
    )
    assert all("/" in r["id"] for r in records)


def test_build_is_reused(data_dir):
    # A second build must not regenerate (and must not need the manual dir at all).
    builder = loading.build("gsm8k", data_dir, "/nonexistent")
    assert builder.info.splits["train"].num_examples == len(fixture_gsm8k("train"))


def test_missing_manual_files_are_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="train.jsonl"):
        loading.build("gsm8k", str(tmp_path / "out"), str(tmp_path))


def epoch(loader):
    return [r["question"] for batch in loader for r in batch]


def test_loader_epoch_shuffle_and_batches(data_dir):
    src = source("gsm8k", "train", data_dir)
    n = len(src)
    kwargs = dict(batch_size=2, num_epochs=1, shard_index=0, shard_count=1)
    batches = list(loading.make_loader(src, seed=0, drop_remainder=False, **kwargs))
    assert [len(b) for b in batches] == [2] * (n // 2) + [1] * (n % 2)
    questions = epoch(loading.make_loader(src, seed=0, drop_remainder=False, **kwargs))
    assert sorted(questions) == sorted(e["question"] for e in fixture_gsm8k("train"))
    assert questions == epoch(loading.make_loader(src, seed=0, drop_remainder=False, **kwargs))
    orders = {tuple(epoch(loading.make_loader(src, seed=s, drop_remainder=False, **kwargs))) for s in range(6)}
    assert len(orders) > 1  # the seed matters
    dropped = list(loading.make_loader(src, seed=0, drop_remainder=True, **kwargs))
    assert all(len(b) == 2 for b in dropped) and len(dropped) == n // 2


def test_loader_host_shards_are_disjoint(data_dir):
    src = source("gsm8k", "train", data_dir)
    shards = [
        epoch(loading.make_loader(src, batch_size=1, seed=1, num_epochs=1, shard_index=i, shard_count=2))
        for i in range(2)
    ]
    assert len(shards[0]) == len(shards[1]) == len(src) // 2  # equal steps on every host
    assert not set(shards[0]) & set(shards[1])


def test_default_shard_is_the_jax_process():
    import jax

    assert loading._default_shard(None, None) == (jax.process_index(), jax.process_count())
    assert loading._default_shard(3, 4) == (3, 4)


def test_iterator_state_survives_json_and_resumes(data_dir):
    src = source("math", "train", data_dir)
    loader = loading.make_loader(src, batch_size=3, seed=7, shard_index=0, shard_count=1)
    it = iter(loader)
    for _ in range(3):  # cross an epoch boundary (4 records, batches of 3)
        next(it)
    state = it.get_state()
    stored = json.dumps(json.loads(state.decode()))  # e.g. written next to a checkpoint
    expected = [next(it) for _ in range(4)]
    resumed = iter(loading.make_loader(src, batch_size=3, seed=7, shard_index=0, shard_count=1))
    resumed.set_state(stored.encode())
    assert [next(resumed) for _ in range(4)] == expected


def test_transform_is_applied(data_dir):
    src = source("gsm8k", "test", data_dir)
    loader = loading.make_loader(
        src, batch_size=1, seed=0, num_epochs=1, shard_index=0, shard_count=1,
        transform=lambda r: len(r["question"]),
    )
    lengths = [b[0] for b in loader]
    assert sorted(lengths) == sorted(len(e["question"]) for e in fixture_gsm8k("test"))
