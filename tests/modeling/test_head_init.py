"""Each method's heads start as its reference code initialises them: every linear layer the detector adds
on the ROI features (the MIL head's two streams, each student's classifier and box regressor, CBL's
R-CNN head) has weights N(0, std) with the reference's std and zero biases.

The expected stds are written here from the references, not read from the configs: a config or a
constructor that drifts from its reference fails. Sources (file:line, also in configs/method/<m>.yaml):

- WSDDN, MIST: NVlabs/wetectron ``wetectron/modeling/roi_heads/weak_head/roi_weak_predictors.py``,
  every ``nn.Linear`` N(0, 0.001), bias 0 (WSDDNPredictor :25-29, MISTPredictor :136-140).
- OICR, PCL: ppengtang/pcl.pytorch ``lib/modeling/pcl_heads.py`` (master and 0.4.0 alike): the MIL
  streams :20-24 and the refinement classifiers :56-59 N(0, 0.01), bias 0. Neither branch has a box
  regressor per student; wsod's OICR students regress boxes from 0.001 (MIST's, and master's Fast R-CNN
  ``bbox_pred``, ``lib/modeling/fast_rcnn_heads.py``:31).
- CBL: Yinyf0804/CBL-WSOD ``lib/modeling/pcl_heads.py``: the MIL streams :23-27 and the refinement
  classifiers :67-70 N(0, 0.01); the R-CNN head's classifier N(0, 0.01) :101-102, its box regressor
  N(0, 0.001) :103-104; biases 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from composed import composed
from omegaconf import OmegaConf
from torch import nn

from wsod.build import build_method, build_model
from wsod.modeling import METHODS

NUM_CLASSES = 80  # COCO's: with the toy model's 128-d ROI features, >= 81 x 128 = 10,368 weights a layer
MIN_WEIGHTS = 10_000
# The sample std of n >= 10,000 N(0, s) draws is within 0.7% of s (one standard error, 1 / sqrt(2n)):
# 5% is 7 standard errors, and a std off by 2x (or the 10x between wetectron's and pcl.pytorch's) fails.
STD_TOLERANCE = 0.05

MIL = {"mil_head.cls_score": "mil", "mil_head.det_score": "mil"}
# Per method: each head's reference std, by the role of its layers.
REFERENCE = {
    "wsddn": {"mil": 0.001},
    "mist": {"mil": 0.001, "student_cls": 0.001, "student_box": 0.001},
    "oicr": {"mil": 0.01, "student_cls": 0.01, "student_box": 0.001},
    "pcl": {"mil": 0.01, "student_cls": 0.01},
    "cbl": {"mil": 0.01, "student_cls": 0.01, "rcnn_cls": 0.01, "rcnn_box": 0.001},
}
# The config key of each role.
KEYS = {
    "mil": "mil_std",
    "student_cls": "student_cls_std",
    "student_box": "student_box_std",
    "rcnn_cls": "rcnn_cls_std",
    "rcnn_box": "rcnn_box_std",
}


def _detector(method: str, *overrides: str):
    """The toy model (configs/model/r18_c4.yaml) with ``method``'s composed config, built from seed 0."""
    cfg = composed("train", (f"method={method}", *overrides))
    torch.manual_seed(0)
    return build_model(cfg.model, NUM_CLASSES, cfg.method)


def _role(name: str) -> str:
    """The role of a head layer from its module name in the detector."""
    if name in MIL:
        return MIL[name]
    if name.startswith("students."):
        return {"cls_score": "student_cls", "bbox_pred": "student_box"}[name.rsplit(".", 1)[1]]
    if name.startswith("method_heads.rcnn."):
        return {"cls_score": "rcnn_cls", "bbox_pred": "rcnn_box"}[name.rsplit(".", 1)[1]]
    raise AssertionError(f"a head layer of no known role: {name}")


def _head_layers(detector) -> dict[str, nn.Linear]:
    """Every linear layer on the ROI features: the MIL head, the students, the method's own heads."""
    return {
        name: module
        for name, module in detector.named_modules()
        if isinstance(module, nn.Linear) and name.startswith(("mil_head.", "students.", "method_heads."))
    }


def _check(name: str, layer: nn.Linear, std: float) -> None:
    weight = layer.weight.detach().double()
    count = weight.numel()
    assert count >= MIN_WEIGHTS, f"{name}: {count} weights, too few for a {STD_TOLERANCE:.0%} std test"
    assert weight.std().item() == pytest.approx(std, rel=STD_TOLERANCE), f"{name}: std of N(0, {std})"
    # The mean of N(0, std) draws: within 6 standard errors of 0.
    assert abs(weight.mean().item()) < 6 * std / math.sqrt(count), f"{name}: mean of N(0, {std})"
    assert torch.equal(layer.bias.detach(), torch.zeros_like(layer.bias)), f"{name}: bias 0"


@pytest.mark.parametrize("method", sorted(REFERENCE))
def test_every_head_layer_starts_at_its_references_std_and_zero_bias(method):
    detector = _detector(method)
    layers = _head_layers(detector)
    roles = {name: _role(name) for name in layers}
    # Every role the reference initialises is built, and no head layer goes unchecked.
    assert set(roles.values()) == set(REFERENCE[method]), sorted(roles.items())
    students = len(detector.students)
    assert students == (0 if method == "wsddn" else 3)
    for name, layer in layers.items():
        _check(name, layer, REFERENCE[method][roles[name]])


def test_the_check_fails_on_another_std():
    """The tolerance tells pcl.pytorch's 0.01 from wetectron's 0.001, and either from half of it."""
    layer = _head_layers(_detector("pcl"))["mil_head.cls_score"]
    _check("mil_head.cls_score", layer, 0.01)
    for wrong in (0.001, 0.005, 0.02):
        with pytest.raises(AssertionError, match="std of"):
            _check("mil_head.cls_score", layer, wrong)
    with torch.no_grad():
        layer.bias[0] = 1e-12
    with pytest.raises(AssertionError, match="bias 0"):
        _check("mil_head.cls_score", layer, 0.01)


@pytest.mark.parametrize(
    ("method", "role"), [(m, r) for m in sorted(REFERENCE) for r in sorted(REFERENCE[m])]
)
def test_each_init_setting_of_the_method_config_reaches_its_layers(method, role):
    """``method.<role>_std`` sets that role's layers, and only them. OICR, PCL and CBL list it in
    configs/method/<m>.yaml; MIST and WSDDN keep the constructor's default (wetectron's, the same) and
    cite it there, so that a plug-in method started from the MIST config has no key to remove."""
    key = KEYS[role]
    listed = composed("train", (f"method={method}",)).method
    assert (key in listed) == (method not in ("mist", "wsddn")), key
    if key in listed:
        assert listed[key] == REFERENCE[method][role]
    changed = {**REFERENCE[method], role: REFERENCE[method][role] * 3}
    detector = _detector(method, f"{'' if key in listed else '+'}method.{key}={changed[role]}")
    for name, layer in _head_layers(detector).items():
        _check(name, layer, changed[_role(name)])


@pytest.mark.parametrize("method", sorted(REFERENCE))
def test_the_method_classes_default_to_their_configs_init(method):
    """Built without a config (``OICRMethod()``...), a method initialises its heads as its config does."""
    cfg = composed("train", (f"method={method}",))
    settings = OmegaConf.to_container(cfg.method)
    built = build_method(settings)
    default = METHODS[settings["name"]]()
    for role in REFERENCE[method]:
        assert getattr(default, KEYS[role]) == getattr(built, KEYS[role]) == REFERENCE[method][role], role


@pytest.mark.parametrize("std", [-0.01, math.inf, math.nan])
@pytest.mark.parametrize("method", sorted(REFERENCE))
def test_a_negative_or_non_finite_std_is_refused(method, std):
    with pytest.raises(ValueError, match="initial std must be finite and >= 0"):
        METHODS[method](mil_std=std)
