"""tools/predict.py: detections of any images as a COCO results json that pycocotools reads, PNGs with the
boxes drawn, and clear errors for inputs that hold no readable image."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from tiny_run import TINY_TOY

from wsod.build import build_model
from wsod.config_checks import ConfigError
from wsod.data.images import find_images
from wsod.data.toy import TOY_CLASSES, ensure_toy_dataset
from wsod.engine.checkpoint import save_checkpoint
from wsod.runs.predict import predict_from_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ENV.pop("HYDRA_FULL_ERROR", None)
FIELDS = {"image_id", "file_name", "category_id", "category_name", "bbox", "score"}
TINY_MODEL = {"backbone": "resnet18", "width": 0.25, "weights": None, "chunk_size": 16}


def _checkpoint(path: Path, classes=TOY_CLASSES) -> Path:
    """An (untrained) wsod checkpoint that records its test views, as training writes them."""
    torch.manual_seed(0)
    test = {"scales": [160], "max_size": 1000, "flip": False, "max_proposals": None}
    metadata = {"model": TINY_MODEL, "method": {"name": "mist"}, "classes": list(classes)}
    metadata["config"] = {"data": {"test": test}}
    save_checkpoint({"model": build_model(TINY_MODEL, len(classes)).state_dict(), "metadata": metadata}, path)
    return path


def _predict_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="predict", overrides=overrides)


def test_predictions_of_the_toy_test_split_load_into_pycocotools_and_cocoeval(tiny_toy_root, tmp_path):
    toy = ensure_toy_dataset(tiny_toy_root, **TINY_TOY).dataset("test")
    images = tmp_path / "toy_test"
    images.mkdir()
    for record in toy.records:
        shutil.copy(record.path, images)
    out = tmp_path / "predictions"
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "predict.py"), f"checkpoint={_checkpoint(tmp_path / 'c.pth')}",
         f"input={images}", f"output={out}", "score_threshold=0.0", "progress=false"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    predictions = json.loads((out / "predictions.json").read_text())
    assert predictions and all(set(p) == FIELDS for p in predictions)
    names = sorted(f"{r.image_id}.jpg" for r in toy.records)
    assert sorted({p["file_name"] for p in predictions}) == names
    assert {p["image_id"] for p in predictions} == set(range(1, len(names) + 1))  # sorted file order
    assert all(p["category_name"] == TOY_CLASSES[p["category_id"] - 1] for p in predictions)
    for name in names:  # one PNG per image, at the image's size
        with Image.open(out / name.replace(".jpg", ".png")) as png:
            assert png.size == (160, 160)

    # A COCO json of the same images under other ids: the results map onto it through file_name.
    coco_ids = {f"{r.image_id}.jpg": 1000 + n for n, r in enumerate(toy.records)}
    ground_truth = {
        "images": [{"id": coco_ids[f"{r.image_id}.jpg"], "file_name": f"{r.image_id}.jpg", "width": r.width,
                    "height": r.height} for r in toy.records],
        "categories": [{"id": i + 1, "name": name} for i, name in enumerate(TOY_CLASSES)],
        "annotations": [
            {"id": 1 + len(toy.records) * k + n, "image_id": coco_ids[f"{r.image_id}.jpg"],
             "category_id": int(label) + 1, "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1),
             "iscrowd": 0}
            for n, r in enumerate(toy.records)
            for k, ((x1, y1, x2, y2), label) in enumerate(zip(r.gt_boxes.tolist(), r.gt_labels, strict=True))
        ],
    }  # fmt: skip
    coco_gt = COCO()
    coco_gt.dataset = ground_truth
    coco_gt.createIndex()
    by_name = {p["file_name"]: p["image_id"] for p in predictions}
    mapped = [{**p, "image_id": coco_ids[p["file_name"]]} for p in predictions]
    assert len(by_name) == len(names)
    coco_dt = coco_gt.loadRes(mapped)
    evaluator = COCOeval(coco_gt, coco_dt, iouType="bbox")
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    assert len(evaluator.stats) == 12 and 0.0 <= evaluator.stats[1] <= 1.0


def test_inputs_are_a_file_a_folder_or_a_glob(tmp_path, jpeg_file):
    for name in ("a.jpg", "b.PNG", "sub/c.jpeg"):
        jpeg_file(tmp_path / "in" / name)
    (tmp_path / "in" / "notes.txt").write_text("not an image")
    files, names = find_images(tmp_path / "in")
    assert names == ["a.jpg", "b.PNG", "sub/c.jpeg"] and files[2] == tmp_path / "in" / "sub" / "c.jpeg"
    assert find_images(tmp_path / "in" / "sub" / "c.jpeg")[1] == ["c.jpeg"]
    assert find_images(f"{tmp_path}/in/*.jpg")[1] == ["a.jpg"]
    assert find_images(f"{tmp_path}/in/**/*.jp*g")[1] == ["a.jpg", "sub/c.jpeg"]


@pytest.fixture
def jpeg_file():
    def write(path: Path, size: tuple[int, int] = (40, 30)) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (120, 40, 200)).save(path)
        return path

    return write


def test_an_empty_input_folder_names_it_and_the_extensions_read(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no images here")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "predict.py"), f"checkpoint={tmp_path / 'c.pth'}",
         f"input={tmp_path / 'empty'}", f"output={tmp_path / 'out'}"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert f"ValueError: input={tmp_path / 'empty'}: no image found (read: .jpg .jpeg .png" in output
    assert "give a folder holding images" in output and "Traceback" not in output
    assert "no image found" in (tmp_path / "out" / "error.txt").read_text()


def test_an_unreadable_image_is_named_before_any_work(tmp_path, jpeg_file):
    jpeg_file(tmp_path / "in" / "good.jpg")
    (tmp_path / "in" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    cfg = _predict_config(
        [f"checkpoint={tmp_path / 'missing.pth'}", f"input={tmp_path / 'in'}", f"output={tmp_path / 'out'}"]
    )
    with pytest.raises(RuntimeError, match=r"cannot read image .*broken\.jpg .*: replace it with a readable"):
        predict_from_config(cfg)  # before the checkpoint is even opened


def test_predict_settings_are_checked_before_anything_runs(tmp_path):
    from hydra.errors import ConfigCompositionException

    from wsod.config_checks import ConfigError

    cfg = _predict_config(["input=x", "score_threshold=2", f"output={tmp_path / 'o'}"])
    with pytest.raises(ConfigError) as error:
        predict_from_config(cfg)
    for message in (
        "checkpoint='???': expected a path",
        "score_threshold=2.0: expected a number >= 0 and <= 1",
    ):
        assert message in str(error.value)
    assert not (tmp_path / "o").exists()
    # A choice outside its Enum (the schema's) is refused as the config is composed, naming the choices.
    with pytest.raises(ConfigCompositionException) as refused:
        _predict_config(["input=x", "selective_search=slow"])
    assert "Invalid value 'slow', expected one of [fast, quality, single]" in str(refused.value.__cause__)


def test_a_non_empty_output_folder_is_refused_unless_overwrite_and_never_holds_old_pngs(tmp_path, jpeg_file):
    for name in ("a.jpg", "b.jpg"):
        jpeg_file(tmp_path / "in" / name)
    checkpoint, out = _checkpoint(tmp_path / "c.pth"), tmp_path / "out"
    common = [f"checkpoint={checkpoint}", f"output={out}", "progress=false", "num_workers=0"]
    predict_from_config(_predict_config([*common, f"input={tmp_path / 'in'}"]))
    assert sorted(p.name for p in out.glob("*.png")) == ["a.png", "b.png"]

    only_a = f"input={tmp_path / 'in' / 'a.jpg'}"
    with pytest.raises(ConfigError, match=r"already holds a prediction \(4 files\): overwrite=true replaces"):
        predict_from_config(_predict_config([*common, only_a]))
    assert (out / "b.png").is_file()  # refused before anything was touched
    predict_from_config(_predict_config([*common, only_a, "overwrite=true"]))
    assert sorted(p.name for p in out.iterdir()) == ["a.png", "log.txt", "predictions.json"]  # no stale b.png
    assert {p["file_name"] for p in json.loads((out / "predictions.json").read_text())} <= {"a.jpg"}

    # A folder holding files no prediction writes (here the input images) is never emptied.
    inputs = f"input={tmp_path / 'in'}"
    with pytest.raises(ConfigError, match="holds files that tools/predict.py did not write"):
        predict_from_config(
            _predict_config([*common[:1], f"output={tmp_path / 'in'}", inputs, "overwrite=true"])
        )
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["a.jpg", "b.jpg"]


def test_predict_is_an_entry_point_of_wsod_runs_and_its_old_import_paths_are_gone():
    # wsod.predict_images re-exported wsod.run's predict_from_config and wsod.data.images' helpers.
    for old in ("wsod.predict_images", "wsod.run"):
        assert importlib.util.find_spec(old) is None, f"{old} is back: import wsod.runs.predict instead"
    assert predict_from_config.__module__ == "wsod.runs.predict"
