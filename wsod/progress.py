"""Progress bars on a terminal only (issue 54, item 5).

A bar redraws itself with carriage returns; written to a file, a pipe or a job scheduler's log those frames
pile up into most of the log. So a bar is drawn only when the run asks for bars (the ``progress`` key) *and*
standard error, where tqdm draws, is a terminal. Elsewhere the log lines (one per ``log_period`` in
training) are the progress report.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["bars_shown", "progress_bar"]


def bars_shown(requested: bool, stream: TextIO | None = None) -> bool:
    """Whether a bar is drawn: ``requested`` and ``stream`` (default: the current standard error) is a
    terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(requested and isatty is not None and isatty())


def progress_bar(iterable: Iterable | None = None, *, shown: bool, **options: Any) -> tqdm:
    """``tqdm(iterable, **options)``, disabled unless :func:`bars_shown` (``shown`` is the request)."""
    return tqdm(iterable, disable=not bars_shown(shown), dynamic_ncols=True, **options)
