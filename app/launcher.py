"""The `speclens` command: a subcommand runs the engine's command line, none opens the window.

It lives in the app, the top layer, because it reaches both: the engine never imports the app.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The window or a subcommand; Ctrl-C at any moment, imports included, ends with "interrupted" and
    exit status 130 (no traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from speclens.engine.tools.cli import SUBCOMMANDS  # inside the try: imports take seconds

        if argv and (argv[0] in SUBCOMMANDS or argv[0] in ("-h", "--help")):
            from speclens.engine.tools.cli import main as cli_main

            return cli_main(argv)
        # Qt aborts, naming no library, when its platform plugin cannot load: check first, and say what to install
        from speclens.engine.tools.display import check_platform, install_advice, no_display_reason

        check = check_platform()
        if not check.ok:
            print(install_advice(check), file=sys.stderr)
            return 1
        if (reason := no_display_reason(check.platform)) is not None:
            print(reason, file=sys.stderr)
            return 1
        from speclens.app.main import main as app_main  # the window

        return app_main(argv)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def _leave_on_ctrl_c(_signum, _frame) -> None:
    """Ctrl-C in a command: leave at once with status 130. Raising KeyboardInterrupt instead can land
    inside an import that swallows it (numpy's, seen here), leaving a half-imported module that fails
    later with a traceback; and nothing a command holds needs saving: files are written whole (temp
    file + rename), shards and the history as they go. The window installs its own handler once it is
    up (app.main: Ctrl-C closes it as its close button does)."""
    try:
        print("\ninterrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
    except (OSError, RuntimeError, ValueError):  # a write interrupted midway: leave anyway
        pass
    os._exit(130)


def entry() -> None:
    """The `speclens` console script. Once main() has returned, a late Ctrl-C is ignored, so the status
    is main()'s."""
    signal.signal(signal.SIGINT, _leave_on_ctrl_c)
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    entry()
