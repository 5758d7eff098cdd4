"""Where radixserve keeps what it builds on disk (converted models, compiled kernels, the disk
tier's default folder). A leaf module: every layer may ask it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of radixserve's on-disk cache: $RADIXSERVE_CACHE, else ~/.cache/radixserve."""
    return Path(os.environ.get("RADIXSERVE_CACHE") or "~/.cache/radixserve").expanduser()
