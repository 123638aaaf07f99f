"""The command line: ``train`` (grpo-train), ``evaluate`` (grpo-evaluate), ``export``
(grpo-export), and ``runs`` (a run as those programs build and load it). The top of the
package: it may import every other package.

This module is the one way for every entry point to report a user error: `<prog>: error: <message>`, exit 2.

    if __name__ == "__main__":
        cli.run(main)

A traceback is shown only with `--debug` on the command line or GRPO_JAX_DEBUG=1, since a
library error's message already names the input to fix. Any other exception is a bug and
propagates with its traceback. Command-line usage errors (argparse's, and the `parser.error`
calls of entry points) are reported the same way, as one line without the usage block.
On a machine without an accelerator, entry points run JAX on the CPU (JAX_PLATFORMS=cpu, as
`make` sets it) unless JAX_PLATFORMS says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import Callable

from grpo_jax.errors import ConfigError, GrpoJaxError


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring as written, and every option's default in its help: "(default: X)" is
    appended where the help text does not already say what the default is."""

    def _format_action(self, action):
        if action.help is None and action.default is not argparse.SUPPRESS:
            action.help = ""  # argparse prints no help line at all for None: the default must show
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text


# argparse's message when a list option (`--seeds 0 1 2`) swallowed the overrides after it.
_SWALLOWED_OVERRIDE = re.compile(r"invalid (?:int|float) value: '[A-Za-z_]\w*\.[A-Za-z_]\w*=")


def _usage_error(parser: argparse.ArgumentParser, message: str):
    if _SWALLOWED_OVERRIDE.search(message):
        message += (" (a section.field=value override was read as one of a list option's values: put the "
                    "overrides before the option, or end its list with --, as in --seeds 0 1 2 -- rl.beta=0)")
    raise ConfigError(message)


def debug_requested(argv: list[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("GRPO_JAX_DEBUG", "") not in ("", "0")


def configure_logging(fmt: str = "%(message)s", datefmt: str | None = None) -> None:
    """Root logging with progress (below WARNING) on stdout and warnings on stderr, so stderr
    holds only what needs attention: a failed run's stderr is its one error line."""
    formatter = logging.Formatter(fmt, datefmt)
    progress = logging.StreamHandler(sys.stdout)
    progress.addFilter(lambda record: record.levelno < logging.WARNING)
    warnings_ = logging.StreamHandler(sys.stderr)
    warnings_.setLevel(logging.WARNING)
    for handler in (progress, warnings_):
        handler.setFormatter(formatter)
    logging.basicConfig(level=logging.WARNING, handlers=[progress, warnings_])


# Device files that mean an accelerator JAX should look for: TPU chips (/dev/accel*, or VFIO
# groups on v5e/v6e), NVIDIA GPUs.
_ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")


def default_jax_platform(environ=os.environ, accelerator_files=_ACCELERATOR_FILES) -> str | None:
    """"cpu" when JAX_PLATFORMS is unset and the machine has no accelerator, else None.

    With libtpu installed (requirements-tpu.txt, for the ahead-of-time TPU check), JAX
    probes for TPU metadata on a CPU-only machine and prints libtpu's errors before the
    run; `make` targets set JAX_PLATFORMS=cpu for that reason, and entry points do the same."""
    import glob

    if environ.get("JAX_PLATFORMS") is not None:
        return None
    if any(glob.glob(pattern) for pattern in accelerator_files):
        return None
    return "cpu"


def _use_default_jax_platform() -> None:
    platform = default_jax_platform()
    if platform is None:
        return
    os.environ["JAX_PLATFORMS"] = platform
    if "jax" in sys.modules:  # imported with the entry point's module: set before any backend starts
        sys.modules["jax"].config.update("jax_platforms", platform)


def run(main: Callable[..., object], prog: str | None = None, *, pass_argv: bool = False) -> None:
    """Call `main()` (`main(sys.argv[1:])` with ``pass_argv``) and exit with its int result
    (0 otherwise); library errors exit 2 in one line. With ``pass_argv``, `-h`/`--help`
    prints the script's docstring instead: such a `main` takes `--preset NAME` and overrides
    (`grpo_jax.config.config_from_argv`) and has no parser of its own to answer it."""
    prog = prog or os.path.basename(sys.argv[0])
    _use_default_jax_platform()
    if pass_argv and {"-h", "--help"} & set(sys.argv[1:]):
        from grpo_jax.config import PRESETS

        doc = (sys.modules[main.__module__].__doc__ or "").strip()
        print(f"usage: {prog} [--preset NAME] [section.field=value ...]\n\n{doc}\n\noptions:\n"
              f"  --preset NAME  one of {', '.join(sorted(PRESETS))} (default: cpu-tiny)")
        sys.exit(0)
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")  # entry points' own parsers do not know the flag
        os.environ["GRPO_JAX_DEBUG"] = "1"
    # Every entry point builds its own argparse parser; routing their errors here (rather
    # than changing each parser) keeps "one line, exit 2" true for all of them.
    argparse_error, argparse.ArgumentParser.error = argparse.ArgumentParser.error, _usage_error
    try:
        result = main(sys.argv[1:]) if pass_argv else main()
    except GrpoJaxError as err:
        if debug_requested():
            raise
        sys.stdout.flush()  # progress printed so far (os._exit below flushes nothing)
        sys.stderr.write(f"{prog}: error: {' '.join(str(err).split())}\n")
        sys.stderr.flush()
        # os._exit skips interpreter shutdown, where Orbax/tensorstore threads left open by
        # the failed run print "sys.meta_path is None" noise.
        os._exit(2)
    finally:
        argparse.ArgumentParser.error = argparse_error
    sys.exit(result if isinstance(result, int) else 0)
