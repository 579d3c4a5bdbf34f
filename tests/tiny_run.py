"""Hydra overrides for few-iteration CPU runs on the tiny toy dataset of ``conftest.tiny_toy_root``."""

from __future__ import annotations

from pathlib import Path

TINY_TOY = {"num_train": 12, "num_test": 6}


def tiny_overrides(root: Path, run_dir: Path, **extra: object) -> list[str]:
    """Hydra overrides for a few-iteration CPU run on the tiny toy dataset."""
    values = {
        "data.root": str(root),
        "data.num_train": TINY_TOY["num_train"],
        "data.num_test": TINY_TOY["num_test"],
        "data.train.num_workers": 0,
        "data.test.num_workers": 0,
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
