"""Packing (``rl.pack``): the train step's forward passes over a micro-batch's sequences laid
end to end, instead of one padded row each.

A train batch row is a prompt left-padded to Tp and a completion right-padded to Tc, so a
forward pass over it costs Tp + Tc positions whatever the real lengths. With packing the
host lays each micro-batch's real sequences (prompt tokens, then completion tokens) end to
end into rows of L = Tp + Tc positions (first fit, longest first), and the forward pass runs
over those rows only:

* ``segments`` give every sequence of a row its own id (1, 2, ...; 0 on padding), and a
  query attends only to keys of its own id (``model.slot_attention``; the splash kernel
  takes them as its segment ids);
* ``positions`` restart at 0 for every sequence: the positions of the padded layout
  (``model.default_positions``), so RoPE sees the same token positions;
* ``index`` says where the hidden state that predicts completion token t of row i lies, and
  ``completion_hidden`` gathers them back into the [B, Tc, E] of the padded layout. The
  log-probs, the losses, advantages and aggregation after it are unchanged.

A real token sees exactly the real tokens it sees in the padded row, at the same positions,
so packed and padded batches give the same loss and gradient up to float rounding
(tests/model/test_packing.py). The saving is the padding's share of the forward passes: a
micro-batch of b sequences runs over R <= b rows.

Micro-batches. The packed row count is one static shape, the most any device needs in any
micro-batch, so which rows share a micro-batch matters: a device's rows are dealt to the
micro-batches longest first, back and forth (each gets one of every band of lengths), and
the step splits the batch in that order (``in_order``; per-row outputs of the prepared
forward passes go back with ``rows_back``). Every loss part is a sum over rows, so the order
changes nothing else.

Sharding. The batch's rows are split over D = data x fsdp devices, and a micro-batch's rows
on one device are packed into rows on that same device: each micro-batch has R = D x r rows,
device d holding rows d·r ... (d+1)·r - 1, and ``index`` counts within a device's r rows, so
the gather back is a batched gather over the D blocks, with no data crossing devices.

Static shapes. r is the most rows any device needs in any micro-batch, rounded up to a
multiple of 1/SHAPES of b / D (one sequence per row, the most it can be): a run compiles at
most SHAPES train steps, and r wastes at most that share of the unpacked rows. The
ahead-of-time check lowers the largest, r = b / D (``abstract``).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.model import transformer as model_lib
from grpo_jax.config import ModelConfig
from grpo_jax.parallel.sharding import batch_degree, batch_sharding

__all__ = ["Packing", "pack", "abstract", "completion_hidden", "rows_per_block", "in_order", "rows_back"]

SHAPES = 8


@flax.struct.dataclass
class Packing:
    """M micro-batches of R = blocks x r rows of L positions each, laid out so that
    ``algorithms.split_micro_batches`` splits them as it splits the reordered batch
    (``in_order``): micro-batch k's packed rows hold the sequences of its rows."""

    tokens: Any  # [M·R, L] int32: sequences end to end, 0 after the last
    segments: Any  # [M·R, L] int32: the sequence's id within its row (1, 2, ...), 0 on padding
    positions: Any  # [M·R, L] int32: each token's position within its own sequence
    index: Any  # [B, Tc] int32, reordered rows: where completion token t is predicted, flat in the device's r x L
    order: Any  # [B] int32: the reordered batch's row i is row order[i] of its device's block
    inverse: Any  # [B] int32: row i of the batch is row inverse[i] of its device's reordered block
    blocks: int = flax.struct.field(pytree_node=False, default=1)  # D, the devices a micro-batch's rows span


def _round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def _contiguous_lengths(mask: np.ndarray, *, left: bool, what: str) -> np.ndarray:
    """Real tokens per row of a [B, T] mask that must be one run at the row's end (left
    padding) or start (right padding); ValueError naming the first row that is not."""
    mask = np.asarray(mask, bool)
    n = mask.sum(axis=1)
    cols = np.arange(mask.shape[1])
    want = cols[None, :] >= (mask.shape[1] - n)[:, None] if left else cols[None, :] < n[:, None]
    bad = np.flatnonzero((mask != want).any(axis=1))
    if bad.size:
        side = "left-padded (real tokens last)" if left else "right-padded (real tokens first)"
        raise ValueError(f"packing needs {what} {side}; row {bad[0]} is not")
    return n


def _merge(x: np.ndarray, unit: int) -> np.ndarray:
    """[M, R, ...] -> [M·R, ...], the inverse of ``split_micro_batches`` (numpy)."""
    num, per = x.shape[:2]
    x = x.reshape((num, per // unit, unit) + x.shape[2:])
    return np.moveaxis(x, 0, 1).reshape((num * per,) + x.shape[3:])


def _first_fit(lengths: list[tuple[int, int]], capacity: int) -> list[list[tuple[int, int]]]:
    """(row id, length) items into bins of ``capacity``, longest first, each into the first
    bin with room: [[(row id, offset), ...] per bin]."""
    bins, room = [], []
    for rid, n in sorted(lengths, key=lambda x: (-x[1], x[0])):
        for b, free in enumerate(room):
            if free >= n:
                bins[b].append((rid, capacity - free))
                room[b] -= n
                break
        else:
            bins.append([(rid, 0)])
            room.append(capacity - n)
    return bins


def rows_per_block(batch: Any, num_micro_batches: int, unit: int, blocks: int) -> int:
    """r: the packed rows each device needs per micro-batch (see the module docstring)."""
    return _plan(batch, num_micro_batches, unit, blocks)[0]


def _plan(batch: Any, num: int, unit: int, blocks: int):
    """(r, {(micro-batch, block): bins of original rows}, prompt lengths, sequence lengths,
    order [B]: the original row at each position of the reordered batch)."""
    rows, tp = np.shape(batch.prompt_tokens)
    tc = np.shape(batch.tokens)[1]
    n = _contiguous_lengths(batch.prompt_mask, left=True, what="prompts")
    if (n < 1).any():
        raise ValueError(f"packing needs at least one prompt token per row; row {int(np.argmin(n))} has none")
    lengths = n + _contiguous_lengths(batch.mask, left=False, what="completions")
    if rows % (num * blocks * unit):
        raise ValueError(f"{rows} rows do not split into {num} micro-batches over {blocks} devices "
                         f"in units of {unit}")
    block_units = rows // (blocks * unit)
    unit_lengths = lengths.reshape(-1, unit).sum(axis=1)
    # Dealt longest first, back and forth over the micro-batches: every micro-batch gets one
    # unit of each band of `num` lengths, long ones beside short ones.
    lap, within = divmod(np.arange(block_units), num)
    dealt_to = np.where(lap % 2 == 0, within, num - 1 - within)
    order = np.empty(rows, np.int64)
    bins = {}
    for d in range(blocks):
        units = d * block_units + np.arange(block_units)
        ranked = units[np.argsort(-unit_lengths[units], kind="stable")]
        for k in range(num):
            mine = ranked[dealt_to == k]
            # split_micro_batches gives micro-batch k the block's unit slots k, k + num, ...
            slots = d * block_units + k + num * np.arange(len(mine))
            ids = (mine[:, None] * unit + np.arange(unit)).ravel()
            order[(slots[:, None] * unit + np.arange(unit)).ravel()] = ids
            bins[k, d] = _first_fit([(int(i), int(lengths[i])) for i in ids], tp + tc)
    most = rows // (num * blocks)
    step = _round_up(-(-most // SHAPES), unit)
    return min(_round_up(max(len(b) for b in bins.values()), step), most), bins, n, lengths, order


def pack(batch: Any, num_micro_batches: int, unit: int = 1, blocks: int = 1) -> Any:
    """``batch`` (host arrays; ``batching.Batch``) with ``packing`` set: each micro-batch's
    sequences packed per device block (module docstring). ``unit``: rows kept together
    (``Algorithm.micro_batch_unit``); ``blocks``: the batch-sharding degree.
    ValueError for a prompt that is not left-padded or a completion that is not right-padded."""
    r, bins, n, lengths, order = _plan(batch, num_micro_batches, unit, blocks)
    prompt_tokens, tokens = np.asarray(batch.prompt_tokens), np.asarray(batch.tokens)
    rows, tp = prompt_tokens.shape
    tc = tokens.shape[1]
    width = tp + tc
    out = {name: np.zeros((num_micro_batches, blocks * r, width), np.int32) for name in ("tokens", "segments", "positions")}
    index = np.zeros((rows, tc), np.int32)
    for (k, d), row_bins in bins.items():
        for b, items in enumerate(row_bins):
            row = d * r + b
            for seg, (i, offset) in enumerate(sorted(items, key=lambda x: x[1]), start=1):
                seq = np.concatenate([prompt_tokens[i, tp - n[i]:], tokens[i, :lengths[i] - n[i]]])
                span = slice(offset, offset + len(seq))
                out["tokens"][k, row, span] = seq
                out["segments"][k, row, span] = seg
                out["positions"][k, row, span] = np.arange(len(seq))
                # Token t is predicted by the hidden state of the token before it; past the
                # completion's end (masked out of every loss) any in-range index will do.
                t = np.minimum(np.arange(tc), max(lengths[i] - n[i] - 1, 0))
                index[i] = b * width + offset + n[i] - 1 + t
    local = (np.arange(rows) // (rows // blocks)) * (rows // blocks)  # each position's block start
    packing = Packing(**{name: _merge(x, unit) for name, x in out.items()}, index=index[order],
                      order=(order - local).astype(np.int32), inverse=(np.argsort(order) - local).astype(np.int32),
                      blocks=blocks)
    return batch.replace(packing=packing)


def abstract(rows: int, prompt_len: int, completion_len: int, mesh) -> Packing:
    """The largest packing a batch of ``rows`` can need (one sequence per row), as
    ShapeDtypeStructs sharded like the batch: what the ahead-of-time check lowers."""
    blocks = batch_degree(mesh)
    width = prompt_len + completion_len

    def arr(shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(mesh, len(shape), shape[0]))

    packed = (rows, width)  # M micro-batches x (blocks x r = rows / M rows each)
    return Packing(tokens=arr(packed), segments=arr(packed), positions=arr(packed),
                   index=arr((rows, completion_len)), order=arr((rows,)), inverse=arr((rows,)), blocks=blocks)


def completion_hidden(cfg: ModelConfig, params: Any, batch: Any) -> jax.Array:
    """``logprobs.completion_hidden`` of a packed micro-batch: one forward pass over its
    packed rows, then the hidden states that predict each completion token gathered back
    into the padded layout, ``[B, Tc, E]``, within each device block."""
    p = batch.packing
    hidden, _ = model_lib.forward_hidden(cfg, params, p.tokens, p.segments > 0, p.positions, segments=p.segments)
    rows, tc = batch.tokens.shape
    packed, width, embed = hidden.shape
    blocks = p.blocks
    per_block = hidden.reshape(blocks, packed // blocks * width, embed)
    index = p.index.reshape(blocks, rows // blocks * tc)
    out = jnp.take_along_axis(per_block, index[..., None], axis=1)
    return out.reshape(rows, tc, embed)


def _take_rows(x: jax.Array, index: jax.Array, blocks: int) -> jax.Array:
    """x[i] <- x[index[i]] within each of ``blocks`` equal row blocks (a batched gather over
    the blocks, which the batch sharding keeps on their devices)."""
    per = x.shape[0] // blocks
    out = jax.vmap(lambda xb, ib: xb[ib])(x.reshape((blocks, per) + x.shape[1:]), index.reshape(blocks, per))
    return out.reshape(x.shape)


def in_order(tree: Any, p: Packing) -> Any:
    """[B, ...] leaves (a ``Batch`` but its packing, ``Extras``) in the packing's row order:
    the order whose micro-batches (``split_micro_batches``) the packed rows hold."""
    if getattr(tree, "packing", None) is not None:
        return in_order(tree.replace(packing=None), p).replace(packing=p)
    return jax.tree.map(lambda x: _take_rows(x, p.order, p.blocks), tree)


def rows_back(tree: Any, p: Packing) -> Any:
    """``in_order``'s inverse, for per-row outputs ([B, ...]) of a reordered batch."""
    return jax.tree.map(lambda x: _take_rows(x, p.inverse, p.blocks), tree)
