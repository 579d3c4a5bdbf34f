"""The evaluation path on test sets without boxes (classification mAP of the detector's image scores),
per-class values, the kept random baseline and the tensorboard previews of each evaluation."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import wsod.engine.evaluate as evaluate
from wsod.build import build_model
from wsod.data.coco import CocoDataset
from wsod.data.dataset import WeakDetectionDataset
from wsod.data.toy import TOY_CLASSES, ensure_toy_dataset
from wsod.engine.evaluate import NO_BOXES, Evaluator, evaluate_detections, write_evaluation
from wsod.engine.inference import predict
from wsod.engine.run_log import RunLog

TINY_MODEL = {"backbone": "resnet18", "width": 0.25, "weights": None, "chunk_size": 8}


@pytest.fixture(scope="module")
def toy_test(tiny_toy_root):
    from tiny_run import TINY_TOY

    return ensure_toy_dataset(tiny_toy_root, **TINY_TOY).dataset("test")


def _label_only(dataset: WeakDetectionDataset) -> WeakDetectionDataset:
    records = [replace(r, gt_boxes=None, gt_labels=None, gt_difficult=None) for r in dataset.records]
    return WeakDetectionDataset(records, dataset.classes, dataset.proposals)


def _detections(dataset, image_scores):
    empty = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.long)}
    return [{**empty, "image_scores": s} for s in image_scores]


def test_a_test_set_without_boxes_reports_classification_map_and_says_why(toy_test):
    dataset = _label_only(toy_test)
    labels = torch.stack([torch.as_tensor(r.labels) for r in dataset.records])
    metrics, report = evaluate_detections(_detections(dataset, labels * 0.9 + 0.05), dataset, metric="voc07")
    assert metrics == {"cls_mAP": pytest.approx(1.0)}  # the labels themselves rank perfectly
    assert report.splitlines()[0] == NO_BOXES
    assert "copypaste: cls_mAP(voc07)=100.00" in report
    assert evaluate.primary_metric("voc07", has_boxes=False) == "cls_mAP"
    older = [{k: v for k, v in d.items() if k != "image_scores"} for d in _detections(dataset, labels)]
    with pytest.raises(ValueError, match="hold no image scores .* evaluate without predictions="):
        evaluate_detections(older, dataset)


def test_a_label_only_coco_json_evaluates_with_the_coco_metric(toy_test, tmp_path):
    # The path that failed with KeyError 'id', then 'bbox', inside pycocotools: a COCO json of labels only.
    images = [
        {"id": int(r.image_id), "file_name": f"{r.image_id}.jpg", "width": r.width, "height": r.height}
        for r in toy_test.records
    ]
    annotations = [
        {"image_id": int(r.image_id), "category_id": c + 1}
        for r in toy_test.records
        for c in r.labels.nonzero()[0].tolist()
    ]
    categories = [{"id": i + 1, "name": n} for i, n in enumerate(TOY_CLASSES)]
    path = tmp_path / "labels.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    root = toy_test.records[0].path.rsplit("/", 1)[0]
    dataset = CocoDataset(path, root, toy_test.proposals)
    assert not dataset.has_ground_truth
    labels = torch.stack([torch.as_tensor(r.labels) for r in dataset.records])
    evaluator = Evaluator(dataset, scales=[160], max_size=1000, metric="coco", num_workers=0, progress=False)
    assert evaluator.primary_metric == "cls_mAP"
    result = evaluator.score(_detections(dataset, labels), build_model(TINY_MODEL, 5))
    assert result.metrics == {"cls_mAP": pytest.approx(1.0)} and NO_BOXES in result.report
    write_evaluation(result, dataset, tmp_path / "eval")
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["cls_mAP"] == pytest.approx(1.0)
    assert (tmp_path / "eval" / "coco_results.json").is_file()  # predictions are still written


def test_evaluator_scores_image_scores_keeps_the_baseline_and_draws_previews(toy_test, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = build_model(TINY_MODEL, 5).eval()
    dataset = _label_only(toy_test)
    calls = []
    real = evaluate.random_detections
    monkeypatch.setattr(evaluate, "random_detections", lambda *a, **k: calls.append(1) or real(*a, **k))
    evaluator = Evaluator(
        dataset, scales=[160], max_size=1000, num_workers=0, progress=False, random_baseline=True
    )
    with torch.no_grad():
        first, second = evaluator(model), evaluator(model)
    assert len(calls) == 1  # the chance level depends on the data and post-processing only: kept
    assert first.metrics.keys() == {"cls_mAP"} and second.extra == first.extra
    assert set(first.values) == {"cls_mAP", "random_cls_mAP", *(f"cls_AP_{n}" for n in TOY_CLASSES)}
    assert all(d["image_scores"].shape == (5,) for d in first.detections)
    assert len(first.previews) == 4
    tag, image = next(iter(first.previews.items()))
    assert tag == f"detections/0_{dataset.image_ids[0]}" and image.dtype == torch.uint8
    assert image.shape == (3, 160, 160)
    with RunLog(tmp_path) as run_log:
        run_log.evaluation(7, first)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["kind"] == "eval" and row["iteration"] == 7 and "random_cls_mAP" in row

    boxed = Evaluator(toy_test, scales=[160], max_size=1000, num_workers=0, progress=False)
    with torch.no_grad():
        result = boxed(model)
    assert result.metrics.keys() == {"mAP", "CorLoc"} and boxed.primary_metric == "mAP"  # as before
    assert set(result.per_class) == {f"AP_{n}" for n in TOY_CLASSES} and not result.extra


def test_image_scores_are_the_teachers_phi_averaged_over_the_views(toy_test, monkeypatch):
    torch.manual_seed(0)
    model = build_model(TINY_MODEL, 5).eval()
    features = torch.randn(7, model.mil_head.cls_score.in_features)
    proposals = [torch.zeros(3, 4), torch.zeros(4, 4)]
    phi = model.mil_head(features, [3, 4])
    expected = torch.stack([phi[:3].sum(0), phi[3:].sum(0)])[:, 1:]
    torch.testing.assert_close(model.image_scores(features, proposals), expected)

    # Two views (the image and its flip): their image scores are averaged, like the per-ROI scores.
    views = iter([torch.full((1, 5), 0.2), torch.full((1, 5), 0.6)])
    monkeypatch.setattr(model, "image_scores", lambda features, proposals: next(views))
    subset = torch.utils.data.Subset(toy_test, [0])
    subset.transform = None
    (detections,) = predict(
        model, subset, scales=[160], max_size=1000, flip=True, num_workers=0, progress=False
    )
    torch.testing.assert_close(detections["image_scores"], torch.full((5,), 0.4))
