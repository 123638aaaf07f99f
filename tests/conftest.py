"""Test-wide setup: 8 fake CPU devices so every sharding test sees a pod-slice-like mesh.

XLA reads XLA_FLAGS once, when jax initialises its backend, so this must run before any
test module imports jax.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
