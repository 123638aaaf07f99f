"""Ahead-of-time TPU compilation on a CPU-only machine (needs ``libtpu`` installed).

``topology_mesh(slice)`` builds the slice's real train mesh from
``jax.experimental.topologies``; ``compile_train_step(cfg, mesh, ...)`` lowers and compiles
the train step on abstract, sharded arguments; ``report(compiled, chip)`` turns the
executable's ``memory_analysis()``/``cost_analysis()`` into per-chip numbers and
``check_fit`` raises ``FitError`` naming the program when peak HBM exceeds the chip.

The programs are the run's own (``grpo_jax.rl.programs``); their FLOPs and bytes come from
cost twins with every loop trip counted (``sampler_cost``, ``train_cost``), and MFU counts
the model's FLOPs only (``model_flops``). All numbers are compiler estimates, not
measurements on a TPU.

One module per concern: ``topology`` (the slice's devices and meshes), ``lowering`` (the
run's programs on abstract arguments), ``hlo`` (reading the compiled HLO text: loops,
collectives), ``cost`` (the cost twins, model FLOPs, the roofline report) and ``fit``
(per-chip memory against HBM), with ``tpu_specs`` (per-chip constants) and ``provenance``
(which code a committed report came from).
"""

from grpo_jax.aot.cost import (TWIN_OPTIONS, NotCounted, call_cost, cost_twin, decode_bytes_analytic,
                               loop_free_cost, matmul_params, model_flops, report, sampler_cost, train_cost, train_flops,
                               twin_calls)
from grpo_jax.aot.fit import FitError, bytes_per_chip, check_fit, compile_lowered, fit, memory
from grpo_jax.aot.hlo import collective_ops, collectives
from grpo_jax.aot.lowering import (abstract_batch, compile_sampler, compile_train_step, lower_sampler, slot_programs,
                                   lower_tool_turn, lower_train_step, run_sampler, sampler_calls, tool_turn_calls,
                                   train_state)
from grpo_jax.aot.topology import libtpu_available, sample_mesh, split_of, topology_devices, topology_mesh

__all__ = ["FitError", "NotCounted", "TWIN_OPTIONS", "abstract_batch", "bytes_per_chip", "call_cost",
           "check_fit", "collective_ops", "collectives", "compile_lowered", "compile_sampler", "slot_programs",
           "compile_train_step", "cost_twin", "decode_bytes_analytic", "fit", "libtpu_available",
           "loop_free_cost", "lower_sampler", "lower_tool_turn", "lower_train_step", "matmul_params",
           "memory", "model_flops", "report", "run_sampler", "sample_mesh", "sampler_calls", "sampler_cost",
           "split_of", "tool_turn_calls", "topology_devices", "topology_mesh", "train_cost", "train_flops",
           "train_state", "twin_calls"]
