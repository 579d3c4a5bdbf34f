"""What every tool does around its work: log to the console and the run's log.txt, and turn a failure
into one clear line (the traceback goes to log.txt) and a non-zero exit code.

``HYDRA_FULL_ERROR=1``, the switch Hydra documents for its own errors, prints wsod's tracebacks on the
console too.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "setup_logging",
    "run_tool",
    "full_tracebacks",
    "write_failure",
    "error_message",
    "SweepJobs",
    "close_run_log",
]

logger = logging.getLogger("wsod")
EXIT_INTERRUPTED = 130  # what a shell reports for a program ended by SIGINT (128 + 2)


def full_tracebacks() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


class _ConsoleFormatter(logging.Formatter):
    """The file keeps tracebacks; the console shows the message alone unless full tracebacks are on."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and not full_tracebacks():
            record = copy.copy(record)
            record.exc_info, record.exc_text = None, None
        return super().format(record)


def setup_logging(run_dir: Path, main: bool) -> None:
    """INFO to the console and to ``run_dir/log.txt`` on the main process; warnings only elsewhere."""
    root = logging.getLogger()
    root.setLevel(logging.INFO if main else logging.WARNING)
    layout = ("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(_ConsoleFormatter(*layout))
    handlers: list[logging.Handler] = [console]
    if main:
        handlers.append(logging.FileHandler(run_dir / "log.txt"))
        handlers[-1].setFormatter(logging.Formatter(*layout))
    for handler in root.handlers[:]:
        if getattr(handler, "_wsod", False):
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        handler._wsod = True  # ours to replace when called again (tests run several trainings)
        root.addHandler(handler)


def _logging_to_a_file() -> bool:
    return any(
        getattr(h, "_wsod", False) and isinstance(h, logging.FileHandler)
        for h in logging.getLogger().handlers
    )


def write_failure(directory: Path, error: BaseException) -> None:
    """Leave ``error.txt`` (message and traceback) in a run or evaluation directory that failed, so that
    it says so instead of looking like an empty or unfinished one."""
    text = f"{error_message(error)}\n\n" + "".join(traceback.format_exception(error))
    (directory / "error.txt").write_text(text)


# How torch's DataLoader re-raises a worker's exception in the main process: the worker's whole
# traceback is the message ("Caught X in DataLoader worker process N.\nOriginal Traceback ...").
_WORKER_ERROR = re.compile(r"^Caught \w+ in (DataLoader worker process \d+)\.\nOriginal Traceback", re.S)


def error_message(error: BaseException) -> str:
    """``"Type: message"``; for an error re-raised from a data-loader worker, the worker's own last line
    (the original type and message, which name the file) and which worker, instead of its traceback."""
    text = str(error)
    worker = _WORKER_ERROR.match(text)
    if worker:
        last = next((line for line in reversed(text.splitlines()) if line.strip()), text)
        return f"{last.strip()} (in {worker.group(1)})"
    return f"{type(error).__name__}: {text}"


def run_tool(entry: Callable[[Any], Any], cfg: Any) -> None:
    """Run ``entry(cfg)`` as a command-line tool: on an exception, log it (with its traceback in log.txt
    when the run directory exists), print one line on the console, and exit with status 1. Interrupted
    (Ctrl-C, SIGTERM): one line, to log.txt too, and exit status 130; after a clean stop of the
    training loop (``TrainingInterrupted``) the line names the checkpoint saved."""
    try:
        entry(cfg)
    except KeyboardInterrupt as interrupt:
        message = str(interrupt) or (
            "interrupted: stopped at once; anything since the newest checkpoint is not saved (resume=true"
            " continues a training run from it)"
        )
        if _logging_to_a_file():
            logger.warning(message)
        else:
            print(message, file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as error:
        message = error_message(error)
        if _logging_to_a_file():
            logger.error(
                "%s\n(traceback in log.txt; HYDRA_FULL_ERROR=1 prints it here)", message, exc_info=error
            )
        else:
            print(f"error: {message}", file=sys.stderr)
            if full_tracebacks():
                traceback.print_exception(error)
        sys.exit(1)


class SweepJobs:
    """The jobs of a Hydra multirun (``-m``) of a training tool, one after the other: a job that fails
    prints its one line (``run_tool``) and the sweep goes on with the next, since they do not depend on
    each other; ``finish()`` then exits with status 1 naming the failed jobs."""

    def __init__(self) -> None:
        self.jobs: list[str] = []  # "#<number> <run directory>"
        self.failed: list[str] = []

    def run(self, entry: Callable[[Any], Any], cfg: Any, job: str) -> None:
        """``run_tool(entry, cfg)`` as the sweep job ``job``, its ``log.txt`` closed afterwards."""
        self.jobs.append(job)
        try:
            run_tool(entry, cfg)
        except SystemExit as stop:
            if stop.code == EXIT_INTERRUPTED:  # the user stopped the sweep, not just this job
                raise
            # run_tool has printed the error and logged its traceback; exiting here would drop the
            # sweep's remaining jobs.
            if stop.code not in (None, 0):
                self.failed.append(job)
        finally:
            close_run_log()

    def finish(self) -> None:
        if self.failed:
            count = f"{len(self.failed)} of {len(self.jobs)} sweep jobs failed"
            print(f"error: {count} (their errors above): {', '.join(self.failed)}", file=sys.stderr)
            sys.exit(1)


def close_run_log() -> None:
    """Detach and close a finished job's ``log.txt`` handler (``setup_logging`` marks its handlers
    ``_wsod``): the next job's messages before its own run directory is chosen (a refused config, say)
    would land in this job's log otherwise."""
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if getattr(handler, "_wsod", False) and isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()
