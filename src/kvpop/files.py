"""Files and folders that a crash, a kill or a full disk never leaves half-written.

* :func:`atomic_write`: one file, written to a temporary name beside it and renamed over it.
* :func:`atomic_writes`: several files that belong together (a checkpoint's weights and its
  training state): all are written first, then renamed; a failed write (a full disk) leaves
  every previous file whole.
* :func:`atomic_dir`: a folder (an adapter bundle) replaced in one step: the new folder is
  written beside it and swapped in with one atomic exchange (Linux ``renameat2``
  ``RENAME_EXCHANGE``), so the path always holds either the old or the new folder. Where the
  exchange is not available (other systems, some file systems) the old folder is renamed away
  and the new one in; a kill between those two renames leaves the old folder at
  ``.<name>.old-*``, which :func:`clean_leftovers` puts back.
* :func:`clean_leftovers`: what killed writers left (``.<name>.*.tmp`` files, ``.<name>.tmp-*``
  and ``.<name>.old-*`` folders), removed at the next start of a writer.

Files get the user's umask mode (``0o666 & ~umask``; folders ``0o777 & ~umask``), and are
synced before they are renamed into place, and their folder after.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "atomic_dir",
    "atomic_write",
    "atomic_writes",
    "check_writable_dir",
    "clean_leftovers",
    "file_mode",
    "fsync_dir",
    "json_safe",
    "write_json",
]

# what the writers here leave when killed: mkstemp/mkdtemp add 8 characters of [a-z0-9_]
_TMP_FILE = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp$")
_TMP_DIR = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[a-z0-9_]{8}$")


def file_mode(folder: bool = False) -> int:
    """The mode a new file (or folder) gets under the user's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask


def fsync_dir(path: str | os.PathLike) -> None:
    """Make renames and unlinks in the folder ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> None:
    """Call ``write(tmp_path)`` then rename over ``path`` (same folder, so the rename is atomic): a
    crash or a full disk leaves the previous file whole. The mode is set after writing: ``mkstemp``
    creates 0600, and writers such as safetensors' ``save_file`` recreate the file 0600 too."""
    atomic_writes([(path, write)])


def atomic_writes(items: list[tuple[str | os.PathLike, Callable[[str], object]]]) -> None:
    """:func:`atomic_write` for files that belong together: every ``write(tmp)`` runs (and is synced)
    before the first rename, so a failed write leaves all previous files whole. A kill between the
    renames (microseconds) leaves the earlier ones new and the later ones old: put first the file a
    resume reads."""
    tmps: list[tuple[str, Path]] = []
    try:
        for path, write in items:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            tmps.append((tmp, path))
            write(tmp)
            os.chmod(tmp, file_mode())
            _fsync_file(tmp)
        for tmp, path in tmps:
            os.replace(tmp, path)
        for folder in {path.parent for _, path in tmps}:
            fsync_dir(folder)
    finally:
        for tmp, _ in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where that is not available (then nothing happened)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without renameat2 (glibc < 2.28, some others)
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _finish_tree(root: Path) -> None:
    """Umask modes on everything under ``root`` (writers such as mkdtemp and safetensors use 0700 /
    0600), and every file and folder synced."""
    os.chmod(root, file_mode(folder=True))
    for f in sorted(root.rglob("*")):
        if f.is_dir():
            os.chmod(f, file_mode(folder=True))
        elif f.is_file():
            os.chmod(f, file_mode())
            _fsync_file(f)
    for d in [*sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True), root]:
        fsync_dir(d)


def atomic_dir(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """``write(tmp_dir)``, then put ``tmp_dir`` at ``path`` in one step, replacing a folder there
    (see the module doc): a kill at any point leaves the old or the new folder at ``path``."""
    path = Path(path)
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(parent, only=path.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=parent))
    try:
        write(tmp)
        _finish_tree(tmp)
        if not path.exists():
            os.rename(tmp, path)
        elif _exchange(tmp, path):  # path now holds the new folder, tmp the old one (removed below)
            pass
        else:
            old = parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        fsync_dir(parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def clean_leftovers(folder: str | os.PathLike, only: str | None = None) -> list[str]:
    """Remove what killed writers left in ``folder`` (for the entry named ``only``, or all): their
    temporary files and folders, and an old folder set aside by a fallback swap that did not finish
    (put back when its name is free, else removed). Returns the names handled. Call it when a
    writer starts, not while another process may be writing the same entries."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    done = []
    for entry in sorted(folder.iterdir()):
        m = _TMP_FILE.match(entry.name) if entry.is_file() else _TMP_DIR.match(entry.name) if entry.is_dir() else None
        if m is None or (only is not None and m.group("name") != only):
            continue
        target = folder / m.group("name")
        if entry.is_dir() and m.group("kind") == "old" and not target.exists():
            os.rename(entry, target)  # the only whole copy of the folder: put it back
        elif entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        done.append(entry.name)
    if done:
        fsync_dir(folder)
    return done


def check_writable_dir(path: str | os.PathLike, what: str = "--out") -> Path:
    """Write and remove a file in the folder ``path`` (or, if it does not exist yet, in the nearest
    folder above it, which must be one), so an output folder that cannot be written is an error
    before any work starts, not a traceback after it. Nothing is left behind (no empty folder)."""
    path = Path(path)
    probe_in = path
    while not probe_in.exists() and probe_in.parent != probe_in:
        probe_in = probe_in.parent
    try:
        if not probe_in.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{probe_in} is not a folder")
        fd, probe = tempfile.mkstemp(prefix=".kvpop-write-check.", dir=probe_in)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OSError(exc.errno, f"{what} {path} is not a writable folder ({exc.strerror or exc})") from exc
    return path


def json_safe(x):
    """``x`` with every non-finite float replaced by None: ``-Infinity`` and ``NaN`` are not JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_json(path: str | os.PathLike, obj, indent: int = 1) -> None:
    """Strict JSON (non-finite floats as null; other objects as ``str``), written atomically."""
    text = json.dumps(json_safe(obj), indent=indent, default=str, allow_nan=False)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"))
