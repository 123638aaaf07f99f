"""Tools a policy can call while it answers: the sandbox that runs model-written Python.

``sandbox``        `Sandbox`, the one interface (code in; stdout, stderr and a status out), and
                   `LocalSandbox`, its local back-end: a fresh confined process per call;
                   `capabilities` measures which protections this machine enforces
``sandbox_child``  the program that process runs (standard library only; never imported)
``python_tool``    `PythonTool`: the format of tool-integrated reasoning (a ```python block
                   in, an ```output block back) and `statuses`, what a reward reads of it

Model-written code is untrusted input: it runs only through a `Sandbox`, never in the
library's own process. docs/tools.md lists the protections and how to plug in a remote
service behind the same interface.

Imports the standard library and grpo_jax's root modules (errors) only: the sampler's
multi-turn rollouts (``sampler.turns``) and the trainer above it call it from the host side
of the loop.
"""

from grpo_jax.tools.python_tool import PythonTool, statuses
from grpo_jax.tools.sandbox import (STATUSES, Confinement, ExecutionResult, LocalSandbox, Protection, Sandbox,
                                    SandboxError, SandboxLimits, capabilities)

__all__ = ["STATUSES", "Confinement", "ExecutionResult", "LocalSandbox", "Protection", "PythonTool", "Sandbox",
           "SandboxError", "SandboxLimits", "capabilities", "statuses"]
