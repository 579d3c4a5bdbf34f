"""wsod/build.py's parts of a training run besides its model, data and optimizer: the companions of the
``COMPANIONS`` registry in its order (the adversary's update before GradNorm's, the EMA teacher last; a
new companion is one entry), and the loader, the checkpointer and the pseudo-label previews from their
config keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tiny_run import tiny_overrides

import wsod.build as build
from wsod.build import (
    COMPANIONS,
    build_checkpointer,
    build_companions,
    build_loader,
    build_model,
    build_pseudo_label_preview,
    build_train_dataset,
)
from wsod.engine.adversarial import DropBlockAdversary
from wsod.engine.balancing import LossBalancer
from wsod.engine.companion import Companion
from wsod.engine.ema import EMATeacher

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = {"backbone": "resnet18", "width": 0.25, "weights": None, "chunk_size": 8}
CPU = torch.device("cpu")


def _config(root: Path, **extra: object):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=tiny_overrides(root, Path("unused"), **extra))


def _model(dropblock: bool):
    return build_model({**TINY_MODEL, "dropblock": dropblock}, 3)


@pytest.mark.parametrize(
    ("dropblock", "gradnorm", "ema", "expected"),
    [
        (False, False, False, []),
        (True, False, False, [DropBlockAdversary]),
        (False, True, False, [LossBalancer]),
        (False, False, True, [EMATeacher]),
        (True, True, False, [DropBlockAdversary, LossBalancer]),
        (True, True, True, [DropBlockAdversary, LossBalancer, EMATeacher]),
    ],
)
def test_the_companions_a_config_turns_on_come_in_the_registrys_order(
    tmp_path, dropblock, gradnorm, ema, expected
):
    # The adversary steps first; the EMA teacher averages the weights both others have updated.
    assert list(COMPANIONS) == ["dropblock_adversary", "gradnorm", "ema_teacher"]
    cfg = _config(
        tmp_path, **{"solver.gradnorm.enabled": str(gradnorm).lower(), "solver.ema.enabled": str(ema).lower()}
    )
    companions = build_companions(cfg, _model(dropblock), CPU)
    assert [type(c) for c in companions] == expected


def test_a_new_companion_is_one_registry_entry(tmp_path, monkeypatch):
    class Teacher(Companion):
        name = "teacher"

    seen = []
    monkeypatch.setitem(
        build.COMPANIONS, "teacher", lambda cfg, model, device: seen.append(device) or Teacher()
    )
    monkeypatch.setitem(build.COMPANIONS, "off", lambda cfg, model, device: None)  # left off by its config
    cfg = _config(tmp_path, **{"solver.gradnorm.enabled": "true"})
    companions = build_companions(cfg, _model(True), CPU)
    assert [type(c) for c in companions] == [DropBlockAdversary, LossBalancer, Teacher] and seen == [CPU]


def test_the_loader_checkpointer_and_previews_take_their_config_keys(tiny_toy_root, tmp_path):
    cfg = _config(
        tiny_toy_root,
        **{"solver.ims_per_batch": 2, "seed": 5, "checkpoint_period": 7, "keep_checkpoints": 2,
           "trust_checkpoint": "true", "pseudo_label_preview.period": 3, "pseudo_label_preview.images": 2},
    )  # fmt: skip
    train_set = build_train_dataset(cfg.data)
    loader = build_loader(cfg, train_set, CPU)
    assert loader.batch_sampler.batch_size == 2 and loader.num_workers == 0 and not loader.pin_memory
    assert loader.batch_sampler.sampler.seed == 5
    checkpointer = build_checkpointer(cfg, tmp_path, {"classes": ["a"]}, enabled=False)
    assert (checkpointer.period, checkpointer.keep, checkpointer.trust) == (7, 2, True)
    assert checkpointer.metadata == {"classes": ["a"]} and not checkpointer.enabled
    preview = build_pseudo_label_preview(cfg, train_set, CPU)
    assert preview.period == 3 and len(preview.images) == 2
    cfg.pseudo_label_preview.period = 0
    assert build_pseudo_label_preview(cfg, train_set, CPU) is None
