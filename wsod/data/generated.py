"""A dataset generated on first use into a folder: made once, whole, and never silently reused.

The embedded toy sets (``wsod.data.toy``, ``wsod.data.toy_voc``) are drawn by code, so their folder is a
cache of that code's output for one set of settings. ``ensure_generated`` owns the rules every such
folder follows:

* a folder holding a manifest equal to the settings' is returned as it is; another manifest (other
  settings, or another generator version) is a one-line ``ValueError`` naming the folder, both manifests
  and the fix, never a silent reuse;
* a non-empty folder without a manifest (a copy, or a folder the user made) is refused;
* generation writes into a hidden sibling folder named after its process (``.{name}.tmp-{pid}``) and
  renames it into place only once the manifest is written, so an interrupted run leaves no half dataset
  and concurrent callers (several ranks) do not collide: the loser of the race uses the winner's copy;
* an interrupted (Ctrl-C) or killed (SIGTERM) generation removes its staging folder; one killed outright
  (kill -9) has it removed by the next call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from wsod.atomic import atomic_write
from wsod.data.json_files import read_json

__all__ = ["STAGING_PREFIX", "ensure_generated"]

logger = logging.getLogger(__name__)

# A generation writes into a hidden sibling folder named after its process, then renames it into place.
STAGING_PREFIX = ".{name}.tmp-"


def _remove_abandoned_staging(root: Path) -> None:
    """Delete the staging folders of generations whose process is gone (killed, or the machine
    restarted); a live process's folder is left alone."""
    prefix = STAGING_PREFIX.format(name=root.name)
    if not root.parent.is_dir():
        return
    for folder in root.parent.glob(f"{prefix}*"):
        pid = folder.name[len(prefix) :]
        if pid.isdigit() and not _process_alive(int(pid)):
            logger.info("removing %s, left behind by an interrupted generation", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    """While it is open, SIGTERM (``kill``'s default, what job schedulers send) raises ``SystemExit(143)``
    in the main thread instead of ending the process on the spot, so that a killed generation removes
    its staging folder as an interrupted one (Ctrl-C) does. A handler installed by someone else (or
    SIGTERM ignored) is left alone, and so are other threads, which cannot set handlers. ``kill -9``
    cannot be caught: the next call removes that folder (``_remove_abandoned_staging``)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def ensure_generated(
    root: Path,
    manifest: Mapping[str, Any],
    write: Callable[[Path], None],
    *,
    manifest_name: str,
    what: str,
) -> bool:
    """Make sure ``root`` holds what ``write`` makes for ``manifest``; True when this call made it.

    ``write(folder)`` fills an empty ``folder`` (the staging folder) with the dataset; ``manifest`` (plain
    JSON values) is then written as ``folder / manifest_name`` and the folder renamed to ``root``.
    ``what`` names the dataset in messages ("a toy dataset").
    """
    manifest = dict(manifest)
    manifest_path = root / manifest_name
    _remove_abandoned_staging(root)  # a generation killed outright (kill -9) left its folder behind
    if _check_existing(manifest_path, manifest, what):
        return False
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(
            f"{root} exists but holds no finished {what} ({manifest_name} is missing: a copy, or a"
            " folder made by hand); delete it, or use another root"
        )
    start = time.perf_counter()
    staging = root.with_name(f"{STAGING_PREFIX.format(name=root.name)}{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with _terminate_raises():  # kill (SIGTERM) too runs the cleanup below
            write(staging)
            with atomic_write(staging / manifest_name, "w") as f:
                json.dump(manifest, f, indent=1)
            if root.exists():
                root.rmdir()  # empty (checked above); os.replace cannot replace a directory
            os.replace(staging, root)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if manifest_path.is_file():  # another process finished first: use its copy
            _check_existing(manifest_path, manifest, what)
            return False
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("%s ready in %s (%.1f s)", what, root, time.perf_counter() - start)
    return True


def _check_existing(manifest_path: Path, manifest: dict[str, Any], what: str) -> bool:
    """True when ``manifest_path`` exists and equals ``manifest``; a different one is an error."""
    if not manifest_path.is_file():
        return False
    existing = read_json(manifest_path, "the manifest its generator writes; delete the folder to remake it")
    if existing != manifest:
        raise ValueError(
            f"{manifest_path.parent} holds {what} made with {existing}, not {manifest}; use another root,"
            " or delete the folder to make it again"
        )
    return True
