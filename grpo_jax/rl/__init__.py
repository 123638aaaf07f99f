"""Reinforcement learning: the paradigm's algorithms, their losses and the loop that runs them.

Read in this order: ``advantages`` (GRPO's outcome / process advantages, GAE), ``losses``
(per-token objectives and their aggregation; the GRPO loss), ``algorithms`` (SFT, RFT,
Online RFT, DPO, PPO and GRPO as one kind of object), ``data_sources`` and ``batching``
(where a step's (q, o) come from, and the device ``Batch``), ``optimizer`` (AdamW and the
multi-step schedule), ``train_step`` (the one jitted step), ``programs`` (the step and
optimizers a run executes), ``reward_models`` (ORM / PRM, trained and scored here),
``metrics`` and ``trainer`` (the loop, the only place with state). Imports every package
below it: the root modules, ``parallel``, ``text``, ``tasks``, ``model``, ``checkpoints``,
``sampler`` and ``eval``.
"""
