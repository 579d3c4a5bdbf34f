"""The evaluation path on test sets without boxes (classification mAP of the detector's image scores),
per-class values, the kept random baseline, the tensorboard previews of each evaluation, and the result
files each dataset's result_format writes."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

import wsod.engine.evaluate as evaluate
from wsod.build import build_model
from wsod.data.coco import CocoDataset
from wsod.data.dataset import RESULT_FORMATS, WeakDetectionDataset
from wsod.data.proposals import ProposalSet
from wsod.data.toy import TOY_CLASSES, ensure_toy_dataset
from wsod.engine.evaluate import NO_BOXES, Evaluator, evaluate_detections, write_evaluation
from wsod.engine.inference import predict
from wsod.engine.run_log import RunLog
from wsod.evaluation.classification import classification_ap
from wsod.evaluation.coco import STAT_NAMES, format_coco_stats, to_coco_results

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
    assert result.metrics.keys() == {"mAP", "CorLoc", "on_part", "cls_mAP"} and boxed.primary_metric == "mAP"
    labels = torch.stack([torch.as_tensor(r.labels) for r in toy_test.records])
    scores = torch.stack([d["image_scores"] for d in result.detections])
    expected = classification_ap(scores, labels, "voc07")["cls_mAP"]  # the label-only path's metric
    assert result.metrics["cls_mAP"] == pytest.approx(expected)
    lines = result.report.splitlines()
    assert lines[-1].startswith("copypaste:") and lines[-2].startswith("image-level classification mAP")
    assert lines[-2].endswith(f"{100 * expected:.2f}")
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


# A boxed COCO json as people write their own: no annotation "id", "iscrowd" or "area" (optional in
# wsod/data/coco.py). Three 64 x 64 images, so no object is large: APl and ARl are undefined (-1).
COCO_OBJECTS = [  # image id, category id, xywh
    (1, 1, [4, 4, 20, 20]),  # small: 400 < 32^2
    (1, 2, [10, 8, 40, 50]),  # medium
    (2, 2, [0, 0, 16, 24]),  # small
    (3, 1, [30, 30, 34, 34]),  # medium
]
COCO_DETECTIONS = [  # per image: xyxy boxes, scores (exact in float32), labels (category id - 1)
    ([[4, 4, 24, 24], [12, 8, 50, 58], [30, 30, 60, 60]], [0.875, 0.625, 0.25], [0, 1, 0]),
    ([[0, 0, 16, 20]], [0.75], [1]),
    ([[28, 30, 64, 64], [0, 0, 10, 10]], [0.6875, 0.125], [0, 1]),
]


def _coco_test_set(tmp_path, filled: bool):
    """The json above (written with the optional fields or without), its images and a few proposals."""
    from PIL import Image

    (tmp_path / "images").mkdir(exist_ok=True)
    for image_id in (1, 2, 3):
        Image.new("RGB", (64, 64), (40 * image_id, 90, 160)).save(tmp_path / "images" / f"{image_id}.jpg")
    annotations = [{"image_id": i, "category_id": c, "bbox": b} for i, c, b in COCO_OBJECTS]
    if filled:
        annotations = [{**a, "id": n + 1, "iscrowd": 0, "area": a["bbox"][2] * a["bbox"][3]}
                       for n, a in enumerate(annotations)]  # fmt: skip
    data = {
        "images": [{"id": i, "file_name": f"{i}.jpg", "width": 64, "height": 64} for i in (1, 2, 3)],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
        "annotations": annotations,
    }
    path = tmp_path / ("filled.json" if filled else "raw.json")
    path.write_text(json.dumps(data))
    boxes = np.array([[0, 0, 30, 30], [10, 8, 50, 58], [30, 30, 63, 63], [0, 0, 63, 63]], np.float32)
    return path, CocoDataset(path, tmp_path / "images", ProposalSet([1, 2, 3], [boxes] * 3))


def _coco_detections():
    return [
        {
            "boxes": torch.tensor(b, dtype=torch.float32),
            "scores": torch.tensor(s),
            "labels": torch.tensor(labels),
        }
        for b, s, labels in COCO_DETECTIONS
    ]


def test_a_coco_json_without_optional_annotation_fields_evaluates_like_the_filled_in_file(tmp_path):
    # The path that trained and then failed with KeyError 'id' (then 'iscrowd', then 'area') inside
    # pycocotools, which re-read the raw file: evaluation now scores against the loader's normalised json.
    _, dataset = _coco_test_set(tmp_path, filled=False)
    filled, _ = _coco_test_set(tmp_path, filled=True)
    metrics, report = evaluate_detections(_coco_detections(), dataset, metric="coco")

    results = to_coco_results(_coco_detections(), [1, 2, 3], [1, 2])
    with contextlib.redirect_stdout(io.StringIO()):
        ground_truth = COCO(str(filled))
        evaluator = COCOeval(ground_truth, ground_truth.loadRes(results), iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    assert list(metrics.values()) == evaluator.stats.tolist()
    assert 0 < metrics["AP"] < 1 and metrics["APl"] == -1.0  # not degenerate; and an undefined value
    assert report == format_coco_stats(metrics)
    # The ground truth is read once and reused: COCOeval's writes into it change nothing the next time.
    assert evaluate_detections(_coco_detections(), dataset, metric="coco")[0] == metrics


def test_the_coco_random_baseline_line_prints_undefined_values_as_the_table_does(tmp_path):
    _, dataset = _coco_test_set(tmp_path, filled=False)
    evaluator = Evaluator(dataset, scales=[64], max_size=100, metric="coco", num_workers=0, progress=False)
    model = build_model(TINY_MODEL, 2).eval()
    result = evaluator.score(_coco_detections(), model, random_baseline=True)

    line = result.report.splitlines()[-1]
    assert line.startswith("random scores over the same proposals: AP ")
    values = dict(part.split(" ") for part in line.split(": ", 1)[1].split(", "))
    assert list(values) == list(STAT_NAMES)
    assert values["APl"] == values["ARl"] == "-"  # no large object: undefined, as in the table above
    assert all(v == "-" or 0 <= float(v) <= 100 for v in values.values())
    assert "-100.00" not in result.report
    write_evaluation(result, dataset, tmp_path / "eval")
    written = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert written["random_APl"] == written["random_ARl"] == -1.0  # the raw numbers are kept


# -- result files: each dataset's own result_format decides them, no class check in evaluate.py -----------


def _one_detection_each(dataset):
    box = {"boxes": torch.tensor([[1.0, 2.0, 10.0, 12.0]]), "scores": torch.tensor([0.9])}
    return [{**box, "labels": torch.tensor([i % dataset.num_classes])} for i in range(len(dataset))]


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _folder_test_set(tmp_path):
    from folder_data import write_image_folder

    from wsod.data.folder import FolderDataset, proposals_path
    from wsod.data.proposals.store import write_proposal_store

    root = tmp_path / "mine"
    names = list(write_image_folder(root, num_train=2, num_test=2))
    boxes = [np.array([[0, 0, 30, 30], [10, 10, 60, 60]], np.float32) for _ in names]
    write_proposal_store(ProposalSet(names, boxes), proposals_path(root))
    return FolderDataset(root, "test")


@pytest.mark.parametrize("kind", ["voc", "label_only", "coco", "folder"])
def test_each_dataset_writes_the_result_files_of_its_format(kind, toy_test, tmp_path):
    from wsod.evaluation import coco, voc

    dataset = {
        "voc": lambda: toy_test,
        "label_only": lambda: _label_only(toy_test),  # the base class: devkit files
        "coco": lambda: _coco_test_set(tmp_path, filled=True)[1],
        "folder": lambda: _folder_test_set(tmp_path),
    }[kind]()
    detections = _one_detection_each(dataset)
    write_evaluation(evaluate.Evaluation(detections, {"m": 0.5}, "report"), dataset, tmp_path / "eval")
    common = ["metrics.json", "predictions.pth", "report.txt"]
    written, expected = tmp_path / "eval", tmp_path / "expected"
    if kind == "coco":
        assert dataset.result_format == "coco" and _files(written) == sorted([*common, "coco_results.json"])
        results = coco.to_coco_results(detections, dataset.image_ids, dataset.category_ids)
        assert json.loads((written / "coco_results.json").read_text()) == results
    elif kind == "folder":  # tools/predict.py's format: file names, not devkit ids
        assert dataset.result_format == "named" and _files(written) == sorted([*common, "predictions.json"])
        results = coco.to_named_results(detections, dataset.image_ids, dataset.classes)
        assert json.loads((written / "predictions.json").read_text()) == results
        assert {r["file_name"] for r in results} == set(dataset.image_ids)
    else:
        assert dataset.result_format == "voc"
        voc.write_voc_results(detections, [str(i) for i in dataset.image_ids], dataset.classes, expected)
        devkit = [f"voc_results/{name}" for name in _files(expected)]
        assert len(devkit) == len(TOY_CLASSES) and _files(written) == sorted([*common, *devkit])
        for name in _files(expected):
            assert (written / "voc_results" / name).read_text() == (expected / name).read_text()


def test_a_dataset_of_an_unknown_result_format_is_refused_before_predicting_or_writing(toy_test, tmp_path):
    assert set(evaluate.RESULT_WRITERS) == set(RESULT_FORMATS)

    class Odd(WeakDetectionDataset):
        result_format = "odd"

    dataset = Odd(toy_test.records, toy_test.classes, toy_test.proposals)
    expected = r"^Odd.result_format is 'odd'; expected one of \['voc', 'coco', 'named'\]"
    with pytest.raises(ValueError, match=expected):
        Evaluator(dataset, scales=[160], max_size=1000, num_workers=0, progress=False)
    with pytest.raises(ValueError, match=expected):
        write_evaluation(evaluate.Evaluation([], {}, ""), dataset, tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_the_coco_metric_asks_for_a_coco_json_test_set(toy_test):
    with pytest.raises(ValueError, match="^metric 'coco' needs a COCO json test set, not VOCDataset"):
        evaluate_detections(_one_detection_each(toy_test), toy_test, metric="coco")
