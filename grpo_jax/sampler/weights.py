"""The forms the policy's params take in the sampler.

* the **sampling copy** (`sampling_copy`): the params the rollout reads, cast to
  ``rl.sample_dtype`` and placed on the sampling mesh, once per step;
* **per layer** (`per_layer_params`): the written-out engines' weights, sliced out of the
  stack once per call, outside the decode loop;
* **feature-major** (`HeldWeights`): ``[out, in]`` copies for the feature-major engine,
  made once per policy and kept while its params live.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from grpo_jax.model import transformer as model_lib
from grpo_jax.config import ModelConfig
from grpo_jax.shapes import abstract_like
from grpo_jax.parallel.sharding import mesh_of
from grpo_jax.parallel.split_mesh import hand_off


def sampling_copy(cfg: ModelConfig, params, dtype: str, mesh: Mesh | None = None):
    """The policy the sampler reads: float32 leaves cast to ``dtype``, placed on ``mesh``
    (the sampler's mesh, ``sharding.make_sample_mesh``) or, when None, where they are.
    float32 on the params' own placement returns ``params`` itself. A bfloat16 copy halves
    the weights' memory and the bytes each decode step reads, and under float32 compute its
    matmuls round their activations to bf16 and sum in float32 (``model.product``), so its
    log-probs differ slightly from the float32 trainer's (logged as logprob_mismatch_*;
    ``benchmarks/bench_rollout.py --bf16`` measures it). On a sampling mesh whose devices
    are not the params' (``mesh.sample_devices``) the copy is ``split_mesh.hand_off``."""
    source = mesh_of(params)
    if dtype == "float32" and (mesh is None or mesh == source):
        return params
    if mesh is not None and source is not None and set(mesh.devices.flat).isdisjoint(source.devices.flat):
        # A split run (mesh.sample_devices): the sampler's chips are not the policy's.
        return hand_off(params, model_lib.param_shardings(cfg, mesh), dtype)
    return _copier(cfg, mesh, dtype)(params)


@functools.lru_cache(maxsize=8)
def _copier(cfg: ModelConfig, mesh: Mesh | None, dtype: str):
    """One jitted cast (and reshard onto ``mesh``) per model, mesh and dtype."""
    out = None if mesh is None else model_lib.param_shardings(cfg, mesh)
    cast = lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x
    return jax.jit(lambda params: jax.tree.map(cast, params), out_shardings=out)


def per_layer_params(params, num_layers: int):
    """A thunk giving the params with their layers stacked from per-layer slices taken once:
    XLA folds each layer's slice(stack(...)) inside a step back to the buffer itself, so a
    step copies no layer's weights out of the stack. The optimization barrier keeps XLA from
    hoisting the loop-invariant stack out of the loop, which would bring the copies back."""
    layers = [jax.tree.map(lambda x: x[i], params["layers"]) for i in range(num_layers)]
    stack = lambda parts: jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
    return lambda: dict(params, layers=stack(jax.lax.optimization_barrier(layers)))


class HeldWeights:
    """A derived form of a policy's params (``make(cfg)`` jitted, applied to them), made
    once per policy: reused while the params hold the same array objects (evaluation
    samples each batch twice, ``sample_to_host`` calls once per chunk) and freed with the
    first of them: a new policy's params are new arrays, so never a stale copy, and one
    copy per model and dtype at most (a float32 policy and its bfloat16 sampling copy,
    alternating, keep one each)."""

    def __init__(self, make):
        self._program = functools.lru_cache(maxsize=8)(lambda cfg: jax.jit(functools.partial(make, cfg)))
        self._held: dict[tuple, _Held] = {}

    def __call__(self, cfg: ModelConfig, params):
        leaves = jax.tree.leaves(params)
        key = (cfg, params["embedding"].dtype.name)
        held = self._held.get(key)
        if held is None or not held.holds(leaves):
            held = self._held[key] = _Held(key, leaves, self._program(cfg)(params), self._held)
        return held.weights

    def abstract(self, cfg: ModelConfig, params):
        """The form's shapes from abstract params (``jax.ShapeDtypeStruct`` leaves)."""
        return jax.eval_shape(self._program(cfg), params)


class _Held:
    """One policy's derived weights, kept while every array of its params lives."""

    def __init__(self, key: tuple, leaves: list, weights, table: dict):
        # The table is held here because the module's globals are already None when the
        # last arrays die at interpreter exit, and their callbacks still run then.
        self.key, self.weights, self.table = key, weights, table
        self.refs = [weakref.ref(x, self._drop) for x in leaves]

    def holds(self, leaves: list) -> bool:
        return len(leaves) == len(self.refs) and all(r() is x for r, x in zip(self.refs, leaves))

    def _drop(self, _):
        if self.table.get(self.key) is self:
            del self.table[self.key]


def abstract_sampling_copy(cfg: ModelConfig, dtype: str, mesh: Mesh | None):
    """`sampling_copy`'s abstract params (``jax.ShapeDtypeStruct`` leaves, sharded on
    ``mesh`` unless None) for a model: what the check lowers the sampler with."""
    params = jax.eval_shape(lambda p: sampling_copy(cfg, p, dtype), model_lib.param_shapes(cfg))
    if mesh is None:
        return params
    return abstract_like(params, model_lib.param_shardings(cfg, mesh))
