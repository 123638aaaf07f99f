"""Multi-host start-up: one JAX process per host (TPU VM worker), or several on localhost.

On a Cloud TPU pod slice `jax.distributed.initialize()` discovers the coordinator by itself.
Elsewhere (CPU tests, GPUs) the coordinator, the process count and this process's id come
from the environment: GRPO_JAX_COORDINATOR (host:port), GRPO_JAX_NUM_PROCESSES,
GRPO_JAX_PROCESS_ID — or from the arguments.

How a multi-process run divides the work (every process runs the same program):

* **Data.** The synthetic tasks generate each step's questions from (seed, step) alone, so
  every process builds the same global batch on the host; `sharding.shard_batch` (and the
  sampler) turn it into global arrays of which each process materialises only the shards
  of its own devices. Grain loaders of file datasets take `shard_index` / `shard_count`
  (default: this process's index and the process count) to read disjoint shards instead.
* **Host results.** Sampled tokens and other global arrays are gathered back with
  `sharding.to_host`, so host-side scoring sees the whole batch on every process.
* **Checkpoints.** Every process calls save/restore; Orbax writes each array's shards
  from the process that holds them, into one shared directory (gs://... on a pod slice).
* **Logging.** Metrics files and progress bars are written by process 0 only
  (`is_main_process`).
* **Host-only values** that must agree across processes (a tokenizer trained on process
  0, say) are shared with `broadcast_bytes`.

On CPU, several processes on one machine form one global mesh: XLA's CPU client does
cross-process collectives with Gloo (the default `jax_cpu_collectives_implementation`
in this JAX), and `--xla_force_host_platform_device_count=N` gives each process N devices.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

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


def is_main_process() -> bool:
    """Process 0: the one that logs, shows progress and writes host-side files."""
    return jax.process_index() == 0


def broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's `data` on every process (other processes may pass None).

    A collective: every process must call it, in the same order relative to other
    collectives. With one process it returns `data` unchanged.
    """
    if jax.process_count() == 1:
        if data is None:
            raise ValueError("broadcast_bytes: process 0 passed None")
        return data
    from jax.experimental import multihost_utils

    main = is_main_process()
    if main and data is None:
        raise ValueError("broadcast_bytes: process 0 passed None")
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data) if main else 0)))
    buf = np.frombuffer(data, np.uint8) if main else np.zeros((size,), np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8).tobytes()


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every process's ``data``, in process order, on every process. A collective, as
    `broadcast_bytes`; with one process, ``[data]``."""
    if jax.process_count() == 1:
        return [data]
    from jax.experimental import multihost_utils

    sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(data)))).reshape(-1)
    buf = np.zeros((int(sizes.max()),), np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    bufs = np.asarray(multihost_utils.process_allgather(buf), np.uint8)
    return [bufs[i, :n].tobytes() for i, n in enumerate(sizes)]


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier called `name` (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
