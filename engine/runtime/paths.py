"""Where SpecLens keeps what it makes on this machine (converted models, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """Where SpecLens keeps converted models (SPECLENS_CACHE_DIR overrides)."""
    return Path(os.environ.get("SPECLENS_CACHE_DIR") or platformdirs.user_cache_dir("speclens"))
