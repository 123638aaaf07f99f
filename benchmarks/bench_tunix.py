"""Tunix (google-tunix 0.1.7), the JAX peer: its vanilla `Sampler` on SmolLM2-135M-Instruct.

Runs with the Tunix virtual environment's python (`bash benchmarks/tunix_env.sh` creates
`.venv-tunix`):

    .venv-tunix/bin/python benchmarks/bench_tunix.py [--quick] [--json out.json]

Tunix's pins conflict with the project's, so the work is split over two environments:

1. reference (the project's .venv, started by this script as a subprocess with
   `--prepare DIR`): the HF export of our imported SmolLM2 weights
   (`common.smollm2_hf_dir`), the prompts of `bench_rollout.py` (B texts of exactly 64
   tokens, our tokenizer, seed = B) and transformers' float32 logits on some of them;
2. Tunix (this process): Tunix's Llama built from that safetensors export with Tunix's
   own loader (`tunix.models.llama3.params.create_model_from_safe_tensors`), and our
   sampler beside it for the paired decode ratio.

Tunix's Llama calls `apply_rope` without passing the configured `rope_theta`, so it always
rotates with theta 1e6; SmolLM2 uses 1e5. The script replaces the module's `apply_rope`
with one that passes the model's theta (a monkeypatch, site-packages untouched), then
compares Tunix's logits with transformers' on the same token ids and refuses to time a
model whose max |Δlogit| exceeds the tolerance (7.7e-5 measured when right; 6.9 on
these prompts with the unpatched theta, about 11.5 on others).

Timing setting, the same as `bench_rollout.py`: B prompts of 64 real tokens, 128 new
tokens forced to full length (end-of-sequence is a forbidden token, as transformers'
`min_new_tokens` does it), temperature 1, top-p 1, no top-k, float32, KV cache of
64 + 128 positions. The prompts reach the Sampler as text through a lookup tokenizer that
returns the reference token ids (no BOS added, so the prompt is exactly 64 tokens and
Tunix's power-of-two prompt padding is a no-op); its decode is a no-op, so neither side
pays for detokenisation.
  * prefill throughput = B × 64 / t(1 new token)
  * decode throughput  = B × 127 / (t(128 new tokens) − t(1 new token))
  * end to end         = B × 128 / t(128 new tokens)
Warm-up (compilation) excluded, reps interleaved t(1), t(128); medians.
Ours is timed in this same process (the project, installed editable into this venv by
`tunix_env.sh`, on our own import of the weights, as `bench_rollout.py` runs it) on the same
token ids, its reps interleaved with Tunix's: the ratio is of runs seconds apart, not of two
benchmarks minutes apart.

Whole GRPO step (`GRPOLearner`, the setting of `bench_grpo_step.py`): P = 2 prompts of 64
tokens (the same texts, seed 7) × G = 4 samples, 128 new tokens forced to full length,
temperature 1, β = 0.04, ε = 0.2, μ = 1, Adam-W lr 1e-6, Tunix's default
sequence-mean-token-mean loss, reward = number of "e" in the decoded completion (the HF
tokenizer of the export decodes). Actor, rollout and reference on one 1×1 CPU mesh (the
vanilla rollout engine then samples with the actor's weights: no weight copy); the
reference is a second copy of the weights. Differences from ours and TRL: no
rematerialisation (Tunix's remat wraps layers in `nnx.remat`, which its sampler's decode
loop cannot run: "Cannot mutate Param from a different trace level"); at this size the
activations fit either way and no remat means less compute. Seconds per step are timed
around the learner's global step, median over the steps after two warm-up steps (the
second is still a few seconds slower than the rest);
sampling and reference are timed around `RLCluster.generate` and
`RLCluster.get_ref_per_token_logps`, update = step − sampling − reference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the project venv's libtpu would probe for a TPU

import common

# Right: ~1e-4 (float32 summation order differs between XLA and torch over 30 layers).
# Wrong theta: 7 to 12 depending on the tokens. The tolerance sits far from both, with margin for other CPUs.
LOGIT_TOL = 5e-3
CHECK_PROMPTS = 2  # prompts of the smallest batch used for the logits check
EOS_ID = 2
GRPO_PROMPTS, GRPO_GROUP, GRPO_SEED = 2, 4, 7  # as bench_grpo_step.py
# Two warm-up steps: besides the first (compiling, ~2x), the second is still slower than the
# rest (measured on AMD EPYC: 57, 32, then 28-30 s; the extra is in its update phase, 17 s
# vs 14-15 s), so it is no steady-state step either.
GRPO_WARMUP = 2


# ============================================================================ pure helpers

class LogitCheckFailed(RuntimeError):
    """Tunix's model does not reproduce transformers' logits: its timings would be of
    another model, so none are taken."""


def logit_max_abs_diff(ours, ref, tol: float = LOGIT_TOL) -> float:
    """max |ours − ref| over all positions and classes; raises LogitCheckFailed when it is
    above `tol`, not finite, or the shapes differ."""
    import numpy as np

    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if ours.shape != ref.shape:
        raise LogitCheckFailed(f"logits shape {ours.shape} != reference {ref.shape}")
    diff = float(np.max(np.abs(ours - ref)))
    if not np.isfinite(diff) or diff > tol:
        err = LogitCheckFailed(
            f"max |Δlogit| vs transformers = {diff:.4g} > {tol:g}: refusing to time this model "
            "(Tunix's unpatched RoPE theta gives about 7 to 12)")
        err.diff = diff
        raise err
    return diff


def tunix_llama_fields(hf: dict) -> dict:
    """Keyword arguments of tunix.models.llama3.model.ModelConfig for an HF Llama
    config.json. Refuses what Tunix's Llama cannot express, rather than loading a model
    that would silently differ."""
    for key in ("rope_scaling", "attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"Tunix's Llama has no {key}={hf[key]!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Tunix's Llama uses silu, not {hf['hidden_act']}")
    heads = int(hf["num_attention_heads"])
    return {
        "num_layers": int(hf["num_hidden_layers"]),
        "vocab_size": int(hf["vocab_size"]),
        "embed_dim": int(hf["hidden_size"]),
        "hidden_dim": int(hf["intermediate_size"]),
        "num_heads": heads,
        "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        "num_kv_heads": int(hf.get("num_key_value_heads", heads)),
        "rope_theta": float(hf.get("rope_theta", 10000.0)),
        "norm_eps": float(hf["rms_norm_eps"]),
        "weight_tying": bool(hf.get("tie_word_embeddings", False)),
    }


class FixedIdsTokenizer:
    """The Sampler takes text; this hands it the reference token ids of each prompt text,
    so Tunix samples from exactly the prompts the other benchmarks use."""

    def __init__(self, texts, ids, *, eos_id: int = EOS_ID):
        self.table = {t: list(map(int, i)) for t, i in zip(texts, ids)}
        self.eos = eos_id

    def encode(self, text, **_) -> list[int]:
        text = str(text)  # the GRPO learner passes numpy string scalars
        if text not in self.table:
            raise KeyError(f"no reference ids for prompt {text[:40]!r}")
        return list(self.table[text])

    def decode(self, ids, **_) -> str:
        return ""

    def bos_id(self) -> int:
        return 0  # falsy: the Sampler then adds no BOS (the reference ids have none)

    def eos_id(self) -> int:
        return self.eos

    def pad_id(self) -> int:
        # The Sampler treats every buffer position equal to pad as padding; eos is
        # forbidden while sampling and absent from the prompts (checked), so it is safe.
        return self.eos


# ============================================================================ reference side

def prepare(out_dir: Path, batches: list[int], plen: int) -> None:
    """In the project's venv: prompts, HF export, transformers logits → out_dir."""
    import numpy as np

    torch = common.torch_setup(2)
    from transformers import AutoModelForCausalLM

    tok = common.smollm2_tokenizer()
    hf_dir = common.smollm2_hf_dir()
    prompts = {}
    for b in batches:
        texts, ids = common.fixed_length_prompts(lambda s: tok.encode(s), b, plen, seed=b)
        prompts[str(b)] = {"texts": texts, "ids": ids}
    texts, ids = common.fixed_length_prompts(lambda s: tok.encode(s), GRPO_PROMPTS, plen, seed=GRPO_SEED)
    prompts["grpo"] = {"texts": texts, "ids": ids}
    check_ids = prompts[str(min(batches))]["ids"][:CHECK_PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(check_ids)).logits.float().numpy()
    np.save(out_dir / "ref_logits.npy", logits)
    np.save(out_dir / "ref_ids.npy", np.asarray(check_ids, np.int32))
    (out_dir / "prompts.json").write_text(json.dumps(prompts))
    (out_dir / "meta.json").write_text(json.dumps({
        "hf_dir": str(hf_dir), "transformers": common.package_version("transformers"),
        "torch": common.package_version("torch")}))


def run_reference(python: str, batches: list[int], plen: int, out_dir: Path) -> None:
    if not Path(python).exists():
        raise SystemExit(f"--ref-python {python} does not exist (the project's venv: `make install-test`)")
    cmd = [python, str(Path(__file__).resolve()), "--prepare", str(out_dir),
           "--batches", ",".join(map(str, batches)), "--prompt-len", str(plen)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("PYTHONHOME", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=common.ROOT)
    if proc.returncode != 0:
        raise SystemExit("reference step failed:\n" + proc.stdout[-3000:] + proc.stderr[-3000:])


def paired_decode_ratios(ours: dict, tunix: dict) -> dict:
    """summarize() of ours / Tunix decode tokens/s, rep by rep (each pair ran back to back),
    from two runners' `common.rollout_rates` dicts of the same prompts and token counts."""
    o, t = (common.rep_seconds(r, "decode") for r in (ours, tunix))
    return common.summarize([ts / os_ for os_, ts in zip(o, t) if os_ > 0 and ts > 0])


def load_ours():
    """Our sampler on our import of SmolLM2, as `bench_rollout.py` times it, in this (Tunix's)
    process: `tunix_env.sh` installs the project into this venv (editable, no dependencies;
    chex and toolz are in its pins for it)."""
    import bench_rollout

    cfg, params, _ = common.smollm2()
    return bench_rollout.SmolJax(cfg, params)


# ============================================================================ Tunix side

def patch_rope_theta(theta: float) -> None:
    """Make Tunix's Llama rotate with `theta`: its attention calls the module-level
    `apply_rope` without a theta, so it gets the function's default (1e6)."""
    from tunix.models.llama3 import model as llama

    original = getattr(llama.apply_rope, "_unpatched", llama.apply_rope)

    def apply_rope(inputs, positions, head_dim, rope_theta=None):
        return original(inputs, positions, head_dim=head_dim, rope_theta=theta)

    apply_rope._unpatched = original
    llama.apply_rope = apply_rope


def load_tunix(hf_dir: str, *, patch: bool = True):
    import jax.numpy as jnp
    from tunix.models.llama3 import model as llama
    from tunix.models.llama3 import params as llama_params

    fields = tunix_llama_fields(json.loads((Path(hf_dir) / "config.json").read_text()))
    cfg = llama.ModelConfig(**fields)
    if patch:
        patch_rope_theta(fields["rope_theta"])
    return cfg, llama_params.create_model_from_safe_tensors(hf_dir, cfg, mesh=None, dtype=jnp.float32)


def tunix_logits(model, ids):
    """Full causal forward (no cache), as the reference computed it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    ids = jnp.asarray(ids, jnp.int32)
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))

    @nnx.jit
    def fwd(m, x, pos, msk):
        return m(x, pos, None, msk)[0]

    return jax.device_get(fwd(model, ids, positions, mask))


class TunixRunner:
    """(prompt texts, new_tokens) -> seconds of one `Sampler.__call__`, full length."""

    def __init__(self, model, cfg, tokenizer, plen: int, new_tokens: int):
        from tunix.generate import sampler as sampler_lib

        self.plen, self.calls = plen, 0
        cache = sampler_lib.CacheConfig(cache_size=plen + new_tokens, num_layers=cfg.num_layers,
                                        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        self.sampler = sampler_lib.Sampler(model, tokenizer, cache)

    def __call__(self, texts, new_tokens) -> float:
        self.calls += 1
        start = time.perf_counter()
        out = self.sampler(texts, max_generation_steps=new_tokens, max_prompt_length=self.plen,
                           temperature=1.0, top_p=1.0, top_k=0, eos_tokens=[EOS_ID],
                           forbidden_tokens=[EOS_ID], seed=self.calls)
        elapsed = time.perf_counter() - start  # tokens are on the host: the output is lists
        lengths = {len(t) for t in out.tokens}
        if lengths != {new_tokens}:
            raise RuntimeError(f"Tunix returned completions of lengths {sorted(lengths)}, "
                               f"not {new_tokens}: the timing would not be full length")
        return elapsed


def force_full_length() -> None:
    """The GRPO learner's rollouts call `Sampler.__call__` without forbidden tokens; forbid
    end-of-sequence there too so every completion is full length, like the other sides."""
    from tunix.generate import sampler as sampler_lib

    call = getattr(sampler_lib.Sampler.__call__, "_unpatched", sampler_lib.Sampler.__call__)

    def patched(self, *a, **k):
        k.setdefault("forbidden_tokens", [EOS_ID])
        return call(self, *a, **k)

    patched._unpatched = call
    sampler_lib.Sampler.__call__ = patched


def grpo_learner(hf_dir: str, texts, ids, *, new_tokens: int, steps: int, plen: int):
    """(RLCluster, GRPOLearner) of this benchmark's setting: actor, rollout and reference on
    one 1×1 CPU mesh, Tunix's Llama without remat, the HF tokenizer decoding for the reward."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax
    from transformers import AutoTokenizer
    from tunix.models.llama3 import model as llama
    from tunix.models.llama3 import params as llama_params
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.grpo import grpo_learner as grpo
    from tunix.rl.rollout import base_rollout

    hf_tok = AutoTokenizer.from_pretrained(hf_dir)

    class Tokenizer(FixedIdsTokenizer):
        def decode(self, ids, **_):  # the reward reads the text
            return hf_tok.decode(list(map(int, ids)))

    cfg, reference = load_tunix(hf_dir)
    cfg = dataclasses.replace(cfg, remat_config=llama.RematConfig.NONE)
    actor = llama_params.create_model_from_safe_tensors(hf_dir, cfg, mesh=None, dtype=jnp.float32)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    roles = (rlc.Role.ACTOR, rlc.Role.REFERENCE, rlc.Role.ROLLOUT)
    cluster = rlc.RLCluster(
        actor=actor, reference=reference, tokenizer=Tokenizer(texts, ids),
        cluster_config=rlc.ClusterConfig(
            role_to_mesh={r: mesh for r in roles}, rollout_engine="vanilla", offload_to_cpu=False,
            training_config=rlc.RLTrainingConfig(actor_optimizer=optax.adamw(1e-6),
                                                 eval_every_n_steps=10 ** 9, max_steps=steps),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=new_tokens, max_prompt_length=plen, kv_cache_size=plen + new_tokens,
                temperature=1.0, top_p=1.0, top_k=0, eos_tokens=[EOS_ID])))
    learner = grpo.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo.GRPOConfig(num_generations=GRPO_GROUP, num_iterations=1, beta=0.04, epsilon=0.2),
        reward_fns=lambda prompts, completions, **_: [common.count_letter_reward(c) for c in completions])
    return cluster, learner


def time_phases(cluster, learner, new_tokens: int) -> list[dict]:
    """Wraps the learner's global step and the cluster's sampling and reference calls in
    timers; returns the list each finished step appends its phase seconds to."""
    import jax

    current: dict[str, float] = {}
    out: list[dict] = []

    def timed(obj, name, phase, check=None):
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            result = jax.block_until_ready(inner(*a, **k))
            current[phase] = current.get(phase, 0.0) + time.perf_counter() - start
            if check:
                check(result)
            return result

        setattr(obj, name, wrapper)

    def full_length(rollout):
        lengths = {len(t) for t in rollout.tokens}
        if lengths != {new_tokens}:
            raise RuntimeError(f"GRPO completions of lengths {sorted(lengths)}, not {new_tokens}")

    timed(cluster, "generate", "sampling", full_length)
    timed(cluster, "get_ref_per_token_logps", "reference")
    global_step = learner._run_global_step  # the learner's own step, whole (no public hook)

    def step(*a, **k):
        current.clear()
        start = time.perf_counter()
        result = global_step(*a, **k)
        current["step"] = time.perf_counter() - start
        current["update"] = current["step"] - current.get("sampling", 0.0) - current.get("reference", 0.0)
        out.append(dict(current))
        return result

    learner._run_global_step = step
    return out


def grpo_steps(hf_dir: str, texts, ids, *, new_tokens: int, steps: int, plen: int) -> list[dict]:
    """Per-step phase seconds of `steps` GRPOLearner global steps (the first compiles)."""
    import numpy as np

    force_full_length()
    cluster, learner = grpo_learner(hf_dir, texts, ids, new_tokens=new_tokens, steps=steps, plen=plen)
    out = time_phases(cluster, learner, new_tokens)
    learner.train([{"prompts": np.array(texts)} for _ in range(steps)])
    if len(out) != steps:
        raise RuntimeError(f"GRPOLearner ran {len(out)} steps, not {steps}")
    return out


def parse_args(argv):
    ap = common.base_parser(__doc__)
    ap.add_argument("--batches", default=None, help="comma list (default 8,32; quick 8)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128; quick 16")
    ap.add_argument("--ref-python", default=os.environ.get("GRPO_JAX_PYTHON", str(common.ROOT / ".venv/bin/python")),
                    help="python of the project's venv, for the reference step (transformers, our tokenizer)")
    ap.add_argument("--no-grpo", action="store_true", help="skip the GRPOLearner whole step")
    ap.add_argument("--no-rope-patch", action="store_true",
                    help="Tunix's Llama as shipped (RoPE theta 1e6): shows the logits check refusing it")
    ap.add_argument("--prepare", metavar="DIR", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def report_environment(rep, plen: int, n: int, reps: int) -> None:
    """The header: Tunix's and the libraries' versions, the CPU and the load."""
    versions = {m: common.package_version(m) for m in ("google-tunix", "jax", "jaxlib", "flax", "numpy", "safetensors")}
    machine = common.machine_info()
    cpu = machine["cpu"]
    rep.emit(f"## Tunix {versions['google-tunix']} vanilla `Sampler`: SmolLM2-135M (imported weights), prompts "
             f"of {plen} tokens, {n} new tokens (full length), temperature 1, top-p 1, float32; median of "
             f"{reps} reps")
    rep.emit()
    rep.emit(f"CPU: {cpu}; load average {os.getloadavg()[0]:.1f} at start; jax {versions['jax']}, "
             f"flax {versions['flax']}, safetensors {versions['safetensors']} (Tunix's own venv).")
    rep.emit()
    rep.results.update({"tunix_cpu_model": cpu, "tunix_cpu_flags": machine["cpu_flags"],
                        "tunix_versions": versions})


def reference_outputs(python: str, batches: list[int], plen: int) -> dict:
    """What `prepare` writes, read back: prompts, meta, ref_logits, ref_ids, and the seconds
    the reference step took."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="tunix_ref_") as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        run_reference(python, batches, plen, tmp)
        return {"seconds": time.perf_counter() - start,
                "prompts": json.loads((tmp / "prompts.json").read_text()),
                "meta": json.loads((tmp / "meta.json").read_text()),
                "ref_logits": np.load(tmp / "ref_logits.npy"), "ref_ids": np.load(tmp / "ref_ids.npy")}


def checked_tunix(rep, ref: dict, patch: bool):
    """(Tunix's model config, the model, the logits check's error or None): loads Tunix's
    Llama and reports its logits against transformers'."""
    start = time.perf_counter()
    cfg, model = load_tunix(ref["meta"]["hf_dir"], patch=patch)
    load_seconds = time.perf_counter() - start
    diff_err = None
    try:
        diff = logit_max_abs_diff(tunix_logits(model, ref["ref_ids"]), ref["ref_logits"])
    except LogitCheckFailed as e:
        diff_err, diff = str(e), getattr(e, "diff", None)
    rep.results["tunix_logit_max_abs_diff"] = diff
    rep.results["tunix_rope_theta"] = cfg.rope_theta
    meta, ids = ref["meta"], ref["ref_ids"]
    rep.emit(f"Logits check vs transformers {meta['transformers']} (torch {meta['torch']}) on "
             f"{ids.shape[0]}×{ids.shape[1]} prompt tokens, RoPE theta "
             + (f"patched to {cfg.rope_theta:g}" if patch else "NOT patched (Tunix uses 1e6)")
             + ": max |Δlogit| = "
             + ("–" if diff is None else f"{diff:.2e}") + f" (tolerance {LOGIT_TOL:g})"
             + (": **FAILED**" if diff_err else ""))
    rep.emit()
    rep.details.update({"reference_seconds": ref["seconds"], "load_seconds": load_seconds,
                        "logit_tolerance": LOGIT_TOL})
    return cfg, model, diff_err


def time_batch(rep, model, cfg, ours, prompts: dict, b: int, plen: int, n: int, reps: int) -> tuple[dict, list]:
    """Tunix's sampler and ours interleaved on batch `b`'s prompts: (its rates, its table row)."""
    texts, ids = prompts["texts"], prompts["ids"]
    if any(EOS_ID in p for p in ids) or {len(p) for p in ids} != {plen}:
        raise SystemExit(f"batch {b}: the prompts must be {plen} tokens without id {EOS_ID}")
    tunix_run = TunixRunner(model, cfg, FixedIdsTokenizer(texts, ids), plen, n)
    # Both are handed the token ids; Tunix's lookup tokenizer gets them back from the texts.
    runners = {"tunix": lambda _ids, k: tunix_run(texts, k), "ours": ours}
    start = time.perf_counter()
    res = common.rollout_rates(runners, ids, n, reps, prompt_len=plen)
    timed = {"seconds": time.perf_counter() - start, **res}
    cells = [b]
    for name, r in res.items():
        r["decode_rates"] = dr = common.decode_rate_spread(r, b, n)
        cells += [common.fmt(r["prefill"]),
                  common.fmt(r["decode"]) + (f" ({common.fmt(dr['min'])}–{common.fmt(dr['max'])})" if dr else "")]
        key = "tunix" if name == "tunix" else "tunix_ours"
        for kind in ("decode", "prefill", "e2e"):
            rep.results[f"{key}_{kind}_tokens_per_s_b{b}"] = r[kind]
    paired = paired_decode_ratios(res["ours"], res["tunix"])
    return timed, cells + [f"**{res['ours']['decode'] / res['tunix']['decode']:.2f}×** "
                           f"({paired['min']:.2f}–{paired['max']:.2f})"]


def sampler_section(rep, model, cfg, prompts: dict, batches: list[int], plen: int, n: int, reps: int) -> None:
    """Tunix's sampler against ours, batch by batch."""
    ours = load_ours()
    rows, per_batch = [], {}
    for b in batches:
        per_batch[b], row = time_batch(rep, model, cfg, ours, prompts[str(b)], b, plen, n, reps)
        rows.append(row)
    rep.table(["batch", "Tunix prefill tok/s", "Tunix decode tok/s (range)", "ours prefill tok/s",
               "ours decode tok/s (range)", "decode ours / Tunix (rep by rep)"], rows)
    rep.details["per_batch"] = per_batch
    rep.emit("Ours is our sampler run in this same process and venv (the same jax and jaxlib as "
             "the project's), its reps interleaved with Tunix's, so a change of machine load "
             "between the two runs cannot move the ratio.")
    rep.emit()


def main(argv=None) -> int:
    args = parse_args(argv)
    batches = [int(b) for b in (args.batches or ("8" if args.quick else "8,32")).split(",")]
    plen = args.prompt_len
    if args.prepare:
        prepare(Path(args.prepare), batches, plen)
        return 0
    reps = common.reps_of(args, full=3, quick=1)
    n = args.new_tokens or (16 if args.quick else 128)
    rep = common.Report("tunix", args)
    report_environment(rep, plen, n, reps)
    ref = reference_outputs(args.ref_python, batches, plen)
    cfg, model, diff_err = checked_tunix(rep, ref, patch=not args.no_rope_patch)
    if diff_err:
        rep.emit(f"**Not timed:** {diff_err}")
        rep.finish()
        return 1
    sampler_section(rep, model, cfg, ref["prompts"], batches, plen, n, reps)
    if not args.no_grpo:
        grpo_section(rep, ref["meta"]["hf_dir"], ref["prompts"]["grpo"], n, reps, plen)
    return rep.finish()


def grpo_section(rep, hf_dir: str, prompts: dict, n: int, reps: int, plen: int) -> None:
    rep.emit(f"### Tunix `GRPOLearner` whole step: {GRPO_PROMPTS} prompts × G={GRPO_GROUP}, {plen}-token "
             f"prompts, {n} new tokens (full length), β=0.04; median of {reps} steps after {GRPO_WARMUP} "
             "warm-up steps")
    rep.emit()
    start = time.perf_counter()
    try:
        steps = grpo_steps(hf_dir, prompts["texts"], prompts["ids"], new_tokens=n, steps=reps + GRPO_WARMUP,
                           plen=plen)
    except Exception as e:  # noqa: BLE001 - the sampler results above stand on their own
        rep.emit(f"**GRPO step not measured:** {type(e).__name__}: {str(e)[:500]}")
        rep.emit()
        return
    phases = ("sampling", "reference", "update", "step")
    s = {k: common.summarize([x.get(k, 0.0) for x in steps[GRPO_WARMUP:]]) for k in phases}
    rep.table(["", *(f"{k} s" for k in phases)], [["Tunix GRPOLearner", *(common.spread(s[k]) for k in phases)]])
    warm = ", ".join(f"{x['step']:.0f} s" for x in steps[:GRPO_WARMUP])
    rep.emit(f"Warm-up steps (excluded): {warm}; "
             f"{time.perf_counter() - start:.0f} s in all.")
    rep.emit()
    rep.results["grpo_step_seconds_tunix"] = s["step"]["median"]
    for k in ("sampling", "reference", "update"):
        rep.results[f"grpo_step_{k}_seconds_tunix"] = s[k]["median"]
    rep.details["grpo_steps"] = steps


if __name__ == "__main__":
    sys.exit(main())
