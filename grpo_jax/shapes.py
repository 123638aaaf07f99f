"""Static shapes: the lengths that variable-sized host data is padded to before it reaches a
jitted program, so that a run compiles each program once per bucket rather than once per
length. The sampler, the batch builder, the reward-model scorer and the ahead-of-time compile
all pad to these, so their programs meet the same shapes. `abstract_like`: a tree's shapes
with shardings attached, what a program is lowered or a checkpoint restored onto."""

from __future__ import annotations

from typing import Any

import jax

MIN_BUCKET = 16


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """The static length used for n: the next power of two, at least `minimum`."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """``jax.ShapeDtypeStruct`` leaves of ``tree`` (arrays or abstract values) sharded by
    ``shardings`` (a tree of the same structure; None: each leaf's own sharding, if any)."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
