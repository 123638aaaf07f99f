"""Datasets: TFDS builders for GSM8K / MATH from local files (``builders``) and Grain
loading with seeded shuffling, host sharding and checkpointable iterators (``loading``).

Import the submodules directly; this package does not import TFDS or Grain by itself, so
the synthetic tasks work without them.
"""
