"""The VOC-like set: the rules each drawn image follows, the folder, the stats report, the config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from composed import composed
from omegaconf import OmegaConf

from wsod.config_checks import TRAIN_RULES, ConfigError, check_config
from wsod.data.formats import dataset_format
from wsod.data.toy_voc.generator import (
    AFFINITY_PAIRS,
    DIFFICULT_VISIBLE,
    FORMAT_VERSION,
    INSTANCE_COUNT_P,
    MANIFEST_NAME,
    MIN_INSIDE,
    MIN_VISIBLE,
    OBJECT_SIDE,
    OWN_COLOUR_P,
    SHORT_SIDE,
    TOY_VOC_CLASSES,
    ToyVOCImage,
    check_generator_seed,
    ensure_toy_voc_dataset,
    render_toy_voc_image,
)
from wsod.data.toy_voc.pretraining import render_object_centric_image
from wsod.data.toy_voc.stats import discriminative_regions, format_stats, image_stats, toy_voc_stats
from wsod.data.voc import load_voc_records

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = 40  # images drawn for the per-image rules (about 1.5 s)


@pytest.fixture(scope="module")
def drawn() -> list[ToyVOCImage]:
    return [render_toy_voc_image(0, n) for n in range(SAMPLE)]


def test_images_are_drawn_from_their_own_seed():
    a, b = render_toy_voc_image(0, 5), render_toy_voc_image(0, 5)
    np.testing.assert_array_equal(a.image, b.image)
    np.testing.assert_array_equal(a.boxes, b.boxes)
    other = render_toy_voc_image(1, 5)
    assert a.image.shape != other.image.shape or not np.array_equal(a.image, other.image)


def test_sizes_and_counts_are_in_their_ranges(drawn):
    shapes = set()
    for d in drawn:
        height, width = d.image.shape[:2]
        assert SHORT_SIDE[0] <= min(height, width) <= SHORT_SIDE[1]
        shapes.add("landscape" if width > height else "portrait" if height > width else "square")
        assert 1 <= len(d.labels) <= len(INSTANCE_COUNT_P)
        relative = d.sides / min(height, width)
        assert (relative >= OBJECT_SIDE[0] - 1e-9).all() and (relative <= OBJECT_SIDE[1] + 1e-9).all()
    assert {"landscape", "portrait"} <= shapes


def test_boxes_are_tight_around_the_visible_pixels_and_flags_follow_the_rules(drawn):
    for d in drawn:
        for i in range(len(d.labels)):
            seen = d.body_masks[i] | d.part_masks[i]
            ys, xs = np.nonzero(seen)
            np.testing.assert_array_equal(d.boxes[i], [xs.min(), ys.min(), xs.max(), ys.max()])
            assert not (d.body_masks[i] & d.part_masks[i]).any()
            assert d.visible[i] >= MIN_VISIBLE - 1e-9
            assert d.difficult[i] == (d.visible[i] < DIFFICULT_VISIBLE)
        # Later objects cover earlier ones: two objects' visible pixels never overlap.
        seen = (d.body_masks | d.part_masks).sum(0)
        assert seen.max(initial=0) <= 1


def test_the_last_object_is_seen_whole_inside_the_image(drawn):
    # Nothing is drawn after it, so what it shows is what lies inside the image (at least MIN_INSIDE).
    for d in drawn:
        assert d.visible[-1] >= MIN_INSIDE - 1e-9 and not d.occluded[-1]
        assert d.truncated[-1] == (d.visible[-1] < 0.99)


def test_the_sample_has_the_difficulties_it_promises(drawn):
    stats = image_stats(drawn, len(TOY_VOC_CLASSES))
    assert stats["instances_per_image"]["mean"] >= 2
    assert stats["images_with_several_of_one_class"] >= 0.25
    assert stats["occluded"] > 0.05 and stats["truncated"] > 0.05
    assert stats["loose_parts_per_image"] > 0 and stats["context_region_share"]["present"] > 0


def _image(labels, difficult=None, context="none") -> ToyVOCImage:
    """A hand-made image record: only what image_stats reads is meaningful."""
    labels = np.array(labels, np.int64)
    count = len(labels)
    difficult = np.zeros(count, bool) if difficult is None else np.array(difficult)
    zeros = np.zeros(count, bool)
    return ToyVOCImage(
        image=np.zeros((200, 300, 3), np.uint8),
        boxes=np.zeros((count, 4), np.float32),
        labels=labels,
        difficult=difficult,
        truncated=zeros,
        visible=np.ones(count),
        sides=np.full(count, 60.0),
        body_masks=np.zeros((0, 1, 1), bool),
        part_masks=np.zeros((0, 1, 1), bool),
        body_shapes=np.zeros((0, 1, 1), bool),
        occluded=zeros,
        loose_parts=0,
        context=context,
    )


def test_image_stats_against_a_hand_count():
    a, b = (TOY_VOC_CLASSES.index(name) for name in AFFINITY_PAIRS[0])
    other = next(c for c in range(len(TOY_VOC_CLASSES)) if c not in (a, b))
    images = [
        _image([a, b]),
        _image([a, a]),
        _image([a, other], context="present"),
        _image([b, a], difficult=[False, True]),  # a difficult a is no label: b without a
    ]
    stats = image_stats(images, len(TOY_VOC_CLASSES))
    pair = stats["affinity"][0]
    assert pair["p_b_given_a"] == pytest.approx(1 / 3)  # 3 images label a, one of them b
    assert pair["p_a_given_b"] == pytest.approx(1 / 2)  # 2 images label b, one of them a
    assert stats["images_with_several_of_one_class"] == pytest.approx(1 / 4)
    assert stats["instances_per_image"] == {"mean": 2.0, "histogram": {"1": 0, "2": 4}}
    assert stats["per_class_images"][a] == 3 and stats["per_class_instances"][a] == 5
    assert stats["difficult"] == pytest.approx(1 / 8)
    assert stats["context_region_share"] == {"present": 0.25, "absent": 0.0}


def test_the_probe_finds_the_region_that_tells_classes_apart():
    # Two classes whose body features are the same noise and whose part features differ.
    rng = np.random.default_rng(0)

    def region(c):
        return c, rng.normal(0, 1, 4), rng.normal(0, 0.1, 4) + 3 * c

    train, test = [region(c % 2) for c in range(200)], [region(c % 2) for c in range(100)]
    recall = discriminative_regions(train, test, 2)
    assert (recall["part"] == 1.0).all() and (recall["body"] < 0.8).all()


def test_generator_seed_must_be_a_non_negative_integer():
    assert check_generator_seed(3) == 3
    for bad in (True, "1", 1.0, -1):
        with pytest.raises(ValueError, match=r"^data.generator_seed=.*expected a non-negative integer"):
            check_generator_seed(bad)


def test_the_folder_is_a_voc_devkit_with_flags(tiny_toy_voc):
    base = tiny_toy_voc.devkit / "VOC2007"
    main = base / "ImageSets" / "Main"
    assert len((main / "trainval.txt").read_text().split()) == 8
    assert len((main / "test.txt").read_text().split()) == 4
    records = load_voc_records(tiny_toy_voc.devkit, "2007", "trainval", TOY_VOC_CLASSES)
    xml = (base / "Annotations" / f"{records[0].image_id}.xml").read_text()
    assert "<truncated>" in xml and "<difficult>" in xml
    for number, record in enumerate(records):
        drawn = render_toy_voc_image(0, number)
        np.testing.assert_array_equal(record.gt_boxes, drawn.boxes)
        np.testing.assert_array_equal(record.gt_difficult, drawn.difficult)
        np.testing.assert_array_equal(
            np.flatnonzero(record.labels), np.unique(drawn.labels[~drawn.difficult])
        )
        assert (record.height, record.width) == drawn.image.shape[:2]
    manifest = json.loads((tiny_toy_voc.root / MANIFEST_NAME).read_text())
    assert manifest["format"] == FORMAT_VERSION and manifest["generator_seed"] == 0
    item = tiny_toy_voc.dataset("test")[0]
    assert len(item["proposals"]) >= 20


def test_a_folder_of_other_settings_is_never_reused(tiny_toy_voc):
    root = tiny_toy_voc.root
    with pytest.raises(ValueError, match="data.root=data/toy_voc_seed1"):
        ensure_toy_voc_dataset(root, generator_seed=1, num_train=8, num_test=4)
    manifest_path = root / MANIFEST_NAME
    saved = manifest_path.read_text()
    try:  # a folder made by another generator version
        manifest_path.write_text(json.dumps({**json.loads(saved), "format": FORMAT_VERSION - 1}))
        with pytest.raises(ValueError, match="holds a VOC-like set made with"):
            ensure_toy_voc_dataset(root, num_train=8, num_test=4)
    finally:
        manifest_path.write_text(saved)


def test_a_half_written_folder_is_refused(tmp_path):
    root = tmp_path / "toy_voc"
    (root / "VOCdevkit").mkdir(parents=True)
    with pytest.raises(FileExistsError, match=f"{MANIFEST_NAME} is missing"):
        ensure_toy_voc_dataset(root, num_train=2, num_test=1)


def test_the_stats_command_measures_an_existing_folder(tiny_toy_voc):
    # The command the module doc and configs/data/toy_voc.yaml give, word for word, in the folder's
    # project directory (data/toy_voc, a small set: the command measures what is there).
    project = tiny_toy_voc.root.parents[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "wsod.data.toy_voc", "stats"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr
    assert "classes are told apart best by their part" in done.stdout
    report = json.loads((tiny_toy_voc.root / "stats.json").read_text())
    assert report["trainval"]["images"] == 8 and report["test"]["images"] == 4
    assert report["manifest"]["num_train"] == 8
    assert 0 <= report["test"]["proposals"]["recall_0.5"] <= 1
    assert len(report["discriminative_region"]) == len(TOY_VOC_CLASSES)
    assert format_stats(toy_voc_stats(tiny_toy_voc.root)).splitlines()[0].startswith("VOC-like set:")


def test_the_config_composes_checks_and_opens(tiny_toy_voc):
    cfg = composed("train", ("data=toy_voc",))
    check_config(cfg, TRAIN_RULES)
    assert cfg.data.kind == "toy_voc" and cfg.data.generator_seed == 0 and cfg.data.root == "data/toy_voc"
    with pytest.raises(ConfigError, match="data.generator_seed=-1"):
        check_config(composed("train", ("data=toy_voc", "data.generator_seed=-1")), TRAIN_RULES)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    data.update(root=str(tiny_toy_voc.root), num_train=8, num_test=4)
    dataset = dataset_format("toy_voc").open(data, data["test"]["set"])
    assert len(dataset) == 4 and dataset.classes == TOY_VOC_CLASSES


def test_colour_is_a_hint_not_the_class():
    # The centre of a lone circle (pretraining images centre one object of class number % 20) is body:
    # its colour is the circle's own in about OWN_COLOUR_P + (1 - OWN_COLOUR_P) / 14 of the images (43%),
    # another class's in the rest, so no patch of colour names the class.
    circle = TOY_VOC_CLASSES.index("circle")
    own = np.array([235.0, 110.0, 90.0])
    distances = []
    for k in range(60):
        image, cls = render_object_centric_image(0, circle + 20 * k)
        assert cls == circle
        centre = image[59:69, 59:69].reshape(-1, 3).astype(float)
        distances.append(np.linalg.norm(np.median(centre, axis=0) - own))
    close = sum(d < 60 for d in distances)
    assert 12 <= close <= 40 and sum(d > 90 for d in distances) >= 15, sorted(distances)
    assert 0 < OWN_COLOUR_P < 1
