"""Per-token log-probabilities of completions, computed without a [B, T, V] array.

Every RL loss needs log π_θ(o_t | q, o_<t) at the sampled token only, yet the naive path
materialises the full logits ``hidden @ unembed`` — for a 100k vocabulary, 1024 tokens
and 64 rows that is 64 × 1024 × 100k × 4 B = 26 GB in float32, and autodiff keeps it alive
for the backward pass.
``token_logprobs`` instead walks the sequence in chunks of ``chunk_size`` positions under
``lax.scan``; each chunk's backward pass is written out (a custom VJP) and recomputes the
chunk's [B, chunk, V] logits from its inputs (hidden states and the unembedding), so the
forward pass keeps nothing vocabulary-sized. Peak logits memory is
B × chunk × V, whatever T is.

Conventions shared with the sampler (``grpo_jax.sampler``):
  * temperature: log-probs are those of ``log_softmax(logits / T)``; T = 0 (greedy
    decoding) is treated as T = 1, which is what the sampler reports for greedy tokens;
  * logits are computed in float32 from float32 copies of the hidden states and the
    unembedding matrix, whatever the model's compute dtype, or (``model.unembed_dtype``
    bfloat16) from bf16-rounded copies summed in float32, in the backward pass's products too;
  * the completion token t is predicted by the hidden state at sequence position
    Tp + t − 1 of ``concat([prompt_tokens, tokens])`` with the model's default positions
    (left-padded prompt, right-padded completion).

On a mesh (traced under ``sharding.on_mesh``) the chunk loop runs inside ``shard_map``
and its communication is written out, FSDP-style: the unembedding is all-gathered over
the axes that shard its ``embed`` dimension once per pass (not once per chunk), every
chunk's [rows, c, V / vocab shards] logits stay sharded over the axes of ``vocab``
(vocab-parallel: the log-softmax's max and sum, the target logit and ∂h are reduced across
vocab shards, the logits never gathered), and its gradient is accumulated locally over the
chunks and reduce-scattered once. Left to the partitioner, the gather and an all-reduce of
the whole [E, V] gradient happened inside the loop, once per chunk.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax import loops
from grpo_jax.model import packing
from grpo_jax.model import transformer as model_lib
from grpo_jax.config import ModelConfig
from grpo_jax.parallel.sharding import logical_to_spec, spec_axes

__all__ = ["token_logprobs", "completion_hidden", "sequence_logprobs", "sequence_values",
           "effective_temperature"]


def effective_temperature(temperature):
    """The divisor of the logits: T, or 1 for T = 0 (greedy sampling reports T = 1 log-probs).
    A Python number gives a Python float; an array (traced) gives a float32 scalar."""
    if isinstance(temperature, (int, float)):
        return float(temperature) if temperature > 0 else 1.0
    t = jnp.asarray(temperature, jnp.float32)
    return jnp.where(t > 0, t, 1.0)


def _specs(vocab_major):
    """einsum specs (logits, ∂h, ∂W) for the unembedding W as stored: [V,E] or [E,V]."""
    w = "ve" if vocab_major else "ev"
    return f"bce,{w}->bcv", f"bcv,{w}->bce", f"bcv,bce->{w}"


def _vocab_sum(x, vocab_axes):
    """Σ over the vocab shards (the mesh axes in ``vocab_axes``; none: x itself)."""
    return jax.lax.psum(x, vocab_axes) if vocab_axes else x


def _vocab_max(x, vocab_axes):
    return jax.lax.pmax(x, vocab_axes) if vocab_axes else x


def _local_targets(targets, width, vocab_axes):
    """Target ids relative to this shard's vocab slice [offset, offset + width)."""
    return targets - jax.lax.axis_index(vocab_axes) * width if vocab_axes else targets


def _operands(hidden, w, operand_dtype):
    """hidden and w as the unembedding's products take them: float32, or bf16-rounded (the
    products then sum in float32)."""
    return hidden.astype(operand_dtype), w.astype(operand_dtype)


def _chunk_forward(hidden, w, targets, temp, with_entropy, vocab_major, vocab_axes, operand_dtype):
    """One chunk: hidden [B,c,E], w the unembedding ([V,E] if vocab_major, else [E,V]; or
    this device's vocab slice of it, V = V_total / shards over ``vocab_axes``), targets
    [B,c] -> (logp [B,c], entropy [B,c] or None, lse [B,c], exp(z − max) [B,c,V], its sum
    [B,c]).

        log π(o_t) = z_t[o_t] − logsumexp_v z_t[v],   z_t = (h_t · W) / T

    The target logit is h_t · W[:, o_t] (a gather of unembedding columns, like an embedding
    lookup, taken by the shard that holds o_t), so nothing indexes into the logits; it takes
    the same (possibly bf16-rounded) operands as the logits, so logp is the log-softmax of one z.
    """
    h, w = _operands(hidden, w, operand_dtype)
    logits = jnp.einsum(_specs(vocab_major)[0], h, w, preferred_element_type=jnp.float32) / temp
    width = logits.shape[-1]
    top = _vocab_max(jnp.max(logits, axis=-1, keepdims=True), vocab_axes)
    e = jnp.exp(logits - top)
    total = _vocab_sum(jnp.sum(e, axis=-1), vocab_axes)
    lse = top[..., 0] + jnp.log(total)
    local = _local_targets(targets, width, vocab_axes)
    held = (local >= 0) & (local < width)
    local = jnp.clip(local, 0, width - 1)
    target_w = jnp.take(w, local, axis=0) if vocab_major else jnp.moveaxis(jnp.take(w, local, axis=1), 0, -1)
    target = jnp.where(held, jnp.einsum("bce,bce->bc", h.astype(jnp.float32), target_w.astype(jnp.float32)), 0.0)
    logp = _vocab_sum(target, vocab_axes) / temp - lse
    if not with_entropy:
        return logp, None, lse, e, total
    # H = logsumexp(z) − Σ_v softmax(z)_v z_v, from the same exp(z − max) as the sum above
    # (one exp over the vocabulary, not two).
    return logp, lse - _vocab_sum(jnp.sum(e * logits, axis=-1), vocab_axes) / total, lse, e, total


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _chunk_logprobs(hidden, w, targets, temp, with_entropy, vocab_major, keep_probs, vocab_axes,
                    operand_dtype="float32"):
    """``(logp, entropy or None)`` of one chunk (``_chunk_forward``); entropy is a metric
    and is not differentiated.

    The backward pass is written out: by default it recomputes the chunk's logits from the
    saved inputs (so no [B,c,V] array outlives the chunk, like ``jax.checkpoint``);
    ``keep_probs`` saves the chunk's softmax [B,c,V] float32 instead, which spares one
    unembedding matmul and one exp per chunk for that memory. Either way it forms
    ∂logp/∂z = (onehot(o) − softmax(z)) / T once and contracts it into W's gradient in the
    layout W is stored in. Left to autodiff under a checkpoint, XLA's CPU backend built the
    gradient of a tied embedding as [E,V] and transposed it in every chunk (a V × E copy),
    and ran the vocabulary reductions twice. With ``vocab_axes`` (inside
    ``shard_map``) w is this device's vocab slice: ∂W stays local and ∂h is summed over
    the vocab shards. ``operand_dtype`` "bfloat16": every product with W (the logits, ∂h,
    ∂W) takes bf16-rounded operands and sums in float32.
    """
    logp, entropy, *_ = _chunk_forward(hidden, w, targets, temp, with_entropy, vocab_major, vocab_axes,
                                       operand_dtype)
    return logp, entropy


def _chunk_fwd(hidden, w, targets, temp, with_entropy, vocab_major, keep_probs, vocab_axes,
               operand_dtype="float32"):
    logp, entropy, lse, e, total = _chunk_forward(hidden, w, targets, temp, with_entropy, vocab_major,
                                                  vocab_axes, operand_dtype)
    softmax_or_lse = e / total[..., None] if keep_probs else lse
    return (logp, entropy), (hidden, w, targets, temp, softmax_or_lse)


def _chunk_bwd(with_entropy, vocab_major, keep_probs, vocab_axes, operand_dtype, res, cotangents):
    hidden, w, targets, temp, softmax_or_lse = res
    g = cotangents[0]  # [B,c]; the entropy's cotangent is ignored (a metric)
    logits_spec, dh_spec, dw_spec = _specs(vocab_major)
    h, wo = _operands(hidden, w, operand_dtype)
    product = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    if keep_probs:
        probs = softmax_or_lse
    else:
        probs = jnp.exp(product(logits_spec, h, wo) / temp - softmax_or_lse[..., None])
    width = probs.shape[-1]
    onehot = _local_targets(targets, width, vocab_axes)[..., None] == jnp.arange(width, dtype=targets.dtype)
    dlogits = ((onehot - probs) * (g / temp)[..., None]).astype(operand_dtype)
    dh = _vocab_sum(product(dh_spec, dlogits, wo), vocab_axes).astype(hidden.dtype)
    dw = product(dw_spec, dlogits, h).astype(w.dtype)
    return dh, dw, None, jnp.zeros_like(temp)


_chunk_logprobs.defvjp(_chunk_fwd, _chunk_bwd)


def token_logprobs(hidden: jax.Array, unembed: jax.Array, targets: jax.Array, *,
                   temperature: float = 1.0, chunk_size: int = 64,
                   with_entropy: bool = False, vocab_major: bool = False, keep_probs: bool = False,
                   operand_dtype: str = "float32"):
    """log_softmax(hidden @ unembed / T) at ``targets``, chunked over the sequence axis.

        logp[b, t] = log softmax(h[b,t] · W / T)[targets[b, t]]

    Positions are processed ``chunk_size`` at a time (the last chunk zero-padded); each
    chunk's logits are recomputed in the backward pass (``_chunk_logprobs``), so neither the
    forward nor the backward pass holds more than one [B, chunk_size, V] float32 array;
    ``keep_probs`` trades that for speed and keeps every chunk's softmax for the backward
    pass ([B, T, V] float32 in all).
    T = 0 is treated as T = 1 (``effective_temperature``).

    Args:
      hidden: ``[B, T, E]`` final hidden states (any float dtype).
      unembed: ``[E, V]`` unembedding matrix, or ``[V, E]`` with ``vocab_major`` (a tied
        embedding as stored: contracting it as it lies spares a transpose of its gradient;
        ``model.unembedding`` gives the matrix and the flag).
      targets: ``[B, T]`` int token ids whose log-probs are wanted.
      temperature: T of the tempered distribution, 0 meaning 1 (a Python number, or a
        scalar array so that changing it does not recompile).
      chunk_size: sequence positions per chunk.
      with_entropy: also return the entropy of every position's tempered distribution
        (not differentiated: gradients through it are zero).
      vocab_major: ``unembed`` is ``[V, E]``.
      keep_probs: save each chunk's softmax for the backward pass instead of recomputing
        its logits (same values; one unembedding matmul fewer per chunk, [B, T, V] float32
        more memory).
      operand_dtype: "float32", or "bfloat16": the products with the unembedding (forward
        and backward) round their operands to bf16 and sum in float32
        (``model.unembed_dtype``).

    Returns:
      ``logp [B, T]`` float32, or ``(logp, entropy)`` with ``entropy [B, T]`` float32.
    """
    chex.assert_rank([hidden, unembed, targets], [3, 2, 2])
    chex.assert_equal_shape_prefix([hidden, targets], 2)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if unembed.shape[1 if vocab_major else 0] != hidden.shape[-1]:
        layout = "[V, E]" if vocab_major else "[E, V]"
        raise ValueError(f"unembed {unembed.shape} ({layout}) does not map hidden size {hidden.shape[-1]}")
    temp = jnp.asarray(effective_temperature(temperature), jnp.float32)
    if operand_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"operand_dtype must be float32 or bfloat16, got {operand_dtype!r}")
    chunked = functools.partial(_chunked, chunk_size=chunk_size, with_entropy=with_entropy,
                                vocab_major=vocab_major, keep_probs=keep_probs, operand_dtype=operand_dtype)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        logp, entropy = chunked(hidden, unembed, targets.astype(jnp.int32), temp, vocab_axes=())
    else:
        logp, entropy = _on_mesh(chunked, mesh, hidden, unembed, targets.astype(jnp.int32), temp,
                                 vocab_major)
    chex.assert_shape(logp, targets.shape)
    return (logp, entropy) if with_entropy else logp


def _chunked(hidden, unembed, targets, temp, *, chunk_size, with_entropy, vocab_major, keep_probs,
             vocab_axes, operand_dtype="float32"):
    """(logp [B, T], entropy [B, T] or None): the chunk loop over one device's rows (or all
    of them, off a mesh); ``unembed`` holds the vocab slice of ``vocab_axes``."""
    b, t, e = hidden.shape
    c = max(1, min(chunk_size, t))
    n = -(-t // c)
    pad = n * c - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [B, n*c, ...] -> [n, B, c, ...]: scan over chunks.
    hs = jnp.moveaxis(hidden.reshape(b, n, c, e), 1, 0)
    ts = jnp.moveaxis(targets.reshape(b, n, c), 1, 0)

    def body(_, xs):
        h, tg = xs
        with jax.named_scope("logprobs"):  # names the chunk's ops in profiles (profile_ops.py)
            return None, _chunk_logprobs(h, unembed, tg, temp, with_entropy, vocab_major, keep_probs,
                                         vocab_axes, operand_dtype)

    _, (logp, entropy) = loops.scan(body, None, (hs, ts))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * c)[:, :t]
    return unchunk(logp), None if entropy is None else unchunk(entropy)


def _on_mesh(chunked, mesh, hidden, unembed, targets, temp, vocab_major):
    """``chunked`` in ``shard_map`` over ``mesh``: rows split as the rules table splits
    ``batch``, the unembedding as it is stored (``vocab``, ``embed``). Each device gathers
    the ``embed`` shards of the unembedding once, keeps its ``vocab`` slice, and runs the
    chunk loop on its own rows with vocab-parallel chunks. The gather transposes to one
    reduce-scatter of ∂W over the row axes that shard ``embed`` (FSDP) and a sum over the
    other row axes (data parallelism)."""
    vocab_dim, embed_dim = (0, 1) if vocab_major else (1, 0)
    w_names = ("vocab", "embed") if vocab_major else ("embed", "vocab")
    w_spec = logical_to_spec(w_names, unembed.shape, mesh)
    row_spec = logical_to_spec(("batch",), targets.shape[:1], mesh)
    rows, vocab, embed = spec_axes(row_spec[0]), spec_axes(w_spec[vocab_dim]), spec_axes(w_spec[embed_dim])
    if set(rows) & set(vocab):
        raise ValueError(f"rows over {rows} and the vocabulary over {vocab} share a mesh axis; "
                         "the rules table must keep batch and vocab apart")
    fsdp = embed if set(embed) <= set(rows) else ()

    def local(h, w, tg, tp):
        if embed:
            # Over row axes the gather transposes to a reduce-scatter of the per-device partial
            # ∂W; over an axis the rows are not split on, to a slice of the same ∂W.
            w = jax.lax.all_gather(w, embed, axis=embed_dim, tiled=True,
                                   to="varying" if fsdp else "invarying")
        # ∂W of this device's rows is a partial sum: typed as varying over the row axes, the
        # transpose sums it over them.
        w = jax.lax.pcast(w, tuple(a for a in rows if a not in fsdp), to="varying")
        return chunked(h, w, tg, tp, vocab_axes=vocab)

    by_rows = P(row_spec[0])
    return jax.shard_map(local, mesh=mesh, in_specs=(by_rows, w_spec, by_rows, P()),
                         out_specs=by_rows)(hidden, unembed, targets, temp)


def completion_hidden(cfg: ModelConfig, params: Any, batch: Any) -> jax.Array:
    """Hidden states that predict each completion token: ``[B, Tc, E]``.

    Runs the model once on ``concat([prompt_tokens, tokens])[:, :-1]`` (the last
    completion token predicts nothing) with mask ``concat([prompt_mask, mask])`` and the
    default positions, and keeps positions Tp − 1 … Tp + Tc − 2. ``batch`` is anything
    with ``prompt_tokens, prompt_mask, tokens, mask`` (a ``train_step.Batch`` or a
    ``sampler.Rollout``). Prompts must be left-padded (the last prompt column is a real
    token) and have at least one column. A batch with ``packing`` (``rl.pack``) runs over
    its packed rows instead (``packing.completion_hidden``), to the same result.
    """
    if getattr(batch, "packing", None) is not None:
        return packing.completion_hidden(cfg, params, batch)
    tp = batch.prompt_tokens.shape[1]
    tc = batch.tokens.shape[1]
    if tp < 1 or tc < 1:
        raise ValueError(f"need at least one prompt and one completion column, got Tp={tp}, Tc={tc}")
    tokens = jnp.concatenate([batch.prompt_tokens, batch.tokens], axis=1)[:, :-1].astype(jnp.int32)
    mask = jnp.concatenate([batch.prompt_mask, batch.mask], axis=1)[:, :-1].astype(bool)
    hidden, _ = model_lib.forward_hidden(cfg, params, tokens, mask)
    out = hidden[:, tp - 1:]
    chex.assert_shape(out, (tokens.shape[0], tc, cfg.embed_dim))
    return out


def sequence_logprobs(cfg: ModelConfig, params: Any, batch: Any, *, temperature,
                      chunk_size: int, with_entropy: bool = False, keep_probs: bool = False):
    """log π_θ(o_t | q, o_<t) of every completion token: ``[B, Tc]`` float32, 0 where
    ``batch.mask`` is False (and ``(logp, entropy)`` when ``with_entropy``; entropy is 0
    there too). One model forward (``completion_hidden``) + chunked ``token_logprobs``
    (``keep_probs``: see there; its products with the unembedding in ``cfg.unembed_dtype``)."""
    hidden = completion_hidden(cfg, params, batch)
    unembed, vocab_major = model_lib.unembedding(cfg, params)
    out = token_logprobs(hidden, unembed, batch.tokens, temperature=temperature, chunk_size=chunk_size,
                         with_entropy=with_entropy, vocab_major=vocab_major, keep_probs=keep_probs,
                         operand_dtype=cfg.unembed_dtype)
    mask = batch.mask.astype(bool)
    if with_entropy:
        logp, entropy = out
        return jnp.where(mask, logp, 0.0), jnp.where(mask, entropy, 0.0)
    return jnp.where(mask, out, 0.0)


def sequence_values(cfg: ModelConfig, value_params: Any, batch: Any) -> jax.Array:
    """Value model V_ψ at every completion token: ``[B, Tc]`` float32, 0 where ``batch.mask``
    is False. V(t) is read from the same hidden state that predicts token t, i.e. the value
    of the state (q, o_<t) before o_t is emitted (``value_params`` carry a value head,
    ``model.add_value_head``)."""
    if "value_head" not in value_params:
        raise ValueError("value_params have no value head; build them with model.add_value_head")
    hidden = completion_hidden(cfg, value_params, batch)
    values = model_lib.value_outputs(value_params, hidden)
    return jnp.where(batch.mask.astype(bool), values, 0.0)
