"""The sampler's host-side entry: prompts in, rows out (`sample`, `sample_with_info`),
`sample_to_host`, which samples a batch a few prompts at a time, and `Sampler`, the run's
sampler built once (model, sampling mesh, settings, the weights' form) that every path that
samples asks.

Plain Python and numpy, never traced: the arguments are checked, the static shapes
bucketed, the prompts left-padded and laid out by the engine, the batch padded with dummy
rows and the dummy rows stripped again; the device work is one `calls.SamplerCall`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from grpo_jax.config import Config, ModelConfig
from grpo_jax.sampler.engines import DecodeEngine, resolve
from grpo_jax.sampler import slots as slots_lib
from grpo_jax.sampler.calls import SamplerCall, sampler_call, sampling_mesh
from grpo_jax.sampler.settings import SamplingParams
from grpo_jax.sampler.weights import abstract_sampling_copy, sampling_copy
from grpo_jax.shapes import bucket_length
from grpo_jax.parallel.sharding import batch_sharding, make_sample_mesh, mesh_of, to_global, to_host


@flax.struct.dataclass
class Rollout:
    """B = num_prompts * G rows, row = prompt_index * G + g."""

    prompt_tokens: jax.Array  # [B, Tp] int32, LEFT-padded with pad_id (Tp = prompt bucket)
    prompt_mask: jax.Array  # [B, Tp] bool
    tokens: jax.Array  # [B, Tc] int32, Tc = max_new_tokens; pad_id after the stop token
    mask: jax.Array  # [B, Tc] bool, real completion tokens including the stop token
    logprobs: jax.Array  # [B, Tc] float32, log-prob of the token under the distribution sampled (top-k/p renormalised); 0 where ~mask
    lengths: jax.Array  # [B] int32 = mask.sum(1)
    finished: jax.Array  # [B] bool: True = stop token ("eos"), False = max_new_tokens ("length")
    # [B, Tc] bool: the tokens a tool wrote into the completion (``turns``: in the context,
    # masked out of the loss); None for a rollout without tools.
    tool_mask: jax.Array | None = None

    def completion_ids(self, row: int, stop_ids: Sequence[int]) -> list[int]:
        """The real completion tokens of one row, without its trailing stop token."""
        ids = np.asarray(self.tokens[row])[np.asarray(self.mask[row])].tolist()
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        return ids


@dataclasses.dataclass(frozen=True)
class SampleInfo:
    """What one `sample_with_info` call did (for benchmarks and tests)."""

    num_prompts: int
    group_size: int
    prompt_bucket: int  # Tp
    completion_bucket: int  # internal completion columns (>= max_new_tokens)
    prompt_rows: int  # prefill batch after padding to the sharding degree
    sample_rows: int  # decode batch after padding
    decode_steps: int  # tokens generated per row before the loop stopped (<= max_new_tokens)


def _validate(cfg: ModelConfig, prompts, settings: SamplingParams, group_size) -> list[list[int]]:
    """Check the prompts and the settings against the model on the host; return the
    prompts as lists of ints."""
    if not isinstance(settings, SamplingParams):
        raise TypeError(f"settings must be a SamplingParams, got {type(settings).__name__}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not isinstance(prompts, np.ndarray):
        raise TypeError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    if not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    vocab = cfg.vocab_size
    for name, ids in (("stop_tokens", list(settings.stop_tokens)), ("pad_id", [settings.pad_id])):
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"{name} {bad} outside the vocabulary [0, {vocab})")
    max_new_tokens = settings.max_new_tokens
    room = cfg.max_seq_len - max_new_tokens
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise TypeError(f"prompt {i} is a string: tokenize it first")
        p = [int(t) for t in np.asarray(p).reshape(-1)]
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if len(p) > room:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} the "
                f"sequence can hold at most cfg.max_seq_len - max_new_tokens = {room} prompt tokens")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        out.append(p)
    return out


def sample(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], settings: SamplingParams, *, key,
           group_size: int = 1, mesh: Mesh | None = None) -> Rollout:
    """G = group_size completions for each prompt (token-id lists of any lengths), drawn with
    ``settings``.

    key: a jax PRNG key (typed or raw); mesh: shard over this mesh (default: the params'
    mesh, if they live on one). Conventions (positions, temperature, randomness, padding):
    see the package docstring.
    """
    return sample_with_info(cfg, params, prompts, settings, key=key, group_size=group_size, mesh=mesh)[0]


def sample_with_info(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], settings: SamplingParams, *,
                     key, group_size: int = 1, mesh: Mesh | None = None) -> tuple[Rollout, SampleInfo]:
    """`sample`, plus a `SampleInfo` describing the shapes used and the decode steps run."""
    prompts = _validate(cfg, prompts, settings, group_size)
    mesh = sampling_mesh(mesh_of(params) if mesh is None else mesh)
    if resolve(settings.engine, mesh, settings.kv_dtype).refills:
        return slot_rollout(slot_decoder(cfg, params, prompts, settings, key=key, group_size=group_size, mesh=mesh))
    call = sampler_call(cfg, mesh, settings, len(prompts), group_size, bucket_length(max(len(p) for p in prompts)))
    return _sample_call(call, params, prompts, key)


def sample_to_host(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], settings: SamplingParams, *, key,
                   group_size: int = 1, prompts_per_call: int = 0, mesh: Mesh | None = None,
                   between_calls: Callable[[], None] | None = None, row_ids=None, first_cols=None) -> Rollout:
    """`sample`'s Rollout as host numpy arrays (on every process), sampled
    `prompts_per_call` prompts at a time (0 = all in one call). `between_calls()` runs
    before each call but the first (the trainer stops a preempted rollout there by raising).
    ``row_ids`` and ``first_cols`` ([P * group_size] each, static engines): the rows draw
    as these rows from these columns on (``layouts.host_batch``; default: rows 0.., column 0).

    Each call's results go to the host before the next call starts, so the device holds
    one call's KV cache ([layers, prompts_per_call * G, ...]) instead of the whole batch's.
    Every call uses the prompt bucket of the whole batch and its rows keep their index
    in it (the randomness index), so the tokens, masks and lengths equal those of one call;
    log-probs may differ in the last bits (other batch shapes), as between meshes.
    """
    prompts = _validate(cfg, prompts, settings, group_size)
    if not isinstance(prompts_per_call, (int, np.integer)) or prompts_per_call < 0:
        raise ValueError(f"prompts_per_call must be an int >= 0 (0 = one call), got {prompts_per_call!r}")
    mesh = sampling_mesh(mesh_of(params) if mesh is None else mesh)
    if resolve(settings.engine, mesh, settings.kv_dtype).refills:  # one queue of every row, across calls
        if row_ids is not None or first_cols is not None:
            raise ValueError("row_ids and first_cols are for the static engines; the slot engine resumes rows itself")
        return slot_rollout(slot_decoder(cfg, params, prompts, settings, key=key, group_size=group_size, mesh=mesh,
                                         rows_per_call=prompts_per_call * group_size, between_calls=between_calls))[0]
    per_call = prompts_per_call or len(prompts)
    tp = bucket_length(max(len(p) for p in prompts))
    parts = []
    for start in range(0, len(prompts), per_call):
        if start and between_calls is not None:
            between_calls()
        chunk = prompts[start:start + per_call]
        call = sampler_call(cfg, mesh, settings, len(chunk), group_size, tp)
        span = slice(start * group_size, (start + len(chunk)) * group_size)
        rollout, _ = _sample_call(call, params, chunk, key, row_offset=start * group_size,
                                  row_ids=None if row_ids is None else np.asarray(row_ids)[span],
                                  first_cols=None if first_cols is None else np.asarray(first_cols)[span])
        parts.append(jax.tree.map(to_host, rollout))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def _sample_call(call: SamplerCall, params, prompts: list[list[int]], key, row_offset: int = 0, row_ids=None,
                 first_cols=None) -> tuple[Rollout, SampleInfo]:
    """One prefill + decode for validated prompts; sample row r draws its randomness as row
    `row_offset + r` (or row_ids[r], from column first_cols[r])."""
    host = call.host_batch(prompts, row_offset, row_ids, first_cols)
    tokens, mask, logps, finished, steps = call.run(params, host, key)
    # Strip dummy rows and the unused columns of the completion bucket.
    rows, max_new_tokens = len(prompts) * call.group_size, call.settings.max_new_tokens
    if tokens.shape != (rows, max_new_tokens):
        tokens, mask, logps = (x[:rows, :max_new_tokens] for x in (tokens, mask, logps))
        finished = finished[:rows]
    # Each sample row's prompt is its prefill slot's.
    prompt_tokens, prompt_mask = (x[host.src_rows[:rows]] for x in (host.prompt_tokens, host.prompt_mask))
    if call.mesh is None:
        prompt_tokens, prompt_mask = jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask)
    else:
        prompt_tokens, prompt_mask = (to_global(x, batch_sharding(call.mesh, 2, rows))
                                      for x in (prompt_tokens, prompt_mask))
    rollout = Rollout(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens, mask=mask,
                      logprobs=logps, lengths=mask.sum(axis=1, dtype=jnp.int32), finished=finished)
    info = SampleInfo(num_prompts=len(prompts), group_size=call.group_size, prompt_bucket=call.prompt_len,
                      completion_bucket=call.num_cols, prompt_rows=host.prompt_tokens.shape[0],
                      sample_rows=host.src_rows.shape[0], decode_steps=int(steps))
    return rollout, info


def slot_decoder(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], settings: SamplingParams, *, key,
                 group_size: int = 1, mesh: Mesh | None = None, rows_per_call: int = 0,
                 between_calls: Callable[[], None] | None = None, **pauses) -> slots_lib.SlotDecoder:
    """The slot engine's rollout of ``prompts`` (checked as `sample`'s) x ``group_size`` rows
    with ``settings`` (engine ``slots``): ``rows_per_call`` sizes its default slots (the
    rows one static call holds); ``pauses``: `slots.SlotDecoder`'s pause arguments."""
    prompts = _validate(cfg, prompts, settings, group_size)
    mesh = sampling_mesh(mesh_of(params) if mesh is None else mesh)
    engine = resolve(settings.engine, mesh, settings.kv_dtype)
    if not engine.refills:
        raise ValueError(f"slot_decoder needs settings.engine='slots', got {settings.engine!r}")
    return slots_lib.SlotDecoder(cfg, mesh, settings, engine, params, prompts, group_size, key=key,
                                 slots=settings.slots, rows_per_call=rows_per_call, between_calls=between_calls,
                                 **pauses)


def slot_rollout(decoder: slots_lib.SlotDecoder) -> tuple[Rollout, SampleInfo]:
    """``decoder``'s rows as a Rollout of host arrays in row order (with the tool mask when
    it paused rows for tools), and what it did."""
    out = decoder.run()
    tokens_p, mask_p = decoder.host_prompts()
    src = np.arange(decoder.rows) // decoder.group_size
    mask = np.arange(decoder.settings.max_new_tokens)[None, :] < out.lengths[:, None]
    rollout = Rollout(prompt_tokens=tokens_p[src], prompt_mask=mask_p[src], tokens=out.tokens, mask=mask,
                      logprobs=out.logprobs, lengths=out.lengths, finished=out.finished,
                      tool_mask=out.tool_mask if decoder.on_pause is not None else None)
    info = SampleInfo(num_prompts=len(decoder.prompts), group_size=decoder.group_size,
                      prompt_bucket=decoder.prompt_bucket, completion_bucket=decoder.num_cols,
                      prompt_rows=decoder.chunk_prompts, sample_rows=decoder.slots, decode_steps=out.decode_steps)
    return rollout, info


def slots_win(cfg: Config, mesh: Mesh | None) -> bool:
    """Whether ``rl.decode=auto`` samples a run's rollouts with the slot engine: where
    benchmarks/bench_slots.py measured it faster (benchmarks/NOTES.md, "The slot engine"), on
    one CPU device when a step's rows fill more than one static call (``rl.sample_prompts``
    below ``data.batch_size``). On one call's rows the slots have no queue to refill from;
    on a TPU slice its decode step reads more bytes than the shared engine's (docs/tpu.md,
    "The slot engine"); a CPU mesh and GPUs are not measured."""
    mesh = sampling_mesh(mesh)
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    split = 0 < cfg.rl.sample_prompts < cfg.data.batch_size
    return mesh is None and platform == "cpu" and split


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A run's sampler: the model ``cfg``, the sampling ``mesh`` (None: where the params
    live), one `SamplingParams` and the form of the weights it reads (``weights_dtype``,
    ``rl.sample_dtype``: `copy`). Built once per run (`for_run`) and handed to every path
    that samples: the rollout (`generate`), evaluation (`evaluation`, a derived sampler),
    the reward models' Monte-Carlo completer, and the ahead-of-time check (`call`,
    `abstract_call`), so they all draw with the run's engine, cache and lengths."""

    cfg: ModelConfig
    mesh: Mesh | None
    settings: SamplingParams
    weights_dtype: str = "float32"

    @classmethod
    def for_run(cls, cfg: Config, train_mesh: Mesh | None = None, tokenizer=None,
                sample_mesh: Mesh | None = None) -> "Sampler":
        """The sampler of a run of ``cfg`` whose train mesh is ``train_mesh``: rl's settings
        (``SamplingParams.from_rl``) with the ``tokenizer``'s stop tokens and pad id (values
        the programs trace: the ahead-of-time check leaves them at their defaults), on
        ``sample_mesh`` when given (a split run's sampling devices, ``split_mesh.run_meshes``),
        else on the sampling mesh (``sharding.make_sample_mesh``: replicas x tensor when
        ``mesh.slice`` or ``mesh.sample_tensor`` is set, else the train mesh itself)."""
        mesh = train_mesh if sample_mesh is None else sample_mesh
        if sample_mesh is None and train_mesh is not None and (cfg.mesh.slice or cfg.mesh.sample_tensor):
            mesh = make_sample_mesh(cfg.mesh, list(train_mesh.devices.flat))
        tokens = {} if tokenizer is None else {"stop_tokens": tokenizer.stop_ids, "pad_id": tokenizer.pad_id}
        settings = SamplingParams.from_rl(cfg.rl, **tokens)
        if cfg.rl.decode == "auto" and slots_win(cfg, mesh):
            settings = settings.replace(engine="slots")
        return cls(cfg.model, mesh, settings, cfg.rl.sample_dtype)

    def with_settings(self, **changes) -> "Sampler":
        """This sampler with some settings replaced (``SamplingParams.replace``)."""
        return dataclasses.replace(self, settings=self.settings.replace(**changes))

    def evaluation(self, temperature: float = 0.0, top_p: float = 1.0) -> "Sampler":
        """The sampler evaluation draws with: this one's engine, cache, lengths and weights,
        untruncated at ``temperature`` (0: greedy) and ``top_p``
        (``SamplingParams.evaluation``)."""
        return dataclasses.replace(self, settings=self.settings.evaluation(temperature, top_p))

    @property
    def engine(self) -> DecodeEngine:
        """The decode engine ``settings.engine`` resolves to on this mesh (``engines.resolve``)."""
        return resolve(self.settings.engine, sampling_mesh(self.mesh), self.settings.kv_dtype)

    def copy(self, params):
        """The policy ``params`` in the form this sampler reads (``weights.sampling_copy``:
        ``weights_dtype`` on the sampling mesh); make it once per policy and sample it many
        times."""
        return sampling_copy(self.cfg, params, self.weights_dtype, self.mesh)

    def sample(self, weights, prompts: Sequence[Sequence[int]], *, key, group_size: int = 1) -> Rollout:
        """`sample` of ``weights`` (`copy`'s) on this sampler's mesh: a device Rollout of
        [P * group_size] rows."""
        return sample(self.cfg, weights, prompts, self.settings, key=key, group_size=group_size, mesh=self.mesh)

    def generate(self, weights, prompts: Sequence[Sequence[int]], *, key, group_size: int = 1,
                 prompts_per_call: int = 0, between_calls: Callable[[], None] | None = None, row_ids=None,
                 first_cols=None) -> Rollout:
        """The rollout: `sample_to_host` of ``weights`` (`copy`'s), ``prompts_per_call``
        prompts a call (0: all in one), as host arrays of [P * group_size] rows;
        ``between_calls()`` runs between two calls; ``row_ids``, ``first_cols``:
        `sample_to_host`'s."""
        return sample_to_host(self.cfg, weights, prompts, self.settings, key=key, group_size=group_size,
                              prompts_per_call=prompts_per_call, mesh=self.mesh, between_calls=between_calls,
                              row_ids=row_ids, first_cols=first_cols)

    def slot_decoder(self, weights, prompts: Sequence[Sequence[int]], *, key, group_size: int = 1,
                     prompts_per_call: int = 0, between_calls: Callable[[], None] | None = None,
                     **pauses) -> slots_lib.SlotDecoder:
        """`slot_decoder` of ``weights`` on this sampler's mesh and settings (engine slots)."""
        return slot_decoder(self.cfg, weights, prompts, self.settings, key=key, group_size=group_size,
                            mesh=self.mesh, rows_per_call=prompts_per_call * group_size,
                            between_calls=between_calls, **pauses)

    def call(self, num_prompts: int, group_size: int, prompt_len: int) -> SamplerCall:
        """The call this sampler makes for ``num_prompts`` x ``group_size`` rows, prompts in
        a bucket of ``prompt_len`` (``calls.sampler_call``)."""
        return sampler_call(self.cfg, self.mesh, self.settings, num_prompts, group_size, prompt_len)

    def abstract_weights(self, call: SamplerCall):
        """The abstract sampling copy of the weights (``weights.abstract_sampling_copy``) on
        ``call``'s mesh: what the ahead-of-time check lowers ``call.abstract`` over."""
        return abstract_sampling_copy(self.cfg, self.weights_dtype, call.mesh)
