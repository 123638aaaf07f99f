"""TFDS builders (from the hand-written fixtures, no network) and Grain loading:
content round trip, seeded shuffling, host sharding, checkpointable iterator state."""
import glob
import json
import os

import pytest

from grpo_jax.data import loading
from grpo_jax.errors import DataError

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")


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

    assert loading.default_shard(None, None) == (jax.process_index(), jax.process_count())
    assert loading.default_shard(3, 4) == (3, 4)


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


def _gsm8k_with_bad_rows(folder):
    """The fixture's files with a truncated row (line 2) and a row without an answer (line 5)."""
    os.makedirs(folder)
    with open(os.path.join(FIXTURES, "gsm8k", "train.jsonl")) as f:
        good = [line for line in f if line.strip()]
    bad = [good[0], '{"question": "Truncated\n', *good[1:3], '{"question": "no answer"}\n', *good[3:]]
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        f.writelines(bad)
    with open(os.path.join(FIXTURES, "gsm8k", "test.jsonl")) as src, \
            open(os.path.join(folder, "test.jsonl"), "w") as dst:
        dst.write(src.read())
    return os.path.join(folder, "train.jsonl"), good


def test_bad_gsm8k_rows_fail_by_default_and_are_skipped_and_counted_on_request(tmp_path, caplog):
    path, good = _gsm8k_with_bad_rows(str(tmp_path / "manual"))
    with pytest.raises(DataError, match=rf"{path}:2: not a GSM8K row \(invalid JSON"):
        loading.build("gsm8k", str(tmp_path / "tfds"), str(tmp_path / "manual"))
    with caplog.at_level("WARNING", logger="grpo_jax.data.loading"):
        builder = loading.build("gsm8k", str(tmp_path / "tfds"), str(tmp_path / "manual"),
                                skip_bad_rows=True)
    src = builder.as_data_source("train")
    questions = sorted(loading.decode_record(src[i])["question"] for i in range(len(src)))
    assert questions == sorted(json.loads(line)["question"] for line in good)
    assert loading.skipped_rows(builder) == {path: 2}
    assert f"gsm8k: skipped 2 malformed row(s) of {path}" in caplog.text
    # Reused later, the prepared dataset still reports what it left out ...
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo_jax.data.loading"):
        loading.build("gsm8k", str(tmp_path / "tfds"), "/nonexistent", skip_bad_rows=True)
    assert f"skipped 2 malformed row(s) of {path}" in caplog.text
    # ... and a strict run never reuses it: it reads the files again and fails on line 2.
    with pytest.raises(DataError, match=rf"{path}:2:"):
        loading.build("gsm8k", str(tmp_path / "tfds"), str(tmp_path / "manual"))


def test_bad_gsm8k_row_line_numbers_count_blank_lines(tmp_path):
    path, _ = _gsm8k_with_bad_rows(str(tmp_path / "manual"))
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:  # blank lines before and the truncated row removed: line 5 is bad
        f.writelines(["\n", lines[0], lines[2], lines[3], lines[4], *lines[5:]])
    with pytest.raises(DataError, match=rf"{path}:5: not a GSM8K row \(missing field 'answer'\)"):
        loading.build("gsm8k", str(tmp_path / "tfds"), str(tmp_path / "manual"))


def _math_copy(folder):
    import shutil

    shutil.copytree(os.path.join(FIXTURES, "math"), folder)
    return folder


def test_bad_math_file_is_named_or_skipped(tmp_path, caplog):
    manual = _math_copy(str(tmp_path / "manual"))
    bad = os.path.join(manual, "train", "algebra", "99.json")
    with open(bad, "w") as f:
        f.write('{\n  "problem": "Compute $1+1$.",\n  "solution": "\\boxed{2}\n')
    with pytest.raises(DataError, match=rf"{bad}:3: not a MATH problem \(invalid JSON"):
        loading.build("math", str(tmp_path / "tfds"), manual)
    with caplog.at_level("WARNING", logger="grpo_jax.data.loading"):
        builder = loading.build("math", str(tmp_path / "tfds"), manual, skip_bad_rows=True)
    assert builder.info.splits["train"].num_examples == len(fixture_math("train"))
    assert loading.skipped_rows(builder) == {os.path.join(manual, "train"): 1}
    assert f"math: skipped 1 malformed row(s) of {os.path.join(manual, 'train')}" in caplog.text


def test_math_without_a_test_split_names_the_folder(tmp_path):
    import shutil

    manual = _math_copy(str(tmp_path / "manual"))
    shutil.rmtree(os.path.join(manual, "test"))
    with pytest.raises(DataError, match=rf"'{os.path.join(manual, 'test')}' holds no"):
        loading.build("math", str(tmp_path / "tfds"), manual)
