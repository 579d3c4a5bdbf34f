"""Files written atomically get the mode the umask gives any other file (0644 under umask 022), not the
private 0600 of the temporary file they are renamed from: a teammate reads a shared run's checkpoints,
pseudo labels, side files and proposals like its logs."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from wsod.atomic import atomic_write
from wsod.data.partial_labels import write_partial_labels_file
from wsod.data.proposals import ProposalSet, save_proposals
from wsod.data.pseudo_boxes import write_pseudo_boxes
from wsod.engine.checkpoint import save_checkpoint
from wsod.engine.run_log import RunLog


@pytest.fixture(params=[0o022, 0o027, 0o002])
def umask(request) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _writers(folder: Path) -> dict[str, Path]:
    """Each of the project's atomic writers, writing one small file into ``folder``."""
    proposals = ProposalSet([1, 2], [np.zeros((1, 4), np.float32), np.ones((2, 4), np.float32)])
    written = {
        "checkpoint": save_checkpoint({"model": {"w": torch.ones(2)}}, folder / "model_0000001.pth"),
        "pseudo labels": write_pseudo_boxes({"images": [], "annotations": []}, folder / "pseudo.json"),
        "proposal pickle": folder / "p.pkl",
        "proposal store": folder / "p.proposals",
        "side file": folder / "points.json",
    }
    save_proposals(proposals, written["proposal pickle"])
    save_proposals(proposals, written["proposal store"])
    write_partial_labels_file(written["side file"], {"a.jpg": [{"class": "dog", "point": [1, 2]}]})
    with RunLog(folder / "run") as run_log:
        run_log.record("train", 1, {"loss": 1.0})
    with RunLog(folder / "run", purge_after=0):  # a resume rewrites metrics.jsonl atomically
        written["metrics (resumed)"] = folder / "run"
    with atomic_write(folder / "plain.bin") as stream:
        stream.write(b"x")
    written["atomic_write"] = folder / "plain.bin"
    return written


def test_atomic_writes_honour_the_umask(tmp_path, umask):
    expected = 0o666 & ~umask
    for name, path in _writers(tmp_path).items():
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        assert files, name
        for file in files:
            assert _mode(file) == expected, f"{name}: {file.name} is {oct(_mode(file))}, not {oct(expected)}"
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file was left behind"


def test_the_toy_set_files_honour_the_umask(tiny_toy_root):
    """The session's toy set was written under the test run's own umask."""
    mask = os.umask(0)
    os.umask(mask)
    manifest = tiny_toy_root / "toy.json"
    assert _mode(manifest) == 0o666 & ~mask
