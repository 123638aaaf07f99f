"""Orbax checkpoints of the full train state, restorable onto any mesh.

A checkpoint is a step directory with two items: `state` (a pytree of arrays: params,
optimizer state, step, RNG key data) and `meta` (JSON: data iterator position, config,
anything host-side). Orbax writes into a temporary directory and renames it when complete,
so a run killed mid-save leaves the previous step as the latest complete one; a latest step
that fails to restore (corrupted files) is skipped with a warning in favour of the one before,
and a folder whose steps are all unreadable is an `UnreadableCheckpointError`. Unreadable steps
can be moved into `unreadable/` (`set_aside`), so their step numbers can be saved again. A save
that Orbax would skip, or that fails, raises CheckpointError: a run never trains on unsaved.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from grpo_jax.parallel.distributed import barrier, is_main_process
from grpo_jax.errors import CheckpointError, UnreadableCheckpointError
from grpo_jax.shapes import abstract_like  # noqa: F401  (re-exported: where a restore lands)

log = logging.getLogger(__name__)
UNREADABLE_FOLDER = "unreadable"  # under the checkpoint folder: steps moved aside by `set_aside`


class Checkpointer:
    """Keep-last-N, save-every-N manager over `directory` (local path or gs://)."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, every: int = 1):
        self.directory = str(directory)
        if "://" not in self.directory:
            self.directory = os.path.abspath(self.directory)
        self.every = max(every, 1)
        self._quiet = _OrbaxStepMetadataErrors(self.directory)
        logging.getLogger("absl").addFilter(self._quiet)
        # Handlers given up front (not only item names) so `item_metadata` can read the stored
        # shapes before a restore (`_stored_shape_mismatches`). Step folders are made before
        # `save` returns: made in the background, one that cannot be made leaves Orbax's other
        # save threads waiting out their timeout (minutes), and a process that caught the
        # error waits for them at exit.
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True,
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False)),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return step % self.every == 0

    def reached_preemption(self, step: int) -> bool:
        """Orbax's preemption check: True on every process at the same step once one of them
        got a preemption notice (jax's preemption sync point; always False with one process,
        where `grpo_jax.parallel.preemption` reads the signal itself)."""
        return self._mngr.reached_preemption(step)

    def save(self, step: int, state: Any, meta: dict | None = None, *, wait: bool = True) -> None:
        """Save `state` at `step`, or raise CheckpointError: for a step that already exists or
        is not newer than the latest (Orbax would skip either silently), and for a write that
        fails. With ``wait=False`` a failed write surfaces at the next save or `close`."""
        if step in self.all_steps():
            raise CheckpointError(
                f"checkpoint step {step} already exists in {self.directory} and is never overwritten; "
                f"move it aside (e.g. into {UNREADABLE_FOLDER}/) or use a new run dir")
        try:
            saved = self._mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta or {})))
            if wait:
                self._mngr.wait_until_finished()
        except (OSError, ValueError) as e:  # permissions, a full disk; tensorstore reports ValueError
            raise CheckpointError(
                f"could not save checkpoint step {step} in {self.directory} ({_first_line(e)}); make the "
                "folder writable or free space, then run the same command again to resume") from e
        if not saved:
            raise CheckpointError(
                f"checkpoint step {step} was not saved in {self.directory}: it is not newer than the "
                f"latest step there ({self.latest_step()}); move the newer steps aside or use a new run dir")

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict] | None:
        """Restore onto the shardings in `abstract_state` (see `abstract_like`).

        With `step=None`, tries the newest step first and falls back to older ones if it is
        unreadable (each step skipped is logged, and every step newer than the one returned
        was skipped). Returns (step, state, meta), or None when there is no checkpoint; steps
        of which none is readable raise UnreadableCheckpointError. A state whose shapes or
        structure do not match `abstract_state` raises CheckpointError, naming the parameter
        paths and shapes when they can be read from the stored metadata.
        """
        steps = [step] if step is not None else self.all_steps()[::-1]
        unreadable = []  # (step, error), newest first
        for s in steps:
            mismatches = self._stored_shape_mismatches(s, abstract_state)
            if mismatches:
                shown = "; ".join(f"{path} is stored as {stored}, the model expects {wanted}"
                                  for path, stored, wanted in mismatches[:3])
                more = f" (and {len(mismatches) - 3} more)" if len(mismatches) > 3 else ""
                raise CheckpointError(
                    f"checkpoint step {s} in {self.directory} was saved by a different model: "
                    f"{shown}{more}. Use the model settings it was saved with, or a new run dir")
            try:
                out = self._mngr.restore(s, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
            except (ValueError, KeyError, TypeError) as e:
                if _is_mismatch(e):  # a structure difference: Orbax names the missing keys
                    raise CheckpointError(
                        f"checkpoint step {s} in {self.directory} does not match the model/"
                        f"optimizer being restored: {e}") from e
                unreadable.append((s, e))
                continue
            except Exception as e:  # corrupted files surface as many different error types
                unreadable.append((s, e))
                continue
            _check_shapes(abstract_state, out.state, s)
            for bad, e in unreadable:
                log.warning("checkpoint step %d in %s is unreadable (%s); restored step %d instead",
                            bad, self.directory, _first_line(e), s)
            return s, out.state, dict(out.meta or {})
        if unreadable and step is not None:
            raise unreadable[0][1]
        if unreadable:
            newest, e = unreadable[0]
            bad = [s for s, _ in unreadable]
            raise UnreadableCheckpointError(
                f"no readable checkpoint in {self.directory}: {steps_text(bad)} "
                f"{'is' if len(bad) == 1 else 'are'} unreadable (step {newest}: {_first_line(e)})", bad)
        return None

    def set_aside(self, steps: Sequence[int]) -> str:
        """Move the folders of `steps` into `<directory>/unreadable/`, renamed and never
        deleted, so that those steps can be saved again; returns that folder. A name taken
        there already (the same step set aside by an earlier run) gets a `.N` suffix."""
        aside = epath.Path(self.directory) / UNREADABLE_FOLDER
        self._mngr.wait_until_finished()
        if is_main_process():  # one process renames; the others see it after the barrier
            aside.mkdir(parents=True, exist_ok=True)
            for s in steps:
                (self._mngr.directory / str(s)).rename(_free_path(aside, str(s)))
        barrier("checkpointing.set_aside")
        self._mngr.reload()  # the manager caches its step list
        return str(aside)

    def restore_params(self, abstract_params: Any, step: int) -> Any:
        """Only the policy parameters (`state.params`) of `step`, onto the shardings in
        `abstract_params`: evaluation needs nothing else, and the optimizer moments,
        reference and value model would take 2-4x the policy's memory. The Trainer's
        `StandardRestore` reads whole items, so the state item is read here with a
        partial PyTree restore of the same step directory."""
        wanted = {"state": {"params": abstract_params}}
        mismatches = self._stored_shape_mismatches(step, wanted)
        if mismatches:
            path, stored, want = mismatches[0]
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: {path} is stored as {stored}, "
                                  f"the model expects {want}")
        ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        try:
            out = ckptr.restore(self._mngr.directory / str(step) / "state", args=ocp.args.PyTreeRestore(
                item=wanted, restore_args=ocp.checkpoint_utils.construct_restore_args(wanted),
                partial_restore=True))
        finally:
            ckptr.close()
        _check_shapes(abstract_params, out["state"]["params"], step)
        return out["state"]["params"]

    def stored_metadata(self, step: int) -> Any:
        """The metadata tree of the state saved at ``step`` (each array's shape and dtype as
        stored), read without restoring any array."""
        return self._mngr.item_metadata(step).state

    def _stored_shape_mismatches(self, step: int, abstract_state: Any) -> list[tuple[str, tuple, tuple]]:
        """(parameter path, stored shape, wanted shape) for each array of `abstract_state`
        whose stored shape at `step` differs. Orbax's own error for this names neither the
        parameter nor a safe fix (it suggests disabling the shape check). Paths are compared
        as plain key strings; arrays that do not appear in both trees, and steps whose
        metadata is unreadable, are left to the restore itself."""
        try:
            stored = self.stored_metadata(step)
        except Exception:  # an unreadable step: restore() falls back or reports it
            return []
        stored_shapes = {_path_key(p): tuple(m.shape) for p, m in
                         jax.tree_util.tree_flatten_with_path(getattr(stored, "tree", stored))[0]
                         if hasattr(m, "shape")}
        out = []
        for path, want in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
            got = stored_shapes.get(_path_key(path))
            if got is not None and got != tuple(want.shape):
                out.append((jax.tree_util.keystr(path), got, tuple(want.shape)))
        # The parameters first: the optimizer moments only repeat their shapes.
        return sorted(out, key=lambda m: "params" not in m[0])

    def read_meta(self, step: int) -> dict:
        """The JSON meta item of ``step`` (config, data position, a LoRA run's base pointer),
        read without restoring any array."""
        return dict(self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta or {})

    def check_config(self, requested: dict, ignore: tuple[str, ...] = (), also: tuple[str, ...] = ()) -> None:
        """Raise CheckpointError listing the restore-relevant fields (`config_differences`,
        plus the dotted fields or whole sections in `also`) where the newest checkpoint's
        saved config differs from `requested`; reads only the small meta item, so it runs
        before any state restore and writes nothing."""
        newest = self.newest_config()
        if newest is None:
            return
        s, saved = newest
        diffs = [d for d in config_differences(saved, requested, also) if d[0] not in ignore]
        if diffs:
            raise CheckpointError(
                f"{self.directory} holds checkpoints (step {s}) of a different setup: "
                + "; ".join(f"{k}: saved {a!r}, requested {b!r}" for k, a, b in diffs)
                + ". Use the saved values, or a new run.run_dir to start over")

    def newest_config(self) -> tuple[int, dict] | None:
        """(step, the config it was saved with) of the newest step whose meta item reads; None
        when there is none."""
        for s in self.all_steps()[::-1]:
            try:
                return s, self.read_meta(s).get("config") or {}
            except Exception:  # an unreadable step is restore()'s to report or skip
                continue
        return None

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
        logging.getLogger("absl").removeFilter(self._quiet)


class _OrbaxStepMetadataErrors(logging.Filter):
    """Drops Orbax's error for an unparsable `_CHECKPOINT_METADATA` of a step under
    `directory`. Orbax goes on without that file (timestamps only) and logs the file's whole
    content each time it lists the steps; `restore` names every step it cannot read, and a
    run that stops on unreadable checkpoints then says so in one line."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory = os.path.join(directory, "")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("Failed to json parse Metadata file")
                    and bool(record.args) and str(record.args[0]).startswith(self.directory))


# Config fields a checkpoint's state depends on: the model's parameter shapes, dtypes and
# layout, and the algorithm (which decides whether a value model is in the state). Every
# other field (run.steps, optimizer settings, data, mesh, ...) may change on resume;
# model.remat, model.max_seq_len and model.attention change no stored array.
RESTORE_SECTIONS = ("model",)
RESTORE_FIELDS = ("rl.algorithm",)
RESUMABLE_MODEL_FIELDS = ("remat", "max_seq_len", "attention")


def config_differences(saved: dict, requested: dict, also: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """(dotted field, saved value, requested value) for each restore-relevant field that
    differs; `also` adds dotted fields ("run.seed") or whole sections ("optimizer")."""
    sections = list(RESTORE_SECTIONS) + [a for a in also if "." not in a]
    keys = [f"{sec}.{k}" for sec in dict.fromkeys(sections)
            for k in sorted(set(saved.get(sec, {})) | set(requested.get(sec, {})))
            if not (sec == "model" and k in RESUMABLE_MODEL_FIELDS)]
    keys += [k for k in list(RESTORE_FIELDS) + [a for a in also if "." in a] if k not in keys]
    out = []
    for key in keys:
        sec, name = key.split(".", 1)
        a, b = saved.get(sec, {}).get(name), requested.get(sec, {}).get(name)
        if sec in saved and a != b:
            out.append((key, a, b))
    return out


def check_run_dir(directory: str | os.PathLike, requested: dict, ignore: tuple[str, ...] = (),
                  also: tuple[str, ...] = ()) -> tuple[int, dict] | None:
    """`Checkpointer.check_config` for a checkpoint folder, if it exists; creates nothing, so a
    run can check before it writes anything else to its run dir. `ignore`: dotted fields the
    caller only knows later (and checks again then); `also`: fields or sections to compare
    beyond the restore-relevant ones (e.g. a cached run that must not be reused). Returns
    `Checkpointer.newest_config` (None without a checkpoint)."""
    if not os.path.isdir(directory):
        return None
    ckpt = Checkpointer(directory)
    try:
        ckpt.check_config(requested, ignore, also)
        return ckpt.newest_config()
    finally:
        ckpt.close()


def _first_line(e: Exception) -> str:
    """An exception as one short line for a message (Orbax's can run to many lines)."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def steps_text(steps: Sequence[int]) -> str:
    """"step 4" or "steps 2, 4", for messages."""
    return f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, sorted(steps)))


def _free_path(folder: epath.Path, name: str) -> epath.Path:
    """`folder/name`, or `folder/name.N` with the first N not taken."""
    path, n = folder / name, 1
    while path.exists():
        path, n = folder / f"{name}.{n}", n + 1
    return path


def _path_key(path) -> tuple[str, ...]:
    """A tree path as strings, whatever the node kind (Orbax stores named tuples as dicts)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _is_mismatch(e: Exception) -> bool:
    text = str(e).lower()
    return any(w in text for w in ("shape", "structure", "tree", "mismatch", "missing"))


def _check_shapes(abstract: Any, restored: Any, step: int) -> None:
    a = jax.tree_util.tree_flatten_with_path(abstract)[0]
    r = jax.tree.leaves(restored)
    for (path, want), got in zip(a, r):
        if tuple(want.shape) != tuple(np.shape(got)):
            raise CheckpointError(
                f"checkpoint step {step}: {jax.tree_util.keystr(path)} has shape {np.shape(got)}, "
                f"the model expects {tuple(want.shape)}")
