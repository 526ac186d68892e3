"""Content fingerprints for caches and the artifact list."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_json(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def source_fingerprint(*packages_dirs: Path) -> str:
    """Hash of the Python sources under the given folders: a cached artifact built by other code is stale."""
    h = hashlib.sha256()
    for folder in packages_dirs:
        for f in sorted(Path(folder).rglob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()
