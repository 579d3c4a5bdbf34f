"""A checkpoint written by wsod before the method and targets seams (commit 9aba265 and issue 20's
fixes) still loads for evaluation and resumes exactly.

``legacy/model_0000002_v0.pth`` is iteration 2 of this run, made with that code on the tiny toy set:

    python tools/train.py data.root=<tiny toy> data.num_train=12 data.num_test=6 data.train.num_workers=0
        data.test.num_workers=0 model.width=0.125 model.chunk_size=16 solver.optimizer=sgd
        solver.max_iter=2 solver.warmup_iters=1 solver.milestones=[] checkpoint_period=2 ...

and ``legacy/resumed_to_4_v0.json`` holds the per-tensor sums of ``model_final.pth`` after that code
resumed it to ``solver.max_iter=4``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tiny_run import TINY_TOY

from wsod.build import load_detector
from wsod.data.toy import PART_PRONE_OBJECT_SIZE, ensure_toy_dataset
from wsod.engine.checkpoint import load_checkpoint, save_checkpoint
from wsod.runs.train import train_from_config

ROOT = Path(__file__).resolve().parents[2]
LEGACY = Path(__file__).parent / "legacy"
OVERRIDES = [
    "data.num_train=12", "data.num_test=6", "data.train.num_workers=0", "data.test.num_workers=0",
    "model.width=0.125", "model.chunk_size=16", "solver.optimizer=sgd", "solver.warmup_iters=1",
    "solver.milestones=[]", "checkpoint_period=2", "progress=false", "random_baseline=false", "log_period=1",
]  # fmt: skip


def _legacy_checkpoint_in(run_dir: Path, toy_root: Path) -> Path:
    """The stored checkpoint in ``run_dir``, its recorded data root pointed at this session's tiny toy
    set (the same generated images: the root is where they were, not what they are)."""
    checkpoint = load_checkpoint(LEGACY / "model_0000002_v0.pth")
    checkpoint["metadata"]["config"]["data"]["root"] = str(toy_root)
    run_dir.mkdir(parents=True)
    save_checkpoint(checkpoint, run_dir / "model_0000002.pth")
    return run_dir / "model_0000002.pth"


def test_a_checkpoint_from_before_the_seams_loads_for_evaluation(tiny_toy_root, tmp_path):
    path = _legacy_checkpoint_in(tmp_path / "run", tiny_toy_root)
    model, metadata = load_detector(path, torch.device("cpu"))
    assert metadata["classes"] and model.num_classes == len(metadata["classes"])


@pytest.fixture(scope="module")
def part_prone_tiny_toy_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny toy set as that code drew it: objects of 25-70 px (data=toy_parts), not today's default."""
    root = tmp_path_factory.mktemp("tiny_toy_parts") / "toy"
    ensure_toy_dataset(root, workers=1, **{**TINY_TOY, "object_size": PART_PRONE_OBJECT_SIZE})
    return root


def test_a_checkpoint_from_before_the_seams_resumes_exactly(part_prone_tiny_toy_root, tmp_path):
    run_dir = tmp_path / "run"
    root = part_prone_tiny_toy_root
    _legacy_checkpoint_in(run_dir, root)
    # The checkpoint's own images and proposal rule (data=toy_parts: objects 25-70 px, proposals from 2 px,
    # the defaults then): a resume refuses other training data (tests/test_config_checks.py).
    overrides = [
        *OVERRIDES,
        "data=toy_parts",
        f"data.root={root}",
        "solver.max_iter=4",
        f"output_dir={run_dir}",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*overrides, "resume=true"])
    threads = torch.get_num_threads()
    try:
        summary = train_from_config(cfg)
    finally:
        torch.set_num_threads(threads)
    assert summary["iteration"] == 4
    expected = json.loads((LEGACY / "resumed_to_4_v0.json").read_text())["weight_sums"]
    final = load_checkpoint(run_dir / "model_final.pth")["model"]
    ours = {k: float(v.double().sum()) for k, v in final.items() if v.is_floating_point()}
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
