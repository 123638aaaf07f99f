"""The decode engines behind one interface (`DecodeEngine`), and the registry that resolves
``rl.decode`` to one of them (`resolve`): the only place an engine's name decides anything.

Each engine owns its prompt layout (how a question's rows find its prompt's cache), its
cache plan (the prefill's slots and the decode's windows), the cache form its step carries,
the weights form its step reads, its step and whether the decode updates the prefill's
cache in place (donated). The decode loop (``loop.decode``) calls only this interface.

* `Scan`: the model's forward, its layers a ``lax.scan`` over the stacked weights and cache.
* `Unrolled`: the same forward with the layers written out, the weights and cache carried
  per layer (``weights.per_layer_params``, ``cache.per_layer``): a step neither copies a
  layer's weights out of the stack nor rewrites the whole cache (one slot write per layer).
* `Shared`: the unrolled forward over a cache of completion slots only, made by the decode,
  each row attending to its prompt slot's keys in the prefill's cache in place
  (``layouts.shared_layout``, ``model.PrefixCache``) instead of a copy of them. The
  completion cache grows by phase, so a step reads the filled slots and at most one phase's
  share of empty ones.
* `FeatureMajor` (one CPU device): ``feature_major.step`` on ``[out, in]`` weight copies
  over a per-layer cache that grows by phase (``cache.decode_windows``), since attention's
  cost grows with the slots it reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from grpo_jax.model import transformer as model_lib
from grpo_jax.config import DECODE_ENGINES, KV_DTYPES, ConfigError, ModelConfig
from grpo_jax.sampler import cache as cache_lib
from grpo_jax.sampler import feature_major
from grpo_jax.sampler.layouts import prefill_layout, shared_layout
from grpo_jax.sampler.weights import HeldWeights, per_layer_params


class DecodeEngine:
    """One way to run the decode; instances are stateless singletons (`ENGINES`).

    `start(cfg, params, cache, logits0, rows, windows)` is called once per decode, inside
    its trace: it returns (step, the cache the loop carries, logits0 [B, V]), step being
    ``step(cache, tokens [B], real [B], positions [B, 1], rope_cs) -> (logits [V, B], cache)``
    for one new token per row written at the cache's index."""

    name = ""
    donates_cache = True  # the decode updates the prefill's cache in place and returns it
    copies_rows = True  # the prefill copies each prompt's cache to its rows
    reads_prompt_in_place = False  # rows read their prompt slot's cache (Shared)
    refills = False  # a static call: prefill, then decode until its longest row ends (Slots: True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def check(self, mesh: Mesh | None, platform: str, kv_dtype: str) -> None:
        """ConfigError where this engine cannot run."""

    def layout(self, num_prompts: int, group_size: int, degree: int):
        """(slot_prompt, src) of ``layouts.prefill_layout``."""
        return prefill_layout(num_prompts, group_size, degree)

    def prefill_chunks(self, num_prompts: int, prompt_slots: int, chunk_tokens: int | None = None) -> int:
        """Row chunks the prefill runs in, one after the other: meshes and accelerators
        gain from large matmuls."""
        return 1

    def cache_plan(self, prompt_slots: int, num_cols: int, phases: int) -> tuple[int, tuple[int, ...]]:
        """(the prefill's cache slots, the decode's windows): one loop over the whole
        prompt + completion cache."""
        return prompt_slots + num_cols, (prompt_slots + num_cols,)

    def prefill_cache(self, cache: model_lib.KVCache, slots: int) -> model_lib.KVCache:
        """The prompts' stacked cache of Tp slots as the prefill hands it on, ``slots`` long."""
        return cache_lib.pad_slots(cache, slots)

    def weights(self, cfg: ModelConfig, params):
        """The params as the step reads them."""
        return params

    def abstract_weights(self, cfg: ModelConfig, params):
        """`weights` of abstract params (``jax.ShapeDtypeStruct`` leaves), for the check."""
        return params

    def start(self, cfg: ModelConfig, params, cache, logits0, rows: int, windows: tuple[int, ...]):
        raise NotImplementedError

    def per_layer_step(self, cfg: ModelConfig, weights):
        """The step over a per-layer cache (``cache.per_layer``) of ``weights`` (`weights`'),
        for engines that carry one; None for the others. The slot engine
        (``grpo_jax.sampler.slots``) decodes with it, each row at its own write index."""
        return None

    def grow(self, cache: model_lib.KVCache, window: int) -> model_lib.KVCache:
        """The carried cache at the start of the phase of ``window`` slots."""
        return cache

    def cache_out(self, cache: model_lib.KVCache) -> model_lib.KVCache:
        """The carried cache in the form this engine hands a cache out: stacked
        [layers, ...] where it carries one per layer over the model's stacked layout."""
        return cache

    def finish(self, cache: model_lib.KVCache) -> model_lib.KVCache | None:
        """The decode's output cache from the carried one (None: the decode returns none)."""
        return self.cache_out(cache)


def _forward_step(cfg: ModelConfig, params, step_params, unroll: bool, prefix=None):
    """The model's forward for one token per row, over a stacked cache."""
    def step(cache, tokens, real, positions, rope_cs):
        hidden, cache = model_lib.forward_hidden(cfg, step_params(), tokens[:, None], real[:, None], positions,
                                                 cache=cache, unroll=unroll, rope_cs=rope_cs, prefix=prefix)
        with jax.named_scope("unembed"):  # the transpose too: XLA folds it into the product
            logits = model_lib.logits_from_hidden(cfg, params, hidden[:, 0]).T
        return logits, cache_lib.constrain_cache(cache)
    return step


def _per_layer_step(step):
    """A stacked-cache step carrying its cache per layer."""
    def per_layer(cache, *args):
        logits, cache = step(cache_lib.stacked(cache), *args)
        return logits, cache_lib.per_layer(cache)
    return per_layer


class Scan(DecodeEngine):
    name = "scan"

    def start(self, cfg, params, cache, logits0, rows, windows):
        return _forward_step(cfg, params, lambda: params, unroll=False), cache, logits0


class Unrolled(DecodeEngine):
    name = "unrolled"

    def start(self, cfg, params, cache, logits0, rows, windows):
        return self.per_layer_step(cfg, params), cache_lib.per_layer(cache), logits0

    def per_layer_step(self, cfg, weights):
        return _per_layer_step(_forward_step(cfg, weights, per_layer_params(weights, cfg.num_layers), unroll=True))

    def cache_out(self, cache):
        return cache_lib.stacked(cache)


class Shared(DecodeEngine):
    """The prefill's cache is only read (not donated); the decode's output would hold the
    completion cache, and its restacked copy, past the loop, so it returns none."""

    name = "shared"
    donates_cache = False
    copies_rows = False
    reads_prompt_in_place = True

    def layout(self, num_prompts, group_size, degree):
        return shared_layout(num_prompts, group_size, degree)

    def cache_plan(self, prompt_slots, num_cols, phases):
        return prompt_slots, cache_lib.decode_windows(0, num_cols, phases)

    def start(self, cfg, params, cache, logits0, rows, windows):
        prefix = model_lib.PrefixCache(k=cache.k, v=cache.v, mask=cache.mask, k_scale=cache.k_scale,
                                       v_scale=cache.v_scale)
        logits0 = cache_lib.constrain_rows(jnp.repeat(logits0, rows // logits0.shape[0], axis=0))
        with jax.named_scope("cache_update"):  # the profile's parts (benchmarks/profile_ops.py)
            own = cache_lib.constrain_cache(model_lib.init_cache(cfg, rows, windows[0], cache.k.dtype))
        step = _forward_step(cfg, params, per_layer_params(params, cfg.num_layers), unroll=True, prefix=prefix)
        return _per_layer_step(step), cache_lib.per_layer(own), logits0

    def grow(self, cache, window):
        # Between phases (one copy each), never inside one: XLA copies a slice of a cache
        # that a step reads, at every step.
        return cache_lib.resize_slots(cache, window)

    def cache_out(self, cache):
        return cache_lib.stacked(cache)

    def finish(self, cache):
        return None


# Prefill chunk size of the feature-major engine (one CPU device): XLA's CPU backend ran a
# long prefill slower in one pass than in row chunks of this many tokens (benchmarks/NOTES.md,
# "Prefill at batch 64 per token"; `python benchmarks/bench_layouts.py` times both).
PREFILL_CHUNK_TOKENS = 2048


class FeatureMajor(DecodeEngine):
    """Its output cache is not the input's shape (it grows between phases), so the
    prefill's is not donated; the prefill hands the cache on per layer (padding each
    layer's buffer directly, where slicing a stacked cache apart at the start of decode and
    stacking it at its end copies the whole cache twice per call)."""

    name = "feature_major"
    donates_cache = False
    _weights = HeldWeights(feature_major.decode_weights)

    def check(self, mesh, platform, kv_dtype):
        if mesh is not None or platform != "cpu":
            where = f"a mesh of {mesh.size} devices" if mesh is not None else f"a {platform} device"
            raise ConfigError(f"rl.decode=feature_major runs on one CPU device; this sampler has {where}: "
                              "use rl.decode=scan or unrolled")
        if kv_dtype == "int8":
            raise ConfigError("rl.kv_dtype=int8 needs the scan, unrolled or shared decode engine; "
                              "rl.decode=feature_major keeps its cache in the compute dtype")

    def prefill_chunks(self, num_prompts, prompt_slots, chunk_tokens=None):
        """Chunks of at most chunk_tokens (default PREFILL_CHUNK_TOKENS) tokens, or one row."""
        rows = max(1, (PREFILL_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens) // prompt_slots)
        return -(-num_prompts // rows)

    def cache_plan(self, prompt_slots, num_cols, phases):
        windows = cache_lib.decode_windows(prompt_slots, num_cols, phases)
        return windows[0], windows

    def prefill_cache(self, cache, slots):
        return cache_lib.resize_slots(cache_lib.per_layer(cache), slots)

    def weights(self, cfg, params):
        return self._weights(cfg, params)

    def abstract_weights(self, cfg, params):
        return self._weights.abstract(cfg, params)

    def start(self, cfg, params, cache, logits0, rows, windows):
        return self.per_layer_step(cfg, params), cache, logits0

    def per_layer_step(self, cfg, weights):
        def step(c, tokens, real, positions, rope_cs):
            logits, ks, vs, mask = feature_major.step(cfg, weights, c.k, c.v, c.mask, c.index, tokens, real, rope_cs)
            return logits, model_lib.KVCache(k=ks, v=vs, mask=mask, index=c.index + 1)
        return step

    def grow(self, cache, window):
        return cache_lib.resize_slots(cache, window)

    def finish(self, cache):
        return None


ENGINES: dict[str, DecodeEngine] = {e.name: e for e in (Scan(), Unrolled(), FeatureMajor(), Shared())}


class Slots(DecodeEngine):
    """``rl.decode=slots``: the slot engine (``grpo_jax.sampler.slots``), continuous batching
    over a fixed number of slots, each slot stepping with ``step``'s per-layer step at its
    own cache index. Not a static call's engine: the host side samples with
    ``slots.SlotDecoder`` where an engine `refills`."""

    name = "slots"
    refills = True

    def __init__(self, step: DecodeEngine):
        self.step = step

    def __repr__(self) -> str:
        return f"Slots({self.step!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Slots) and other.step is self.step

    def __hash__(self) -> int:
        return hash(("slots", self.step.name))


assert tuple(ENGINES) + (Slots.name,) == DECODE_ENGINES[1:], "config.DECODE_ENGINES names the engines"


def resolve(name: str, mesh: Mesh | None, kv_dtype: str = "auto") -> DecodeEngine:
    """The engine that runs for ``rl.decode = name`` on the sampling ``mesh`` (None: one
    device) with a ``kv_dtype`` cache. ``slots``: `Slots` over auto's step (unrolled where
    auto's carries no per-layer cache). ``auto``: the feature-major engine on one CPU device
    (the layouts XLA's CPU dots are fastest in; unrolled for an int8 cache, which it does
    not hold), unrolled on a CPU mesh, shared on accelerators (decode there is bound by HBM
    bandwidth, and the shared engine reads a prompt's cache once per slot and only the
    completion slots filled so far; docs/tpu.md compares the engines). ConfigError where
    the engine cannot run (`DecodeEngine.check`)."""
    if name not in DECODE_ENGINES:
        raise ConfigError(f"rl.decode={name!r} is not one of {list(DECODE_ENGINES)}")
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"rl.kv_dtype={kv_dtype!r} is not one of {list(KV_DTYPES)}")
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    if name == "slots":
        # auto's step where it carries a per-layer cache (not the shared engine's prompt reads)
        step = resolve("auto", mesh, kv_dtype)
        return Slots(ENGINES["unrolled"] if type(step).per_layer_step is DecodeEngine.per_layer_step else step)
    if name == "auto":
        name = ("shared" if platform != "cpu" else
                "feature_major" if mesh is None and kv_dtype != "int8" else "unrolled")
    engine = ENGINES[name]
    engine.check(mesh, platform, kv_dtype)
    return engine
