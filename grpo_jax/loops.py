"""Loops whose trip counts the ahead-of-time cost count can see.

XLA's ``cost_analysis()`` counts a while loop's body once, whatever its trip count, so a
program's FLOPs and bytes read off the compiled program undercount every loop. The cost
count (``grpo_jax.aot.sampler_cost`` and ``train_cost``) therefore traces each program a
second time inside ``unrolled()``: every ``scan`` and ``map`` below (and the model's layer scan) is then
written out iteration by iteration, and the compiled twin holds no loop. Outside
``unrolled()`` they are ``lax.scan`` / ``lax.map`` unchanged, so the programs a run
executes do not depend on this module.

A program traced inside ``unrolled()`` must be a fresh jit object: jax keys its trace
cache on the function and its static arguments, not on this flag.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

_UNROLLED = contextvars.ContextVar("grpo_jax_loops_unrolled", default=False)


@contextlib.contextmanager
def unrolled():
    """Trace every loop of this module fully unrolled while the context is open."""
    token = _UNROLLED.set(True)
    try:
        yield
    finally:
        _UNROLLED.reset(token)


def unrolling() -> bool:
    """True inside ``unrolled()``."""
    return _UNROLLED.get()


def scan(f, init, xs=None, length=None, reverse=False):
    """``jax.lax.scan``, fully unrolled inside ``unrolled()``: written out here, because
    ``lax.scan(..., unroll=True)`` still emits a one-trip while loop when the length is 1."""
    if not unrolling():
        return jax.lax.scan(f, init, xs, length=length, reverse=reverse)
    n = length if length is not None else jax.tree.leaves(xs)[0].shape[0]
    carry, ys = init, [None] * n
    for i in reversed(range(n)) if reverse else range(n):
        carry, ys[i] = f(carry, jax.tree.map(lambda x: x[i], xs))
    return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def map(f, xs):  # noqa: A001  (the name mirrors jax.lax.map)
    """``jax.lax.map``, fully unrolled inside ``unrolled()``."""
    if not unrolling():
        return jax.lax.map(f, xs)
    return scan(lambda _, x: (None, f(x)), None, xs)[1]
