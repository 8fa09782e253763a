"""`speclens bench` (being written)."""
from __future__ import annotations

import argparse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def cmd_bench(args: argparse.Namespace) -> int:
    raise SystemExit("speclens bench is not available yet")
