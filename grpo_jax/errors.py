"""The library's error family: bad input a user can fix, reported by entry points as one line.

Every error here means "the input is wrong", never "the code is wrong": its message names the
input (key, file and line, parameter path, config field) and what to do. Entry points print
these as `<prog>: error: <message>` and exit 2 (`grpo_jax.cli`); any other exception is a bug
and keeps its traceback. They subclass ValueError so existing `except ValueError` callers
keep working.
"""


class GrpoJaxError(ValueError):
    """Base of every user-fixable error raised by grpo_jax."""


class ConfigError(GrpoJaxError):
    """A configuration key, type or value that cannot be used."""


class UnknownNameError(ConfigError, KeyError):
    """A name (task, dataset, TPU slice, chip) that is not registered. Also a KeyError,
    which these lookups raised before joining the family."""

    __str__ = ValueError.__str__  # the message as written, not KeyError's quoted repr


class MeshError(GrpoJaxError):
    """A mesh that does not fit the available devices."""


class DataError(GrpoJaxError):
    """A dataset folder or file that cannot be read; the message names the file and line."""


class PretrainedError(GrpoJaxError):
    """A checkpoint that cannot be imported; the message names the tensor or field."""


class CheckpointError(GrpoJaxError):
    """A run dir whose checkpoints do not match the requested config, cannot be read, or
    cannot be written."""


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint folder that holds steps of which none can be restored; ``steps`` lists
    them, newest first, so a caller can set them aside and start over."""

    def __init__(self, message: str, steps: list[int]):
        super().__init__(message)
        self.steps = steps


class RewardModelError(GrpoJaxError):
    """A reward-model path or checkpoint that cannot be used."""


class SandboxError(GrpoJaxError):
    """A sandbox that cannot run code at all (its interpreter missing, its process unable to
    confine itself, a remote service unreachable): not the code's fault, so no status.
    ``kind`` names the failure in a word (``start``, ``confine``, ``launcher``, ``remote``),
    by which a rollout counts them (``tools/backend_failures/<kind>``)."""

    def __init__(self, message: str, kind: str = "backend"):
        super().__init__(message)
        self.kind = kind
