"""Memory: GRPO vs PPO train steps, FSDP sharding, and chunked log-probs (XLA's own accounting).

Nothing here runs a model: every number is `compiled.memory_analysis()` of a program
lowered from abstract shapes (`jax.ShapeDtypeStruct` with shardings), i.e. XLA's buffer
assignment for the real train step. "Peak" = arguments + outputs − aliased (donated)
outputs + temporaries: every buffer the program holds at once in the worst case (XLA's
temporary allocation is already liveness-packed; on CPU `peak_memory_in_bytes` leaves the
temporaries out, so it is not used). On a mesh the
compiled program is the per-device SPMD program, so the bytes are per device.

1. Algorithms, same model (SmolLM2-135M shape, float32), same batch (R × (prompt +
   completion)), the `smollm2-135m` preset's remat / chunking, 2 micro-batches:
   GRPO β = 0.04 (policy + frozen reference + AdamW), GRPO β = 0 (no reference kept),
   PPO with a value model (policy + AdamW + reference + value model + its AdamW).
2. FSDP: the GRPO (β > 0) step on fake-device meshes (data, fsdp, tensor) = (1,1,1),
   (1,2,1), (1,4,1), (1,8,1) (`--xla_force_host_platform_device_count=8`, set by this
   script before jax starts).
3. Chunked log-probs: gradient of the masked mean completion log-prob w.r.t. (hidden
   states, unembedding) — the loss path — with `logprobs.token_logprobs` (chunks of c
   positions, each rematerialised) vs materialising the [B,T,V] float32 logits.
4. LoRA: the GRPO (β = 0.04) step of a full fine-tune against LoRA adapters of rank 8 and
   16 on the same frozen base, one device, compiled as the trainer compiles it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

flag = "--xla_force_host_platform_device_count=8"
if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

import common

import jax
import jax.numpy as jnp
import numpy as np


def abstract(tree, shardings):
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)


def step_memory(cfg, mesh_shape, rows: int, tp: int, tc: int) -> dict:
    """memory_analysis of the train step for `cfg` on a mesh, from abstract inputs."""
    from grpo_jax.model import transformer as model_lib
    from grpo_jax.rl import batching, optimizer
    from grpo_jax.parallel import sharding
    from grpo_jax.rl import train_step as ts
    from grpo_jax.rl.algorithms import RLHParams, get_algorithm

    mesh = sharding.mesh_from_shape(mesh_shape)
    tx, _ = optimizer.make_optimizer(cfg.optimizer, 1000)
    algo = get_algorithm(cfg.rl.algorithm)
    value_tx = tx if algo.needs_value_model else None
    step = ts.make_train_step(cfg, tx, mesh, value_tx=value_tx)
    sh = step.state_shardings
    pshapes = model_lib.param_shapes(cfg.model)
    state = ts.TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=sh.step),
        params=abstract(pshapes, sh.params),
        opt_state=abstract(jax.eval_shape(tx.init, pshapes), sh.opt_state),
        ref_params=abstract(pshapes, sh.ref_params) if sh.ref_params is not None else None)
    if algo.needs_value_model:
        vshapes = model_lib.param_shapes(cfg.model, value_head=True)
        state = state.replace(value_params=abstract(vshapes, sh.value_params),
                              value_opt_state=abstract(jax.eval_shape(value_tx.init, vshapes),
                                                       sh.value_opt_state))
    host = batching.make_batch(np.zeros((rows, tp), np.int32), np.ones((rows, tp), bool),
                               np.zeros((rows, tc), np.int32), np.ones((rows, tc), bool))
    batch = abstract(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host),
                     step.batch_shardings(host))
    jitted = jax.jit(step.fn, in_shardings=(sh, step.batch_shardings(host), sharding.replicated(mesh)),
                     out_shardings=(sh, sharding.replicated(mesh)), donate_argnums=(0,))
    compiled = jitted.lower(state, batch, RLHParams.from_config(cfg.rl)).compile()
    m = compiled.memory_analysis()
    state_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
    return {"peak": common.peak_bytes(m), "argument": m.argument_size_in_bytes,
            "temp": m.temp_size_in_bytes, "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes, "state_global": state_bytes,
            "devices": int(np.prod(mesh_shape))}


def loss_path_memory(b: int, t: int, e: int, v: int, chunk: int | None) -> dict:
    """Gradient of the mean log-prob w.r.t. (hidden, unembed); chunk None = naive [B,T,V]."""
    from grpo_jax.model.logprobs import token_logprobs

    def naive(h, w, targets):
        logits = jnp.einsum("bte,ev->btv", h.astype(jnp.float32), w.astype(jnp.float32))
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

    def loss(h, w, targets, mask):
        logp = naive(h, w, targets) if chunk is None else token_logprobs(h, w, targets, chunk_size=chunk)
        return jnp.sum(logp * mask) / jnp.sum(mask)

    f = jax.jit(jax.grad(loss, argnums=(0, 1)))
    args = (jax.ShapeDtypeStruct((b, t, e), jnp.float32), jax.ShapeDtypeStruct((e, v), jnp.float32),
            jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.float32))
    m = f.lower(*args).compile().memory_analysis()
    return {"peak": common.peak_bytes(m), "temp": m.temp_size_in_bytes}


def parse_args(argv):
    ap = common.base_parser(__doc__)
    ap.add_argument("--rows", type=int, default=None, help="default 16; quick 8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=None, help="default 192; quick 64")
    ap.add_argument("--micro-batches", type=int, default=2)
    return ap.parse_args(argv)


class Shape(NamedTuple):
    rows: int
    prompt: int
    completion: int


def algorithm_configs(args, shape: Shape) -> dict:
    """{row label: config} of the algorithms compared, on the cpu-tiny (`--quick`) or the
    SmolLM2-135M preset."""
    from grpo_jax.config import apply_overrides, cpu_tiny, smollm2_135m

    base = cpu_tiny() if args.quick else smollm2_135m()
    common_overrides = [f"rl.num_micro_batches={args.micro_batches}", "rl.group_size=4",
                        f"model.max_seq_len={max(1024, shape.prompt + shape.completion)}"]
    variants = {"GRPO β=0.04": ("rl.algorithm=grpo", "rl.beta=0.04"), "GRPO β=0": ("rl.algorithm=grpo", "rl.beta=0"),
                "PPO β=0.04 (value model)": ("rl.algorithm=ppo", "rl.beta=0.04")}
    if not args.quick:
        variants["PPO β=0 (value model)"] = ("rl.algorithm=ppo", "rl.beta=0")
    return {name: apply_overrides(base, [*common_overrides, *overrides]) for name, overrides in variants.items()}


def algorithms_section(rep, configs: dict, shape: Shape) -> dict:
    """Each algorithm's single-device train step memory, against PPO's (β = 0.04) peak."""
    algo = {name: step_memory(cfg, (1, 1, 1), *shape) for name, cfg in configs.items()}
    ppo = algo["PPO β=0.04 (value model)"]["peak"]
    rep.table(["train step", "peak", "state (params, optimiser, ref, value)", "temporaries",
               "peak / PPO's"],
              [[k, common.fmt_bytes(v["peak"]), common.fmt_bytes(v["state_global"]),
                common.fmt_bytes(v["temp"]), f"{v['peak'] / ppo:.2f}×"] for k, v in algo.items()])
    r = rep.results
    r["grpo_vs_ppo_peak_bytes_ratio"] = algo["GRPO β=0.04"]["peak"] / ppo
    r["grpo_beta0_vs_ppo_peak_bytes_ratio"] = algo["GRPO β=0"]["peak"] / ppo
    r.update({"grpo_peak_bytes": algo["GRPO β=0.04"]["peak"], "grpo_beta0_peak_bytes": algo["GRPO β=0"]["peak"],
              "ppo_peak_bytes": ppo})
    return algo


def fsdp_section(rep, grpo, single: dict, shape: Shape, quick: bool) -> dict:
    """The GRPO step's per-device memory on FSDP meshes of as many devices as there are
    (`single`: its memory on one device, already measured)."""
    meshes = [(1, 1, 1), (1, 8, 1)] if quick else [(1, 1, 1), (1, 2, 1), (1, 4, 1), (1, 8, 1)]
    if len(jax.devices()) < 8:
        meshes = [m for m in meshes if np.prod(m) <= len(jax.devices())]
    fsdp = {m: (single if m == (1, 1, 1) else step_memory(grpo, m, *shape)) for m in meshes}
    one = fsdp[(1, 1, 1)]["peak"]
    rep.table(["mesh (data, fsdp, tensor)", "per-device peak", "per-device arguments", "per-device temporaries",
               "peak / single device", "ideal (1/n)"],
              [[str(m), common.fmt_bytes(v["peak"]), common.fmt_bytes(v["argument"]),
                common.fmt_bytes(v["temp"]), f"{v['peak'] / one:.3f}×", f"{1 / np.prod(m):.3f}×"]
               for m, v in fsdp.items()])
    if (1, 8, 1) in fsdp:
        rep.results["fsdp8_per_device_bytes_ratio"] = fsdp[(1, 8, 1)]["peak"] / one
    rep.results.update({f"fsdp{np.prod(m)}_per_device_peak_bytes": v["peak"] for m, v in fsdp.items()})
    return fsdp


def chunked_section(rep, grpo, rows: int, tc: int, quick: bool) -> dict:
    """The loss path's memory with chunked log-probs against the [B, T, V] logits:
    {(positions, chunk): {"chunked", "naive"}}."""
    mc = grpo.model
    chunk_rows, chunk_res = [], {}
    for t in ((tc,) if quick else (tc, 1024)):
        naive = loss_path_memory(rows, t, mc.embed_dim, mc.vocab_size, None)
        for c in ((64,) if quick else (16, 64, 256)):
            if c > t:
                continue
            ch = loss_path_memory(rows, t, mc.embed_dim, mc.vocab_size, c)
            chunk_res[(t, c)] = {"chunked": ch, "naive": naive}
            chunk_rows.append([f"{rows} × {t}", c, common.fmt_bytes(ch["peak"]), common.fmt_bytes(naive["peak"]),
                               common.fmt_bytes(naive["peak"] - ch["peak"]), f"{ch['peak'] / naive['peak']:.3f}×"])
    rep.emit(f"Chunked log-probs (loss path: d mean log π / d(hidden, unembed), vocab {mc.vocab_size}, "
             f"embed {mc.embed_dim}); the train step uses chunk {grpo.rl.logprob_chunk_size}:")
    rep.emit()
    rep.table(["B × T", "chunk", "peak, chunked", "peak, [B,T,V] logits", "saved", "chunked / naive"], chunk_rows)
    key = (tc, grpo.rl.logprob_chunk_size)
    if key in chunk_res:
        r, res = rep.results, chunk_res[key]
        r["chunked_logprob_peak_bytes"] = res["chunked"]["peak"]
        r["naive_logprob_peak_bytes"] = res["naive"]["peak"]
        r["chunked_logprob_vs_naive_peak_bytes_ratio"] = res["chunked"]["peak"] / res["naive"]["peak"]
    return chunk_res


def lora_section(rep, grpo, shape: Shape) -> dict:
    """The GRPO (β = 0.04) step on one device, full fine-tune against LoRA adapters
    (`model.lora_rank`): {label: aot.memory of the step as the trainer compiles it}."""
    from grpo_jax import aot
    from grpo_jax.parallel import sharding
    from grpo_jax.config import apply_overrides

    mesh = sharding.mesh_from_shape((1, 1, 1))
    variants = {"full fine-tune": [], "LoRA rank 8": ["model.lora_rank=8"], "LoRA rank 16": ["model.lora_rank=16"]}
    out = {}
    for label, overrides in variants.items():
        cfg = apply_overrides(grpo, [f"rl.max_new_tokens={shape.completion}", *overrides])
        out[label] = aot.memory(aot.compile_train_step(cfg, mesh, shape.rows, shape.prompt)[0])
    full = out["full fine-tune"]["peak_bytes"]
    rep.emit("LoRA (the GRPO β=0.04 step on one device; the frozen base is π_ref, AdamW holds the adapters only):")
    rep.emit()
    rep.table(["train step", "peak", "arguments (state + batch)", "temporaries", "peak / full"],
              [[k, common.fmt_bytes(v["peak_bytes"]), common.fmt_bytes(v["argument_bytes"]),
                common.fmt_bytes(v["temp_bytes"]), f"{v['peak_bytes'] / full:.2f}×"] for k, v in out.items()])
    rep.results.update({"lora8_vs_full_peak_bytes_ratio": out["LoRA rank 8"]["peak_bytes"] / full,
                        "lora16_vs_full_peak_bytes_ratio": out["LoRA rank 16"]["peak_bytes"] / full})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    rep = common.Report("memory", args)
    shape = Shape(args.rows or (8 if args.quick else 16), args.prompt_len,
                  args.completion_len or (64 if args.quick else 192))
    model_name = "cpu-tiny" if args.quick else "SmolLM2-135M"
    rep.emit(f"## Memory ({model_name} shape, float32, {shape.rows} × ({shape.prompt} + {shape.completion}) "
             f"tokens, {args.micro_batches} micro-batches; XLA compiled memory analysis)")
    rep.emit()
    configs = algorithm_configs(args, shape)
    algo = algorithms_section(rep, configs, shape)
    grpo = configs["GRPO β=0.04"]
    fsdp = fsdp_section(rep, grpo, algo["GRPO β=0.04"], shape, args.quick)
    chunk_res = chunked_section(rep, grpo, shape.rows, shape.completion, args.quick)
    lora = lora_section(rep, grpo, shape)
    rep.details.update({"algorithms": algo, "fsdp": {str(m): v for m, v in fsdp.items()}, "lora": lora,
                        "chunked": {f"{t}x{c}": v for (t, c), v in chunk_res.items()},
                        "shape": {"rows": shape.rows, "prompt": shape.prompt, "completion": shape.completion,
                                  "micro_batches": args.micro_batches, "model": model_name}})
    return rep.finish()


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
