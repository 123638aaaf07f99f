"""Where each prompt's prefill slot and each sample row go (host side, numpy): the engines'
prompt layouts.

Rows and slots are split into D equal contiguous blocks, D the batch-sharding degree, and
every row's slot lies in its own shard's block, so that copying (or reading) a prompt's
cache for its rows is local on every device: a gather across shards would move the whole
cache between chips (on a 7B model, tens of GB per chip per call).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def prefill_layout(num_prompts: int, group_size: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot_prompt [D*k], src [Bp]): prefill slot j holds prompt slot_prompt[j] (-1: a
    dummy prompt); sample row r copies the cache of slot src[r]. k is the most prompts any
    shard's rows need (a prompt whose group spans two shards is prefilled on both). Dummy
    rows copy their block's first slot."""
    rows = num_prompts * group_size
    per_shard = round_up(rows, degree) // degree
    shard = np.arange(degree)
    first = shard * per_shard // group_size  # first prompt of each shard's rows
    last = (np.minimum((shard + 1) * per_shard, rows) - 1) // group_size
    count = np.where(shard * per_shard < rows, last - first + 1, 0)
    k = max(1, int(count.max()))
    j = np.arange(k)
    slot_prompt = np.where(j < count[:, None], first[:, None] + j, -1).reshape(-1).astype(np.int32)
    r = np.arange(degree * per_shard)
    local = np.where(r < rows, r // group_size - first[r // per_shard], 0)
    return slot_prompt, (r // per_shard * k + local).astype(np.int32)


def shared_layout(num_prompts: int, group_size: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """`prefill_layout`'s (slot_prompt, src) for rows that read their prompt's cache in
    place (``model.PrefixCache``): every slot serves r consecutive rows, r = gcd(rows per
    shard, group_size), so a shard's rows are whole runs of one slot and a question's G rows
    use G / r copies of its prompt (one per shard they span when G exceeds a shard). Dummy
    rows get dummy slots."""
    rows = num_prompts * group_size
    bp = round_up(rows, degree)
    r = math.gcd(bp // degree, group_size)
    first_row = np.arange(bp // r) * r
    slot_prompt = np.where(first_row < rows, first_row // group_size, -1).astype(np.int32)
    return slot_prompt, (np.arange(bp) // r).astype(np.int32)


@dataclasses.dataclass
class HostBatch:
    """One call's inputs as the host lays them out (`host_batch`): Pp prefill slots of Tp
    tokens, Bp sample rows."""

    prompt_tokens: np.ndarray  # [Pp, Tp] left-padded, in the engine's layout order
    prompt_mask: np.ndarray  # [Pp, Tp]
    src_rows: np.ndarray  # [Bp] prefill slot each sample row copies (or reads) its cache from
    row_ids: np.ndarray  # [Bp]: the randomness index (row_offset + 0..Bp-1 unless given)
    row_valid: np.ndarray  # [Bp] False for dummy rows
    prompt_lens: np.ndarray  # [Bp] real prompt tokens of each sample row
    first_cols: np.ndarray  # [Bp] the column each row's first draw is (0 unless it resumes a row)


def host_batch(prompts: list[list[int]], group_size: int, layout: tuple[np.ndarray, np.ndarray], pad_id: int,
               prompt_bucket: int, row_offset: int = 0, row_ids=None, first_cols=None) -> HostBatch:
    """Left-pad the prompts into `prompt_bucket` and lay them out by ``layout`` (an
    engine's (slot_prompt, src) for them and `group_size`); the rows' randomness indices
    start at `row_offset` (the call's first row in the whole batch), or are ``row_ids``
    [rows], and their first draws are columns ``first_cols`` [rows] (default 0): a
    continuation's rows draw as the rows they continue (``sampler.turns``)."""
    slot_prompt, src = layout
    # Row -1 (the dummy slots' prompt) stays all pad and fully masked.
    tokens = np.full((len(prompts) + 1, prompt_bucket), pad_id, np.int32)
    mask = np.zeros((len(prompts) + 1, prompt_bucket), bool)
    for i, p in enumerate(prompts):
        tokens[i, prompt_bucket - len(p):] = p
        mask[i, prompt_bucket - len(p):] = True
    tokens, mask = tokens[slot_prompt], mask[slot_prompt]
    bp = len(src)
    valid = np.arange(bp) < len(prompts) * group_size
    lens = mask.sum(1).astype(np.int32)[src]
    ids = row_offset + np.arange(bp, dtype=np.int32)
    cols = np.zeros(bp, np.int32)
    rows = len(prompts) * group_size
    if row_ids is not None:
        ids[:rows] = row_ids
    if first_cols is not None:
        cols[:rows] = first_cols
    return HostBatch(tokens, mask, src, ids, valid, lens, cols)
