"""Sampler (rollout engine): G completions per prompt, with the log-probs the trainer needs.

``sample(cfg, params, prompts, SamplingParams(max_new_tokens=...), key=..., group_size=G)``
returns a `Rollout` whose row ``prompt_index * G + g`` is the g-th completion of prompt
``prompt_index``. The files, in the order a call runs through them:

=================  =======================================================================
``settings``       `SamplingParams`: the one frozen set of settings (``from_rl``)
``host``           host side: prompts in, rows out, a batch a few prompts per call;
                   `Sampler`, the run's sampler, built once (``Sampler.for_run``)
``layouts``        host side: each engine's prompt layout, the padded host batch
``calls``          `sampler_call`: the programs, their arguments, shardings and donation
``prefill``        device: the prompts once through the model, the cache to their rows
``loop``           device: the generic decode loop (``lax.while_loop``), one token a step
``engines``        `DecodeEngine` and its engines; `resolve` for ``rl.decode``
``slots``          the slot engine (``rl.decode=slots``): decode slots refilled from a queue
                   of rows as rows end, each slot at its own cache index; rows equal the
                   static engines' token for token
``feature_major``  the feature-major engine's step (one CPU device)
``draw``           temperature, top-k, top-p and the per-row randomness
``cache``          the KV cache: layouts, sharding, int8, phases
``weights``        the params' forms: the sampling copy, per layer, feature-major
=================  =======================================================================

Conventions (the train step recomputes log-probs with the same ones)
--------------------------------------------------------------------
* **Left padding.** Prompts are left-padded to the prompt bucket `Tp`, so every row's last
  prompt token sits in cache slot `Tp - 1` and decode step t writes the same slot
  `Tp + t - 1` for every row: one scalar write index, one `dynamic_update_slice` per layer,
  and the prefill logits of every row are at the same column. (Right padding would need
  a different slot per row, i.e. a scatter per step, and a gather for the prefill logits.)
* **Positions.** RoPE positions are those of `grpo_jax.model.transformer.default_positions` applied
  to `[prompt_mask, mask]`: prompt tokens get 0..n-1, completion token t of a prompt with
  n real tokens gets n + t. Pad slots are masked out of attention.
* **Temperature.** `logprobs = log_softmax(logits / T)` at the sampled token for T > 0.
  T = 0 is greedy decoding (argmax of the logits) and reports `log_softmax(logits)`,
  i.e. the T = 1 log-probs. With top-k / top-p the log-probs are those of the
  distribution actually sampled: the tempered one renormalised over the kept tokens
  (log_softmax(logits / T) − log Σ_kept p). Without truncation this is exactly what a full
  forward pass recomputes (`log_softmax(forward_logits / T)`); with it, the trainer's
  ratio against these log-probs is the true importance ratio π_θ / π_sampler (see
  `algorithms`: GRPO uses them as π_θold at μ = 1 when truncation is on).
* **Top-k, then top-p** (the order transformers uses): top-k keeps the k largest logits
  (ties at the k-th value are kept); top-p then keeps the smallest prefix of the remaining
  tokens, by decreasing probability renormalised over them, whose mass is >= top_p.
* **Randomness.** Row r (= prompt_index * G + g) draws its token at completion column t
  with one uniform from `fold_in(fold_in(key, t), r)` and inverse-CDF sampling. A row's
  result depends only on (key, r, its prompt, params, settings): it does not depend on the
  batch padding, the mesh, the engine, which slot or call draws it (the slot engine; a tool
  rollout's continuations), or on whether the prefill is shared, so
  `sample(prompts, G)` equals `sample([p for p in prompts for _ in range(G)], group_size=1)`
  row by row, and `sample_to_host` in several calls equals one call (each call's rows keep
  their index in the whole batch).
* **Stop tokens.** The stop token is part of the completion (`mask` True, counted in
  `lengths`); everything after it is `pad_id`, masked, with log-prob 0. `finished` is True
  for rows that hit a stop token ("eos"), False for rows cut at `max_new_tokens` ("length").

Static shapes and compilation
-----------------------------
Compiled shapes are: the number of prompts (padded to a multiple of the batch-sharding
degree) and G, the prompt bucket and the completion bucket (powers of two, at least 16),
plus the settings the programs are built for: the decode engine (`rl.decode`, resolved once
by `engines.resolve`), its phases (`rl.decode_phases`), the cache dtype and whether
top-k/top-p filtering is on at all (`SamplingParams.filtered`: a sort over the vocabulary
each step). Everything else — temperature, the values of top_k and top_p, max_new_tokens
within its bucket, the stop tokens, pad_id, the key — is traced, so a run compiles the
prefill and the decode once per (batch, prompt bucket). `prefill.TRACE_COUNTS` counts the
traces. The returned arrays have exactly `max_new_tokens` completion columns; the cache is
`Tp + Tc` slots (Tc the completion bucket), which may exceed `cfg.max_seq_len` — only real
tokens' positions (< `cfg.max_seq_len`) reach RoPE.

Sharding
--------
Under a mesh (`mesh=` or, when omitted, the mesh the params live on) the batch and the KV
cache are sharded over ('data', 'fsdp') and the cache's kv heads over 'tensor' (the rules
table in `grpo_jax.parallel.sharding`); the params are used as they are sharded for training (no
gather of the whole model anywhere). The sample batch is padded to a multiple of the
batch-sharding degree with dummy rows that start out finished (they never delay the early
stop) and are stripped from the result. The prompt batch is laid out shard by shard
(`layouts`), so a prompt's cache reaches its rows without crossing devices. Inputs become
global arrays (`sharding.to_global`: every process passes the same prompts and key), so the
sampler also runs on several processes; there the returned arrays are global too, and host
code reads them through `sharding.to_host`.
"""

from grpo_jax.sampler.engines import DecodeEngine, resolve
from grpo_jax.sampler.host import (Rollout, SampleInfo, Sampler, sample, sample_to_host, sample_with_info, slot_decoder,
                                   slot_rollout)
from grpo_jax.sampler.calls import SamplerCall, sampler_call, sampling_mesh
from grpo_jax.sampler.settings import SamplingParams
from grpo_jax.sampler.weights import abstract_sampling_copy, sampling_copy

__all__ = ["DecodeEngine", "Rollout", "SampleInfo", "Sampler", "SamplerCall", "SamplingParams",
           "abstract_sampling_copy", "resolve", "sample", "sample_to_host", "sample_with_info", "sampler_call",
           "sampling_copy", "sampling_mesh", "slot_decoder", "slot_rollout"]
