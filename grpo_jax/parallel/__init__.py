"""Parallelism: the device mesh and how work is spread over it.

``slices`` (Cloud TPU slice presets, no jax import), ``sharding`` (the mesh and the one table
from logical axis names to mesh axes), ``split_mesh`` (disjoint devices for sampling and
training), ``distributed`` (multi-host start-up) and ``preemption`` (a SIGTERM becomes "save
and stop" on every process). Imports only the root modules (config, errors).
"""
