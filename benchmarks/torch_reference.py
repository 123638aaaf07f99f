"""The torch side of the comparisons: a plain transformers GRPO update and TRL's GRPOTrainer.

Not a library module: the benchmarks import it after `common` (which sets the OpenMP
wait policy before torch loads).

* `TorchGRPOUpdate` — what a straightforward PyTorch user writes for one GRPO policy
  update: `model(...).logits`, log-softmax over the vocabulary, gather the sampled
  tokens, the reference model's log-probs under `no_grad`, k3 KL, clipped surrogate
  (ρ = exp(logp − logp.detach()), μ = 1), sequence-mean aggregation, backward, global-norm
  clipping, AdamW. No gradient checkpointing, full-sequence logits; optionally gradient
  accumulation over equal micro-batches (as our step does).
* `make_trl_trainer` — TRL's `GRPOTrainer` on CPU (use_cpu, float32, no vLLM) with
  per-phase timers: generation (`_generate_single_turn`), rewards (`_calculate_rewards`),
  reference log-probs (`_get_per_token_logps_and_entropies` on the reference model), and
  the whole optimizer step (callback `on_step_begin` → `on_step_end`). With
  `rollout=...` the completions are not generated but handed to TRL through its
  `rollout_func` hook (pre-generated token ids), so a step is reward + reference
  forward + policy update only.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import common  # noqa: F401  (OMP_WAIT_POLICY before torch)
import numpy as np


class TorchGRPOUpdate:
    """One GRPO policy update in plain torch/transformers (see the module docstring)."""

    def __init__(self, hf_dir: Path, *, threads: int, lr: float = 1e-6, beta: float = 0.04,
                 eps: float = 0.2, weight_decay: float = 0.1, betas=(0.9, 0.95), grad_clip: float = 1.0):
        torch = common.torch_setup(threads)
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.policy = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
        self.ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        for p in self.ref.parameters():
            p.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=lr, betas=betas,
                                     weight_decay=weight_decay)
        self.beta, self.eps, self.grad_clip = beta, eps, grad_clip

    def batch(self, prompt_ids: np.ndarray, completion_ids: np.ndarray, advantages: np.ndarray):
        t = self.torch
        ids = t.tensor(np.concatenate([prompt_ids, completion_ids], 1), dtype=t.long)
        return {"ids": ids, "attn": t.ones_like(ids), "tp": prompt_ids.shape[1],
                "targets": t.tensor(completion_ids, dtype=t.long),
                "mask": t.ones(completion_ids.shape, dtype=t.float32),
                "adv": t.tensor(advantages, dtype=t.float32)[:, None]}

    def _logp(self, model, b):
        logits = model(input_ids=b["ids"], attention_mask=b["attn"]).logits
        logits = logits[:, b["tp"] - 1:-1].float()
        return self.torch.log_softmax(logits, -1).gather(-1, b["targets"][..., None])[..., 0]

    def _micro(self, b, k: int, n: int):
        rows = b["ids"].shape[0]
        sl = slice(k * rows // n, (k + 1) * rows // n)
        return {key: (v[sl] if hasattr(v, "shape") else v) for key, v in b.items()}

    def step(self, b, micro_batches: int = 1) -> float:
        """One update (gradients accumulated over `micro_batches` equal slices of the rows,
        each contributing its share of the sequence mean); returns its wall seconds."""
        t = self.torch
        start = time.perf_counter()
        for k in range(micro_batches):
            mb = self._micro(b, k, micro_batches)
            with t.no_grad():
                ref_logp = self._logp(self.ref, mb)
            logp = self._logp(self.policy, mb)
            ratio = t.exp(logp - logp.detach())
            surrogate = t.minimum(ratio * mb["adv"], t.clamp(ratio, 1 - self.eps, 1 + self.eps) * mb["adv"])
            log_r = ref_logp - logp
            kl = t.exp(log_r) - log_r - 1  # k3
            per_token = -(surrogate - self.beta * kl)
            mask = mb["mask"]
            loss = ((per_token * mask).sum(1) / mask.sum(1)).mean() / micro_batches  # sequence mean
            loss.backward()
        t.nn.utils.clip_grad_norm_(self.policy.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start


class _PhaseTimer:
    def __init__(self):
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def add(self, label: str, seconds: float) -> None:
        self.current[label] = self.current.get(label, 0.0) + seconds

    def wrap(self, obj, name: str, label: str, when: Callable | None = None) -> None:
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if when is None or when(*args, **kwargs):
                    self.add(label, time.perf_counter() - start)

        setattr(obj, name, timed)


def make_trl_trainer(hf_dir: Path, prompt_texts: Sequence[str], *, num_generations: int,
                     prompts_per_step: int, max_completion_length: int, steps: int, beta: float,
                     reward_fn: Callable[[str], float], threads: int, output_dir: str,
                     rollout: Callable[[list], dict] | None = None, between_steps: Callable | None = None,
                     min_new_tokens: int | None = None, lr: float = 1e-6):
    """A GRPOTrainer for `steps` optimizer steps of `prompts_per_step` × G completions.

    Returns (trainer, timer): after `trainer.train()`, `timer.steps[i]` maps 'step' (the
    whole optimizer step), 'generate', 'reward', 'reference' to seconds for step i.
    `between_steps()` runs after each step outside its timing (used to interleave our
    own reps with TRL's so both see the same background load). `min_new_tokens`
    forces full-length completions (transformers `generate` kwarg)."""
    torch = common.torch_setup(threads)
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = prompts_per_step * steps
    data = datasets.Dataset.from_dict({"prompt": [prompt_texts[i % len(prompt_texts)] for i in range(rows)]})

    def reward(completions, **_):
        return [reward_fn(c) for c in completions]

    gen_kwargs = {"min_new_tokens": min_new_tokens} if min_new_tokens else None
    args = GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, use_vllm=False,
        beta=beta, loss_type="grpo", num_generations=num_generations,
        per_device_train_batch_size=prompts_per_step * num_generations, gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, max_steps=steps, temperature=1.0, top_p=1.0,
        top_k=0, generation_kwargs=gen_kwargs, learning_rate=lr, logging_steps=10**6,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0, shuffle_dataset=False,
        dataloader_num_workers=0)
    extra = {"rollout_func": rollout} if rollout is not None else {}
    trainer = GRPOTrainer(model=str(hf_dir), reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, **extra)
    torch.set_num_threads(threads)
    timer = _PhaseTimer()
    timer.wrap(trainer, "_generate_single_turn", "generate")
    timer.wrap(trainer, "_calculate_rewards", "reward")
    timer.wrap(trainer, "_get_per_token_logps_and_entropies", "reference",
               when=lambda model, *a, **k: model is trainer.ref_model)

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            timer.current = {}
            timer.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            timer.current["step"] = time.perf_counter() - timer.start
            timer.steps.append(timer.current)
            if between_steps is not None:
                between_steps()

    trainer.add_callback(Steps())
    return trainer, timer


def run_trl(hf_dir: Path, prompt_texts: Sequence[str], *, after_warm_step: Callable[[], object],
            **trainer_kwargs) -> list[dict[str, float]]:
    """`timer.steps` of one `make_trl_trainer(hf_dir, prompt_texts, **trainer_kwargs)` run, in a
    temporary output directory. `after_warm_step()` runs after every step but the first (TRL's
    warm-up), outside the step's timing: the benchmarks interleave their own reps there."""

    def between():
        if len(timer.steps) > 1:
            after_warm_step()

    with tempfile.TemporaryDirectory() as out:
        trainer, timer = make_trl_trainer(hf_dir, prompt_texts, output_dir=out, between_steps=between,
                                          **trainer_kwargs)
        trainer.train()
    return timer.steps


def pregenerated_rollout(prompt_ids_by_text: dict[str, list[int]], completion_ids: np.ndarray):
    """A TRL `rollout_func` that returns fixed token ids instead of generating: row r of a
    call gets the prompt's ids and `completion_ids[r]`."""

    def rollout(prompts, trainer=None):
        n = len(prompts)
        return {"prompt_ids": [list(prompt_ids_by_text[p]) for p in prompts],
                "completion_ids": [completion_ids[r % len(completion_ids)].tolist() for r in range(n)],
                "logprobs": None}

    return rollout
