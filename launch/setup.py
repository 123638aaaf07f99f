#!/usr/bin/env python3
"""Copy grpo_jax to every worker of a TPU VM and install it into ~/grpo_jax/.venv.

    python launch/setup.py --name grpo-jax --zone us-west4-a --project my-proj
    python launch/setup.py ... --repo-url https://github.com/me/grpo_jax.git --ref main

By default the local checkout's HEAD is packed with `git archive` (uncommitted changes
are NOT included: commit first), copied with `tpu-vm scp --worker=all` and unpacked.
With --repo-url every worker fetches the repository at --ref instead (into the same folder,
which may already hold the files launch/stage.py put there). Then, on every worker, a venv
is made once and `requirements.txt` plus `jax[tpu]` at the pinned jax version installed.
Safe to re-run after changing code: the venv is kept, pip only installs what changed.
"""
from __future__ import annotations

import argparse

import common  # launch/common.py: the script's folder is on sys.path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_tpu_arguments(parser, shape=False)
    common.add_source_arguments(parser)
    args = parser.parse_args(argv)
    runner = common.Runner(args.dry_run)
    settings = common.settings_from_args(args)
    for argv_ in common.setup_commands(settings, common.source_from_args(args)):
        runner.check(argv_)
    return 0


if __name__ == "__main__":
    common.main_guard(main)
