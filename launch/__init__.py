"""Cloud TPU launch scripts (create, setup, run, delete); shared code in `launch.common`."""
