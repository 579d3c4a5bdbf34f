"""Atomic checkpoints, resume from the newest valid one, and the one place that decides what a run saves.

A checkpoint is written to a temporary file in the same directory, flushed and fsync'ed, then renamed
over its final name: a killed run leaves either the old file or the new one, never half of one. On
resume, checkpoints are tried newest first; one that cannot be read (truncated, corrupt) is skipped with
a warning and the previous one is used.

A run directory's files (``Checkpointer``):

* ``model_<iteration>.pth``, the newest ``keep`` of them: everything a resume needs. The training loop
  gives the ``payload`` (``model``, ``optimizer``, ``scaler``, ``rng`` and each companion's state under
  its name); the checkpointer adds ``trainer`` (``TrainState`` as a dict plus ``best``) and ``metadata``.
* ``model_final.pth``: ``{"model", "iteration", "metadata"}``, the weights at the end of training (plus
  the companions' ``final_weights``: an EMA teacher's under ``teacher``).
* ``model_best.pth``: the checkpoint, periodic or final, whose evaluation had the highest value of the
  primary metric, with that evaluation's record ``{"value", "iteration", "metric"}`` under ``best``. Only
  a strictly higher value replaces it, also across a resume: the record is read back from it then.
"""

from __future__ import annotations

import logging
import pickle
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from wsod.atomic import atomic_write

__all__ = [
    "TrainState",
    "Checkpointer",
    "checkpoint_name",
    "save_checkpoint",
    "load_checkpoint",
    "UntrustedCheckpointError",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "rng_state",
    "set_rng_state",
]

logger = logging.getLogger(__name__)
_ITERATION_NAME = re.compile(r"^model_(\d+)\.pth$")


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` (anything ``torch.save`` takes) to ``path`` atomically."""
    with atomic_write(path) as stream:
        torch.save(state, stream)
    return Path(path)


class UntrustedCheckpointError(ValueError):
    """A checkpoint that the weights-only loader refuses: reading it would unpickle arbitrary objects,
    which can run code. Raised instead of skipping the file (``latest_valid_checkpoint``), so that no
    refused file is silently passed over."""


# How torch's weights-only unpickler words its refusals (torch 2.4 to 2.14): a refused global or object,
# or bytes that are not the pickle torch.save writes (a json, an image, a plain pickle renamed .pth).
_REFUSED = "Weights only load failed"
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_NOT_TORCH_PICKLE = re.compile(r"Unsupported operand (\d+)")


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, trust: bool = False
) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint``; raises a clear error naming the file.

    Loaded with torch's weights-only unpickler, which builds tensors, plain containers and numbers but
    never calls a function named by the file: a downloaded ``.pth`` cannot run code. Everything wsod
    writes is such plain data. A file that needs more (an older wsod's, or another program's) is refused
    with ``UntrustedCheckpointError`` unless ``trust`` (the tools' ``trust_checkpoint=true``) says that
    its source is trusted: then the full unpickler reads it, with a warning. A file that is no checkpoint
    at all (truncated, empty, a json) is a ``RuntimeError`` naming it, in one line.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(
            f"checkpoint {path} is a folder: give a .pth file in it, e.g. {path / 'model_final.pth'}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if trust:
        logger.warning("trust_checkpoint=true: reading %s with the full unpickler, which can run code", path)
    try:
        return torch.load(path, map_location=map_location, weights_only=not trust)
    except pickle.UnpicklingError as error:
        text = str(error)
        if trust or not text.startswith(_REFUSED) or _NOT_TORCH_PICKLE.search(text):
            raise RuntimeError(f"checkpoint {path} cannot be read ({_unreadable(error)})") from error
        found = _REFUSED_GLOBAL.search(text)
        what = f"an object of {found.group(1)}" if found else "objects other than tensors and plain data"
        raise UntrustedCheckpointError(
            f"checkpoint {path} holds {what}, which the weights-only loader refuses (loading it could run"
            " code): use a checkpoint written by this wsod, or add trust_checkpoint=true if you trust"
            " where the file came from (docs/RELIABILITY.md)"
        ) from None
    except Exception as error:
        raise RuntimeError(f"checkpoint {path} cannot be read ({_unreadable(error)})") from error


def _unreadable(error: Exception) -> str:
    """Why a file is no readable checkpoint, in a few words (torch's messages run over many lines)."""
    operand = _NOT_TORCH_PICKLE.search(str(error))
    if operand:
        return f"not a file torch.save wrote: its pickle stops at byte code {operand.group(1)}"
    if isinstance(error, EOFError):
        return "empty, or cut short"
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first.split('. ')[0][:200]}"  # its first sentence


def list_checkpoints(directory: str | Path) -> list[Path]:
    """``model_<iteration>.pth`` files in ``directory``, newest (highest iteration) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _ITERATION_NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_valid_checkpoint(
    directory: str | Path, map_location: str | torch.device = "cpu", *, trust: bool = False
) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable checkpoint in ``directory`` and its contents, or ``None`` if there is none.
    A truncated or corrupt file is skipped with a warning; one the weights-only loader refuses is not
    (``UntrustedCheckpointError``: ``load_checkpoint``'s ``trust`` decides)."""
    for path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path, map_location, trust=trust)
        except RuntimeError as error:
            logger.warning("skipping unreadable checkpoint, trying the previous one: %s", error)
    return None


def rng_state() -> dict[str, Any]:
    """Python, torch CPU and CUDA random states (one per visible GPU), for a checkpoint. Data order is
    seeded separately, by position, so it needs no state here."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _byte_tensor(state: Any) -> torch.Tensor:
    # torch.set_rng_state and torch.cuda.set_rng_state take CPU uint8 tensors only, but a checkpoint
    # loaded with map_location="cuda" has moved them to the GPU.
    return torch.as_tensor(state).to(device="cpu", dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore ``rng_state()``'s output, whatever device its tensors were loaded to.

    CUDA generators are restored for the GPUs both layouts have: a run saved with more visible GPUs
    than this process sees (an 8-GPU run continued on one) restores the first ones and says so; a
    run saved on CPU leaves the CUDA generators as they are.
    """
    random.setstate(state["python"])
    torch.set_rng_state(_byte_tensor(state["torch"]))
    saved = list(state.get("cuda") or [])
    if not torch.cuda.is_available():
        return
    visible = torch.cuda.device_count()
    if len(saved) != visible:
        logger.warning(
            "the checkpoint holds %d CUDA generator state(s), this process sees %d GPU(s): restoring %d",
            len(saved), visible, min(len(saved), visible),
        )  # fmt: skip
    for index, device_state in enumerate(saved[:visible]):
        torch.cuda.set_rng_state(_byte_tensor(device_state), index)


@dataclass
class TrainState:
    """The training loop's counters; checkpoints store them as the ``trainer`` dict (with the checkpointer's
    ``best`` beside them), the same keys as before this class existed, so that old and new checkpoints
    read alike.

    Attributes:
        iteration: optimizer steps done (applied or skipped).
        skipped_steps: steps skipped because something was not finite.
        last_finite: the iteration of the last applied step, or None when none was.
        last_eval: the metrics of the last periodic evaluation, or None.
    """

    iteration: int = 0
    skipped_steps: int = 0
    last_finite: int | None = None
    last_eval: dict[str, float] | None = None

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> TrainState:
        """A checkpoint's ``trainer`` dict; keys that are not counters (``best``) are the checkpointer's."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in stored.items() if k in names})


def checkpoint_name(iteration: int) -> str:
    """``model_<iteration>.pth`` with seven digits, so that names sort as iterations do."""
    return f"model_{iteration:07d}.pth"


def _better_best(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    # A checkpoint older than the best evaluation does not know it; model_best.pth does.
    if a is None or (b is not None and b["value"] > a["value"]):
        return b
    return a


class Checkpointer:
    """Periodic checkpoints with rotation, ``model_final.pth`` and ``model_best.pth`` of one run directory
    (the module docstring says what each holds).

    Args:
        run_dir: the run directory (created when it does not exist).
        period: a periodic checkpoint every ``period`` iterations (0: none but the forced ones).
        keep: how many periodic checkpoints stay; older ones are deleted after each save.
        metadata: stored in every file under ``metadata`` (the model config and class names, so that
            evaluation rebuilds the model from a checkpoint alone).
        enabled: whether this process writes files (the main one). Every process keeps the same best
            record, so that all of them make the same decisions.
        trust: read this folder's ``model_best.pth`` with the full unpickler (``load_checkpoint``), as
            the run's own checkpoints were (``trust_checkpoint=true``).
        keep_at: iterations whose periodic checkpoint is saved whatever ``period`` says and never
            deleted (outside the newest ``keep``): the third stage's split reads the second stage's
            checkpoint from just before its first learning-rate step.

    Attributes:
        best: the best evaluation's record ``{"value", "iteration", "metric"}``, or None.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        period: int = 1000,
        keep: int = 3,
        metadata: dict[str, Any] | None = None,
        enabled: bool = True,
        trust: bool = False,
        keep_at: Sequence[int] = (),
    ) -> None:
        self.run_dir = Path(run_dir)
        self.period, self.keep, self.enabled, self.trust = period, keep, enabled, trust
        self.keep_at = frozenset(int(i) for i in keep_at)
        self.metadata = metadata or {}
        self.best: dict[str, Any] | None = None
        self._final: dict[str, Any] | None = None
        self._saved_at: int | None = None  # the iteration of the last periodic save
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def path(self, iteration: int) -> Path:
        """Where the periodic checkpoint of ``iteration`` is (or would be) saved."""
        return self.run_dir / checkpoint_name(iteration)

    def newest(self) -> Path | None:
        """The newest periodic checkpoint on disk, or None."""
        saved = list_checkpoints(self.run_dir)
        return saved[0] if saved else None

    def resume(self, checkpoint: dict[str, Any]) -> TrainState:
        """The counters of ``checkpoint`` (this run's, read by ``latest_valid_checkpoint``); the best
        record becomes the better of the checkpoint's and ``model_best.pth``'s."""
        stored = checkpoint["trainer"]
        self.best = _better_best(stored.get("best"), self._recorded_best())
        return TrainState.from_dict(stored)

    def checkpoint(self, state: TrainState, payload: dict[str, Any]) -> dict[str, Any]:
        """A periodic checkpoint's contents: the loop's ``payload`` with the counters and metadata."""
        return {**payload, "trainer": {**asdict(state), "best": self.best}, "metadata": self.metadata}

    def periodic(
        self, state: TrainState, payload: Callable[[], dict[str, Any]], *, force: bool = False
    ) -> Path | None:
        """Save ``model_<state.iteration>.pth`` when the iteration is a multiple of ``period``, or with
        ``force`` (a stop, the end of training), unless this iteration's is saved already; keep the newest
        ``keep`` (those of ``keep_at`` aside: saved too, never deleted). ``payload()`` is called only when
        a file is written. Returns the path saved, or None."""
        due = force or (self.period and state.iteration % self.period == 0) or state.iteration in self.keep_at
        if not due or not self.enabled or state.iteration == self._saved_at:
            return None
        path = save_checkpoint(self.checkpoint(state, payload()), self.path(state.iteration))
        self._saved_at = state.iteration
        rotating = [
            p
            for p in list_checkpoints(self.run_dir)
            if int(_ITERATION_NAME.match(p.name).group(1)) not in self.keep_at
        ]
        for old in rotating[self.keep :]:
            old.unlink(missing_ok=True)
        return path

    def final(self, model_state: dict[str, Any], iteration: int, extra: dict[str, Any] | None = None) -> None:
        """Save ``model_final.pth`` (the weights ``model_state`` after ``iteration`` steps, plus
        ``extra``: the companions' ``final_weights``, e.g. the EMA teacher's under ``"teacher"``)."""
        self._final = {
            "model": model_state,
            **(extra or {}),
            "iteration": iteration,
            "metadata": self.metadata,
        }
        if self.enabled:
            save_checkpoint(self._final, self.run_dir / "model_final.pth")

    def offer_best(
        self,
        metric: str,
        value: float | None,
        iteration: int,
        contents: Callable[[], dict[str, Any]] | None = None,
    ) -> bool:
        """Record the evaluation at ``iteration`` as the best when its ``value`` of ``metric`` beats the
        recorded one (None, an undefined value, never does), and save ``model_best.pth``: ``contents()``
        (a periodic evaluation's: ``checkpoint(state, payload)``, called after the record is updated) or,
        by default, the final model that ``final()`` saved. Returns whether it was the best."""
        if value is None or (self.best is not None and value <= self.best["value"]):
            return False
        self.best = {"value": value, "iteration": iteration, "metric": metric}
        if self.enabled:
            if contents is None and self._final is None:
                raise RuntimeError("Checkpointer.offer_best: no final model: call final() or give contents")
            saved = contents() if contents is not None else self._final
            save_checkpoint({**saved, "best": self.best}, self.run_dir / "model_best.pth")
        return True

    def _recorded_best(self) -> dict[str, Any] | None:
        """The evaluation ``model_best.pth`` was saved for, or None (no file, or an unreadable one)."""
        path = self.run_dir / "model_best.pth"
        if not path.is_file():
            return None
        try:
            return load_checkpoint(path, trust=self.trust).get("best")
        except RuntimeError as error:
            logger.warning("ignoring %s: %s", path, error)
            return None
