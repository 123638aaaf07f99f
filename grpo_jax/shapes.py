"""Static shapes: the lengths that variable-sized host data is padded to before it reaches a
jitted program, so that a run compiles each program once per bucket rather than once per
length. The sampler, the batch builder, the reward-model scorer and the ahead-of-time compile
all pad to these, so their programs meet the same shapes."""

from __future__ import annotations

MIN_BUCKET = 16


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """The static length used for n: the next power of two, at least `minimum`."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())
