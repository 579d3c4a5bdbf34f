"""Every config file composes and builds; experiment recipes carry the reference numbers (docs/METHOD.md
§8); struct mode is on."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from wsod.build import LABELERS, build_labeler, build_model
from wsod.engine.inference import tta_views

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["data", "model", "method", "solver", "experiment"])
def test_every_group_option_composes(group):
    assert _names(group), f"no configs in {group}/"
    for name in _names(group):
        cfg = _compose("train", [f"{group}={name}"])
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        assert {"data", "model", "method", "solver", "seed", "output_dir"} <= set(cfg)


@pytest.mark.parametrize("model", _names("model"))
def test_every_model_config_builds_a_detector(model):
    # A misspelt key or value in a model yaml must fail here, not at the start of a user's run. Random
    # weights: ImageNet weights cannot be fetched here and are checked by the backbone tests.
    cfg = _compose("train", [f"model={model}", "model.weights=null"])
    detector = build_model(cfg.model, num_classes=3, method_cfg=cfg.method)
    assert sum(p.numel() for p in detector.parameters()) > 0


@pytest.mark.parametrize("method", _names("method"))
def test_every_method_config_builds_its_labeller(method):
    cfg = _compose("train", [f"method={method}"])
    labeler = build_labeler(cfg.method)
    assert type(labeler) is LABELERS[cfg.method.name]
    assert labeler.fg_iou == cfg.method.fg_iou
    with pytest.raises(TypeError, match=f"method '{cfg.method.name}'"):
        build_labeler({**OmegaConf.to_container(cfg.method), "typo": 1})


def test_eval_config_needs_an_explicit_checkpoint():
    cfg = _compose("eval", ["checkpoint=some/model_final.pth", "data=voc07"])
    assert cfg.checkpoint == "some/model_final.pth" and cfg.predictions is None
    assert OmegaConf.is_missing(_compose("eval", []), "checkpoint")


def test_defaults_are_the_cpu_toy_run_with_sequential_backprop():
    cfg = _compose("train", [])
    assert cfg.data.kind == "toy" and cfg.model.backbone == "resnet18" and cfg.model.width == 0.25
    assert cfg.model.chunk_size is not None and cfg.model.neck_norm in ("gn", "frozen_bn")


# (lr, images per step, milestones, max_iter, warm-up) of the reference configs (docs/RECIPES.md).
REFERENCE_SCHEDULES = {
    "voc07": (0.01, 8, [20000, 26700], 30000, 200),
    "voc0712": (0.02, 16, [30000, 35000], 40000, 200),
    "voc12": (0.02, 16, [20000, 26700], 30000, 200),
    "coco14": (0.01, 8, [90000, 120000], 130000, 500),
}


@pytest.mark.parametrize("name", [n for n in _names("experiment") if n.startswith("mist_")])
def test_experiments_carry_the_reference_recipe(name):
    cfg = _compose("train", [f"experiment={name}"])
    s = cfg.solver
    lr, images, milestones, max_iter, warmup = REFERENCE_SCHEDULES[name.split("_")[2]]
    assert (s.optimizer, s.lr, s.momentum, s.weight_decay, s.momentum_rescale) == ("sgd", lr, 0.9, 1e-4, True)
    assert (s.bias_lr_factor, s.bias_weight_decay) == (2.0, 0.0)
    assert (s.warmup_iters, s.warmup_factor) == (warmup, pytest.approx(1 / 3))
    assert (list(s.milestones), s.max_iter, s.gamma) == (milestones, max_iter, 0.1)
    processes = 1 if name.endswith("_1gpu") else 8
    assert processes * s.ims_per_batch * s.accumulation == images
    assert s.ims_per_batch == 1 or not name.endswith("_1gpu")
    assert cfg.seed == 1234
    assert list(cfg.data.train.scales) == [480, 576, 688, 864, 1000, 1200] and cfg.data.train.max_size == 2000
    assert cfg.data.train.flip and cfg.data.kind in ("voc", "coco")
    assert cfg.model.weights == "IMAGENET1K_V1" and cfg.model.norm == "frozen_bn"


@pytest.mark.parametrize("data", [n for n in _names("data") if n != "toy"])
def test_voc_and_coco_evaluate_with_the_reference_14_views(data):
    # Reference engine/bbox_aug.py: the 800-px test view, its flip, then each BBOX_AUG scale and its flip.
    test = _compose("train", [f"data={data}"]).data.test
    expected = [(s, f) for s in (800, 480, 576, 688, 864, 1000, 1200) for f in (False, True)]
    assert tta_views(list(test.scales), test.flip) == expected and test.max_size == 2000
    toy = _compose("train", []).data.test
    assert tta_views(list(toy.scales), toy.flip) == [(160, False)]


def test_a_mistyped_override_is_an_error():
    with pytest.raises(ConfigCompositionException):
        _compose("train", ["solver.learning_rate=0.1"])
    with pytest.raises(ConfigCompositionException):
        _compose("train", ["model=r50"])
