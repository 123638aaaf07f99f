"""Preemption: a SIGTERM (a Spot or preemptible VM's notice) or a SIGINT becomes "save the
step the run stands at, on every process, then stop", so the same command resumes with no
step lost.

While `Trainer.train` runs (`watching()`), the trainer stops at its next check (between the
rollout's sampler calls, after the rollout, after the update): a step still sampling is
dropped, one whose update has begun is finished. It saves the step it stands at (the same
checkpoint a scheduled save writes), logs one line and raises `Preempted`, which ends the
process with `EXIT_CODE` where nothing catches it. Signals that come while it saves are
logged and wait for the save: a step is never left half written.

Who decides at which step to stop:

* **One process**: the signal alone. The flag it sets stays set for the rest of the process,
  so a script that runs several trainers one after the other stops at the next step.
* **Several processes** (`jax.distributed`): the signal may reach one process only, or each
  at another moment, yet all of them must save the same step (a save is a collective). jax's
  coordination service does this: `jax.distributed.initialize` starts its preemption sync
  manager, which catches SIGTERM itself, shares the notice with every process and picks the
  step after the furthest one's; `multihost_utils.reached_preemption_sync_point(step)` (which
  Orbax's `CheckpointManager.reached_preemption` wraps) is then True on every process at the
  same check. So SIGTERM is left to jax there, and a SIGINT is passed on to it as a SIGTERM.
  The trainer asks at every check with the step's number, the same checks on every process,
  as that protocol requires.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Callable, Iterator

log = logging.getLogger(__name__)

# EX_TEMPFAIL (sysexits.h): "a temporary failure; the same command may be retried". Launch
# scripts read it as "stopped on a signal after saving": the same command resumes.
EXIT_CODE = 75

_received: str | None = None  # the name of the first signal this process caught


class Preempted(SystemExit):
    """Raised by `Trainer.train` once the step it stopped at is saved.

    A SystemExit: a request to stop, not an error. It unwinds `finally` blocks (closing
    checkpointers), is not caught by `except Exception`, and where nothing catches it the
    interpreter exits with `EXIT_CODE` and no traceback."""

    def __init__(self, step: int, directory: str, reason: str):
        super().__init__(EXIT_CODE)
        self.step, self.directory, self.reason = step, directory, reason

    def __str__(self) -> str:
        return f"{self.reason}: stopped after saving step {self.step} in {self.directory}"


def multi_process() -> bool:
    import jax  # here, not at the top: launch/ reads EXIT_CODE on machines without jax

    return jax.process_count() > 1


def received() -> str | None:
    """The signal this process caught ("SIGTERM", "SIGINT"), or None."""
    return _received


def clear() -> None:
    """Forget a caught signal: for a process that goes on after `Preempted` (tests; a
    notebook that resumes the run in place)."""
    global _received
    _received = None


def _on_signal(signum, frame) -> None:
    global _received
    name = signal.Signals(signum).name
    if _received is None:
        _received = name
        log.warning("%s: stopping where the run stands once the sampler call or update in progress "
                    "ends, and saving it first", name)
    else:  # the step or its save is under way; stopping now could lose it
        log.warning("%s again: stopping once the current step is saved", name)


def _pass_to_jax(signum, frame) -> None:
    """SIGINT on a multi-process run: jax's preemption service listens to SIGTERM only."""
    global _received
    if _received is None:
        _received = signal.Signals(signum).name
        log.warning("%s: passed on as SIGTERM to jax's preemption service (every process saves "
                    "the same step, then stops)", _received)
    os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Catch SIGTERM and SIGINT for the duration (outside it they keep their defaults, so a
    script's evaluation or plotting still stops at once); the previous handlers come back after.
    Python runs signal handlers in the main thread only: elsewhere nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if multi_process():
        # jax.distributed's preemption sync manager installed its own (C) SIGTERM handler;
        # a Python one would replace it and hide the notice from the other processes.
        handlers = {signal.SIGINT: _pass_to_jax}
    else:
        handlers = {signal.SIGTERM: _on_signal, signal.SIGINT: _on_signal}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_requested(step: int, reached_sync_point: Callable[[int], bool]) -> bool:
    """Whether the run stops after `step` (the number of steps done). Every process must call
    it once per step with growing `step`: on several processes `reached_sync_point` (Orbax's
    `CheckpointManager.reached_preemption`) answers, True on all of them at the same step; on
    one process the signal answers."""
    if multi_process():
        return bool(reached_sync_point(step))
    return _received is not None


def reason() -> str:
    """What stopped the run, for messages."""
    if _received is not None:
        return _received
    return "a preemption notice (SIGTERM to one of the processes)"
