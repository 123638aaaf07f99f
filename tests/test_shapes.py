"""The static lengths host data is padded to (grpo_jax.shapes)."""

from grpo_jax import shapes


def test_bucket_length_is_the_next_power_of_two_at_least_the_minimum():
    assert [shapes.bucket_length(n) for n in (1, 15, 16, 17, 100, 128, 129)] == [16, 16, 16, 32, 128, 128, 256]
    assert [shapes.bucket_length(n, minimum=1) for n in (0, 1, 2, 3, 5)] == [1, 1, 2, 4, 8]
