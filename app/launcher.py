"""The `speclens` command: a subcommand runs the engine's command line, none opens the window.

It lives in the app, the top layer, because it reaches both: the engine never imports the app.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from speclens.engine.tools.cli import SUBCOMMANDS


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and (argv[0] in SUBCOMMANDS or argv[0] in ("-h", "--help")):
        from speclens.engine.tools.cli import main as cli_main

        return cli_main(argv)
    from speclens.app.main import main as app_main  # the window

    return app_main(argv)


if __name__ == "__main__":
    sys.exit(main())
