"""One run per folder: an OS file lock held by the process that writes a run, evaluation or export folder.

The lock is ``fcntl.flock`` on ``<folder>/.lock``, taken without waiting: a second command given the same
folder is refused at once, naming the folder and the holder's pid (written into the file). The kernel
releases a flock when its holder's file descriptor closes, so the lock goes with the process however it
ends, ``kill -9`` included: a file left behind by a killed process locks nothing. A holder that ends
normally removes the file while it still holds the lock, so that finished folders hold only their
results; a process that opened the old file just before is told by ``acquire``'s inode check that it
locked a removed file, and tries again on the new one.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

__all__ = ["DirectoryLock", "DirectoryBusyError", "LOCK_FILE"]

LOCK_FILE = ".lock"


class DirectoryBusyError(RuntimeError):
    """Another process holds the folder's lock."""


class DirectoryLock:
    """The lock of one folder (created when missing), held from ``acquire()`` to ``release()``.

    Args:
        directory: the run, evaluation or export folder.
        option: the option that named it, for the refusal's fix (``output_dir``; ``output`` for
            tools/predict.py).
    """

    def __init__(self, directory: str | os.PathLike, option: str = "output_dir") -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.option = option
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock now or raise ``DirectoryBusyError`` naming the folder and the holder's pid."""
        if self._fd is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise DirectoryBusyError(
                    f"{self.directory} is in use by another process (pid {self._holder()}, see"
                    f" {self.path}): wait for it to end, or give another {self.option}="
                ) from None
            if self._still_there(fd):
                break
            os.close(fd)  # its holder removed this file as we opened it: lock the one there now
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and let the lock go (in that order: see the module docstring); a second
        call does nothing."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None

    def _still_there(self, fd: int) -> bool:
        """Whether ``fd`` is the file now at ``self.path`` (not one removed since it was opened)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _holder(self) -> str:
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def __enter__(self) -> DirectoryLock:
        self.acquire()  # nothing to do when held already
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
