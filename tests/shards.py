"""Test helper: what one device holds of a sharded tree."""

import jax


def per_device_bytes(tree) -> int:
    """Bytes held on the first device by the shards of every array in `tree`."""
    dev = None
    total = 0
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            if dev is None:
                dev = shard.device
            if shard.device == dev:
                total += shard.data.size * shard.data.dtype.itemsize
    return total
