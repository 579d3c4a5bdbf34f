"""Shared fixtures: a tiny toy dataset (12 trainval + 6 test images) for the training and tool tests. The
config schemas are registered with Hydra's ConfigStore before any test composes a config."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_run import TINY_TOY

import wsod.config_schema  # noqa: F401  (registers the configs' schemas)
from wsod.data.toy import ensure_toy_dataset


@pytest.fixture(scope="session")
def tiny_toy_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny_toy") / "toy"
    ensure_toy_dataset(root, workers=1, **TINY_TOY)
    return root


@pytest.fixture(scope="session")
def guide_pipeline(tiny_toy_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """The first toy block of docs/guides/second_stage.md (train -> export -> stage 2 -> eval) with a
    short schedule, in a scratch working directory: that directory and each step's result. The second-
    and third-stage tests share it."""
    from guide_pipeline import guide_block, run_commands

    workdir = tmp_path_factory.mktemp("pipeline")
    return workdir, run_commands(guide_block(0), tiny_toy_root, workdir)
