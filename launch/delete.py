#!/usr/bin/env python3
"""Delete the TPU VM (or, with --queued, the queued resource and its node).

    python launch/delete.py --name grpo-jax --zone us-west4-a --project my-proj

Checkpoints written to gs:// survive; anything under ~/grpo_jax on the workers is lost.
"""
from __future__ import annotations

import argparse

import common  # launch/common.py: the script's folder is on sys.path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_tpu_arguments(parser, shape=False)
    args = parser.parse_args(argv)
    common.Runner(args.dry_run).check(common.delete_command(common.settings_from_args(args)))
    return 0


if __name__ == "__main__":
    common.main_guard(main)
