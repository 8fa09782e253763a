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


def entry() -> None:
    """The `speclens` console script. An interrupted run leaves with status 130 at once: CPython kills
    itself with SIGINT at exit (status -2, whatever caught the interrupt) when Ctrl-C landed while an
    extension ran Python code during an import. Once main() has returned, a late Ctrl-C is ignored,
    so the status is main()'s."""
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    entry()
