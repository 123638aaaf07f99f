"""What a reward model that checks each line by itself can reach on labelled testbed samples.

An outcome label says whether the final answer is right, not whether the chain is. On a
policy's samples, two wrong lines can cancel (a slipped subtraction, then a wrong lookup), so
some right answers come from wrong chains. A checker that reads every line by itself (is the
line the question's next operator and operand, its value its own ``a op b``, its ``a`` the
previous line's value, the answer line the last value) cannot tell those apart from wrong
answers. This script measures, on rule-labelled samples of the modular testbed (JSON lines,
`reward_models.write_samples`, e.g. Figure 5's reward-model data):

- the share of right answers reached through a chain with a wrong line;
- the pairwise accuracy (same-prompt right vs wrong pairs, ties ½) of three rule scores:
  ``clean`` (1 if no line is wrong), ``-errors`` (minus the number of wrong lines) and
  ``P(right | errors)`` (the rate of right answers among --fit samples with as many wrong
  lines): what a reward model gets by finding wrong lines, and by also counting them. These are
  values with ties counted ½, not ceilings: ``clean`` ties every right answer reached through
  a wrong line with every wrong answer, and a model with continuous scores may order those
  pairs any way, from all lost to all won;
- the step accuracy against the progress labels of a checker that says "right" until the
  first wrong line and "wrong" from there on (with the majority baseline). The progress labels
  (`ArithmeticTask.step_rewards`) skip blank lines and do not check the operand a line copies
  from the previous one, and ``line_errors`` counts both as wrong: a chain with such a line
  alone has a wrong line here and no step labelled 0;
- with --reward-model, that model's pairwise accuracy split by kind of pair: the right sample
  clean or through a wrong line, against a wrong sample with one wrong line or more. It shows
  whether a model loses pairs by missing wrong lines (clean right answers) or on right answers
  that a line checker cannot tell from wrong ones;
- with --likelihood-parts (a likelihood-aware ORM, `train_reward_model(likelihood=True)`), the
  pairwise accuracy of each part of its score: the value head alone, the learned scale times the
  trunk's log-likelihood of the completion alone, and other reductions of the same per-token
  log-likelihoods (the least likely token; the sum with each token's term clipped at -3). It
  shows what the score ranks by, and whether counting wrong lines differently would help;
- with --answer-check, what checking the answer could add: the reward model's trunk, read as a
  language model, answers each question greedily; the samples are then ranked by whether their
  answer agrees with the trunk's, alone and with the model's own score breaking ties.

    python experiments/reward_model_ceilings.py runs/figure5_testbed/reward_models/held_out.jsonl \\
        --fit runs/figure5_testbed/reward_models/train.jsonl \\
        --reward-model runs/rm_testbed/outcome_seed0/reward_model --likelihood-parts --answer-check
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import re

import jax
import numpy as np

from grpo_jax.eval.evaluation import sample_and_score
from grpo_jax.model import transformer as model_lib
from grpo_jax.rl.reward_models import RewardModel, pairwise_from_scores, read_samples
from grpo_jax.rl.reward_models.scorer import LIKELIHOOD_SCALE, completion_logprobs, encode, pad_batch
from grpo_jax.sampler.host import Sampler
from grpo_jax.sampler.settings import SamplingParams
from grpo_jax.tasks.modular import ModularTask, step
from grpo_jax.text.tokenizer import encode_prompt

_PROMPT_RE = re.compile(r"Q: (\d+(?:[+-]\d+)*) mod (\d+)=\?\n")
_LINE_RE = re.compile(r"(\d+)([+-])(\d+)=(\d+)")
_ANSWER_RE = re.compile(r"A: (\d+)")


def question(prompt: str) -> tuple[list[int], list[str], int]:
    """(operands, operators, modulus) of a testbed prompt; ValueError for any other prompt."""
    match = _PROMPT_RE.fullmatch(prompt)
    if match is None:
        raise ValueError(f"not a modular testbed prompt: {prompt!r}")
    expr, modulus = match.group(1), int(match.group(2))
    return [int(x) for x in re.findall(r"\d+", expr)], re.findall(r"[+-]", expr), modulus


def line_errors(prompt: str, completion: str) -> list[bool]:
    """Per step line of the question (then the answer line): whether the completion's line,
    read by itself, is wrong. A missing or unreadable line is wrong."""
    operands, ops, p = question(prompt)
    lines = completion.split("\n")
    errors, previous = [], operands[0]
    for k, (op, b) in enumerate(zip(ops, operands[1:])):
        match = _LINE_RE.fullmatch(lines[k]) if k < len(lines) else None
        if match is None:
            errors.append(True)
            previous = None
            continue
        a, line_op, line_b, c = int(match.group(1)), match.group(2), int(match.group(3)), int(match.group(4))
        errors.append(line_op != op or line_b != b or a != previous or c != step(a, line_op, line_b, p))
        previous = c
    answer = _ANSWER_RE.fullmatch(lines[len(ops)]) if len(lines) > len(ops) else None
    errors.append(answer is None or int(answer.group(1)) != previous)
    return errors


def pairwise(samples, score) -> float:
    """Same-prompt (right, wrong) pairs ranked right by ``score(sample)``; ties count ½."""
    return pairwise_from_scores(samples, [score(s) for s in samples])


def report(samples, fit) -> dict:
    errors = {id(s): sum(line_errors(s.prompt, s.completion)) for s in [*samples, *fit]}
    right = [s for s in samples if s.correct]
    counts, rights = collections.Counter(), collections.Counter()
    for s in fit:
        counts[errors[id(s)]] += 1
        rights[errors[id(s)]] += s.correct
    rate = {k: rights[k] / counts[k] for k in counts}
    steps = agree = ones = 0
    for s in samples:
        flags = line_errors(s.prompt, s.completion)
        first = flags.index(True) if True in flags else len(flags)
        for j, (_, label) in enumerate(s.step_labels):
            steps += 1
            ones += label > 0.5
            agree += (j < first) == (label > 0.5)
    return {
        "samples": len(samples), "right": len(right),
        "right_through_a_wrong_line": sum(errors[id(s)] > 0 for s in right) / len(right),
        "pairwise_clean": pairwise(samples, lambda s: float(errors[id(s)] == 0)),
        "pairwise_minus_errors": pairwise(samples, lambda s: -errors[id(s)]),
        "pairwise_p_right_given_errors": pairwise(samples, lambda s: rate.get(errors[id(s)], 0.0)),
        "p_right_given_errors": {k: [counts[k], round(rate[k], 3)] for k in sorted(counts)},
        "step_accuracy_until_first_wrong_line": agree / steps,
        "step_majority": max(ones, steps - ones) / steps,
    }


def pairwise_by_kind(samples, scores, errors) -> dict[str, list]:
    """``{"<right kind> vs <wrong kind>": [pairs, accuracy]}`` over same-prompt (right, wrong)
    pairs (ties ½): the right sample ``clean`` or ``through a wrong line``, the wrong one with
    ``1 wrong line`` or ``2+ wrong lines``. ``scores[i]`` and ``errors[i]`` (its wrong lines)
    are ``samples[i]``'s."""
    groups = collections.defaultdict(list)
    for s, score, n in zip(samples, scores, errors):
        groups[s.prompt].append((s.correct, float(score), n))
    won = collections.defaultdict(float)
    pairs = collections.Counter()
    for group in groups.values():
        for right, r_score, r_errors in group:
            if not right:
                continue
            for wrong, w_score, w_errors in group:
                if wrong:
                    continue
                key = (f"{'clean' if r_errors == 0 else 'through a wrong line'} vs "
                       f"{'1 wrong line' if w_errors <= 1 else '2+ wrong lines'}")
                pairs[key] += 1
                won[key] += 1.0 if r_score > w_score else 0.5 if r_score == w_score else 0.0
    return {k: [pairs[k], won[k] / pairs[k]] for k in sorted(pairs)}


def model_report(samples, scores, errors) -> dict:
    """A reward model's pairwise accuracy on ``samples`` from its ``scores`` [N] (`RewardModel.score`:
    a PRM's, the minimum over its steps), whole and `pairwise_by_kind`; ``errors[i]`` is
    ``samples[i]``'s number of wrong lines."""
    return {"pairwise": pairwise_from_scores(samples, list(scores)),
            "pairwise_by_kind": {k: [n, round(a, 3)]
                                 for k, (n, a) in pairwise_by_kind(samples, scores, errors).items()}}


@functools.partial(jax.jit, static_argnums=0)
def _head_and_logprobs(cfg, params, tokens, mask, start):
    hidden, _ = model_lib.forward_hidden(cfg, params, tokens, mask)
    return model_lib.value_outputs(params, hidden), completion_logprobs(cfg, params, hidden, tokens, mask, start)


def likelihood_parts(rm: RewardModel, samples, rows: int = 64) -> tuple[np.ndarray, list[np.ndarray], float]:
    """(head [N], per-sample completion-token log-likelihoods [n_i], scale) of a likelihood-aware
    ORM: its score is ``head + scale * logps.sum()`` (`scorer.values_from_hidden`, at eos)."""
    if rm.kind != "outcome" or LIKELIHOOD_SCALE not in rm.params:
        raise ValueError("--likelihood-parts needs a likelihood-aware outcome reward model "
                         "(train_reward_model.py --kind outcome without --no-likelihood)")
    enc = [encode(rm.tokenizer, s.prompt, s.completion, (), rm.cfg.max_seq_len) for s in samples]
    head, logps = np.zeros(len(enc), np.float32), []
    for lo in range(0, len(enc), rows):
        chunk = enc[lo:lo + rows]
        batch = pad_batch(chunk, rows, rm.cfg.max_seq_len, 1, rm.tokenizer.pad_id)
        h, lp = (np.asarray(x) for x in _head_and_logprobs(rm.cfg, rm.params, batch["tokens"], batch["mask"],
                                                             batch["start"]))
        for i, e in enumerate(chunk):
            n = len(e.tokens)
            head[lo + i] = h[i, n - 1]
            logps.append(lp[i, e.start:n].astype(np.float32))
    return head, logps, float(rm.params[LIKELIHOOD_SCALE])


def parts_report(samples, rm: RewardModel, errors) -> dict:
    """`pairwise_by_kind` of each part of a likelihood-aware ORM's score (`likelihood_parts`)."""
    head, logps, scale = likelihood_parts(rm, samples)
    total = np.array([lp.sum() for lp in logps])
    scores = {
        "score (head + scale x log-likelihood)": head + scale * total,
        "value head alone": head,
        "scale x log-likelihood alone": scale * total,
        "least likely token": np.array([lp.min(initial=0.0) for lp in logps]),
        "log-likelihood, each token clipped at -3": np.array([np.maximum(lp, -3.0).sum() for lp in logps]),
    }
    return {"likelihood_scale": scale, "parts": {
        name: {"pairwise": round(pairwise_from_scores(samples, list(sc)), 3),
               **{k: round(a, 3) for k, (_, a) in pairwise_by_kind(samples, sc, errors).items()}}
        for name, sc in scores.items()}}


def answer_check_report(samples, rm: RewardModel, scores) -> dict:
    """The reward model's trunk as a solver: its greedy answer to each question, and the
    samples' pairwise accuracy when ranked by agreement with it (alone; then with ``scores``
    [N], the model's own, breaking ties). The trunk decodes up to ``max_seq_len``."""
    prompts = sorted({s.prompt for s in samples})
    parsed = [question(p) for p in prompts]
    if len({modulus for *_, modulus in parsed}) > 1:
        raise ValueError("--answer-check needs samples of one modulus")
    operands, ops, modulus = parsed[0]
    task = ModularTask(modulus, len(operands), ops.count("-"))
    examples = [task.make_example(operands, ops) for operands, ops, _ in parsed]
    longest = max(len(encode_prompt(rm.tokenizer, p)) for p in prompts)
    sampler = Sampler(rm.cfg, None, SamplingParams(rm.cfg.max_seq_len - longest, stop_tokens=rm.tokenizer.stop_ids,
                                                   pad_id=rm.tokenizer.pad_id))
    records = sample_and_score(sampler, sampler.copy(rm.params), task, rm.tokenizer, examples, prompts,
                               key=jax.random.key(0))
    greedy = {p: r["greedy_answer"] for p, r in zip(prompts, records)}
    agree = np.array([float(greedy[s.prompt] is not None and task.extract_answer(s.completion) == greedy[s.prompt])
                      for s in samples])
    # Dense ranks of the model's scores, squeezed below 1: they order samples only within agreement.
    ranks = np.unique(np.asarray(scores, np.float64), return_inverse=True)[1].reshape(-1)
    return {"trunk_greedy_accuracy": float(np.mean([r["greedy_correct"] for r in records])),
            "questions": len(prompts),
            "pairwise_agreement": pairwise_from_scores(samples, list(agree)),
            "pairwise_agreement_then_score": pairwise_from_scores(samples, list(agree + ranks / (ranks.max() + 1)))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("samples", help="labelled samples to measure (JSON lines)")
    p.add_argument("--fit", default=None,
                   help="labelled samples to fit P(right | wrong lines) on (default: the measured ones)")
    p.add_argument("--reward-model", default=None, metavar="PATH",
                   help="a saved reward model (RewardModel.load) to score the samples with")
    p.add_argument("--likelihood-parts", action="store_true",
                   help="with --reward-model (a likelihood-aware ORM): the pairwise accuracy of each part of its score")
    p.add_argument("--answer-check", action="store_true",
                   help="with --reward-model: its trunk answers each question greedily; rank by agreement with it")
    args = p.parse_args(argv)
    for flag in ("likelihood_parts", "answer_check"):
        if getattr(args, flag) and not args.reward_model:
            p.error(f"--{flag.replace('_', '-')} needs --reward-model")
    samples = read_samples(args.samples)
    out = report(samples, read_samples(args.fit) if args.fit else samples)
    if args.reward_model:
        rm = RewardModel.load(args.reward_model)
        errors = [sum(line_errors(s.prompt, s.completion)) for s in samples]
        scores = rm.score([s.prompt for s in samples], [s.completion for s in samples])
        out.update(reward_model=args.reward_model, **model_report(samples, scores, errors))
        if args.likelihood_parts:
            out.update(parts_report(samples, rm, errors))
        if args.answer_check:
            out.update(answer_check_report(samples, rm, scores))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}, indent=1))
    return out


if __name__ == "__main__":
    main()
