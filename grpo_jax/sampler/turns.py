"""Multi-turn rollouts: the model writes code, the host runs it, the output joins the context.

``generate_with_tools(sampler, weights, prompts, key=..., group_size=G, tools=ToolUse)`` is
`Sampler.generate` for a policy that may call a tool (``grpo_jax.tools.PythonTool``) up to
``tools.max_calls`` times per completion (rl.max_tool_calls). Host-side Python between
sampler calls; each call is an ordinary `sample_to_host`:

1. Decode every running row until it stops: on a stop token (the completion ends), on a
   token that may close a code block (`ToolUse.fence_ids`, stop tokens of this call while a
   row has calls left), or at the call's length.
2. For a row stopped where its text since the last output holds a complete block
   (`PythonTool.code`): run it in the tool's sandbox and append its output
   (`PythonTool.output`, tokenized) to the row. A fence that opened a block, or a block
   after the last allowed call, is just text: the row decodes on. The blocks of one call,
   across the rows, run on up to ``tools.workers`` sandbox processes at once (`ToolUse.run`);
   their outputs are appended in row order, whichever finishes first.
3. Sample the running rows again, each with its prompt and completion so far as the prompt
   (a fresh prefill: no cache is carried between calls), until every row has stopped or
   filled ``max_new_tokens``.

With the slot engine (``rl.decode=slots``) there are no calls: a row pauses in its slot on a
closing fence (``slots.SlotDecoder``'s pause tokens), its cache kept; its block runs in the
sandbox while the other slots decode; then only the tool's output tokens go through the
model (``slots.append``) and the row decodes on. The rows are the same as with calls. Across
processes a row's blocks run on the process that holds the row, and their outputs and runs
are gathered (every process appends the same tokens at the same step).

The result is one `Rollout` of exactly the shapes `Sampler.generate` returns: the
completion holds the model's tokens and the tool's, in order; ``mask`` is True on both (the
tool's output is context: the train step's forward pass reads it), ``tool_mask`` on the
tool's only (the loss, the KL and the entropy skip them: ``rl.algorithms.own_tokens``), and
``logprobs`` are the model's own (0 on the tool's). The tool runs' results come back beside it.

Randomness: row r draws its token at completion column t with ``uniforms(key, t, r)``, as in
a single-turn rollout, whichever call (or slot) draws it: a continuation's rows draw as the
rows they continue, from the columns they reached (``sample_to_host``'s ``row_ids`` and
``first_cols``). So a rollout is a function of (key, prompts, params, settings, the code's
outputs), whatever ``tools.workers`` is, and a row's draws do not depend on the other rows.
The running rows of a call are padded to a power of two (repeats of the first, discarded),
so a rollout compiles for few batch shapes. The ahead-of-time check compiles the
continuations from the same functions (`continuation_call` at `continuation_rows` rows and
`continuation_shapes`; docs/tpu.md, "What a tool call costs a pod step").
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import jax
import numpy as np

from grpo_jax.parallel import distributed
from grpo_jax.sampler import slots
from grpo_jax.sampler.calls import SamplerCall
from grpo_jax.sampler.host import Rollout, Sampler, slot_rollout
from grpo_jax.shapes import bucket_length
from grpo_jax.text.tokenizer import Tokenizer
from grpo_jax.tools.python_tool import PythonTool
from grpo_jax.tools.sandbox import ExecutionResult


def default_workers() -> int:
    """Sandbox processes one call's blocks run on at once by default: a few, never more than
    the cores (each process is a fresh interpreter, CPU-bound while it starts)."""
    return min(4, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """A run's tool use, built once (`build`): the ``tool``, the ``tokenizer`` its output is
    encoded with, the most calls per completion, ``fence_ids``, every token whose text
    holds the last character of the tool's closing marker (a marker split over several
    tokens ends on one of them), and ``workers``, the most sandbox processes one call's
    blocks run on at once (1: one after another)."""

    tool: PythonTool
    tokenizer: Tokenizer
    max_calls: int
    fence_ids: tuple[int, ...]
    workers: int = 1

    @classmethod
    def build(cls, tool: PythonTool, tokenizer: Tokenizer, max_calls: int, workers: int | None = None) -> "ToolUse":
        """``workers``: None (or 0) for `default_workers`."""
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1 (0 is a rollout without tools), got {max_calls}")
        workers = workers or default_workers()
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers (sandbox processes at once) must be an int >= 1, got {workers!r}")
        last = tool.close[-1]
        fence = tuple(i for i in range(tokenizer.vocab_size) if last in tokenizer.decode([i]))
        if not fence:
            raise ValueError(f"no token of the vocabulary holds {last!r}: the model cannot close a "
                             f"code block with {tool.close!r}")
        return cls(tool, tokenizer, max_calls, fence, workers)

    def run(self, codes: Sequence[str]) -> list[ExecutionResult]:
        """Each of ``codes`` run in the tool's sandbox (`PythonTool.run`: a back-end failure
        is that block's ``error``, never an exception), on up to ``workers`` processes at once;
        the results in the order of ``codes``. Each thread only waits on its sandbox process,
        so a slow block delays no other block's run, though the next sampler call waits for
        all of them."""
        if self.workers == 1 or len(codes) <= 1:
            return [self.tool.run(code) for code in codes]
        with ThreadPoolExecutor(max_workers=min(self.workers, len(codes)), thread_name_prefix="sandbox") as pool:
            return list(pool.map(self.tool.run, codes))


@dataclasses.dataclass
class _Row:
    """One completion as it grows: its tokens, which are the model's, their log-probs."""

    ids: list[int] = dataclasses.field(default_factory=list)
    own: list[bool] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    turn_start: int = 0  # where the model's text since the last output starts
    calls: list[ExecutionResult] = dataclasses.field(default_factory=list)
    done: bool = False
    finished: bool = False  # ended on a stop token

    def extend(self, ids, logps, own: bool) -> None:
        self.ids += [int(i) for i in ids]
        self.logps += [float(x) for x in logps]
        self.own += [own] * len(ids)


def generate_with_tools(sampler: Sampler, weights, prompts: Sequence[Sequence[int]], *, key, group_size: int,
                        tools: ToolUse, prompts_per_call: int = 0,
                        between_calls: Callable[[], None] | None = None
                        ) -> tuple[Rollout, list[list[ExecutionResult]]]:
    """The multi-turn rollout (module docstring): host arrays of [P * group_size] rows, and
    each row's tool runs. ``prompts_per_call`` (questions of the first call; later calls take
    that many times G rows) and ``between_calls`` are `Sampler.generate`'s."""
    if sampler.engine.refills:
        return _generate_in_slots(sampler, weights, prompts, key=key, group_size=group_size, tools=tools,
                                  prompts_per_call=prompts_per_call, between_calls=between_calls)
    budget = sampler.settings.max_new_tokens
    stops = set(sampler.settings.stop_tokens)
    fence = set(tools.fence_ids) - stops
    rows = [_Row() for _ in range(len(prompts) * group_size)]
    first = None
    for call in range(budget):  # every call adds a token to every running row
        running = [r for r, row in enumerate(rows) if not row.done]
        if not running:
            break
        if call and between_calls is not None:
            between_calls()
        calls_left = any(len(rows[r].calls) < tools.max_calls for r in running)
        this = turn_sampler(sampler, max(len(rows[r].ids) for r in running),
                            tuple(sorted(stops | (fence if calls_left else set()))))
        if call == 0:
            out = this.generate(weights, prompts, key=key, group_size=group_size,
                                prompts_per_call=prompts_per_call, between_calls=between_calls)
            first = out
        else:
            padded = running + running[:1] * (_power_of_two(len(running)) - len(running))
            contexts = [list(prompts[r // group_size]) + rows[r].ids for r in padded]
            out = this.generate(weights, contexts, key=key, group_size=1,
                                prompts_per_call=prompts_per_call * group_size, between_calls=between_calls,
                                row_ids=padded, first_cols=[len(rows[r].ids) for r in padded])
        tokens, mask, logps = (np.asarray(x) for x in (out.tokens, out.mask, out.logprobs))
        blocks = []  # (row, its closed block's code), in row order
        for i, r in enumerate(running):
            row, real = rows[r], mask[i]
            row.extend(tokens[i][real], logps[i][real], own=True)
            code = _closed_block(row, tools, stops, fence)
            if code is not None:
                blocks.append((row, code))
        for (row, _), result in zip(blocks, tools.run([code for _, code in blocks])):
            row.calls.append(result)
            output = tools.tokenizer.encode(tools.tool.output(result))[: budget - len(row.ids)]
            row.extend(output, [0.0] * len(output), own=False)
            row.turn_start = len(row.ids)
        for r in running:
            rows[r].done = rows[r].done or len(rows[r].ids) >= budget
    return _rollout(first, rows, budget, sampler.settings.pad_id), [row.calls for row in rows]


def _generate_in_slots(sampler: Sampler, weights, prompts: Sequence[Sequence[int]], *, key, group_size: int,
                       tools: ToolUse, prompts_per_call: int,
                       between_calls: Callable[[], None] | None) -> tuple[Rollout, list[list[ExecutionResult]]]:
    """`generate_with_tools` on the slot engine: a row pauses on a fence; a closed block runs
    on one of ``tools.workers`` sandbox threads while the other slots decode, and its output
    is appended to the row's cache (module docstring)."""
    budget = sampler.settings.max_new_tokens
    fence = sorted(set(tools.fence_ids) - set(sampler.settings.stop_tokens))
    calls: list[list[ExecutionResult]] = [[] for _ in range(len(prompts) * group_size)]
    pool = ThreadPoolExecutor(max_workers=tools.workers, thread_name_prefix="sandbox")

    def on_pause(r: int, ids: list[int], since: int, local: bool):
        code = tools.tool.code(tools.tokenizer.decode(ids[since:]))
        if code is None:  # a fence that opened a block, or closed none: the row decodes on
            return None
        if not local:  # the process that holds the row runs it
            return slots.REMOTE

        def run():
            result = tools.tool.run(code)  # a back-end failure is this call's error
            calls[r].append(result)
            output = tools.tokenizer.encode(tools.tool.output(result))[: budget - len(ids)]
            return output, len(calls[r]) < tools.max_calls

        return pool.submit(run)

    try:
        decoder = sampler.slot_decoder(weights, prompts, key=key, group_size=group_size,
                                       prompts_per_call=prompts_per_call, between_calls=between_calls,
                                       pause_tokens=fence, pausable=True, on_pause=on_pause)
        rollout, _ = slot_rollout(decoder)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return rollout, gather_calls(calls)


def gather_calls(calls: list[list[ExecutionResult]]) -> list[list[ExecutionResult]]:
    """Each row's tool runs on every process, from the one process that ran them (the
    others' lists for that row are empty). Pickled: the bytes come from this run's own
    processes, never from a model."""
    if jax.process_count() == 1:
        return calls
    gathered = [list(row) for row in calls]
    for data in distributed.all_gather_bytes(pickle.dumps({r: row for r, row in enumerate(calls) if row})):
        for r, row in pickle.loads(data).items():
            gathered[r] = row
    return gathered


def _closed_block(row: _Row, tools: ToolUse, stops: set[int], fence: set[int]) -> str | None:
    """What follows a row's decoding: the end (a stop token: marks the row done), the code of
    a block to run (a complete block after a fence, while the row has calls left), or more
    decoding (None)."""
    last = row.ids[-1]
    if last in stops:
        row.done = row.finished = True
        return None
    if last in fence and len(row.calls) < tools.max_calls:
        return tools.tool.code(tools.tokenizer.decode(row.ids[row.turn_start:]))
    return None


def turn_sampler(sampler: Sampler, used: int, stop_tokens: tuple[int, ...]) -> Sampler:
    """The sampler of one call, once the longest running row holds ``used`` tokens: the
    rest of ``sampler``'s budget (max_new_tokens - used) as its length, stopping at
    ``stop_tokens``. Both are traced values (``grpo_jax.sampler.settings``): only the
    completion bucket of the length picks the programs."""
    return sampler.with_settings(max_new_tokens=sampler.settings.max_new_tokens - used, stop_tokens=stop_tokens)


def _power_of_two(n: int) -> int:
    """The rows a call of ``n`` running rows samples (repeats of the first pad them)."""
    return 1 << (n - 1).bit_length()


def continuation_rows(rows: int, prompts_per_call: int, group_size: int) -> int:
    """The most rows one sampler call of a continuation takes, in a rollout of ``rows``
    rows drawn ``prompts_per_call`` questions x ``group_size`` rows a call (0: all at once):
    the running rows padded to a power of two, cut into calls of prompts_per_call x G rows
    (``generate_with_tools``, ``sample_to_host``)."""
    padded = _power_of_two(rows)
    return min(padded, prompts_per_call * group_size) if prompts_per_call else padded


def continuation_call(sampler: Sampler, rows: int, context_len: int, used: int) -> SamplerCall:
    """The sampler call that continues ``rows`` rows once the longest holds ``used``
    tokens and the longest context (prompt and completion so far) ``context_len``: every
    row its own prompt (group_size 1), its context prefilled afresh in a bucket of
    context_len, the rest of the budget decoded (`turn_sampler`)."""
    return turn_sampler(sampler, used, sampler.settings.stop_tokens).call(rows, 1, bucket_length(context_len))


def continuation_shapes(prompt_len: int, budget: int) -> list[int]:
    """``used`` of each of the largest programs a continuation can compile, for prompts in
    a bucket of ``prompt_len`` and ``budget`` new tokens (rl.max_new_tokens): a call after
    ``used`` in 1..budget - 1 tokens has a context bucket of prompt_len + used tokens and a
    completion bucket of budget - used. Of the pairs of buckets, those no other pair
    reaches in both: every other program holds no more slots, so fits where these fit.
    Each pair at its smallest ``used``: the most tokens to decode."""
    pairs: dict[tuple[int, int], int] = {}
    for used in range(1, budget):
        pairs.setdefault((bucket_length(prompt_len + used), bucket_length(budget - used)), used)
    return [used for (c, n), used in pairs.items()
            if not any(c2 >= c and n2 >= n and (c2, n2) != (c, n) for c2, n2 in pairs)]


def _rollout(first: Rollout, rows: list[_Row], budget: int, pad_id: int) -> Rollout:
    """The rows as one Rollout of the first call's prompts and ``budget`` completion columns."""
    b = len(rows)
    tokens = np.full((b, budget), pad_id, np.int32)
    mask = np.zeros((b, budget), bool)
    tool_mask = np.zeros((b, budget), bool)
    logps = np.zeros((b, budget), np.float32)
    for r, row in enumerate(rows):
        n = len(row.ids)
        tokens[r, :n], mask[r, :n], logps[r, :n] = row.ids, True, row.logps
        tool_mask[r, :n] = ~np.asarray(row.own, bool)
    return Rollout(prompt_tokens=np.asarray(first.prompt_tokens), prompt_mask=np.asarray(first.prompt_mask),
                   tokens=tokens, mask=mask, logprobs=logps, lengths=mask.sum(axis=1, dtype=np.int32),
                   finished=np.array([row.finished for row in rows]), tool_mask=tool_mask)
