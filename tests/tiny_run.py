"""Hydra overrides for few-iteration CPU runs on the tiny toy dataset of ``conftest.tiny_toy_root``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from wsod.data.toy import OBJECT_SIZE

ROOT = Path(__file__).resolve().parents[1]

TINY_TOY = {"num_train": 12, "num_test": 6, "object_size": list(OBJECT_SIZE)}


def tiny_overrides(root: Path, run_dir: Path, **extra: object) -> list[str]:
    """Hydra overrides for a few-iteration CPU run on the tiny toy dataset."""
    values = {
        "data.root": str(root),
        "data.num_train": TINY_TOY["num_train"],
        "data.num_test": TINY_TOY["num_test"],
        "data.train.num_workers": 0,
        "data.test.num_workers": 0,
        # The first 32 of each training image's proposals (87 on average, up to 164): a step's cost is
        # its ROIs' res5 head, and a tiny run tests the run's mechanics, not its accuracy.
        "data.train.max_proposals": 32,
        "solver.max_iter": 4,
        "solver.warmup_iters": 2,
        "solver.milestones": "[3]",
        "model.chunk_size": 16,
        "output_dir": str(run_dir),
        "log_period": 1,
        "checkpoint_period": 2,
        "progress": "false",
        **extra,
    }
    return [f"{key}={value}" for key, value in values.items()]


def minimal_pseudo_labels(path: Path) -> Path:
    """A pseudo-label json of the right layout (one image, one box), for tests that stop a second-stage
    command before it trains: tools/train_stage2.py checks the file before anything else."""
    content = {
        "images": [{"id": 1, "file_name": "000000.jpg", "width": 10, "height": 10}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5], "score": 1.0}],
        "categories": [{"id": 1, "name": "red_circle"}],
    }
    path.write_text(json.dumps(content))
    return path


def kill_and_resume(command: list[str], run_dir: Path, env: dict[str, str], checkpoint: str) -> None:
    """Run ``command`` (a tools/train.py call writing into ``run_dir``), SIGKILL it once ``checkpoint``
    is written, then run it again with ``resume=true`` to the end; fails if the run ended before the
    kill or the resumed one fails."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (run_dir / checkpoint).exists():
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline, f"no {checkpoint} within 240 s"
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    process.stderr.close()
    assert not (run_dir / "model_final.pth").exists(), "the run ended before the kill: nothing was resumed"
    resumed = subprocess.run(
        [*command, "resume=true"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
