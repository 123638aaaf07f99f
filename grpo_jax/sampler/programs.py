"""The sampler's two programs (prefill, decode) and one call of them (`SamplerCall`): the
programs together with their arguments, shardings, static arguments and donation, built by
one function (`sampler_call`) that the rollout, evaluation and the ahead-of-time check
(``grpo_jax.aot``, through ``grpo_jax.programs``) all use, so the check lowers the calls the
run makes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from grpo_jax import loops
from grpo_jax.config import ModelConfig
from grpo_jax.sampler import cache as cache_lib
from grpo_jax.sampler.draw import Drawing
from grpo_jax.sampler.engines import DecodeEngine, resolve
from grpo_jax.sampler.layouts import HostBatch, host_batch
from grpo_jax.sampler.loop import Rows, decode
from grpo_jax.sampler.prefill import prefill
from grpo_jax.sampler.settings import SamplingParams
from grpo_jax.sharding import batch_degree, batch_sharding, on_mesh, replicated, to_global
from grpo_jax.shapes import bucket_length


class OnMesh:
    """A jitted program that is traced, lowered and run on its mesh (``sharding.on_mesh``), so
    its activation constraints apply (``sharding.constrain``, the model's and the sampler's);
    the mesh is entered outside the trace, as jax requires. ``unrolled``: traced inside
    ``loops.unrolled()`` (the cost twin of ``aot``)."""

    def __init__(self, jitted: Any, mesh: Mesh | None, unrolled: bool = False):
        self.jitted, self.mesh, self.unrolled = jitted, mesh, unrolled

    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(on_mesh(self.mesh))
        if self.unrolled:
            stack.enter_context(loops.unrolled())
        return stack

    def __call__(self, *args, **kwargs):
        with self._context():
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with self._context():
            return self.jitted.lower(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        with self._context():
            return jax.eval_shape(functools.partial(self.jitted, **kwargs), *args)


def programs(cfg: ModelConfig, mesh: Mesh | None, engine: DecodeEngine, kv_dtype: str,
             unrolled: bool = False) -> tuple[OnMesh, OnMesh]:
    """(prefill, decode): one jit object each per model shape, mesh, engine and cache dtype
    (jax's own cache then keys on array shapes and the drawing's `filtered`); ``unrolled``
    programs (the cost twin) are separate jit objects, so their traces never mix with the
    run's. Forward only, over a KV cache: remat and model.attention (the cache-free
    forward's kernel) change training, not sampling, so every remat policy and attention
    share them. The decode's cache is donated where the engine updates it in place."""
    return _programs(dataclasses.replace(cfg, remat="none", attention="xla"), mesh, engine, kv_dtype, unrolled)


@functools.lru_cache(maxsize=32)
def _programs(cfg: ModelConfig, mesh: Mesh | None, engine: DecodeEngine, kv_dtype: str,
              unrolled: bool) -> tuple[OnMesh, OnMesh]:
    pre = jax.jit(functools.partial(prefill, cfg, mesh, engine, kv_dtype), static_argnames=("cache_len", "chunk_tokens"))
    dec = jax.jit(functools.partial(decode, cfg, engine), static_argnames=("num_cols", "windows", "cost_steps"),
                  donate_argnums=(1,) if engine.donates_cache else ())
    return OnMesh(pre, mesh, unrolled), OnMesh(dec, mesh, unrolled)


def sampling_mesh(mesh: Mesh | None) -> Mesh | None:
    """The mesh the sampler's programs are built for: None for one device (nothing to
    shard; the unsharded programs are shared)."""
    return None if mesh is not None and mesh.size == 1 else mesh


@dataclasses.dataclass(frozen=True)
class SamplerCall:
    """One call of ``num_prompts`` x ``group_size`` rows, prompts in a bucket of
    ``prompt_len``, as `sampler_call` builds it: its programs, their static arguments
    (`prefill_kwargs`, `decode_kwargs`), donation (`donate`), and the arguments in call
    order, placed on the mesh (`prefill_args`, `decode_args`; abstract ones for the check)."""

    cfg: ModelConfig
    mesh: Mesh | None
    engine: DecodeEngine
    settings: SamplingParams
    num_prompts: int
    group_size: int
    prompt_len: int
    prefill: OnMesh
    decode: OnMesh
    cache_len: int
    windows: tuple[int, ...]
    num_cols: int
    cost_steps: int | None = None

    @property
    def layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(slot_prompt [Pp], src [Bp]) of the engine's prompt layout."""
        return self.engine.layout(self.num_prompts, self.group_size, batch_degree(self.mesh))

    @property
    def prefill_kwargs(self) -> dict:
        return {"cache_len": self.cache_len}

    @property
    def decode_kwargs(self) -> dict:
        kwargs = {"num_cols": self.num_cols, "windows": self.windows}
        return kwargs if self.cost_steps is None else {**kwargs, "cost_steps": self.cost_steps}

    @property
    def donate(self) -> dict[str, tuple[int, ...]]:
        """The donated positional arguments of each program: the decode's cache (1) where
        the engine updates it in place."""
        return {"prefill": (), "decode": (1,) if self.engine.donates_cache else ()}

    def host_batch(self, prompts: list[list[int]], row_offset: int = 0) -> HostBatch:
        return host_batch(prompts, self.group_size, self.layout, self.settings.pad_id, self.prompt_len, row_offset)

    def _place(self, x, to, abstract: bool):
        """x placed by ``to`` (a function of the mesh giving its sharding; None: a host
        scalar), or its abstract value."""
        sharding = None if self.mesh is None or to is None else to(self.mesh)
        if abstract:
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
        return x if sharding is None else to_global(x, sharding)

    def _rows(self, x, abstract: bool):
        return self._place(x, lambda mesh: batch_sharding(mesh, np.ndim(x), np.shape(x)[0]), abstract)

    def prefill_args(self, params, host: HostBatch, abstract: bool = False) -> tuple:
        """(params, prompt tokens [Pp, Tp], prompt mask [Pp, Tp], src rows [Bp] or None)."""
        copy_to = (self._rows(host.src_rows, abstract) if self.group_size > 1 and self.engine.copies_rows
                   else None)
        return (params, self._rows(host.prompt_tokens, abstract), self._rows(host.prompt_mask, abstract), copy_to)

    def decode_args(self, params, cache, logits0, host: HostBatch, key, abstract: bool = False) -> tuple:
        """(the engine's weights, cache, logits0, `Rows`, key, `Drawing`)."""
        weights = (self.engine.abstract_weights if abstract else self.engine.weights)(self.cfg, params)
        rows = Rows(*(self._rows(x, abstract) for x in (host.prompt_lens, host.row_ids, host.row_valid)))
        drawing = Drawing.host(self.settings, self.cfg.vocab_size)
        stop_mask = self._place(drawing.stop_mask, replicated, abstract)
        drawing = jax.tree.map(lambda x: self._place(x, None, abstract), drawing.replace(stop_mask=None))
        return weights, cache, logits0, rows, self._key(key, abstract), drawing.replace(stop_mask=stop_mask)

    def _key(self, key, abstract: bool):
        """The key replicated on the mesh, from the same key value on every process (typed
        or raw); abstract: a typed key's."""
        if abstract:
            key = jax.eval_shape(lambda: jax.random.key(0))
            return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=None if self.mesh is None else replicated(self.mesh))
        if self.mesh is None or isinstance(key, jax.Array) and not key.is_fully_addressable:
            return key
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            data = to_global(jax.random.key_data(key), replicated(self.mesh))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
        return to_global(key, replicated(self.mesh))

    def run(self, params, host: HostBatch, key):
        """Prefill, then decode -> (tokens, mask, logprobs [Bp, Tc], finished [Bp], steps)."""
        cache, logits0 = self.prefill(*self.prefill_args(params, host), **self.prefill_kwargs)
        outputs = self.decode(*self.decode_args(params, cache, logits0, host, key), **self.decode_kwargs)
        return outputs[:5]

    def abstract(self, params) -> dict:
        """{"prefill" | "decode": (program, abstract args, static kwargs)} for abstract
        ``params`` (``weights.abstract_sampling_copy``): what the check lowers."""
        host = self.host_batch([[self.settings.pad_id] * self.prompt_len] * self.num_prompts)
        pre_args = self.prefill_args(params, host, abstract=True)
        cache, logits0 = self.prefill.eval_shape(*pre_args, **self.prefill_kwargs)
        if self.mesh is not None:
            cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                 cache, cache_lib.sharding(self.mesh, cache))
        logits0 = self._rows(logits0, abstract=True)
        dec_args = self.decode_args(params, cache, logits0, host, None, abstract=True)
        return {"prefill": (self.prefill, pre_args, self.prefill_kwargs),
                "decode": (self.decode, dec_args, self.decode_kwargs)}


@functools.lru_cache(maxsize=64)
def sampler_call(cfg: ModelConfig, mesh: Mesh | None, settings: SamplingParams, num_prompts: int, group_size: int,
                 prompt_len: int, *, unrolled: bool = False, cost_steps: int | None = None,
                 window: int | None = None) -> SamplerCall:
    """The call a run makes to sample ``num_prompts`` x ``group_size`` rows with
    ``settings`` on ``mesh`` (``sampling_mesh`` applies), prompts in a bucket of
    ``prompt_len``. ``unrolled`` / ``cost_steps``: the cost twin of ``grpo_jax.aot`` (every
    loop written out, ``cost_steps`` decode steps over one phase's cache: ``window`` slots,
    default the last phase's). ConfigError for an engine that cannot run there."""
    mesh = sampling_mesh(mesh)
    engine = resolve(settings.engine, mesh, settings.kv_dtype)
    num_cols = bucket_length(settings.max_new_tokens)
    cache_len, windows = engine.cache_plan(prompt_len, num_cols, settings.decode_phases)
    if cost_steps is not None:
        windows = (windows[-1] if window is None else window,)
        cache_len = cache_len if engine.reads_prompt_in_place else windows[0]
    pre, dec = programs(cfg, mesh, engine, settings.kv_dtype, unrolled)
    return SamplerCall(cfg, mesh, engine, settings, num_prompts, group_size, prompt_len, pre, dec, cache_len,
                       windows, num_cols, cost_steps)
