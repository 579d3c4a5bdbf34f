"""The VOC-like set's pretrained base (its "ImageNet"): the images it learns from, the folder it lives in,
and the toy models that start from it when ``data=toy_voc``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from composed import composed
from omegaconf import OmegaConf

from wsod.build import build_model, build_stage2_model, prepare_data
from wsod.data.toy_voc.generator import TOY_VOC_CLASSES
from wsod.data.toy_voc.pretraining import (
    ARCH,
    BASE_FILE,
    IMAGE_SIZE,
    MANIFEST_NAME,
    base_manifest,
    ensure_toy_voc_base,
    render_object_centric_image,
    render_pretraining_images,
)
from wsod.modeling.resnet import build_resnet_c4, build_resnet_trunk


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
    return ensure_toy_voc_base(tmp_path_factory.mktemp("toy_voc") / "base", steps=3)


def test_pretraining_images_hold_one_centred_object_of_every_class_in_turn():
    images, labels = render_pretraining_images(0, 40)
    assert images.shape == (40, IMAGE_SIZE, IMAGE_SIZE, 3) and images.dtype == torch.uint8
    assert labels.tolist() == [n % len(TOY_VOC_CLASSES) for n in range(40)]
    again, cls = render_object_centric_image(0, 7)
    assert cls == 7 and np.array_equal(again, images[7].numpy())  # drawn from its own seed, every time
    assert not np.array_equal(render_object_centric_image(1, 7)[0], again)  # another generator seed


def test_the_base_file_has_torchvision_keys_and_loads_into_the_toy_model(base_file):
    state = torch.load(base_file, weights_only=True)
    assert {"conv1.weight", "layer4.1.bn2.weight", "fc.weight"} <= set(state)
    assert state["fc.weight"].shape[0] == len(TOY_VOC_CLASSES)
    base, res5 = build_resnet_c4(
        18, width=ARCH["width"], weights=str(base_file), norm=ARCH["norm"], neck_norm=ARCH["neck_norm"]
    )
    assert torch.equal(base.stem.conv1.weight, state["conv1.weight"])
    assert torch.equal(base.res4[1].bn2.running_var, state["layer3.1.bn2.running_var"])
    assert torch.equal(res5[1].bn2.weight, state["layer4.1.bn2.weight"])  # GroupNorm, as pretrained
    report = json.loads((base_file.parent / "report.json").read_text())
    assert report["steps"] == 3 and 0 <= report["val_top1"] <= 1


def test_a_base_folder_of_other_settings_or_bad_steps_is_refused(base_file):
    manifest = json.loads((base_file.parent / MANIFEST_NAME).read_text())
    assert manifest == base_manifest(0, 3)
    with pytest.raises(ValueError, match="made with"):
        ensure_toy_voc_base(base_file.parent, steps=4)
    with pytest.raises(ValueError, match="data.base_steps=0"):
        ensure_toy_voc_base(base_file.parent, steps=0)


def test_a_weights_file_of_another_width_is_one_line_naming_the_layer(base_file):
    with pytest.raises(ValueError, match=r"do not fit resnet18 at width=0.5.*conv1.weight \(16, 3, 7, 7\)"):
        build_resnet_trunk(18, width=0.5, weights=str(base_file), norm="bn", neck_norm="gn")
    with pytest.raises(
        ValueError, match="ImageNet weights need width=1.0"
    ):  # torchvision's names: full width
        build_resnet_trunk(18, width=0.25, weights="IMAGENET1K_V1", norm="bn")


def test_toy_voc_configs_start_the_toy_models_from_the_base_and_other_data_from_scratch():
    train = composed("train", ("data=toy_voc",))
    assert train.model.weights == "data/toy_voc/base/" + BASE_FILE
    stage2 = composed("stage2", ("data=toy_voc", "pseudo_labels=p.json"))
    assert stage2.detector.weights == "data/toy_voc/base/" + BASE_FILE
    assert stage2.detector.neck_norm == "gn"
    assert composed("train", ("data=toy_voc", "data.base_weights=null")).model.weights is None
    assert composed("train", ()).model.weights is None
    toy_stage2 = composed("stage2", ("pseudo_labels=p.json",))
    assert toy_stage2.detector.weights is None and toy_stage2.detector.neck_norm is None


def test_prepare_makes_the_base_the_models_then_load(tiny_toy_voc, tmp_path):
    root = tiny_toy_voc.root
    overrides = (
        "data=toy_voc",
        f"data.root={root}",
        "data.num_train=8",
        "data.num_test=4",
        "data.base_steps=2",
    )
    cfg = composed("train", overrides)
    prepare_data(cfg.data)
    state = torch.load(root / "base" / BASE_FILE, weights_only=True)
    model = build_model(cfg.model, len(TOY_VOC_CLASSES), cfg.method)
    assert torch.equal(model.base.stem.conv1.weight, state["conv1.weight"])
    stage2 = composed("stage2", (*overrides, "pseudo_labels=p.json"))
    detector = build_stage2_model(OmegaConf.to_container(stage2.detector, resolve=True), 20)
    trunk_conv1 = dict(detector.named_parameters())
    name = next(n for n in trunk_conv1 if n.endswith("body.conv1.weight"))
    assert torch.equal(trunk_conv1[name], state["conv1.weight"])
    # A file of the user's (not {root}/base's) is theirs: prepare makes nothing.
    shutil.rmtree(root / "base")
    prepare_data(composed("train", (*overrides, "data.base_weights=mine.pth")).data)
    assert not (root / "base").exists()
