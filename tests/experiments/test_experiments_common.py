"""experiments/common.py: the SFT settings each task gets when the command line leaves them out,
and the cache of results every seed shares."""
import argparse
import json
import os

import pytest

from tests.cli.test_evaluate import script

common = script("common")


def parse(argv):
    p = argparse.ArgumentParser()
    common.add_sft_args(p)
    return p.parse_args(argv)


def test_the_testbed_trains_until_its_tables_are_learned_others_a_fixed_count():
    args = parse([])
    common.resolve_sft_args(args, "modular")
    assert (args.sft_steps, args.sft_until) == (4000, 0.95)
    args = parse([])
    common.resolve_sft_args(args, "arithmetic")
    assert (args.sft_steps, args.sft_until) == (1500, 0.0)


def test_what_the_command_line_gives_is_kept():
    args = parse(["--sft-steps", "7", "--sft-until", "0"])  # 0 is a value, not "not given"
    common.resolve_sft_args(args, "modular")
    assert (args.sft_steps, args.sft_until) == (7, 0.0)


def test_an_sft_cache_from_before_data_tool_prob_stands_for_a_corpus_without_tool_solutions(monkeypatch, tmp_path):
    from grpo_jax.checkpoints import checkpointing
    from grpo_jax.config import apply_overrides, get_preset

    (tmp_path / "checkpoints").mkdir()
    compared = []

    def cached(tool_prob):
        """A cached start whose saved config has this data.tool_prob (None: saved before the field)."""
        saved = apply_overrides(get_preset("cpu-tiny"), ["data.task=modular", f"run.run_dir={tmp_path}"]).to_dict()
        if tool_prob is None:
            del saved["data"]["tool_prob"]
        else:
            saved["data"]["tool_prob"] = tool_prob

        class Saved:
            def __init__(self, directory):
                pass

            def all_steps(self):
                return [4]

            def read_meta(self, step):
                return {"config": saved}

            def close(self):
                pass

        monkeypatch.setattr(checkpointing, "Checkpointer", Saved)
        monkeypatch.setattr(checkpointing, "check_run_dir", lambda directory, requested, also: compared.append(
            checkpointing.config_differences(saved, requested, also)))

    def differences(saved_prob, requested_prob):
        cached(saved_prob)
        cfg = apply_overrides(get_preset("cpu-tiny"), ["data.task=modular", f"data.tool_prob={requested_prob}",
                                                       f"run.run_dir={tmp_path}"]).validate()
        common._check_sft_cache(cfg)
        return [d[0] for d in compared[-1]]

    assert differences(None, 0.0) == []  # a start cached before the field: no tool solutions
    assert differences(None, 0.25) == ["data.tool_prob"]
    assert differences(0.25, 0.0) == ["data.tool_prob"]
    assert differences(0.25, 0.25) == [] and differences(0.0, 0.0) == []


def test_a_cached_result_is_computed_once_per_key_and_a_killed_write_keeps_the_file(tmp_path, monkeypatch):
    path, calls = str(tmp_path / "starts.json"), []
    compute = lambda value: lambda: (calls.append(value), {"accuracy": value})[1]
    said = []
    assert common.cached_json(path, {"before": "task", "eval_size": 192}, compute(0.167), said.append) == {"accuracy": 0.167}
    assert common.cached_json(path, {"control": "instructed", "eval_size": 192}, compute(0.089), said.append) == \
        {"accuracy": 0.089}
    # the same keys read, whatever the new computation would say; another key computes
    assert common.cached_json(path, {"eval_size": 192, "before": "task"}, compute(0.5), said.append) == {"accuracy": 0.167}
    assert common.cached_json(path, {"before": "task", "eval_size": 96}, compute(0.25), said.append) == {"accuracy": 0.25}
    assert calls == [0.167, 0.089, 0.25]
    assert said == [f"read from {path} (computed before for the same key)"]
    assert [e["value"]["accuracy"] for e in json.loads(open(path).read())] == [0.167, 0.089, 0.25]

    def killed(tmp, obj):  # the write dies half way: the old file stays whole
        open(tmp, "w").write("[{")
        raise KeyboardInterrupt

    monkeypatch.setattr(common, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        common.cached_json(path, {"before": "task", "eval_size": 64}, compute(0.3))
    assert len(json.loads(open(path).read())) == 3 and os.path.exists(path + ".tmp")
