"""Step labels that mean progress: Math-Shepherd's Monte-Carlo estimate, for any task.

A step is good when the right answer can still be reached from the prefix that ends with it
(Wang et al. 2024, Math-Shepherd, the labels of the paper's process reward model): a
property of the prefix, not of the step's own line. For each step of a completion, ``n``
continuations of the prompt plus that prefix are sampled from a policy; the **hard** label is
1 when any of them reaches the right answer (``task.is_correct`` of its extracted answer),
the **soft** label the fraction that do. The last step's prefix is the whole completion,
which is not continued: its label is the completion's own outcome.

The labels are only as good as the completer: a weak policy that rarely finishes a right
prefix correctly gives hard 0 to good steps unless ``n`` is large. Where a task knows the
answer to "can this prefix still be finished right" exactly (the arithmetic chain's written
value equals the true value at that step, `ArithmeticTask.step_rewards`), that is the limit
these estimates approach as ``n`` grows.

Cost: one continuation call per step prefix, ``n`` samples each, at most the policy's
``max_new_tokens`` each (`labelling_cost`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

# complete(prompts, prefixes, n) -> per (prompt, prefix) pair, n continuation texts (the text
# generated after the prefix).
Complete = Callable[[Sequence[str], Sequence[str], int], list[list[str]]]


@dataclasses.dataclass(frozen=True)
class ProgressLabels:
    """One completion's steps: ``ends`` (exclusive character offsets, as
    ``Task.step_rewards``), the ``hard`` and ``soft`` labels, and ``sampled``: whether the
    step's label came from continuations (False: the completion's own outcome)."""

    ends: tuple[int, ...]
    hard: tuple[float, ...]
    soft: tuple[float, ...]
    sampled: tuple[bool, ...]

    def step_labels(self, kind: str = "hard") -> tuple[tuple[int, float], ...]:
        """``(end, label)`` pairs, the form `LabelledSample.step_labels` holds."""
        if kind not in ("hard", "soft"):
            raise ValueError(f"kind must be 'hard' or 'soft', got {kind!r}")
        return tuple(zip(self.ends, self.hard if kind == "hard" else self.soft))


def monte_carlo_step_labels(task, examples: Sequence, completions: Sequence[str], complete: Complete,
                            n: int) -> list[ProgressLabels]:
    """Progress labels of each completion's steps (the task's segmentation, the ends of
    ``task.step_rewards``), from ``n`` continuations per step prefix by ``complete``."""
    if n < 1:
        raise ValueError(f"n (continuations per step) must be >= 1, got {n}")
    if len(examples) != len(completions):
        raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
    plans, prompts, prefixes = [], [], []
    for ex, text in zip(examples, completions):
        ends = [e for e, _ in task.step_rewards(text, ex)]
        final = len(text.rstrip())
        plan = []
        for end in ends:
            if end >= final:  # the whole completion: nothing left to continue
                plan.append(None)
            else:
                plan.append(len(prompts))
                prompts.append(ex.prompt)
                prefixes.append(text[:end])
        plans.append((ends, plan))
    continuations = complete(prompts, prefixes, n) if prompts else []
    if len(continuations) != len(prompts) or any(len(c) != n for c in continuations):
        raise ValueError(f"complete() must return {n} continuations for each of {len(prompts)} prefixes")
    out = []
    for (ends, plan), ex, text in zip(plans, examples, completions):
        outcome = float(bool(task.is_correct(task.extract_answer(text), ex)))
        hard, soft = [], []
        for slot in plan:
            if slot is None:
                hard.append(outcome)
                soft.append(outcome)
                continue
            reached = [bool(task.is_correct(task.extract_answer(prefixes[slot] + c), ex))
                       for c in continuations[slot]]
            hard.append(float(any(reached)))
            soft.append(sum(reached) / n)
        out.append(ProgressLabels(tuple(ends), tuple(hard), tuple(soft), tuple(s is not None for s in plan)))
    return out


def labelling_cost(labels: Sequence[ProgressLabels], n: int) -> dict:
    """What the labels cost: step prefixes continued, continuations sampled."""
    prefixes = sum(sum(x.sampled) for x in labels)
    return {"completions": len(labels), "steps": sum(len(x.ends) for x in labels),
            "prefixes_continued": prefixes, "continuations": prefixes * n}


def policy_completer(sampler, params, tokenizer, *, key, max_new_tokens: int, temperature: float = 1.0,
                     chunk: int = 64) -> Complete:
    """A `Complete` that samples the policy ``params`` (in ``sampler``'s weights form,
    ``Sampler.copy``) with the run's ``sampler`` (its engine, cache and mesh), untruncated
    at ``temperature``: each prompt + prefix is encoded as one prompt and continued ``n``
    times (at most ``max_new_tokens``, and what the model's max_seq_len leaves), ``chunk``
    prefixes a call."""
    import jax

    from grpo_jax.parallel.sharding import to_host
    from grpo_jax.text.tokenizer import encode_prompt

    max_seq_len = sampler.cfg.max_seq_len
    drawing = sampler.evaluation(temperature)
    calls = [0]

    def complete(prompts: Sequence[str], prefixes: Sequence[str], n: int) -> list[list[str]]:
        ids = [encode_prompt(tokenizer, p + x) for p, x in zip(prompts, prefixes)]
        # Prefixes of similar length share a call, so each call's token budget (what the
        # longest of them leaves of max_seq_len) cuts none of them short.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out: list[list[str] | None] = [None] * len(ids)
        for lo in range(0, len(order), chunk):
            rows = order[lo:lo + chunk]
            budget = min(max_new_tokens, max_seq_len - max(len(ids[i]) for i in rows))
            if budget < 1:
                raise ValueError(f"a prompt + step prefix of {max(len(ids[i]) for i in rows)} tokens leaves no "
                                 f"room to continue within model.max_seq_len={max_seq_len}")
            calls[0] += 1
            ro = drawing.with_settings(max_new_tokens=budget).sample(
                params, [ids[i] for i in rows], key=jax.random.fold_in(key, calls[0]), group_size=n)
            ro = jax.tree.map(to_host, ro)
            texts = [tokenizer.decode(ro.completion_ids(r, tokenizer.stop_ids)) for r in range(len(rows) * n)]
            for k, i in enumerate(rows):
                out[i] = texts[k * n:(k + 1) * n]
        return out

    return complete


__all__ = ["Complete", "ProgressLabels", "labelling_cost", "monte_carlo_step_labels", "policy_completer"]
