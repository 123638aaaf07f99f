"""A run on disk: ``checkpointing`` (Orbax checkpoints of the train state, restorable onto any
mesh) and ``run_files`` (the files beside them from which a run is rebuilt). Imports the root
modules and ``parallel``.
"""
