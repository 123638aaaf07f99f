"""The RL loop: sample → reward → advantages → μ updates, for every algorithm of the unified paradigm.

State lives here and only here (params, optimizer, reference model, RNG, step counter);
everything it calls is a pure function. The loop body reads top to bottom as the paper's
Algorithm 1:

    questions  = task.examples(train, batch, seed=f(step))          # host
    rollout    = sampler.sample(policy or π_sft, questions, G)       # device (jitted)
    scores     = task rewards / reward model on decoded text         # host: untrusted text
    batch      = Batch(rollout, scores)                              # host → device
    state, m   = train_step(state, batch)                            # device: ref/old log-probs,
                                                                     #   advantages, μ updates
With rl.async_steps = k > 0 the rollout of step t draws batch t + k with the weights of step
t (batches 0..k with those of step 0) and the update trains batch t, drawn k steps earlier;
the batches in flight between two steps are saved with each checkpoint. With mesh.sample_devices
as well (``split_mesh``) the rollout runs on its own devices, in a thread, while the update of
batch t runs on the others; it is handed the weights of step t before that update starts.

The data order and the RNG depend only on (seed, step), so a run resumed from a checkpoint
at step s produces exactly the steps an uninterrupted run would have.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import time
from typing import Sequence

import jax
import numpy as np

from grpo_jax.checkpoints import checkpointing, run_files
from grpo_jax.model import lora, pretrained
from grpo_jax.parallel import preemption, split_mesh
from grpo_jax.rl import programs, reward_signal
from grpo_jax.rl.algorithms import Algorithm, algorithm_of
from grpo_jax.rl.batching import Batch, Scores, score_rollout
from grpo_jax.config import Config, ConfigError
from grpo_jax.errors import CheckpointError, UnreadableCheckpointError
from grpo_jax.parallel.distributed import is_main_process
from grpo_jax.eval.evaluation import evaluate
from grpo_jax.rl.reward_models.checks import hacking_warning
from grpo_jax.tasks.shortcuts import try_shortcut_baselines
from grpo_jax.rl.metrics import MetricsWriter
from grpo_jax.rl.tool_metrics import broken_backend, failing_streak, tool_metrics
from grpo_jax.model.transformer import add_value_head, param_shardings
from grpo_jax.rl.optimizer import updates_applied
from grpo_jax.parallel.sharding import replicated, shard_batch, to_global
from grpo_jax.sampler import Rollout, Sampler
from grpo_jax.sampler.turns import ToolUse, generate_with_tools
from grpo_jax.tasks import Example, Task
from grpo_jax.text.tokenizer import Tokenizer, encode_prompt
from grpo_jax.rl.train_step import init_train_state, reset_reference

log = logging.getLogger(__name__)


def _reward_model(cfg: Config, algorithm: Algorithm, reward_model, tokenizer: Tokenizer, task: Task):
    """The run's reward model: ``reward_model``, else the one rl.reward_model names (one that
    checks answers reads them with ``task``'s extraction), else None. ConfigError when the
    algorithm's reward is the rule, which would ignore it."""
    if reward_model is None and cfg.rl.reward_model:
        from grpo_jax.rl.reward_models import RewardModel

        reward_model = RewardModel.load(cfg.rl.reward_model, tokenizer, extract_answer=task.extract_answer)
    if reward_model is not None and algorithm.reward != "model":
        raise ConfigError(
            f"rl.reward_model is set but rl.algorithm={algorithm.name!r} uses "
            f"{algorithm.reward!r} rewards (its gradient coefficient reads the rule's "
            "correctness), so the reward model would be ignored; use ppo or grpo, or unset it")
    return reward_model


def _tool_use(cfg: Config, task: Task, tokenizer: Tokenizer) -> ToolUse | None:
    """The run's tool use (rl.max_tool_calls > 0), built once: the task's tool, its fence
    tokens in this tokenizer. ConfigError when the task has no tool to call."""
    if not cfg.rl.max_tool_calls:
        return None
    if task.tool is None:
        raise ConfigError(f"rl.max_tool_calls={cfg.rl.max_tool_calls} but task {task.name!r} has no tool: "
                          "give it one (CustomTask(..., tool=PythonTool())) or set rl.max_tool_calls=0")
    return ToolUse.build(task.tool, tokenizer, cfg.rl.max_tool_calls, cfg.rl.tool_workers)


def _shortcuts(task: Task, examples: list[Example]):
    """What rules that skip the skill score on the held-out set, reported beside every
    held-out accuracy (``shortcuts.try_shortcut_baselines``); None without one."""
    shortcuts = try_shortcut_baselines(task, examples) if examples else None
    if shortcuts is not None:
        log.info("held-out set: %d questions (%d distinct); %s", shortcuts.num_questions,
                 shortcuts.distinct_questions, shortcuts.line())
    return shortcuts


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A batch sampled ahead (rl.async_steps): by the weights of step ``sampled_at``, with its
    rollout metrics ``info``."""

    sampled_at: int
    batch: Batch
    info: dict


def _in_flight_meta(in_flight: dict[int, _InFlight]) -> list[dict]:
    """The in-flight batches as JSON for a checkpoint's meta: each host array's dtype, shape
    and bytes (base64), so the restored batch is the saved one bit for bit. Every process
    holds the same host batch (the rollout is gathered to each), so the meta the main
    process writes is every process's."""
    def array(x):
        x = np.ascontiguousarray(x)
        return {"dtype": x.dtype.str, "shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode()}

    fields = [f.name for f in dataclasses.fields(Batch) if f.name != "packing"]  # packed at the step
    return [{"step": s, "sampled_at": e.sampled_at, "info": e.info,
             "batch": {name: array(getattr(e.batch, name)) for name in fields if getattr(e.batch, name) is not None}}
            for s, e in sorted(in_flight.items())]


def _in_flight_from_meta(items: list[dict]) -> dict[int, _InFlight]:
    """Inverse of ``_in_flight_meta``."""
    def array(a):
        return np.frombuffer(base64.b64decode(a["data"]), np.dtype(a["dtype"])).reshape(a["shape"]).copy()

    return {int(e["step"]): _InFlight(int(e["sampled_at"]), Batch(**{k: array(a) for k, a in e["batch"].items()}),
                                      dict(e["info"])) for e in items}


class _HandedOff:
    """The run as a data source sees it from the sampler thread of a split run: its
    questions, settings and scoring, with a rollout that samples the policy copy handed off
    before the update (``weights``), never the state the update is replacing meanwhile."""

    def __init__(self, run: "Trainer", weights):
        self._run, self._weights = run, weights

    def __getattr__(self, name):
        return getattr(self._run, name)

    def rollout(self, examples, key, offline):
        return self._run.rollout(examples, key, offline, weights=self._weights)


# ============================================================================ the loop

class _StopBeforeUpdate(Exception):
    """A preemption between a step's sampling and its update: the run stops before the step."""


class Trainer:
    """Holds the run's state and runs `cfg.run.steps` steps of `cfg.rl.algorithm`.

    params: the starting policy (an SFT model for RL). The reference model (when β > 0 or
    DPO) and the sampling policy of offline methods (RFT, DPO: π_sft) are frozen copies of
    it. `sft_data(step) -> (prompts, completions)` feeds the dataset source (SFT). The
    run's objects are built once here and handed down: the sampler (rollout and
    evaluation), the train step, the checkpointer.
    """

    _stop_check = None  # while `train` runs: done -> whether a preemption stops the run there

    def __init__(self, cfg: Config, *, task: Task, tokenizer: Tokenizer, params, mesh=None,
                 reward_model=None, sft_data=None, eval_examples: Sequence[Example] | None = None,
                 progress: bool = True, resume: bool = True):
        self.cfg, self.task, self.tokenizer, self.progress = cfg, task, tokenizer, progress
        self.algorithm = algorithm_of(cfg)
        # mesh.sample_devices: the training half of the devices (those of ``mesh`` when given)
        # and the split; else ``mesh`` itself, or every device.
        if mesh is not None and not cfg.mesh.sample_devices:
            self.mesh, self.split = mesh, None
        else:
            self.mesh, self.split = split_mesh.run_meshes(cfg.mesh, None if mesh is None else list(mesh.devices.flat))
        # A split run's rollout of batch t + k, running in this thread while batch t trains.
        self._pool = None if self.split is None else concurrent.futures.ThreadPoolExecutor(1, "sampler")
        self._sampling: concurrent.futures.Future | None = None
        self.reward_model = _reward_model(cfg, self.algorithm, reward_model, tokenizer, task)
        if not self.algorithm.data_source.sampled and sft_data is None:
            raise ValueError(f"algorithm {self.algorithm.name!r} trains on a dataset: pass sft_data")
        self.sft_data = sft_data
        self.sampler = Sampler.for_run(cfg, self.mesh, tokenizer,
                                       sample_mesh=None if self.split is None else self.split.sample)
        if is_main_process():
            log.info("decode engine: %s (rl.decode=%s, rl.kv_dtype=%s, sampling mesh %s)", self.sampler.engine.name,
                     cfg.rl.decode, cfg.rl.kv_dtype, dict(self.sampler.mesh.shape))
            if self.split is not None:
                log.info("mesh.sample_devices=%d: sampling on %d devices, training on %d (mesh %s), overlapped",
                         cfg.mesh.sample_devices, self.split.sample_devices, self.split.train_devices,
                         dict(self.mesh.shape))
            elif cfg.mesh.sample_devices:
                log.info("mesh.sample_devices=%d on one device: sampling %d step(s) ahead on it, not overlapped",
                         cfg.mesh.sample_devices, cfg.rl.async_steps)
        self.tool_use = _tool_use(cfg, task, tokenizer)
        self.step_fn = programs.train_step(cfg, self.mesh)
        self.state, self.sft_params = self._initial_state(params)
        self.rng = jax.random.key(cfg.run.seed)
        # A LoRA checkpoint points to its frozen base instead of holding it (lora.base_pointer).
        self.base_pointer = None if self.state.base_params is None else lora.base_pointer(cfg, self.state.base_params)
        self.eval_examples = list(eval_examples) if eval_examples is not None else \
            task.examples("test", cfg.data.eval_size, cfg.data.seed)
        self.shortcuts = _shortcuts(task, self.eval_examples)
        self.history: list[dict] = []
        self.reward_model_evals: list[tuple[int, float, float]] = []  # (step, score, accuracy)
        # (step, `evaluate`'s output with texts and correct) of the newest in-run evaluation: a
        # script reports the end's per question without decoding the held-out set again.
        self.last_evaluation: tuple[int, dict] | None = None
        self.bad_steps = 0
        self.backend_streak = 0  # steps in a row whose tool calls the sandbox mostly could not run
        self.flat_steps = 0  # steps in a row in which no group's rewards varied (reward_signal)
        self.start_step = 0  # the step this Trainer resumed from (0 for a fresh run)
        self.next_step = 0  # the first step the next `train` call takes
        # rl.async_steps = k: batch index -> the batch sampled ahead; between two steps it
        # holds batches next_step .. next_step + k - 1.
        self.in_flight: dict[int, _InFlight] = {}
        self.ckpt = checkpointing.Checkpointer(os.path.join(cfg.run.run_dir, "checkpoints"),
                                               keep=cfg.run.keep_checkpoints,
                                               every=max(cfg.run.checkpoint_every, 1))
        # Restore before the metrics writer and the run's files (run_files): a checkpoint that
        # does not match fails with the run dir untouched.
        restored = self._restore() if resume else None
        self.writer = MetricsWriter(cfg.run.run_dir)
        if is_main_process():
            run_files.write(cfg, task, tokenizer)
        if resume:  # metrics past the step the run goes on from are redone: all of them when
            # the run was cut before its first checkpoint and starts over
            self.writer.truncate_after(restored or 0)
            if restored:
                log.info("resumed from step %d in %s", self.start_step, cfg.run.run_dir)

    def _initial_state(self, params):
        """(TrainState on the mesh, π_sft or None): the state from the starting ``params``
        (a value model when the algorithm needs one), placed in its shards from the start so
        a restored checkpoint lands in the same ones; π_sft, the offline sources' sampling
        policy, is a copy of the starting weights, except under LoRA, whose frozen base
        already is them."""
        cfg = self.cfg
        params = jax.device_put(params, param_shardings(cfg.model, self.mesh))
        tx, value_tx, self.lr_schedule = programs.optimizers(cfg)
        value_params = None
        if self.algorithm.needs_value_model:
            value_params = add_value_head(cfg.model, params, jax.random.key(cfg.run.seed + 1), self.mesh)
        state = jax.device_put(init_train_state(cfg, params, tx, value_params=value_params, value_tx=value_tx),
                               self.step_fn.state_shardings)
        if not self.algorithm.data_source.offline or lora.enabled(cfg.model):
            return state, None
        return state, jax.device_put(params, self.step_fn.state_shardings.params)

    # ------------------------------------------------------------------ helpers
    def applied_lr(self, train_steps: int) -> float:
        """The rate of the last AdamW update applied in the first ``train_steps`` steps (0
        if gradient accumulation has not completed an update yet)."""
        n = updates_applied(self.cfg.optimizer, train_steps, self.cfg.rl.num_updates)
        return float(self.lr_schedule(n - 1)) if n > 0 else 0.0

    def checkpoint_tree(self):
        """What a checkpoint of this run holds: {"state": the TrainState without the frozen
        LoRA base, "rng": the key's data}; ``checkpointing.abstract_like`` of it is what
        ``Checkpointer.restore`` takes to read one back."""
        # The key replicated on the mesh: processes cannot jointly save a host-local array.
        rng = to_global(jax.random.key_data(self.rng), replicated(self.mesh))
        return {"state": self.state.replace(base_params=None), "rng": rng}

    def _restore(self) -> int | None:
        """Load the newest readable checkpoint into this Trainer and return its step: None if
        there is none, 0 if none was readable and `run.restart_unreadable` starts over.
        Unreadable steps past the one returned are moved aside, so the run saves them anew."""
        self.ckpt.check_config(self.cfg.to_dict())
        try:
            restored = self.ckpt.restore(checkpointing.abstract_like(self.checkpoint_tree()))
        except UnreadableCheckpointError as err:
            if not self.cfg.run.restart_unreadable:
                raise CheckpointError(
                    f"{err}. Restore the checkpoints from a copy, or set run.restart_unreadable=true to "
                    f"move them into {self.ckpt.directory}/{checkpointing.UNREADABLE_FOLDER}/ and start "
                    f"{self.cfg.run.run_dir} over from step 0") from err
            self._set_aside(err.steps, "the run starts over from step 0 (run.restart_unreadable=true)")
            return 0
        if restored is None:
            return None
        step, tree, meta = restored
        base = self.state.base_params
        if self.base_pointer is not None:
            base, self.base_pointer = lora.resolve_base(meta.get("base"), base, self.base_pointer, self.cfg.run.run_dir,
                                                        f"checkpoint step {step} in {self.ckpt.directory}")
        self.state = tree["state"].replace(base_params=base)
        self.rng = jax.random.wrap_key_data(tree["rng"])
        self.start_step = self.next_step = step
        self.bad_steps = int(meta.get("bad_steps", 0))
        # A checkpoint without them (saved at another rl.async_steps) leaves the missing
        # batches to be sampled by the restored weights.
        self.in_flight = {s: e for s, e in _in_flight_from_meta(meta.get("in_flight", [])).items()
                          if step <= s < step + self.cfg.rl.async_steps}
        self._set_aside([s for s in self.ckpt.all_steps() if s > step], f"the run resumes from step {step}")
        return step

    def _set_aside(self, steps: list[int], outcome: str) -> None:
        """Move unreadable `steps` out of the way of the saves to come (Orbax skips a step
        that exists), keeping their files."""
        if not steps:
            return
        folder = self.ckpt.set_aside(steps)
        log.warning("moved unreadable checkpoint %s into %s (kept, not deleted) so that every later "
                    "save is written; %s", checkpointing.steps_text(steps), folder, outcome)

    def save(self, step: int) -> None:
        self._collect()  # a split run's batch in flight is in the checkpoint too
        meta = {"step": step, "bad_steps": self.bad_steps, "config": self.cfg.to_dict()}
        if self.cfg.rl.async_steps:  # the batches steps step.. will train: sampled by weights not saved
            meta["in_flight"] = _in_flight_meta({s: e for s, e in self.in_flight.items()
                                                 if step <= s < step + self.cfg.rl.async_steps})
        if self.base_pointer is not None:
            meta["base"] = self.base_pointer
        t0 = time.perf_counter()
        self.ckpt.save(step, self.checkpoint_tree(), meta)
        # How long a save takes on this storage: whether a preemption's save fits its notice.
        log.info("saved checkpoint step %d in %.1f s", step, time.perf_counter() - t0)

    def reset_reference(self) -> None:
        """π_ref ← π_θ (``train_step.reset_reference``; iterative GRPO). Under LoRA that makes
        a new base: it is saved once into the run dir (bases/step-N, ``pretrained.save_converted``)
        and the checkpoints that follow point to it, so they resume and evaluate over the
        base they were trained on."""
        self.state = jax.device_put(reset_reference(self.state, self.cfg.model), self.step_fn.state_shardings)
        if self.base_pointer is not None:
            rel = os.path.join("bases", f"step-{self.next_step}")
            pretrained.save_converted(os.path.join(self.cfg.run.run_dir, rel), self.cfg.model, self.state.base_params)
            self.base_pointer = {"path": rel, "fingerprint": lora.fingerprint(self.state.base_params),
                                 "merged_at": self.next_step}

    @property
    def params(self):
        """π_θ as full weights (a LoRA policy's adapters merged into its base)."""
        return lora.policy_weights(self.cfg.model, self.state)

    def questions(self, step: int) -> list[Example]:
        """The step's questions: a function of (data seed, step) only, so resume is exact."""
        return self.task.examples("train", self.cfg.data.batch_size, self.cfg.data.seed * 1_000_003 + step)

    # ------------------------------------------------------------------ one step
    def make_batch(self, step: int, key) -> tuple[Batch, dict]:
        """The step's host batch and its info, built by the algorithm's data source
        (``data_sources``) from this run."""
        return self.algorithm.data_source.batch(self, step, key)

    def rollout(self, examples: Sequence[Example], key, offline: bool,
                weights=None) -> tuple[Rollout, Scores, dict]:
        """G completions of each of ``examples`` drawn from π_θ, or with
        ``offline`` from π_sft, gathered to the host (rl.sample_prompts questions a call), and
        their scores (the task's rules or the reward model, on decoded text), with the
        rollout's metrics. ``weights``: the sampling copy to draw from instead (a split
        run's hand-off, sampled in the sampler thread)."""
        rl = self.cfg.rl
        between_calls = self._stop_between_calls()
        if weights is not None:
            # The sampler thread never asks the preemption sync point: every process must ask
            # it in the same order, which two threads would not keep. The loop asks it.
            between_calls = None
        elif not offline:
            weights = self.sampler.copy(self.params)
        else:
            weights = self.sampler.copy(self.state.base_params if self.sft_params is None else self.sft_params)
        prompts = [encode_prompt(self.tokenizer, ex.prompt) for ex in examples]
        info = {}
        if self.tool_use is None:
            rollout = self.sampler.generate(weights, prompts, key=key, group_size=rl.group_size,
                                            prompts_per_call=rl.sample_prompts, between_calls=between_calls)
        else:
            rollout, runs = generate_with_tools(self.sampler, weights, prompts, key=key, group_size=rl.group_size,
                                                tools=self.tool_use, prompts_per_call=rl.sample_prompts,
                                                between_calls=between_calls)
            info = tool_metrics(runs, rollout.tool_mask)
        t_score = time.perf_counter()
        scores = score_rollout(self.task, self.tokenizer, examples, rollout, rl.group_size,
                               reward_model=self.reward_model, process=rl.supervision == "process")
        info.update({"reward_mean": float(scores.rewards.mean()), "accuracy_train": float(scores.correct.mean()),
                     "completion_length": float(np.asarray(rollout.lengths).mean()),
                     "score_time_s": time.perf_counter() - t_score})
        return rollout, scores, info

    def _on_mesh(self, batch):
        """The host batch as global arrays on the train mesh; a packing's rows (rl.pack) are
        sharded by their own count."""
        placed = shard_batch(batch.replace(packing=None), self.mesh)
        if batch.packing is None:
            return placed
        return placed.replace(packing=shard_batch(batch.packing, self.mesh))

    def _stop_between_calls(self):
        """While `train` runs: what a rollout during step `next_step` calls between sampler
        calls, so that a preemption need not wait for the whole rollout (minutes on a large
        model). It asks with the step the loop is in, whichever batch it samples: the checks'
        numbers never go down."""
        if self._stop_check is None:
            return None
        step = self.next_step

        def check():
            if self._stop_check(step + 1):
                raise _StopBeforeUpdate

        return check

    def sampled_ahead(self, step: int) -> tuple[Batch, dict]:
        """rl.async_steps = k: batch ``step`` (sampled by the weights of step max(step - k, 0))
        and its info with its ``staleness`` in steps, after sampling with the current weights
        (those of step ``step``) every batch of step .. step + k not yet in flight: batch
        step + k, or all of them at the first step. ``score_time_s`` is this call's scoring.
        A split run first collects the batch its sampler thread drew, and leaves batch
        step + k to that thread (``sample_behind``, once the step is sure to train)."""
        scored, timings = 0.0, self._collect()
        last = step + self.cfg.rl.async_steps - (1 if self.split is not None else 0)
        for s in range(step, last + 1):
            if s not in self.in_flight:
                batch, info = self.make_batch(s, jax.random.fold_in(self.rng, s))
                scored += info.get("score_time_s", 0.0)
                self.in_flight[s] = _InFlight(step, batch, info)
        entry = self.in_flight[step]
        return entry.batch, {**entry.info, **timings, "score_time_s": scored, "staleness": step - entry.sampled_at}

    def sample_behind(self, step: int) -> float:
        """A split run: hand the weights of step ``step`` to the sampling devices and start
        drawing batch step + k from them in the sampler thread, to run while the update of
        batch ``step`` does; the seconds the hand-off took. Waits for the copy to land: the
        update then donates the state it was copied from."""
        t0 = time.perf_counter()
        weights = jax.block_until_ready(self.sampler.copy(self.params))
        s = step + self.cfg.rl.async_steps
        key, run = jax.random.fold_in(self.rng, s), _HandedOff(self, weights)

        def draw():
            start = time.perf_counter()
            batch, info = self.algorithm.data_source.batch(run, s, key)
            return s, _InFlight(step, batch, {**info, "rollout_time_s": time.perf_counter() - start})

        self._sampling = self._pool.submit(draw)
        return time.perf_counter() - t0

    def _collect(self) -> dict:
        """Put the batch the sampler thread drew into ``in_flight`` (re-raising its error),
        waiting for it if it is still being drawn; {"sample_wait_time_s": the wait} (nothing
        when no batch was being drawn)."""
        if self._sampling is None:
            return {}
        t0 = time.perf_counter()
        future, self._sampling = self._sampling, None
        s, entry = future.result()
        self.in_flight[s] = entry
        return {"sample_wait_time_s": time.perf_counter() - t0}

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        if self.cfg.rl.async_steps:
            batch, info = self.sampled_ahead(step)
        else:
            batch, info = self.make_batch(step, jax.random.fold_in(self.rng, step))
        if self._stop_check is not None and self._stop_check(step + 1):
            raise _StopBeforeUpdate  # the state is still that of `step` steps: the run stops there
        self.in_flight.pop(step, None)
        if self.split is not None:
            info["hand_off_time_s"] = self.sample_behind(step)
        t1 = time.perf_counter()
        self.state, metrics = self.step_fn(self.state, self._on_mesh(self.step_fn.packed(batch)))
        metrics = {k: float(v) for k, v in metrics.items()}
        t2 = time.perf_counter()
        # sample = rollout (and batching); score = rewards; update = the jitted step,
        # reference log-probs included. A split run's sample time is what this thread spent
        # drawing or waiting (sample_wait_time_s), its rollout_time_s what the sampler thread
        # spent on the batch trained (overlapped with an earlier update).
        metrics.update(info, sample_time_s=t1 - t0 - info.get("score_time_s", 0.0) - info.get("hand_off_time_s", 0.0),
                       update_time_s=t2 - t1, lr=self.applied_lr(step + 1))
        return metrics

    # ------------------------------------------------------------------ the loop
    def train(self, steps: int | None = None) -> list[dict]:
        """Train up to step `steps` (default `run.steps`), continuing from where this Trainer
        stopped: calling train(20) then train(40) is the same run as train(40), which is how
        iterative GRPO swaps the reward model and reference between iterations.

        A SIGTERM or SIGINT meanwhile (`grpo_jax.parallel.preemption`) stops the run where it stands,
        saved, and raises `preemption.Preempted`: a signal during a step's sampling drops that
        batch and saves the steps done before it (the update has not touched the state; on a
        large model the update alone outlasts a Spot VM's notice; with rl.async_steps = k the
        batch dropped is t + k, and the k batches in flight before it are saved); one during
        the update, an evaluation or a save lets that step finish and saves it."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        total = steps if steps is not None else cfg.run.steps
        bar = tqdm(total=total, initial=self.next_step, desc=self.algorithm.name,
                   disable=not (self.progress and is_main_process()), dynamic_ncols=True)
        # Asked between the step's sampler calls, after its sampling and after its update, on
        # every process alike and always with the step's number. jax's sync point needs the
        # same calls in the same order on every process, with numbers that never go down; it
        # answers True first at the first call with the agreed number, the same call everywhere.
        stop_check = lambda done: preemption.stop_requested(done, self.ckpt.reached_preemption)
        with preemption.watching(), contextlib.closing(bar), self._checking(stop_check):
            for step in range(self.next_step, total):
                try:
                    metrics = self.train_step(step)
                except _StopBeforeUpdate:
                    self._stop_preempted(step, saved=step in self.ckpt.all_steps())
                done = step + 1
                if not all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm") if k in metrics):
                    self.bad_steps += 1
                    log.warning("step %d: non-finite loss/grad (%s); update skipped (%d in a row)",
                                done, {k: metrics.get(k) for k in ("loss", "grad_norm")}, self.bad_steps)
                else:
                    self.bad_steps = 0
                self.backend_streak = failing_streak(self.backend_streak, metrics, cfg.rl.tool_backend_stop_share)
                self.flat_steps = reward_signal.flat_steps(self.flat_steps, metrics)
                no_signal = reward_signal.warning(self.flat_steps, done)
                if no_signal and is_main_process():
                    log.warning("%s", no_signal)
                if self.eval_examples and cfg.run.eval_every and (done % cfg.run.eval_every == 0 or done == total):
                    metrics.update(self.evaluate_held_out(done))
                metrics["step"] = done
                self.history.append(metrics)
                if done % cfg.run.log_every == 0 or done == total or self.bad_steps or self.backend_streak:
                    self.writer.write(done, metrics)
                if self.bad_steps >= cfg.run.max_bad_steps:
                    raise FloatingPointError(
                        f"{self.bad_steps} consecutive non-finite updates (run.max_bad_steps="
                        f"{cfg.run.max_bad_steps}); stopping at step {done}")
                if self.backend_streak >= cfg.rl.tool_backend_stop_steps:
                    raise broken_backend(metrics, self.backend_streak, cfg.rl.tool_backend_stop_share, done)
                bar.update(1)
                bar.set_postfix({k: f"{metrics[k]:.3f}" for k in ("reward_mean", "eval_accuracy",
                                                                   "eval_shortcut_best", "kl", "loss")
                                 if k in metrics})
                scheduled = bool(cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0 or done == total)
                if scheduled:
                    self.save(done)
                self.next_step = done
                if stop_check(done):
                    self._stop_preempted(done, saved=scheduled)
        return self.history

    def evaluate_held_out(self, done: int) -> dict:
        """The in-run evaluation after step ``done``: greedy accuracy on the held-out questions
        (by the task's rule), the best shortcut beside it, and with a reward model its mean
        score on the same greedy outputs; a warning when that score rose while accuracy fell
        over consecutive evaluations of this process (`reward_models.checks.hacking_warning`)."""
        self._collect()  # a split run's sampler thread, done before its devices evaluate
        # The rollout's sampler and policy copy.
        ev = evaluate(self.sampler, self.sampler.copy(self.params), self.task, self.tokenizer, self.eval_examples,
                      key=jax.random.fold_in(self.rng, 10**9 + done), texts=True)
        self.last_evaluation = (done, dict(ev))
        texts = ev.pop("texts")
        ev.pop("correct")
        out = {f"eval_{k}": v for k, v in ev.items()}
        if self.shortcuts is not None:
            out["eval_shortcut_best"] = self.shortcuts.best[1]
        if self.reward_model is not None:
            scores = self.reward_model.score([ex.prompt for ex in self.eval_examples], texts)
            out["eval_reward_model_score"] = float(np.mean(scores))
            self.reward_model_evals.append((done, out["eval_reward_model_score"], out["eval_accuracy"]))
            warning = hacking_warning(self.reward_model_evals)
            if warning and is_main_process():
                log.warning("%s", warning)
        return out

    @contextlib.contextmanager
    def _checking(self, stop_check):
        """`stop_check` for the checks inside a step (`train_step`, the rollout) while `train` runs;
        a step taken outside `train` (tests, tools) is never stopped."""
        self._stop_check = stop_check
        try:
            yield
        finally:
            self._stop_check = None

    def _stop_preempted(self, step: int, *, saved: bool) -> None:
        """Save `step` (unless it is saved already, or 0) and raise `preemption.Preempted`."""
        why = preemption.reason()
        if step == 0:
            log.warning("%s: stopped before the first step; nothing to save", why)
            raise preemption.Preempted(step, self.ckpt.directory, why)
        if not saved:
            try:
                self.save(step)
            except CheckpointError as err:  # its message ends "... run the same command again to resume"
                latest = self.ckpt.latest_step()
                kept = (f" from step {latest}, the newest saved step (intact)" if latest
                        else "; no earlier step was saved, so it starts from step 0")
                raise CheckpointError(f"stopping on {why}: {err}{kept}") from err
        log.warning("%s: saved checkpoint step %d in %s and stopped; the same command resumes from step %d",
                    why, step, self.ckpt.directory, step)
        raise preemption.Preempted(step, self.ckpt.directory, why)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.ckpt.close()
        self.writer.close()
