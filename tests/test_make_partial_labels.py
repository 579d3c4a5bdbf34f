"""tools/make_partial_labels.py: simulated points and scribbles lie inside each object's mask (the toy
set's drawn shapes, COCO's polygons), boxes are the ground truth, the fractions are exact counts, the
same command writes the same file, and what it writes loads as training data."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from wsod.data.partial_label_simulation import choose_kinds, parse_fraction
from wsod.data.toy import ensure_toy_dataset, toy_object_masks

TOOL = Path(__file__).resolve().parents[1] / "tools" / "make_partial_labels.py"


def _main():
    spec = importlib.util.spec_from_file_location("make_partial_labels_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _toy_objects(root: Path):
    toy = ensure_toy_dataset(root, num_train=12, num_test=6, workers=1)
    seed = json.loads((root / "toy.json").read_text())["seed"]
    records = toy.dataset("trainval").records
    return toy, {r.image_id: (r, toy_object_masks(seed, int(r.image_id))) for r in records}


def test_points_and_scribbles_lie_inside_the_toy_shapes_and_boxes_are_the_ground_truth(
    tiny_toy_root, tmp_path
):
    toy, objects = _toy_objects(tiny_toy_root)
    main = _main()
    files = {}
    for kind, flag in (("point", "--points"), ("scribble", "--scribbles"), ("box", "--boxes")):
        files[kind] = tmp_path / f"{kind}.json"
        assert main(["toy", "--root", str(tiny_toy_root), flag, "1", "--output", str(files[kind])]) == 0
    for kind, path in files.items():
        images = json.loads(path.read_text())["images"]
        assert sorted(images) == sorted(objects)  # every image, every object
        for image_id, entries in images.items():
            record, masks = objects[image_id]
            assert [e["class"] for e in entries] == [toy.classes[c] for c in record.gt_labels]
            for entry, mask, box in zip(entries, masks, record.gt_boxes, strict=True):
                if kind == "box":
                    assert entry["box"] == box.tolist()
                    continue
                xs, ys = (entry["point"][:1], entry["point"][1:]) if kind == "point" else entry["scribble"]
                assert len(xs) >= 1 and mask[np.asarray(ys, int), np.asarray(xs, int)].all()


def test_fractions_are_exact_counts_per_image_or_per_object_and_the_draw_is_seeded(tiny_toy_root, tmp_path):
    _, objects = _toy_objects(tiny_toy_root)
    num_objects = sum(len(r.gt_labels) for r, _ in objects.values())
    main = _main()
    half = tmp_path / "half.json"
    main(["toy", "--root", str(tiny_toy_root), "--boxes", "1/2", "--output", str(half)])
    assert len(json.loads(half.read_text())["images"]) == 6  # half of the 12 images, all their objects
    mixed, again = tmp_path / "mixed.json", tmp_path / "again.json"
    command = ["toy", "--root", str(tiny_toy_root), "--points", "1/3", "--scribbles", "1/3", "--boxes", "1/3"]
    main([*command, "--per", "object", "--output", str(mixed)])
    main([*command, "--per", "object", "--output", str(again)])
    assert mixed.read_bytes() == again.read_bytes()
    entries = [e for objs in json.loads(mixed.read_text())["images"].values() for e in objs]
    kinds = [next(k for k in ("point", "scribble", "box") if k in e) for e in entries]
    third = round(num_objects / 3)
    assert len(kinds) == min(num_objects, 3 * third)
    assert sorted(set(kinds)) == ["box", "point", "scribble"]
    main([*command, "--per", "object", "--seed", "1", "--output", str(again)])
    assert mixed.read_bytes() != again.read_bytes()
    # The side file trains: it loads onto the records it names.
    dataset = ensure_toy_dataset(tiny_toy_root, num_train=12, num_test=6).dataset(
        "trainval", partial_labels=mixed
    )
    assert sum(r.supervision is not None for r in dataset.records) == len(
        json.loads(mixed.read_text())["images"]
    )


def test_choose_kinds_and_fractions():
    kinds = choose_kinds(10, {"point": 0.3, "box": 0.2}, seed=0)
    assert kinds.count("point") == 3 and kinds.count("box") == 2 and kinds.count(None) == 5
    assert parse_fraction("1/3") == pytest.approx(1 / 3) and parse_fraction("0.1") == 0.1
    with pytest.raises(ValueError, match="add up to"):
        choose_kinds(4, {"point": 0.7, "box": 0.7}, seed=0)
    with pytest.raises(ValueError, match="not a fraction"):
        parse_fraction("a third")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        parse_fraction("3/2")


# The check below decodes masks with pycocotools, whose decoder warns under numpy 2 (not wsod's code;
# the tool itself filters the same warning where it decodes).
@pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)
def test_coco_points_lie_in_the_polygon_and_every_annotation_says_how_it_is_used(tmp_path):
    from PIL import Image

    from wsod.data.coco import load_coco_records

    (tmp_path / "images").mkdir()
    Image.new("RGB", (60, 40)).save(tmp_path / "images" / "1.jpg")
    triangle = [10.0, 30.0, 30.0, 30.0, 20.0, 5.0]  # x y pairs
    data = {
        "images": [{"id": 1, "file_name": "1.jpg", "height": 40, "width": 60}],
        "categories": [{"id": 1, "name": "cat"}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 5, 20, 25], "segmentation": [triangle],
             "area": 250.0, "iscrowd": 0},
            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [40, 5, 10, 10], "iscrowd": 0},  # no mask
            {"id": 3, "image_id": 1, "category_id": 1, "bbox": [0, 0, 60, 40], "iscrowd": 1},
        ],
    }  # fmt: skip
    source = tmp_path / "instances.json"
    source.write_text(json.dumps(data))
    out = tmp_path / "points.json"
    assert _main()(["coco", "--annotations", str(source), "--points", "1", "--output", str(out)]) == 0
    written = json.loads(out.read_text())["annotations"]
    assert [a.get("use_as") for a in written] == ["point", "point", None]  # the crowd region is untouched
    from pycocotools import mask as mask_utils

    rle = mask_utils.frPyObjects([triangle], 40, 60)
    polygon = mask_utils.decode(mask_utils.merge(rle)).astype(bool)
    x, y = written[0]["point"]
    assert polygon[int(y), int(x)]
    x, y = written[1]["point"]
    assert 40 <= x <= 50 and 5 <= y <= 15  # inside the box where there is no mask
    (record,), _, _ = load_coco_records(out, tmp_path / "images")
    assert record.supervision["points"].shape == (2, 2)


def _tool():
    spec = importlib.util.spec_from_file_location("make_partial_labels_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refused(capsys, arguments) -> str:
    """The one line the tool prints when it refuses ``arguments`` (exit status 2, as argparse's)."""
    with pytest.raises(SystemExit) as stop:
        _main()(arguments)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage block
    return err.strip()


@pytest.mark.parametrize(
    ("value", "problem"),
    [("abc", "'abc' is not a fraction"), ("1/0", "'1/0' is not a fraction"), ("2", "'2' is outside [0, 1]")],
)
def test_a_bad_fraction_names_the_option_the_value_and_what_is_accepted(tmp_path, capsys, value, problem):
    """argparse used to print ``invalid parse_fraction value: 'abc'`` after a usage block."""
    line = _refused(capsys, ["toy", "--scribbles", value, "--output", str(tmp_path / "x.json")])
    assert line.endswith(
        f" toy: error: argument --scribbles: {problem}; give a number in [0, 1], as a decimal (0.1) or a"
        " ratio (1/3)"
    )


def test_a_root_that_holds_no_toy_set_is_refused_and_nothing_is_made(tmp_path, capsys):
    """A mistyped --root used to make a whole new toy set there (minutes), silently."""
    typo = tmp_path / "tyo"
    line = _refused(
        capsys, ["toy", "--root", str(typo), "--points", "1", "--output", str(tmp_path / "p.json")]
    )
    assert line.endswith(
        f" toy: error: --root {typo}: no such folder; give the folder of a toy set made before"
        " (tools/train.py data.root=<folder> makes one there) or leave --root out to use data/toy, made on"
        " first use"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _refused(
        capsys, ["toy", "--root", str(empty), "--points", "1", "--output", str(tmp_path / "p.json")]
    )
    assert f"--root {empty}: no toy set in it ({empty / 'toy.json'} is missing);" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any(empty.iterdir())


def test_without_root_the_default_toy_set_is_read(tiny_toy_root, tmp_path, monkeypatch):
    tool = _tool()
    monkeypatch.setattr(tool, "DEFAULT_TOY_ROOT", tiny_toy_root)  # data/toy, here already made
    out = tmp_path / "points.json"
    assert tool.main(["toy", "--points", "1", "--output", str(out)]) == 0
    assert len(json.loads(out.read_text())["images"]) == 12


def test_fractions_that_label_nothing_or_more_than_everything_are_refused(tiny_toy_root, tmp_path, capsys):
    root, out = str(tiny_toy_root), str(tmp_path / "x.json")
    line = _refused(capsys, ["toy", "--root", root, "--points", "1/2", "--boxes", "0.01", "--output", out])
    assert line.endswith(
        " toy: error: --boxes 0.01 gives no image with objects a box (0.01 of 12 rounds to none); give at"
        " least 1/12"
    )
    line = _refused(capsys, ["toy", "--root", root, "--points", "0.7", "--boxes", "1/2", "--output", out])
    assert line.endswith(
        " toy: error: --points 0.7 + --boxes 0.5 add up to 1.2 > 1; each image gets one kind at most"
    )
    assert not (tmp_path / "x.json").exists()


def test_a_coco_file_of_another_kind_names_the_file_and_the_missing_field(tmp_path):
    """A side file or a checkpoint given as --annotations failed with a bare KeyError ('categories') or
    UnicodeDecodeError; a json without boxes or sizes, with a KeyError ('bbox', 'height')."""
    import torch

    side = tmp_path / "points.json"
    side.write_text(json.dumps({"images": {"000001": [{"class": "cat", "point": [1, 2]}]}}))
    arguments = ["--points", "1", "--output", str(tmp_path / "out.json")]
    with pytest.raises(ValueError) as error:
        _main()(["coco", "--annotations", str(side), *arguments])
    assert str(error.value) == (
        f"{side}: no 'categories' list, or an empty one; expected a COCO json with non-empty 'images' and"
        " 'categories' lists and an 'annotations' list"
    )
    checkpoint = tmp_path / "model_final.pth"
    torch.save({"model": {}}, checkpoint)
    with pytest.raises(ValueError, match=rf"^{checkpoint}: not a JSON file \(a zip archive, as a PyTorch"):
        _main()(["coco", "--annotations", str(checkpoint), *arguments])
    labels_only = tmp_path / "labels.json"
    labels_only.write_text(
        json.dumps(
            {
                "images": [{"id": 1, "file_name": "1.jpg"}],
                "categories": [{"id": 1, "name": "cat"}],
                "annotations": [{"image_id": 1, "category_id": 1}],
            }
        )
    )
    with pytest.raises(
        ValueError, match=rf"^{labels_only}: its annotations have no 'bbox' \(image labels only\)"
    ):
        _main()(["coco", "--annotations", str(labels_only), *arguments])
    unsized = tmp_path / "unsized.json"
    unsized.write_text(
        json.dumps(
            {
                "images": [{"id": 1, "file_name": "1.jpg"}],
                "categories": [{"id": 1, "name": "cat"}],
                "annotations": [
                    {
                        "image_id": 1,
                        "category_id": 1,
                        "bbox": [1, 1, 5, 5],
                        "segmentation": [[1, 1, 5, 1, 3, 5]],
                    }
                ],
            }
        )
    )
    with pytest.raises(
        ValueError, match=rf"^{unsized}: images\[0\] \(id 1\) has height None and width None;"
    ):
        _main()(["coco", "--annotations", str(unsized), *arguments])
    assert not (tmp_path / "out.json").exists()
