"""Atomic file writes: a reader (or a resumed run) never sees a half-written file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["atomic_write"]


def _umask() -> int:
    """The process's umask: Linux shows it in /proc/self/status; elsewhere POSIX offers no read-only
    call, so it is set and restored at once (a file another thread creates in between gets 022)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file next to ``path``; on success move it onto ``path`` in one rename.

    The temporary file lives in the destination folder so that ``os.replace`` stays on one file system
    (a rename across file systems is not atomic). On error the temporary file is removed. The file gets
    the mode any ``open(path, "w")`` would give it (0644 under umask 022), not ``mkstemp``'s private
    0600: a teammate reads a shared run's checkpoints like its logs.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
