"""Atomic checkpoints and resume from the newest valid one.

A checkpoint is written to a temporary file in the same directory, flushed and fsync'ed, then renamed
over its final name: a killed run leaves either the old file or the new one, never half of one. On
resume, checkpoints are tried newest first; one that cannot be read (truncated, corrupt) is skipped with
a warning and the previous one is used.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

import torch

from wsod.atomic import atomic_write

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
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


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint``; raises a clear error naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        # Our checkpoints hold RNG states and plain Python values besides tensors: trusted files only.
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as error:
        raise RuntimeError(f"checkpoint {path} cannot be read ({type(error).__name__}: {error})") from error


def list_checkpoints(directory: str | Path) -> list[Path]:
    """``model_<iteration>.pth`` files in ``directory``, newest (highest iteration) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _ITERATION_NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_valid_checkpoint(
    directory: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable checkpoint in ``directory`` and its contents, or ``None`` if there is none."""
    for path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path, map_location)
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
