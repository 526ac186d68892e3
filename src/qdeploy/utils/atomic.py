"""Write files so that a crash or an error never leaves a half-written artifact behind."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import json
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

from qdeploy.errors import QDeployError
from qdeploy.utils.faults import kill_point
from qdeploy.utils.hashing import sha256_file
from qdeploy.utils.log import warn


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


# Marks a folder as qdeploy's own output and lists every file qdeploy wrote into it (size, hash, mtime).
OUTPUT_MARKER = ".qdeploy-output"
MANIFEST_FORMAT = "qdeploy.output/2"
SWAP_RECORD = "swap.json"  # in .DIR.old-*: which staging folder the interrupted swap was moving in
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


class OutputDir:
    """A run's output folder, written as a whole: everything goes into a staging folder beside it
    (``.DIR.staging-*``), and ``commit()`` swaps it in. ``DIR`` is at any moment the previous output or the
    new one, whole; results of two runs are never mixed.

    - The swap is one atomic exchange of the two folders where the system can (Linux ``renameat2``
      ``RENAME_EXCHANGE``), else two renames (``DIR`` → ``.DIR.old-*/previous``, staging → ``DIR``) with a record
      of the swap written first. Ctrl-C (SIGINT/SIGTERM) during the swap takes effect once it is done.
    - The file list (``OUTPUT_MARKER``) is written into staging before the swap. Opening ``DIR`` again first
      recovers what a killed run left beside it (:func:`recover`): a half-done swap is finished (the staging
      folder is complete by its file list) or rolled back, and staging folders of dead runs are deleted.
    - A folder is replaced only when qdeploy wrote everything in it: a file it did not write (or one changed
      since) is refused up front, naming it, and never deleted.
    """

    def __init__(self, final: str | os.PathLike):
        final = Path(final).expanduser()
        if final.is_symlink() and final.is_dir():  # replace the folder the link points at; the link stays
            final = final.resolve()
        self.final = final
        parent = ensure_writable_dir(final.parent if str(final.parent) else Path("."))
        for line in recover(final):
            warn(line)
        if final.exists():
            problem = foreign_files(final)
            if problem:
                raise QDeployError(problem)
        with _dir_lock(parent):  # made and locked before another run's recover() can look at it
            self.staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.staging-", dir=parent))
            self._lock = _hold_lock(self.staging)  # a live run's staging folder is not stale: recover() leaves it
        self.committed = False

    def path(self, name: str) -> Path:
        return self.staging / name

    def commit(self) -> Path:
        """Swap the staging folder in; returns the folder the output now is in (``DIR``; see below otherwise)."""
        if self.committed:
            return self.final
        write_manifest(self.staging)
        os.chmod(self.staging, 0o777 & ~_umask())  # mkdtemp made it 0700
        kill_point("swap-before")
        final, old = self.final, None
        with _signals_deferred(), _dir_lock(final.parent):
            problem = foreign_files(final) if final.exists() else None
            if problem:  # files appeared in DIR while this run ran: keep them, put the new output beside DIR
                final = _free_sibling(final)
                warn(f"{problem}: it was left as it is and the new output is in {final}")
            if not final.exists():
                os.replace(self.staging, final)
                kill_point("swap-between")
            elif _exchange(self.staging, final):
                old = self.staging  # now holds the previous output
                kill_point("swap-between")
            else:
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
                write_json(old / SWAP_RECORD, {"staging": self.staging.name})
                os.replace(final, old / "previous")
                try:
                    kill_point("swap-between")
                    os.replace(self.staging, final)
                except BaseException:
                    if not final.exists():  # roll back: the previous output stays
                        os.replace(old / "previous", final)
                        shutil.rmtree(old, ignore_errors=True)
                    raise
            self.committed = True
            self.final = final
        self._lock = _release_lock(self._lock)
        kill_point("swap-after")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def abort(self) -> None:
        if not self.committed:
            shutil.rmtree(self.staging, ignore_errors=True)
            self._lock = _release_lock(self._lock)


# ---------------------------------------------------------------------------------------------------------------
# The file list, and what is not on it

def write_manifest(folder: Path) -> dict:
    """Write ``folder/OUTPUT_MARKER``: every file below ``folder`` (size, sha256, mtime) and every subfolder."""
    files, dirs = {}, []
    for rel, st in _entries(folder):
        if stat.S_ISDIR(st.st_mode):
            dirs.append(rel)
        elif rel != OUTPUT_MARKER:
            files[rel] = {"size": st.st_size, "sha256": sha256_file(folder / rel), "mtime_ns": st.st_mtime_ns}
    manifest = {"format": MANIFEST_FORMAT,
                "note": "written by qdeploy: the next run into this folder replaces the files listed here, and refuses "
                        "to when the folder holds anything else",
                "files": files, "dirs": dirs}
    (folder / OUTPUT_MARKER).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def read_manifest(folder: Path) -> Optional[dict]:
    try:
        manifest = json.loads((Path(folder) / OUTPUT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT and isinstance(manifest.get("files"), dict)
    return manifest if ok else None


def foreign_files(folder: Path) -> Optional[str]:
    """None when qdeploy may replace ``folder`` (empty, or holding only the files its file list names, unchanged);
    else a one-line reason naming one file."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"output directory {folder} is not a directory"
    entries = _entries(folder)
    if not entries:
        return None
    manifest = read_manifest(folder)
    if manifest is None:
        names = sorted(rel for rel, _ in entries)
        if OUTPUT_MARKER in names:
            return (f"output directory {folder} holds files that qdeploy did not write, as far as it can tell: an older "
                    f"qdeploy wrote it without a file list (e.g. {next(n for n in names if n != OUTPUT_MARKER)}); "
                    "delete it or choose another --out")
        return (f"output directory {folder} holds files that qdeploy did not write (e.g. {names[0]}); choose a new or "
                "empty folder, or move them out (qdeploy replaces an output folder only when it wrote everything in it)")
    files, dirs = manifest["files"], set(manifest.get("dirs", []))
    problems = []
    for rel, st in entries:
        if rel == OUTPUT_MARKER:
            continue
        if stat.S_ISDIR(st.st_mode):
            if rel not in dirs:
                problems.append(rel)
            continue
        meta = files.get(rel)
        if meta is None or not stat.S_ISREG(st.st_mode):
            problems.append(rel)
        elif st.st_size != meta.get("size") or (st.st_mtime_ns != meta.get("mtime_ns")
                                                 and sha256_file(folder / rel) != meta.get("sha256")):
            problems.append(f"{rel}, changed since qdeploy wrote it")
    if not problems:
        return None
    return (f"output directory {folder} holds files that qdeploy did not write (e.g. {sorted(problems)[0]}); move them "
            "out or choose another --out (qdeploy replaces an output folder only when it wrote everything in it)")


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds every file its file list names, with the listed size and hash."""
    manifest = read_manifest(folder)
    if manifest is None:
        return False
    for rel, meta in manifest["files"].items():
        path = Path(folder) / rel
        try:
            if path.stat().st_size != meta.get("size") or sha256_file(path) != meta.get("sha256"):
                return False
        except OSError:
            return False
    return True


def _entries(folder: Path) -> list[tuple[str, os.stat_result]]:
    """Every file, folder and link below ``folder`` (links not followed), as (relative posix path, lstat)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            out.append((path.relative_to(folder).as_posix(), path.lstat()))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Recovery after a killed run

def recover(final: Path) -> list[str]:
    """Repair what a killed run left beside ``final`` (``.NAME.old-*``, ``.NAME.staging-*``); returns what it did.

    - ``final`` missing and a swap record present (killed between the two renames): finish the swap when its
      staging folder is complete by its file list, else roll back (the previous output returns to ``final``).
    - ``final`` present: a leftover ``.NAME.old-*`` is a previous output already replaced: deleted.
    - ``.NAME.staging-*`` that no live process holds (its lock died with its run): deleted. All of these are
      folders qdeploy made; nothing else beside ``final`` is touched.
    """
    final = Path(final)
    parent, done = final.parent, []
    if not parent.is_dir():
        return done
    pattern = glob.escape(f".{final.name}")
    with _dir_lock(parent):
        for old in sorted(parent.glob(pattern + ".old-*")):
            if old.is_symlink() or not old.is_dir():
                continue
            record = _read_json(old / SWAP_RECORD)
            name = record.get("staging") if isinstance(record, dict) else None
            staging = parent / name if isinstance(name, str) and "/" not in name and name.startswith(f".{final.name}.staging-") else None
            previous = old / "previous"
            if not os.path.lexists(final):
                if staging is not None and staging.is_dir() and is_complete(staging):
                    os.replace(staging, final)
                    done.append(f"{final}: an interrupted run had moved the previous output aside; its complete new "
                                "output is now in place")
                elif previous.is_dir():
                    os.replace(previous, final)
                    done.append(f"{final}: an interrupted run had moved the previous output aside; restored it")
                else:
                    continue
            elif previous.exists() and staging is not None and staging.is_dir():
                done.append(f"{final}: {old} holds a previous output that an interrupted run moved aside, but {final} "
                            "was created since: left both as they are")
                continue
            shutil.rmtree(old, ignore_errors=True)
        stale = [p for p in parent.glob(pattern + ".staging-*") if p.is_dir() and not p.is_symlink() and _unheld(p)]
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
    return done


def _read_json(path: Path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _free_sibling(final: Path) -> Path:
    n = 2
    while os.path.lexists(final.with_name(f"{final.name}-{n}")):
        n += 1
    return final.with_name(f"{final.name}-{n}")


# ---------------------------------------------------------------------------------------------------------------
# Locks (flock: released by the kernel when the process dies, SIGKILL included) and the swap itself

def _hold_lock(folder: Path) -> Optional[int]:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _release_lock(fd: Optional[int]) -> None:
    """Close ``fd`` (releasing its lock); returns None for the caller to forget it."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    return None


def _unheld(folder: Path) -> bool:
    """True when no process holds ``folder``'s lock (its run is over); False when one does or locks don't work."""
    fd = _hold_lock(folder)
    _release_lock(fd)
    return fd is not None


@contextlib.contextmanager
def _dir_lock(folder: Path) -> Iterator[None]:
    """Serialise swaps and recoveries beside the same folder (several qdeploy processes writing into one parent)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # a file system without flock: unserialised, as before
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT/SIGTERM received inside the block act when it ends (the swap is done, not half done)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for s in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(s)
        if handler is not None:  # None: installed outside Python, cannot be put back
            previous[s] = signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            os.kill(os.getpid(), s)  # now with the handler the process had (KeyboardInterrupt, termination)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system or file system
    cannot. ``QDEPLOY_SWAP=rename`` forces the two-rename swap (tests)."""
    if sys.platform != "linux" or os.environ.get("QDEPLOY_SWAP") == "rename":
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc before 2.28
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))
