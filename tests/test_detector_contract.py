"""The detector contract (wsod/modeling/protocol.py): both detectors implement it, code outside
wsod/modeling/ never asks a model for its class, prediction takes its settings from the caller, and the
loop's optimizer step is wsod/engine/step.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from wsod.engine import step as step_module
from wsod.engine import train as train_module
from wsod.modeling import build_detector
from wsod.modeling.faster_rcnn import build_faster_rcnn
from wsod.modeling.protocol import DetectionSettings, Detector, TrainingOutput
from wsod.modeling.teacher_student import TeacherStudentPair

ROOT = Path(__file__).resolve().parents[1]
MODEL_CLASSES = {"WeaklySupervisedDetector", "FasterRCNNDetector", "TeacherStudentPair"}


def _tiny_weak():
    torch.manual_seed(0)
    return build_detector("resnet18", num_classes=3, chunk_size=4, width=0.25)


def _tiny_faster_rcnn():
    torch.manual_seed(0)
    return build_faster_rcnn(3, backbone="resnet18", width=0.25, weights=None, norm="bn", fpn_channels=16,
                             representation_size=32)  # fmt: skip


def test_every_detector_implements_the_contract_and_the_second_stage_carries_no_dropblock():
    weak, second = _tiny_weak(), _tiny_faster_rcnn()
    for model in (weak, second, TeacherStudentPair(weak, _tiny_weak())):
        assert isinstance(model, Detector), type(model).__name__
        assert set(model.module_groups()) == {"backbone", "neck", "heads"}
    assert not hasattr(second, "dropblock") and second.makes_proposals and not weak.makes_proposals
    # Every parameter of each detector is in exactly one group (what the EMA teacher follows).
    for model in (weak, second):
        grouped = [id(p) for ms in model.module_groups().values() for m in ms for p in m.parameters()]
        assert sorted(grouped) == sorted(id(p) for p in model.parameters())


def test_no_code_outside_modeling_asks_a_model_for_its_class():
    offenders = []
    for path in sorted((ROOT / "wsod").rglob("*.py")):
        if "modeling" in path.relative_to(ROOT / "wsod").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & MODEL_CLASSES:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_training_forward_has_one_shape_and_keeps_only_what_is_asked():
    model = _tiny_weak().train()
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 64, 96, generator=g)
    proposals = [torch.tensor([[0.0, 0.0, 30.0, 30.0], [10.0, 5.0, 60.0, 50.0]])] * 2
    labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    plain = model(images, proposals, labels)
    kept = model(images, proposals, labels, keep=("roi_features", "loss_scales"))
    assert isinstance(plain, TrainingOutput) and plain.roi_features is None and plain.loss_scales is None
    assert kept.roi_features.shape[0] == 4 and set(kept.loss_scales) == set(model.loss_names)
    assert tuple(plain.losses) == model.loss_names


def test_prediction_settings_come_from_the_caller_and_leave_the_model_unchanged():
    model = _tiny_faster_rcnn().eval()
    before = model.detection_settings
    images = torch.randn(1, 3, 64, 64)
    inputs = {"images": images, "image_sizes": [(64, 64)], "original_sizes": [(64, 64)]}
    capped = DetectionSettings(score_threshold=0.0, nms_iou=0.5, detections_per_image=2)
    (view,) = model.predict_view(inputs, [False], capped)
    assert len(view["boxes"]) <= 2 and model.detection_settings == before
    merged = model.merge_views([view, view], capped)
    assert len(merged["boxes"]) <= 2 and merged["image_scores"].shape == (3,)


def test_the_loop_runs_the_steps_train_step_and_has_no_copy_of_it():
    assert train_module.train_step is step_module.train_step
    loop = Path(train_module.__file__).read_text()
    assert ".backward(" not in loop and "scaler.step(" not in loop and "model(**" not in loop
