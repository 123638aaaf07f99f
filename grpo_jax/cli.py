"""One way for every entry point to report a user error: `<prog>: error: <message>`, exit 2.

    if __name__ == "__main__":
        cli.run(main)

A traceback is shown only with `--debug` on the command line or GRPO_JAX_DEBUG=1, since a
library error's message already names the input to fix. Any other exception is a bug and
propagates with its traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from grpo_jax.errors import GrpoJaxError


def debug_requested(argv: list[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("GRPO_JAX_DEBUG", "") not in ("", "0")


def run(main: Callable[[], object], prog: str | None = None) -> None:
    """Call `main()` and exit with its int result (0 otherwise); library errors exit 2 in one line."""
    prog = prog or os.path.basename(sys.argv[0])
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")  # entry points' own parsers do not know the flag
        os.environ["GRPO_JAX_DEBUG"] = "1"
    try:
        result = main()
    except GrpoJaxError as err:
        if debug_requested():
            raise
        sys.stderr.write(f"{prog}: error: {' '.join(str(err).split())}\n")
        sys.stderr.flush()
        # os._exit skips interpreter shutdown, where Orbax/tensorstore threads left open by
        # the failed run print "sys.meta_path is None" noise.
        os._exit(2)
    sys.exit(result if isinstance(result, int) else 0)
