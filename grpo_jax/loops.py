"""Loops whose trip counts the ahead-of-time cost count can see.

XLA's ``cost_analysis()`` counts a while loop's body once, whatever its trip count, so a
program's FLOPs and bytes read off the compiled program undercount every loop. The cost
count (``grpo_jax.aot.sampler_cost`` and ``train_cost``) therefore traces each program a
second time inside ``unrolled()``: every ``scan`` and ``map`` below (and the model's layer scan) is then
written out iteration by iteration (a ``while_loop`` for the trips it is told), and the
compiled twin holds no loop. Outside
``unrolled()`` they are ``lax.scan`` / ``lax.map`` / ``lax.while_loop`` unchanged, so the
programs a run executes do not depend on this module.

A program traced inside ``unrolled()`` must be a fresh jit object: jax keys its trace
cache on the function and its static arguments, not on this flag.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

_UNROLLED = contextvars.ContextVar("grpo_jax_loops_unrolled", default=None)


@contextlib.contextmanager
def unrolled(while_trips: int | None = None):
    """Trace every loop of this module fully unrolled while the context is open; a
    `while_loop`, whose trip count is data, runs its body ``while_trips`` times. Yields the
    list of every `while_loop`'s final carry, in trace order."""
    finals: list = []
    token = _UNROLLED.set((while_trips, finals))
    try:
        yield finals
    finally:
        _UNROLLED.reset(token)


def unrolling() -> bool:
    """True inside ``unrolled()``."""
    return _UNROLLED.get() is not None


def while_loop(cond, body, init):
    """``jax.lax.while_loop``; inside ``unrolled(while_trips=n)``: ``body`` written out n
    times, ``cond`` never evaluated (the count takes the trips it is told), the final carry
    recorded in the context's list."""
    state = _UNROLLED.get()
    if state is None:
        return jax.lax.while_loop(cond, body, init)
    trips, finals = state
    if trips is None:
        raise ValueError("a while_loop inside loops.unrolled() needs its while_trips")
    carry = init
    for _ in range(trips):
        carry = body(carry)
    finals.append(carry)
    return carry


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
