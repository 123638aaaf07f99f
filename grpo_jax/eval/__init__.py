"""Evaluation: how well a policy answers, with intervals.

``evaluation`` (greedy accuracy, Pass@K, Maj@K, and ``sample_and_score``, the one way a policy
is sampled and scored), ``evaluate_run`` (a benchmark run written as per-question JSONL),
``math_verify_check`` (a second answer checker), ``stats`` (intervals over seeds) and
``plots`` (PNG curves). Imports the root modules, ``parallel``, ``text``, ``tasks``,
``model`` and ``sampler``.
"""
