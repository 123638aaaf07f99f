"""The RL loop: sample → reward → advantages → μ updates, for every algorithm of the unified paradigm.

State lives here and only here (params, optimizer, reference model, RNG, step counter);
everything it calls is a pure function. The loop body reads top to bottom as the paper's
Algorithm 1:

    questions  = task.examples(train, batch, seed=f(step))          # host
    rollout    = sampling.sample(policy or π_sft, questions, G)      # device (jitted)
    scores     = task rewards / reward model on decoded text         # host: untrusted text
    batch      = Batch(rollout, scores)                              # host → device
    state, m   = train_step(state, batch)                            # device: ref/old log-probs,
                                                                     #   advantages, μ updates
The data order and the RNG depend only on (seed, step), so a run resumed from a checkpoint
at step s produces exactly the steps an uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax import checkpointing, sampling
from grpo_jax.algorithms import get_algorithm
from grpo_jax.config import Config
from grpo_jax.metrics import MetricsWriter, is_main_process
from grpo_jax.model import add_value_head, param_shardings
from grpo_jax.optimizer import make_optimizer
from grpo_jax.sharding import make_mesh, replicated, shard_batch, to_global, to_host
from grpo_jax.tasks import Example, Task
from grpo_jax.tokenizer import Tokenizer, char_to_token_index, encode_prompt
from grpo_jax.train_step import Batch, batch_from_rollout, init_train_state, make_train_step

log = logging.getLogger(__name__)

MAX_STEPS_PER_OUTPUT = 16  # process supervision: steps beyond this merge into the last one


# ============================================================================ host side: scoring

@dataclasses.dataclass
class Scores:
    """Host-side judgement of B completions (row p*G+g)."""

    texts: list[str]
    rewards: np.ndarray  # [B] float32
    correct: np.ndarray  # [B] bool
    step_rewards: np.ndarray  # [B,S] float32
    step_end: np.ndarray  # [B,S] int32, completion token index where the step ends
    step_mask: np.ndarray  # [B,S] bool


def completion_ids(rollout, row: int, stop_ids: Sequence[int]) -> list[int]:
    """The real completion tokens of one row, without its trailing stop token."""
    ids = np.asarray(rollout.tokens[row])[np.asarray(rollout.mask[row])].tolist()
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return ids


def score_rollout(task: Task, tokenizer: Tokenizer, examples: Sequence[Example], rollout,
                  group_size: int, *, reward_model=None, process: bool = False) -> Scores:
    """Decode each completion and score it with the task's rules (or a reward model).

    Model text is untrusted: it only ever reaches the task's reward functions, which parse
    it with bounded whitelisted evaluators and never eval it.
    """
    tokens = np.asarray(rollout.tokens)
    b = tokens.shape[0]
    stop_ids = list(tokenizer.stop_ids)
    ids_per_row = [completion_ids(rollout, r, stop_ids) for r in range(b)]
    texts = [tokenizer.decode(ids) for ids in ids_per_row]
    row_examples = [examples[r // group_size] for r in range(b)]
    correct = np.array([task.is_correct(task.extract_answer(t), ex) for t, ex in zip(texts, row_examples)], bool)
    if reward_model is not None and reward_model.kind == "outcome":
        rewards = np.asarray(reward_model.score([ex.prompt for ex in row_examples], texts), np.float32)
    else:
        rewards = np.array([task.reward(t, ex) for t, ex in zip(texts, row_examples)], np.float32)
    s = MAX_STEPS_PER_OUTPUT if process else 1
    step_rewards = np.zeros((b, s), np.float32)
    step_end = np.zeros((b, s), np.int32)
    step_mask = np.zeros((b, s), bool)
    if process:
        if reward_model is not None and reward_model.kind == "process":
            steps_per_row = reward_model.step_scores([ex.prompt for ex in row_examples], texts)
        else:
            steps_per_row = [task.step_rewards(t, ex) for t, ex in zip(texts, row_examples)]
        for r, (ids, steps) in enumerate(zip(ids_per_row, steps_per_row)):
            if not ids:
                continue
            ends = tokenizer.token_end_offsets(ids)
            steps = list(steps)
            if len(steps) > s:  # merge the tail: the last kept step ends where the last one did
                steps = steps[: s - 1] + [(steps[-1][0], float(np.mean([v for _, v in steps[s - 1:]])))]
            for j, (char_end, value) in enumerate(steps):
                step_rewards[r, j] = value
                step_end[r, j] = char_to_token_index(ends, char_end)
                step_mask[r, j] = True
    return Scores(texts, rewards, correct, step_rewards, step_end, step_mask)


def texts_to_batch(tokenizer: Tokenizer, prompts: Sequence[str], completions: Sequence[str], *,
                   max_new_tokens: int, prompt_bucket: int | None = None) -> Batch:
    """Teacher-forced batch (SFT data): left-padded prompts, right-padded completions + eos."""
    p_ids = [encode_prompt(tokenizer, p) for p in prompts]
    c_ids = [(tokenizer.encode(c) + [tokenizer.eos_id])[:max_new_tokens] for c in completions]
    tp = prompt_bucket or sampling.bucket_length(max(len(x) for x in p_ids))
    if max(len(x) for x in p_ids) > tp:
        raise ValueError(f"a prompt has {max(len(x) for x in p_ids)} tokens, more than the bucket {tp}")
    b = len(prompts)
    pt = np.full((b, tp), tokenizer.pad_id, np.int32)
    pm = np.zeros((b, tp), bool)
    ct = np.full((b, max_new_tokens), tokenizer.pad_id, np.int32)
    cm = np.zeros((b, max_new_tokens), bool)
    for i, (p, c) in enumerate(zip(p_ids, c_ids)):
        pt[i, tp - len(p):] = p
        pm[i, tp - len(p):] = True
        ct[i, : len(c)] = c
        cm[i, : len(c)] = True
    ones = np.ones((b,), np.float32)
    return Batch(prompt_tokens=pt, prompt_mask=pm, tokens=ct, mask=cm,
                 sample_logprobs=np.zeros((b, max_new_tokens), np.float32), rewards=ones,
                 correct=np.ones((b,), bool), truncated=np.zeros((b,), bool),
                 step_rewards=np.zeros((b, 1), np.float32), step_end=np.zeros((b, 1), np.int32),
                 step_mask=np.zeros((b, 1), bool))


def preference_pairs(rollout, scores: Scores, group_size: int, num_pairs: int) -> tuple[Any, np.ndarray]:
    """DPO data from G samples per question: rows (chosen, rejected) = (first correct, first
    incorrect) per question that has both, padded to `num_pairs` pairs with fully masked rows
    (zero gradient) so the compiled shape never changes. Returns (row arrays, pair mask)."""
    rows, valid = [], []
    for p in range(len(scores.correct) // group_size):
        group = range(p * group_size, (p + 1) * group_size)
        good = [r for r in group if scores.correct[r]]
        bad = [r for r in group if not scores.correct[r]]
        if good and bad and len(rows) < 2 * num_pairs:
            rows += [good[0], bad[0]]
            valid += [True, True]
    while len(rows) < 2 * num_pairs:
        rows += [0, 0]
        valid += [False, False]
    return np.array(rows), np.array(valid)


# ============================================================================ evaluation

def evaluate(cfg: Config, params, task: Task, tokenizer: Tokenizer, examples: Sequence[Example], *,
             key, mesh=None, num_samples: int = 0, temperature: float = 1.0,
             ks: Sequence[int] = ()) -> dict[str, float]:
    """Greedy accuracy; with `num_samples` > 0 also Pass@K and Maj@K (K in `ks`) from that many
    samples per question at `temperature` (the paper's Figure 7 setting)."""
    from grpo_jax.evaluation import maj_at_k, pass_at_k

    prompts = [encode_prompt(tokenizer, ex.prompt) for ex in examples]
    greedy = sampling.sample(cfg.model, params, prompts, key=key, group_size=1,
                             max_new_tokens=cfg.rl.max_new_tokens, temperature=0.0,
                             stop_tokens=tokenizer.stop_ids, pad_id=tokenizer.pad_id, mesh=mesh)
    greedy = jax.tree.map(to_host, greedy)
    texts = [tokenizer.decode(completion_ids(greedy, r, tokenizer.stop_ids)) for r in range(len(examples))]
    acc = np.mean([task.is_correct(task.extract_answer(t), ex) for t, ex in zip(texts, examples)])
    out = {"accuracy": float(acc)}
    if num_samples > 0:
        ro = sampling.sample(cfg.model, params, prompts, key=jax.random.fold_in(key, 1),
                             group_size=num_samples, max_new_tokens=cfg.rl.max_new_tokens,
                             temperature=temperature, stop_tokens=tokenizer.stop_ids,
                             pad_id=tokenizer.pad_id, mesh=mesh)
        ro = jax.tree.map(to_host, ro)
        answers, correct = [], []
        for i, ex in enumerate(examples):
            rows = range(i * num_samples, (i + 1) * num_samples)
            ans = [task.extract_answer(tokenizer.decode(completion_ids(ro, r, tokenizer.stop_ids))) for r in rows]
            answers.append(ans)
            correct.append([task.is_correct(a, ex) for a in ans])
        for k in ks:
            out[f"pass@{k}"] = float(np.mean([pass_at_k(num_samples, sum(c), k) for c in correct]))
            out[f"maj@{k}"] = float(np.mean([maj_at_k(a, lambda ans, ex=ex: task.is_correct(ans, ex), k)
                                             for a, ex in zip(answers, examples)]))
    return out


# ============================================================================ the loop

class Trainer:
    """Holds the run's state and runs `cfg.run.steps` steps of `cfg.rl.algorithm`.

    params: the starting policy (an SFT model for RL). The reference model (when β > 0 or
    DPO) and the sampling policy of offline methods (RFT, DPO: π_sft) are frozen copies of
    it. `sft_data(step) -> (prompts, completions)` feeds the 'dataset' source (SFT).
    """

    def __init__(self, cfg: Config, *, task: Task, tokenizer: Tokenizer, params, mesh=None,
                 reward_model=None, sft_data=None, eval_examples: Sequence[Example] | None = None,
                 progress: bool = True, resume: bool = True):
        self.cfg, self.task, self.tokenizer = cfg, task, tokenizer
        self.algorithm = get_algorithm(cfg.rl.algorithm)
        self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh)
        if reward_model is None and cfg.rl.reward_model:
            from grpo_jax.reward_models import RewardModel

            reward_model = RewardModel.load(cfg.rl.reward_model, tokenizer)
        self.reward_model, self.sft_data, self.progress = reward_model, sft_data, progress
        if self.algorithm.data_source == "dataset" and sft_data is None:
            raise ValueError(f"algorithm {self.algorithm.name!r} trains on a dataset: pass sft_data")
        params = jax.device_put(params, param_shardings(cfg.model, self.mesh))
        base_tx, self.lr_schedule = make_optimizer(cfg.optimizer, cfg.run.steps)
        # A non-finite gradient skips the update instead of corrupting the params.
        tx = optax.apply_if_finite(base_tx, max_consecutive_errors=10**9)
        value_params = value_tx = None
        if self.algorithm.needs_value_model:
            value_params = add_value_head(cfg.model, params, jax.random.key(cfg.run.seed + 1), self.mesh)
            value_tx = optax.apply_if_finite(make_optimizer(cfg.optimizer, cfg.run.steps)[0], 10**9)
        self.sft_params = params if self.algorithm.data_source.startswith("sft_policy") else None
        self.step_fn = make_train_step(cfg, tx, self.mesh, value_tx=value_tx, group_size=self._group_size())
        # On the mesh from the start, so a restored checkpoint lands in the same shards.
        self.state = jax.device_put(init_train_state(cfg, params, tx, value_params=value_params, value_tx=value_tx),
                                    self.step_fn.state_shardings)
        if self.sft_params is not None:
            self.sft_params = jax.device_put(self.sft_params, self.step_fn.state_shardings.params)
        self.rng = jax.random.key(cfg.run.seed)
        self.eval_examples = list(eval_examples) if eval_examples is not None else \
            task.examples("test", cfg.data.eval_size, cfg.data.seed)
        self.history: list[dict] = []
        self.bad_steps = 0
        self.start_step = 0  # the step this Trainer resumed from (0 for a fresh run)
        self.next_step = 0  # the first step the next `train` call takes
        self.writer = MetricsWriter(cfg.run.run_dir)
        self.ckpt = checkpointing.Checkpointer(os.path.join(cfg.run.run_dir, "checkpoints"),
                                               keep=cfg.run.keep_checkpoints,
                                               every=max(cfg.run.checkpoint_every, 1))
        if resume:
            self._restore()

    # ------------------------------------------------------------------ helpers
    def _group_size(self) -> int:
        return 2 if self.algorithm.data_source == "sft_policy_pairs" else (
            1 if self.algorithm.data_source == "dataset" else self.cfg.rl.group_size)

    def _checkpoint_tree(self):
        # The key replicated on the mesh: processes cannot jointly save a host-local array.
        rng = to_global(jax.random.key_data(self.rng), replicated(self.mesh))
        return {"state": self.state, "rng": rng}

    def _restore(self) -> None:
        restored = self.ckpt.restore(checkpointing.abstract_like(self._checkpoint_tree()))
        if restored is None:
            return
        step, tree, meta = restored
        self.state, self.rng = tree["state"], jax.random.wrap_key_data(tree["rng"])
        self.start_step = self.next_step = step
        self.bad_steps = int(meta.get("bad_steps", 0))
        self.writer.truncate_after(step)
        log.info("resumed from step %d in %s", step, self.cfg.run.run_dir)

    def save(self, step: int) -> None:
        self.ckpt.save(step, self._checkpoint_tree(), {"step": step, "bad_steps": self.bad_steps,
                                                       "config": self.cfg.to_dict()})

    @property
    def params(self):
        return self.state.params

    def questions(self, step: int) -> list[Example]:
        """The step's questions: a function of (data seed, step) only, so resume is exact."""
        return self.task.examples("train", self.cfg.data.batch_size, self.cfg.data.seed * 1_000_003 + step)

    # ------------------------------------------------------------------ one step
    def make_batch(self, step: int, key) -> tuple[Batch, dict]:
        cfg, rl, tok = self.cfg, self.cfg.rl, self.tokenizer
        source = self.algorithm.data_source
        if source == "dataset":
            prompts, completions = self.sft_data(step)
            return texts_to_batch(tok, prompts, completions, max_new_tokens=rl.max_new_tokens), {}
        examples = self.questions(step)
        policy = self.state.params if source == "policy" else self.sft_params
        g = rl.group_size
        rollout = sampling.sample(cfg.model, policy, [encode_prompt(tok, ex.prompt) for ex in examples],
                                  key=key, group_size=g, max_new_tokens=rl.max_new_tokens,
                                  temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p,
                                  stop_tokens=tok.stop_ids, pad_id=tok.pad_id, mesh=self.mesh)
        rollout = jax.tree.map(to_host, rollout)  # device → host (gathered from every process)
        scores = score_rollout(self.task, tok, examples, rollout, g, reward_model=self.reward_model,
                               process=rl.supervision == "process")
        info = {"reward_mean": float(scores.rewards.mean()), "accuracy_train": float(scores.correct.mean()),
                "completion_length": float(np.asarray(rollout.lengths).mean())}
        if source == "sft_policy_pairs":
            rows, valid = preference_pairs(rollout, scores, g, cfg.data.batch_size)
            pick = lambda x: np.asarray(x)[rows]
            sub = jax.tree.map(pick, rollout)
            sub = sub.replace(mask=np.asarray(sub.mask) & valid[:, None])
            batch = batch_from_rollout(sub, pick(scores.rewards), pick(scores.correct))
            info["pairs_fraction"] = float(valid.mean())
            return batch, info
        batch = batch_from_rollout(rollout, scores.rewards, scores.correct, scores.step_rewards,
                                   scores.step_end, scores.step_mask)
        return batch, info

    def train_step(self, step: int) -> dict:
        key = jax.random.fold_in(self.rng, step)
        t0 = time.perf_counter()
        batch, info = self.make_batch(step, key)
        t1 = time.perf_counter()
        self.state, metrics = self.step_fn(self.state, shard_batch(batch, self.mesh))
        metrics = {k: float(v) for k, v in metrics.items()}
        t2 = time.perf_counter()
        metrics.update(info, sample_time_s=t1 - t0, update_time_s=t2 - t1,
                       lr=float(self.lr_schedule(step)))
        return metrics

    # ------------------------------------------------------------------ the loop
    def train(self, steps: int | None = None) -> list[dict]:
        """Train up to step `steps` (default `run.steps`), continuing from where this Trainer
        stopped: calling train(20) then train(40) is the same run as train(40), which is how
        iterative GRPO swaps the reward model and reference between iterations."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        total = steps if steps is not None else cfg.run.steps
        bar = tqdm(total=total, initial=self.next_step, desc=self.algorithm.name,
                   disable=not (self.progress and is_main_process()), dynamic_ncols=True)
        try:
            for step in range(self.next_step, total):
                metrics = self.train_step(step)
                done = step + 1
                if not all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm") if k in metrics):
                    self.bad_steps += 1
                    log.warning("step %d: non-finite loss/grad (%s); update skipped (%d in a row)",
                                done, {k: metrics.get(k) for k in ("loss", "grad_norm")}, self.bad_steps)
                else:
                    self.bad_steps = 0
                if self.eval_examples and cfg.run.eval_every and (done % cfg.run.eval_every == 0 or done == total):
                    ev = evaluate(cfg, self.state.params, self.task, self.tokenizer, self.eval_examples,
                                  key=jax.random.fold_in(self.rng, 10**9 + done), mesh=self.mesh)
                    metrics.update({f"eval_{k}": v for k, v in ev.items()})
                metrics["step"] = done
                self.history.append(metrics)
                if done % cfg.run.log_every == 0 or done == total or self.bad_steps:
                    self.writer.write(done, metrics)
                if self.bad_steps >= cfg.run.max_bad_steps:
                    raise FloatingPointError(
                        f"{self.bad_steps} consecutive non-finite updates (run.max_bad_steps="
                        f"{cfg.run.max_bad_steps}); stopping at step {done}")
                bar.update(1)
                bar.set_postfix({k: f"{metrics[k]:.3f}" for k in ("reward_mean", "eval_accuracy", "kl", "loss")
                                 if k in metrics})
                if cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0 or done == total:
                    self.save(done)
                self.next_step = done
        finally:
            bar.close()
        return self.history

    def close(self) -> None:
        self.ckpt.close()
        self.writer.close()
