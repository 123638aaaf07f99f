"""The sampler's two programs (prefill, decode) and one call of them (`SamplerCall`): the
programs together with their arguments, shardings, static arguments and donation, built by
one function (`sampler_call`) that the rollout, evaluation and the ahead-of-time check
(``grpo_jax.aot``, through the run's ``Sampler``) all use, so the check lowers the calls the
run makes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh

from grpo_jax.config import ModelConfig
from grpo_jax.sampler import cache as cache_lib
from grpo_jax.sampler.draw import Drawing
from grpo_jax.sampler.engines import DecodeEngine, resolve
from grpo_jax.sampler.layouts import HostBatch, host_batch
from grpo_jax.sampler.loop import Rows, decode
from grpo_jax.sampler.prefill import prefill
from grpo_jax.sampler.settings import SamplingParams
from grpo_jax.parallel.sharding import batch_degree, batch_sharding, on_mesh, replicated, to_global
from grpo_jax.shapes import abstract_like, bucket_length


class OnMesh:
    """A program: ``fn`` jitted with its static arguments and donation, traced, lowered and
    run on its mesh (``sharding.on_mesh``), so its activation constraints apply
    (``sharding.constrain``, the model's and the sampler's); the mesh is entered outside the
    trace, as jax requires."""

    def __init__(self, fn, mesh: Mesh | None, static_argnames: tuple[str, ...] = (),
                 donate_argnums: tuple[int, ...] = ()):
        self.fn, self.mesh, self.static_argnames, self.donate_argnums = fn, mesh, static_argnames, donate_argnums
        self.jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnums=donate_argnums)

    def around(self, wrap) -> "OnMesh":
        """The same program's signature, mesh and donation around ``wrap(fn)``: a fresh jit
        object (jax keys its trace cache on the function, so the two never share traces)."""
        return OnMesh(wrap(self.fn), self.mesh, self.static_argnames, self.donate_argnums)

    def __call__(self, *args, **kwargs):
        with on_mesh(self.mesh):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with on_mesh(self.mesh):
            return self.jitted.lower(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        with on_mesh(self.mesh):
            return jax.eval_shape(functools.partial(self.jitted, **kwargs), *args)


def programs(cfg: ModelConfig, mesh: Mesh | None, engine: DecodeEngine, kv_dtype: str) -> tuple[OnMesh, OnMesh]:
    """(prefill, decode): one jit object each per model shape, mesh, engine and cache dtype
    (jax's own cache then keys on array shapes and the drawing's `filtered`). Forward only,
    over a KV cache: remat and model.attention (the cache-free forward's kernel) change
    training, not sampling, so every remat policy and attention share them. The decode's
    cache is donated where the engine updates it in place."""
    return _programs(dataclasses.replace(cfg, remat="none", attention="xla"), mesh, engine, kv_dtype)


@functools.lru_cache(maxsize=32)
def _programs(cfg: ModelConfig, mesh: Mesh | None, engine: DecodeEngine, kv_dtype: str) -> tuple[OnMesh, OnMesh]:
    pre = OnMesh(functools.partial(prefill, cfg, mesh, engine, kv_dtype), mesh, ("cache_len", "chunk_tokens"))
    dec = OnMesh(functools.partial(decode, cfg, engine), mesh, ("num_cols", "windows"),
                 (1,) if engine.donates_cache else ())
    return pre, dec


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

    @property
    def layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(slot_prompt [Pp], src [Bp]) of the engine's prompt layout."""
        return self.engine.layout(self.num_prompts, self.group_size, batch_degree(self.mesh))

    @property
    def prefill_kwargs(self) -> dict:
        return {"cache_len": self.cache_len}

    @property
    def decode_kwargs(self) -> dict:
        return {"num_cols": self.num_cols, "windows": self.windows}

    @property
    def donate(self) -> dict[str, tuple[int, ...]]:
        """The donated positional arguments of each program: the decode's cache (1) where
        the engine updates it in place."""
        return {"prefill": (), "decode": (1,) if self.engine.donates_cache else ()}

    def host_batch(self, prompts: list[list[int]], row_offset: int = 0, row_ids=None, first_cols=None) -> HostBatch:
        return host_batch(prompts, self.group_size, self.layout, self.settings.pad_id, self.prompt_len, row_offset,
                          row_ids, first_cols)

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
        rows = Rows(*(self._rows(x, abstract) for x in (host.prompt_lens, host.row_ids, host.row_valid,
                                                         host.first_cols)))
        drawing = Drawing.host(self.settings, self.cfg.vocab_size)
        stop_mask = self._place(drawing.stop_mask, replicated, abstract)
        drawing = jax.tree.map(lambda x: self._place(x, None, abstract), drawing.replace(stop_mask=None))
        return weights, cache, logits0, rows, self._key(key, abstract), drawing.replace(stop_mask=stop_mask)

    def _key(self, key, abstract: bool):
        return place_key(key, self.mesh, abstract)

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
            cache = abstract_like(cache, cache_lib.sharding(self.mesh, cache))
        logits0 = self._rows(logits0, abstract=True)
        dec_args = self.decode_args(params, cache, logits0, host, None, abstract=True)
        return {"prefill": (self.prefill, pre_args, self.prefill_kwargs),
                "decode": (self.decode, dec_args, self.decode_kwargs)}


def place_key(key, mesh: Mesh | None, abstract: bool = False):
    """The key replicated on ``mesh``, from the same key value on every process (typed or
    raw); abstract: a typed key's."""
    if abstract:
        key = jax.eval_shape(lambda: jax.random.key(0))
        return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=None if mesh is None else replicated(mesh))
    if mesh is None or isinstance(key, jax.Array) and not key.is_fully_addressable:
        return key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = to_global(jax.random.key_data(key), replicated(mesh))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
    return to_global(key, replicated(mesh))


@functools.lru_cache(maxsize=64)
def sampler_call(cfg: ModelConfig, mesh: Mesh | None, settings: SamplingParams, num_prompts: int, group_size: int,
                 prompt_len: int) -> SamplerCall:
    """The call a run makes to sample ``num_prompts`` x ``group_size`` rows with
    ``settings`` on ``mesh`` (``sampling_mesh`` applies), prompts in a bucket of
    ``prompt_len``. ConfigError for an engine that cannot run there."""
    mesh = sampling_mesh(mesh)
    engine = resolve(settings.engine, mesh, settings.kv_dtype)
    num_cols = bucket_length(settings.max_new_tokens)
    cache_len, windows = engine.cache_plan(prompt_len, num_cols, settings.decode_phases)
    pre, dec = programs(cfg, mesh, engine, settings.kv_dtype)
    return SamplerCall(cfg, mesh, engine, settings, num_prompts, group_size, prompt_len, pre, dec, cache_len,
                       windows, num_cols)
