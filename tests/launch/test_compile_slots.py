"""launch/compile.py --slots on a tiny preset for a real TPU slice (libtpu): the slot engine's
programs fit, and the expected rollout is the schedule's decode steps times one iteration's
cost plus the chunks' prefills, beside the static calls' steps on the same drawn lengths."""

import numpy as np
import pytest

from grpo_jax import aot
from grpo_jax.config import apply_overrides, get_preset
from grpo_jax.sampler import slots
from launch import compile as compile_script

pytestmark = pytest.mark.skipif(not aot.libtpu_available(), reason="needs libtpu (requirements-tpu.txt)")


def test_the_slot_programs_fit_and_the_rollout_is_their_cost_times_the_schedule():
    cfg = apply_overrides(get_preset("cpu-tiny"), ["rl.sample_prompts=2", "data.batch_size=8",
                                                   "rl.max_new_tokens=48", "rl.group_size=4"]).validate()
    lines = []
    reports = compile_script.slot_engine(cfg, "v5e:2x2", 16, log=lines.append)
    for name in ("slot_prefill", "slot_decode", "slot_append"):
        rep = reports[name]
        assert rep["peak_bytes"] < rep["hbm_capacity_bytes"] and rep["estimated_seconds"] > 0
        assert rep["expected_seconds"] >= rep["estimated_seconds"]
    est = reports["slot_rollout"]
    law = compile_script.SLOT_LENGTHS
    lengths = np.minimum(np.ceil(np.random.default_rng(law["seed"]).lognormal(np.log(law["median"]), law["sigma"],
                                                                              32)), 48).astype(int)
    assert est["slots"] == 8 and est["rows"] == 32  # one static call's rows: 2 questions x G = 4
    assert (est["decode_steps"], est["static_decode_steps"]) == (slots.schedule(lengths, 8)[0],
                                                                 slots.static_steps(lengths, 8))
    assert est["rollout_seconds"] == pytest.approx(est["decode_steps"] * reports["slot_decode"]["estimated_seconds"]
                                                   + est["chunks"] * reports["slot_prefill"]["estimated_seconds"])
    assert len(lines) == 4 and lines[-1].startswith("  slot rollout: 32 rows on 8 slots")
