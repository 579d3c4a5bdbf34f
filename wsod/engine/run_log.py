"""A run's numbers on disk: one JSON object per line in ``metrics.jsonl``, tensorboard scalars and, at
each evaluation, tensorboard images of test images with their detections drawn."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.utils.tensorboard import SummaryWriter

from wsod.atomic import atomic_write

__all__ = ["RunLog"]


class RunLog:
    """Appends ``{"kind", "iteration", **values}`` rows to ``run_dir/metrics.jsonl`` and each finite
    number to tensorboard as ``<kind>/<name>`` (events under ``run_dir/tb``). With ``enabled=False``
    (every process but the main one) it writes nothing. Use as a context manager, or ``close()``.

    ``purge_after``: a resumed run continues after this iteration; rows and events logged later by the
    interrupted run are dropped first (tensorboard's ``purge_step``), so each iteration appears once. It
    stays an attribute: the training loop checks it against the iteration it resumes at. One RunLog
    serves a whole run, the final evaluation's row included (``wsod.runs.train``).
    """

    def __init__(self, run_dir: str | Path, enabled: bool = True, purge_after: int | None = None) -> None:
        self.enabled, self.purge_after = enabled, purge_after
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / "metrics.jsonl"
        if purge_after is not None and metrics.is_file():
            kept = [
                line
                for line in metrics.read_text().splitlines(keepends=True)
                if line.strip() and json.loads(line)["iteration"] <= purge_after
            ]
            with atomic_write(metrics, "w") as stream:
                stream.writelines(kept)
        self._file = open(metrics, "a")  # noqa: SIM115 (closed by close())
        purge_step = None if purge_after is None else purge_after + 1
        self._writer = SummaryWriter(run_dir / "tb", purge_step=purge_step)

    def record(self, kind: str, iteration: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"kind": kind, "iteration": iteration, **values}) + "\n")
        self._file.flush()
        for name, value in values.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self._writer.add_scalar(f"{kind}/{name}", value, iteration)

    def image(self, tag: str, image: Tensor, iteration: int) -> None:
        """A uint8 (3, H, W) image in tensorboard under ``tag`` at ``iteration``."""
        if self.enabled:
            self._writer.add_image(tag, image, iteration, dataformats="CHW")

    def evaluation(self, iteration: int, evaluation: Any) -> None:
        """An ``wsod.engine.evaluate.Evaluation``: its ``values`` (metrics, per-class values, random
        baseline) as an ``eval`` row and scalars, and its ``previews`` as images (``eval/<tag>``)."""
        self.record("eval", iteration, evaluation.values)
        for tag, image in evaluation.previews.items():
            self.image(f"eval/{tag}", image, iteration)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._writer.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
