"""Where qdeploy keeps what it can reuse across runs (exports, calibration ranges, built artifacts)."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("QDEPLOY_CACHE", Path.home() / ".cache" / "qdeploy"))
