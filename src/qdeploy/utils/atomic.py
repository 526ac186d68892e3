"""Write files so that a crash or an error never leaves a half-written artifact behind."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from qdeploy.errors import QDeployError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds."""
    path = Path(path)
    ensure_writable_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.exists():
            os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp creates 0600; give the usual permissions
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")


def ensure_writable_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and check that files can be created in it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QDeployError(f"output directory {path} cannot be created: {e.strerror or e}") from None
    if not path.is_dir():
        raise QDeployError(f"output directory {path} is not a directory")
    # os.access() says yes to root even on read-only mounts: probe with a real file instead.
    try:
        fd, probe = tempfile.mkstemp(prefix=".qdeploy-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise QDeployError(f"output directory {path} is not writable: {e.strerror or e}") from None
    return path


# Marks a folder as qdeploy's own output: only such a folder (or an empty one) is ever replaced.
OUTPUT_MARKER = ".qdeploy-output"


class OutputDir:
    """A run's output folder, written as a whole: everything goes into a staging folder beside it,
    and ``commit()`` swaps it in. An older run's files are replaced whole or, if the run stops early,
    left untouched; results of two runs are never mixed.

    A non-empty folder that qdeploy did not write (no marker, no results.json) is refused up front:
    replacing it would delete the user's files.
    """

    def __init__(self, final: str | os.PathLike):
        self.final = Path(final).expanduser()
        if self.final.exists():
            if not self.final.is_dir():
                raise QDeployError(f"output directory {self.final} is not a directory")
            entries = [p.name for p in self.final.iterdir()]
            ours = OUTPUT_MARKER in entries or "results.json" in entries
            if entries and not ours:
                raise QDeployError(
                    f"output directory {self.final} holds files that qdeploy did not write (e.g. {sorted(entries)[0]}); "
                    "choose a new or empty folder (an earlier qdeploy output folder is replaced whole)")
        parent = ensure_writable_dir(self.final.parent if str(self.final.parent) else Path("."))
        self.staging = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.staging-", dir=parent))
        self.committed = False

    def path(self, name: str) -> Path:
        return self.staging / name

    def commit(self) -> Path:
        (self.staging / OUTPUT_MARKER).write_text("written by qdeploy; this folder is replaced whole by the next run\n")
        old = None
        if self.final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.old-", dir=self.final.parent))
            os.replace(self.final, old / "previous")
        os.replace(self.staging, self.final)
        self.committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.final

    def abort(self) -> None:
        if not self.committed:
            shutil.rmtree(self.staging, ignore_errors=True)
