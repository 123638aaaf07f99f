"""Multi-host start-up: one JAX process per host (TPU VM worker), or several on localhost.

On a Cloud TPU pod slice `jax.distributed.initialize()` discovers the coordinator by itself.
Elsewhere (CPU tests, GPUs) the coordinator, the process count and this process's id come
from the environment: GRPO_JAX_COORDINATOR (host:port), GRPO_JAX_NUM_PROCESSES,
GRPO_JAX_PROCESS_ID — or from the arguments.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)
_initialized = False


def on_tpu_pod() -> bool:
    """A multi-host TPU VM sets TPU_WORKER_HOSTNAMES to more than one host."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h]) > 1


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_count: int | None = None) -> bool:
    """Join the multi-process runtime when there is more than one process. Returns whether it did.

    Must run before anything touches a JAX device. Idempotent.
    """
    global _initialized
    if _initialized:
        return True
    coordinator = coordinator or os.environ.get("GRPO_JAX_COORDINATOR")
    num_processes = num_processes or int(os.environ.get("GRPO_JAX_NUM_PROCESSES", "0") or 0)
    if process_id is None and os.environ.get("GRPO_JAX_PROCESS_ID"):
        process_id = int(os.environ["GRPO_JAX_PROCESS_ID"])
    if coordinator and num_processes > 1:
        if process_id is None:
            raise ValueError("multi-process run: set GRPO_JAX_PROCESS_ID (or pass process_id)")
        kwargs = {}
        if local_device_count is not None:
            kwargs["local_device_ids"] = list(range(local_device_count))
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, **kwargs)
    elif on_tpu_pod():
        jax.distributed.initialize()
    else:
        return False
    _initialized = True
    log.info("process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True
