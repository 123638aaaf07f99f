"""One process of tests/parallel/test_multihost_slot_tools.py: a tool rollout on the slot
engine across processes.

    GRPO_JAX_COORDINATOR=localhost:PORT GRPO_JAX_NUM_PROCESSES=2 GRPO_JAX_PROCESS_ID=i \\
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.parallel.slot_tools_worker OUT_DIR

Every process joins the runtime and draws the same rollout (`rollout`) on one mesh of both
processes' devices, then writes OUT_DIR/result_<process>.json (`record`): the rows, each
row's tool runs, and the rows whose blocks this process ran. The test draws `rollout` in its
own process for the reference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

MESH = (1, 4, 2)  # (data, fsdp, tensor): the slots' rows split over fsdp, which spans both processes
SLOTS = 4  # 8 rows refilled through 4 slots, two on each process


def rollout(mesh):
    """(rollout, tool runs, rows whose blocks ran here) of the tiny 4-token model of
    tests/sampler/test_turns.py, which calls its tool often: 2 questions x G = 4 on SLOTS
    slots, sampled, at most 2 calls a row."""
    import jax

    from grpo_jax.config import cpu_tiny
    from grpo_jax.model import transformer as model
    from grpo_jax.sampler import Sampler, SamplingParams
    from grpo_jax.sampler.turns import ToolUse, generate_with_tools
    from grpo_jax.tools import LocalSandbox, PythonTool
    from tests.sampler.test_turns import UNHURRIED, Alphabet

    ran = []

    class Recording(LocalSandbox):
        def run(self, code):
            ran.append(code)
            return super().run(code)

    cfg = dataclasses.replace(cpu_tiny().model, vocab_size=4, max_seq_len=64, tie_embeddings=False)
    params = model.init_params(cfg, jax.random.key(1), mesh)
    sampler = Sampler(cfg, mesh, SamplingParams(max_new_tokens=16, pad_id=0, engine="slots", slots=SLOTS))
    tools = ToolUse.build(PythonTool(Recording(UNHURRIED.limits), open="a", close="b"), Alphabet(), 2)
    out, runs = generate_with_tools(sampler, sampler.copy(params), [[2, 3, 2], [3, 2]], key=jax.random.key(3),
                                    group_size=4, tools=tools)
    return out, runs, ran


def record(out, runs, ran) -> dict:
    import numpy as np

    return {"tokens": np.asarray(out.tokens).tolist(), "tool_mask": np.asarray(out.tool_mask).tolist(),
            "lengths": np.asarray(out.lengths).tolist(), "logprobs": np.asarray(out.logprobs).tolist(),
            "runs": [[[r.status, r.stdout] for r in row] for row in runs], "blocks_run_here": len(ran)}


def main() -> None:
    out_dir = sys.argv[1]
    from grpo_jax.parallel import distributed

    distributed.initialize()
    import jax

    from grpo_jax.parallel.sharding import mesh_from_shape

    result = record(*rollout(mesh_from_shape(MESH)))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"result_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
