"""A clean stop on Ctrl-C and SIGTERM: the training loop finishes the step it is in, saves a checkpoint
at the step reached and raises ``TrainingInterrupted``; the tools print one line and exit with 130
(``wsod.cli.run_tool``).

``StopRequests`` installs the handlers for the loop's lifetime (main thread only: Python delivers
signals there). The first SIGINT or SIGTERM only records the request, since stopping in the middle of a
backward pass or a checkpoint write would lose the step's work; a second one raises
``KeyboardInterrupt`` at once, for a user who cannot wait for the step to end. Under torchrun every
process is told (torchrun forwards both signals), possibly at different steps: the loop agrees on the
step to stop at with one reduction per step (``requested_anywhere``).

The data loaders' workers ignore SIGINT (``wsod.data.loader.ignore_interrupts_in_worker``): Ctrl-C
reaches every process of the terminal's foreground group, and a worker that died of it would break the
step the main process is finishing.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

import torch

from wsod.distributed import all_reduce_mean, is_distributed

__all__ = ["StopRequests", "TrainingInterrupted"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """The loop stopped on request after saving a checkpoint; the message says where and how to go on.
    A ``KeyboardInterrupt``: ``except Exception`` handlers (``error.txt``, sweeps) let it through."""


class StopRequests:
    """A context manager that turns the first SIGINT / SIGTERM into a request (``requested``, the signal's
    ``name``) and the second into ``KeyboardInterrupt``; the earlier handlers are restored on exit.
    Outside the main thread (where handlers cannot be installed) it records nothing."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.name is not None

    def requested_anywhere(self, device: torch.device) -> bool:
        """Whether any process was asked to stop (the same answer on every process)."""
        if not is_distributed():
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        return all_reduce_mean(flag).item() > 0

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.name is not None:  # the second request: stop now, whatever is running
            raise KeyboardInterrupt
        self.name = signal.Signals(number).name

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle) for number in _SIGNALS}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
