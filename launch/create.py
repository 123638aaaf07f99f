#!/usr/bin/env python3
"""Create a Cloud TPU VM for grpo_jax, directly or through a queued resource.

    python launch/create.py --slice v5litepod-8 --zone us-west4-a --project my-proj --spot
    python launch/create.py --slice v4-32 --queued --spot --wait ...
    python launch/create.py --list-slices

A direct create fails at once when the zone has no capacity; a queued resource
(`--queued`) waits in Cloud TPU's queue until the slice can be provisioned, which is the
recommended way to get pod slices and Spot capacity.
"""
from __future__ import annotations

import argparse
import shlex

import common  # launch/common.py: the script's folder is on sys.path
from grpo_jax.parallel.slices import SLICES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_tpu_arguments(parser)
    parser.add_argument("--wait", action="store_true",
                        help="with --queued: poll until the queued resource is ACTIVE")
    parser.add_argument("--list-slices", action="store_true",
                        help="print the slice presets and exit")
    return parser.parse_args(argv)


def list_slices() -> None:
    print(f"{'slice':<15}{'devices':>8}{'hosts':>7}  {'train mesh':<14}{'sample mesh':<14}runtime")
    for p in SLICES.values():
        print(f"{p.name:<15}{p.num_devices:>8}{p.num_hosts:>7}  {str(p.train_mesh):<14}"
              f"{str(p.sample_mesh):<14}{p.runtime_version}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_slices:
        list_slices()
        return 0
    settings = common.settings_from_args(args)
    runner = common.Runner(args.dry_run)
    runner.check(common.create_command(settings))
    if settings.queued and args.wait:
        common.wait_until_healthy(runner, settings)
    if settings.queued and not args.wait and not args.dry_run:
        common.note(f"queued; check with: {shlex.join(common.state_command(settings))}")
    return 0


if __name__ == "__main__":
    common.main_guard(main)
