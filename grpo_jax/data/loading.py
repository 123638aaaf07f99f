"""Grain loading of the TFDS datasets: seeded shuffling, per-host shards, batches.

A loader is a ``grain.DataLoader`` over ``builder.as_data_source(split)``. Its iterator
has ``get_state()`` / ``set_state()``; the state is a small JSON document (bytes), so it
can be stored next to a checkpoint, and a restored iterator yields exactly the batches
the original would have yielded next.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Mapping

from grpo_jax.data.builders import BUILDERS, SKIP_BAD_ROWS, STRICT
from grpo_jax.errors import DataError, UnknownNameError

log = logging.getLogger(__name__)

# Grain (which imports JAX) is imported only when a loader is made, so random access
# through ``data_source`` (e.g. ``Task.examples``) stays light.


def build(name: str, data_dir: str | None = None, manual_dir: str | None = None, *,
          skip_bad_rows: bool = False):
    """The prepared builder for ``name`` ("gsm8k" or "math"), building it if needed.

    Building reads the official files from ``manual_dir`` (no network) and writes
    array_record files under ``data_dir``; an already prepared dataset is reused. A
    malformed row is a DataError naming its file and line, unless ``skip_bad_rows``: then
    it is left out, and the rows left out are logged as a warning, per file, every time
    the dataset is loaded.
    """
    import tensorflow_datasets as tfds  # already imported by builders; local for clarity

    if name not in BUILDERS:
        raise UnknownNameError(f"unknown dataset {name!r}; available: {sorted(BUILDERS)}")
    builder = BUILDERS[name](data_dir=data_dir, config=SKIP_BAD_ROWS if skip_bad_rows else STRICT,
                             file_format="array_record")
    # TFDS's is_prepared() logs a warning for a dataset folder that does not exist yet, so a
    # first build asks it only once the folder has its dataset_info.json.
    prepared = (builder.data_path / "dataset_info.json").exists() and builder.is_prepared()
    if not prepared and not (manual_dir and os.path.isdir(manual_dir) and os.listdir(manual_dir)):
        # TFDS would fail here with an AssertionError from deep inside its download manager.
        raise DataError(f"{name}: the folder of the official files, {manual_dir!r} (data.data_dir; grpo-evaluate "
                        "--data-dir), is missing or empty; "
                        f"{builder.MANUAL_DOWNLOAD_INSTRUCTIONS}")
    # Preparing from local files takes seconds; TFDS's progress bars would only interleave
    # with the run's own output (and with the one error line of a bad file).
    tfds.disable_progress_bar()
    try:
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=manual_dir)
        )
    except DataError:
        # A failed preparation leaves empty config/version folders that TFDS warns about on
        # every later load; only empty folders are removed.
        version_dir = os.fspath(builder.data_dir)
        for path in (version_dir, os.path.dirname(version_dir)):
            if os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)
        raise
    for where, count in sorted(skipped_rows(builder).items()):
        log.warning("%s: skipped %d malformed row(s) of %s (data.skip_bad_rows)", name, count, where)
    return builder


def skipped_rows(builder) -> dict[str, int]:
    """File (GSM8K) or split folder (MATH) -> rows left out when ``builder`` was prepared."""
    return dict((builder.info.metadata or {}).get("skipped_rows", {}))


def data_source(name: str, split: str, data_dir: str | None = None, manual_dir: str | None = None,
                *, skip_bad_rows: bool = False):
    """Random-access source of raw records (dicts of bytes) for one split."""
    return build(name, data_dir, manual_dir, skip_bad_rows=skip_bad_rows).as_data_source(split)


def decode_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """TFDS text features arrive as bytes; turn them into str (other values unchanged)."""
    return {
        key: value.decode("utf-8") if isinstance(value, bytes) else value
        for key, value in record.items()
    }


@functools.cache
def _apply_class():
    import grain.python as grain

    class Apply(grain.MapTransform):
        """Decode a record, then apply the caller's transform (e.g. record -> Example)."""

        def __init__(self, fn: Callable[[dict], Any] | None):
            self.fn = fn

        def map(self, record):
            record = decode_record(record)
            return record if self.fn is None else self.fn(record)

    return Apply


def default_shard(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
    """(shard index, shard count) of this host's slice of the data: the given ones, a missing
    one from jax (this process's index, the number of processes)."""
    if shard_index is not None and shard_count is not None:
        return shard_index, shard_count
    import jax  # only here: data code should not initialise JAX unless it must

    return (
        jax.process_index() if shard_index is None else shard_index,
        jax.process_count() if shard_count is None else shard_count,
    )


def make_loader(
    source,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard_index: int | None = None,
    shard_count: int | None = None,
    drop_remainder: bool = True,
    transform: Callable[[dict], Any] | None = None,
) -> "grain.DataLoader":
    """A Grain loader yielding lists of ``batch_size`` decoded (and transformed) records.

    Each host reads its own shard ``shard_index`` of ``shard_count`` (default: this JAX
    process of all processes); shards are made equal-sized by dropping the remainder so
    that every host runs the same number of steps. ``num_epochs=None`` repeats forever,
    reshuffling every epoch with a seed derived from ``seed``. ``drop_remainder`` drops a
    last incomplete batch. Batches are Python lists (records hold strings, which do not
    stack into arrays usefully).
    """
    import grain.python as grain

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    shard_index, shard_count = default_shard(shard_index, shard_count)
    sampler = grain.IndexSampler(
        num_records=len(source),
        shard_options=grain.ShardOptions(
            shard_index=shard_index, shard_count=shard_count, drop_remainder=True
        ),
        shuffle=shuffle,
        num_epochs=num_epochs,
        seed=seed,
    )
    operations = [
        _apply_class()(transform),
        grain.Batch(batch_size=batch_size, drop_remainder=drop_remainder, batch_fn=list),
    ]
    # worker_count=0: records are tiny strings; worker processes would only add latency.
    return grain.DataLoader(
        data_source=source, sampler=sampler, operations=operations, worker_count=0
    )
