"""LoRA policies: the base weights frozen, low-rank adapters trained (issue 44).

The policy is the base with W' = W + (α/r)·A·B on each weight named in ``model.lora_targets``
(``model.adapted_weight``; α = ``model.lora_alpha``, r = ``model.lora_rank``). A starts
random, B at 0, so the policy starts equal to the base (Hu et al. 2021, §4.1).

Adapters are a pytree with the params' own paths (stacked on the ``layers`` axis like the
weights they adapt): ``adapters["layers"]["attn"]["q_lora_a"]`` is A of q, [layers, embed, r],
and ``..._lora_b`` its B, [layers, r, heads, head_dim]. A takes the weight's input axes,
B its output axes, so both are sharded by the rules table like the weight (the rank axis
is replicated). ``policy_params(base, adapters)`` puts them beside the weights, where the
model's layers find them (``model.adapted_product``); without them the same model is the base.
This is why LoRA costs no second model: the train state keeps the base once and it is
π_ref too (``model_view``), the optimizer sees only the adapters, and the sampler reads
``merge(base, adapters)``, made once per step.

Written by hand rather than with qwix: docs/lora.md says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from grpo_jax.model import transformer as model_lib
from grpo_jax.config import ModelConfig
from grpo_jax.errors import CheckpointError
from grpo_jax.parallel.sharding import DTYPES, logical_to_sharding, mesh_of, to_host

Params = Any

# The layer sub-module holding each target and how many leading (input) axes it contracts
# with the activations, after the stacked ``layers`` axis: o is [heads, head_dim, embed].
_MODULE = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp", "down": "mlp"}
_INPUT_AXES = {"o": 2}


def enabled(cfg: ModelConfig) -> bool:
    return cfg.lora_rank > 0


def targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The adapted weights (``model.lora_targets``); none when LoRA is off."""
    return tuple(cfg.lora_targets.split(",")) if enabled(cfg) else ()


def _split(name: str, shape: tuple, axes: tuple, rank: int) -> dict:
    """A weight's [layers, *in, *out] shape and logical axes -> its adapters' ``{suffix:
    (shape, axes)}``: A [layers, *in, r], B [layers, r, *out]."""
    n = 1 + _INPUT_AXES.get(name, 1)
    return {f"{name}_lora_a": (shape[:n] + (rank,), axes[:n] + ("lora_rank",)),
            f"{name}_lora_b": (shape[:1] + (rank,) + shape[n:], axes[:1] + ("lora_rank",) + axes[n:])}


@functools.lru_cache(maxsize=16)
def _layout(cfg: ModelConfig) -> dict:
    """``{module: {leaf name: (shape, logical axes)}}`` of the adapters, from the model's
    own declarations of the weights they adapt."""
    shapes = model_lib.param_shapes(cfg)["layers"]
    axes = model_lib.param_logical_axes(cfg)["layers"]
    out: dict = {}
    for name in targets(cfg):
        module = _MODULE[name]
        out.setdefault(module, {}).update(
            _split(name, shapes[module][name].shape, axes[module][name], cfg.lora_rank))
    return out


def adapter_shapes(cfg: ModelConfig) -> Params:
    """ShapeDtypeStructs of the adapters (``model.param_dtype``, the master weights')."""
    dtype = DTYPES[cfg.param_dtype]
    return {"layers": {m: {k: jax.ShapeDtypeStruct(s, dtype) for k, (s, _) in leaves.items()}
                       for m, leaves in _layout(cfg).items()}}


def adapter_shardings(cfg: ModelConfig, mesh: Mesh) -> Params:
    """NamedSharding of every adapter leaf, from its logical axes and the rules table."""
    return {"layers": {m: {k: logical_to_sharding(a, s, mesh) for k, (s, a) in leaves.items()}
                       for m, leaves in _layout(cfg).items()}}


def init_adapters(cfg: ModelConfig, key: jax.Array, mesh: Mesh | None = None) -> Params:
    """Fresh adapters: A ~ N(0, 1/fan_in) (fan_in: the weight's input size), B = 0; created
    in their shards when a mesh is given."""
    return _initializer(cfg, mesh)(key)


@functools.lru_cache(maxsize=8)
def _initializer(cfg: ModelConfig, mesh: Mesh | None):
    shapes = adapter_shapes(cfg)

    def init(key):
        out = {}
        for i, (module, leaves) in enumerate(sorted(shapes["layers"].items())):
            out[module] = {}
            for j, (name, s) in enumerate(sorted(leaves.items())):
                if name.endswith("_lora_b"):
                    out[module][name] = jnp.zeros(s.shape, s.dtype)
                    continue
                fan_in = 1
                for d in s.shape[1:-1]:
                    fan_in *= d
                noise = jax.random.normal(jax.random.fold_in(key, 100 * i + j), s.shape, jnp.float32)
                out[module][name] = (noise / jnp.sqrt(fan_in)).astype(s.dtype)
        return {"layers": out}

    return jax.jit(init, out_shardings=None if mesh is None else adapter_shardings(cfg, mesh))


def zero_b(adapters: Params) -> Params:
    """The adapters with every B at 0 (A kept): added to any base, they leave it unchanged."""
    return {"layers": {m: {k: jnp.zeros_like(x) if k.endswith("_lora_b") else x for k, x in leaves.items()}
                       for m, leaves in adapters["layers"].items()}}


def policy_params(base: Params, adapters: Params) -> Params:
    """π_θ as the model reads it: the base params with each adapter leaf beside the weight
    it adapts (no array is copied; the model merges them layer by layer)."""
    layers = {m: dict(v) for m, v in base["layers"].items()}
    for module, leaves in adapters["layers"].items():
        layers[module].update(leaves)
    return {**base, "layers": layers}


def merge(params: Params, adapters: Params, cfg: ModelConfig) -> Params:
    """Full weights of the LoRA policy: each target W -> W + (α/r)·A·B in W's dtype, every
    other parameter as in ``params``. What the sampler and evaluation read, and what an
    export of the fine-tuned model holds."""
    layers = {m: dict(v) for m, v in params["layers"].items()}
    for name in targets(cfg):
        leaves = adapters["layers"][_MODULE[name]]
        layer = layers[_MODULE[name]]
        layer[name] = jax.vmap(model_lib.adapted_weight, in_axes=(0, 0, 0, None))(  # over layers
            layer[name], leaves[f"{name}_lora_a"], leaves[f"{name}_lora_b"], cfg.lora_alpha)
    return {**params, "layers": layers}


def merged(cfg: ModelConfig, base: Params, adapters: Params) -> Params:
    """``merge`` as one jitted program, its output sharded like the base (on the base's
    mesh, per the rules table)."""
    return _merger(cfg, mesh_of(base))(base, adapters)


@functools.lru_cache(maxsize=8)
def _merger(cfg: ModelConfig, mesh: Mesh | None):
    out = None if mesh is None else model_lib.param_shardings(cfg, mesh)
    return jax.jit(functools.partial(merge, cfg=cfg), out_shardings=out)


def model_view(state: Any) -> Any:
    """A train state as the algorithms read it (``train_step.TrainState``): ``params`` the
    policy (base + adapters, ``policy_params``) and ``ref_params`` the base, π_ref being
    the policy with its adapters off. A state without a base is returned as it is."""
    if state.base_params is None:
        return state
    return state.replace(params=policy_params(state.base_params, state.params),
                         ref_params=state.base_params)


def policy_weights(cfg: ModelConfig, state: Any) -> Params:
    """π_θ of a train state as full weights: its params, or under LoRA its adapters merged
    into its base (``merged``: one new copy, for the sampler and evaluation)."""
    if state.base_params is None:
        return state.params
    return merged(cfg, state.base_params, state.params)


# Two odd multipliers (Knuth's golden-ratio hash and its square): a leaf's two sums below
# weigh each element by its position, so moved or changed values change them.
_MIXERS = (np.uint32(2654435761), np.uint32(2246822519))


def _leaf_sums(x: jax.Array) -> jax.Array:
    """[2] uint32: Σ_i bits(x_i)·(m·i + 1) mod 2^32 for each mixer m, over the raw bits of
    x. Sums mod 2^32 are exact in any order, so the result does not depend on the mesh."""
    bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
    bits = bits.astype(jnp.uint32)
    index = jax.lax.broadcasted_iota(jnp.uint32, x.shape, 0)
    for axis in range(1, x.ndim):  # the row-major flat index, built without a reshape
        index = index * jnp.uint32(x.shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
    return jnp.stack([jnp.sum(bits * (m * index + jnp.uint32(1)), dtype=jnp.uint32) for m in _MIXERS])


def fingerprint(params: Params) -> str:
    """A content hash of a params tree (16 hex digits), computed where the weights lie
    (each device sums its shards; no weight leaves the devices) and the same for any mesh:
    a LoRA checkpoint stores its base's, and a restore onto another base is refused."""
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(params)[0])
    sums = to_host(jax.jit(lambda xs: jnp.stack([_leaf_sums(x) for x in xs]))(list(leaves)))
    digest = hashlib.sha256()
    for path, leaf, s in zip(paths, leaves, sums):
        digest.update(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype}:{s[0]}:{s[1]};".encode())
    return digest.hexdigest()[:16]


def base_pointer(cfg: Any, base: Params) -> dict:
    """What a LoRA checkpoint records about the weights it adapts: run.pretrained (empty
    for a random init) and the base's ``fingerprint``."""
    return {"path": cfg.run.pretrained, "fingerprint": fingerprint(base)}


def resolve_base(saved: dict | None, base: Params, pointer: dict, run_dir: str, where: str) -> tuple[Params, dict]:
    """(base, pointer) a LoRA checkpoint was saved over, given its recorded pointer
    ``saved``: ``base`` itself when the fingerprints agree, or the base a reference reset
    merged and saved into the run (``Trainer.reset_reference``: ``saved["path"]`` under
    ``run_dir``), read back onto ``base``'s mesh and checked; any other is refused in one
    line (``check_base``)."""
    saved = saved or {}
    if saved.get("fingerprint") == pointer["fingerprint"] or "merged_at" not in saved:
        check_base(saved, pointer, where)
        return base, pointer
    from grpo_jax.model import pretrained

    _, merged_base, _ = pretrained.load_converted(os.path.join(run_dir, saved["path"]), mesh=mesh_of(base))
    check_base(saved, {**saved, "fingerprint": fingerprint(merged_base)}, where)
    return merged_base, saved


def check_base(saved: dict | None, current: dict, where: str) -> None:
    """Refuse (CheckpointError, one line) a LoRA checkpoint saved over another base."""
    saved = saved or {}
    if saved.get("fingerprint") != current["fingerprint"]:
        raise CheckpointError(
            f"{where} holds LoRA adapters of another base: saved over {saved.get('path')!r} "
            f"(fingerprint {saved.get('fingerprint')}), this run's base is {current['path']!r} "
            f"(fingerprint {current['fingerprint']}); load the same base, or use a new run.run_dir")
