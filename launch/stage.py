#!/usr/bin/env python3
"""Copy weights and data from GCS onto the local disk of every worker of a TPU VM.

    python launch/stage.py gs://my-bucket/models/deepseek-math-7b-instruct gs://my-bucket/data/gsm8k

Training reads `run.pretrained` (an HF folder or a GGUF file) and `data.data_dir` (the official
GSM8K / MATH files) from local disk, on every host of a slice at once. This copies each
gs:// SOURCE to ~/grpo_jax/staged/<its last name> on every worker with `gcloud storage cp -r
--no-clobber` (the TPU VM images ship the gcloud CLI; the VM's service account must be able to
read the bucket), then prints the overrides that point a run there. The run's working folder is
~/grpo_jax, so the paths are relative to it:

    run.pretrained=staged/deepseek-math-7b-instruct data.data_dir=staged/gsm8k

A source that is a single file (a .gguf) lands as staged/<file name>. Re-running copies only
files not there yet. Run it after launch/setup.py (which keeps staged/). `launch/run.py
--stage SOURCE ...` does the same before it starts the run, and again on every TPU it
re-creates after a preemption, whose disks start empty.
"""
from __future__ import annotations

import argparse

import common  # launch/common.py: the script's folder is on sys.path
from grpo_jax.config import FILE_TASKS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="gs://BUCKET/PATH of a model folder, a .gguf file or a dataset folder")
    common.add_tpu_arguments(parser, shape=False)
    args = parser.parse_args(argv)
    settings = common.settings_from_args(args)
    common.Runner(args.dry_run).check(common.stage_command(settings, args.sources))
    for source, target in zip(args.sources, common.staged_paths(args.sources)):
        common.note(f"{source} -> ~/{common.REMOTE_DIR}/{target} on every worker: {override_for(target)}")
    return 0


def override_for(target: str) -> str:
    """The override that points a run at a staged source: a .gguf is a model and a folder named
    after a file task holds its data; any other folder may be either, so both are named."""
    name = target.rsplit("/", 1)[-1]
    if name.endswith(".gguf"):
        return f"run.pretrained={target}"
    if name.lower() in FILE_TASKS:
        return f"data.data_dir={target}"
    return f"run.pretrained={target} if it is a model, data.data_dir={target} if it holds GSM8K or MATH files"


if __name__ == "__main__":
    common.main_guard(main)
