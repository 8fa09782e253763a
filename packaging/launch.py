"""Entry script of the frozen bundle: the same dispatch as the `speclens` command."""

import sys

from speclens.app.launcher import main

if __name__ == "__main__":
    sys.exit(main())
