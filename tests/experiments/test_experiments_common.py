"""experiments/common.py: the SFT settings each task gets when the command line leaves them out."""
import argparse

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
