"""Entry script of the frozen bundle: the same dispatch as the `speclens` command."""

from speclens.app.launcher import entry

if __name__ == "__main__":
    entry()
