"""Proposals from any tool (issue 39): a COCO-style json of boxes, detectron2's proposal pickle and a folder
of per-image arrays, each read with its scores and each bad file named in one line; scores that survive
a pickle and a store; the cap that keeps the best-scored boxes, against a naive sort."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from wsod.data.proposals import ProposalSet, filter_proposals, load_proposals, save_proposals, union_proposals

ROOT = Path(__file__).resolve().parents[2]


def _json(path: Path, entries) -> Path:
    path.write_text(json.dumps(entries))
    return path


def test_a_json_of_boxes_is_read_per_image_with_its_scores(tmp_path):
    entries = [
        {"image_id": 5, "bbox": [10, 20, 30, 40], "score": 0.9, "category_id": 1},
        {"image_id": "000007", "bbox": [0, 0, 5, 5], "score": 0.1},
        {"image_id": 5, "bbox": [1.5, 2, 3, 4], "score": 0.3},
    ]
    for content in (entries, {"annotations": entries, "images": [{"id": 5}, {"id": "000007"}]}):
        proposals = load_proposals(_json(tmp_path / "boxes.json", content))
        np.testing.assert_allclose(proposals["000005"], [[10, 20, 40, 60], [1.5, 2, 4.5, 6]])  # x + w, y + h
        np.testing.assert_allclose(proposals.scores(5), [0.9, 0.3])
        np.testing.assert_allclose(proposals[7], [[0, 0, 5, 5]])
    unscored = load_proposals(_json(tmp_path / "plain.json", [{"image_id": 5, "bbox": [0, 0, 2, 2]}]))
    assert unscored.scores(5) is None


JSON_CASES = {
    "not a list": ({"boxes": []}, r"the json is a dict; expected a json list"),
    "no bbox": ([{"image_id": 5}], r"entry 0 is a dict without image_id and bbox"),
    "bbox": ([{"image_id": 5, "bbox": [0, 0, -1, 4]}], r"entry 0 \(image_id 5\): bbox is \[0, 0, -1, 4\]"),
    "bbox length": ([{"image_id": 5, "bbox": [0, 0, 4]}], r"entry 0 \(image_id 5\): bbox is \[0, 0, 4\]"),
    "image id": ([{"image_id": [5], "bbox": [0, 0, 4, 4]}], r"entry 0 \(image_id \[5\]\): the image_id"),
    "score": ([{"image_id": 5, "bbox": [0, 0, 4, 4], "score": "high"}], r"entry 0 \(image_id 5\): score is"),
    "mixed scores": (
        [{"image_id": 5, "bbox": [0, 0, 4, 4], "score": 1.0}, {"image_id": 6, "bbox": [0, 0, 4, 4]}],
        r"entry 1 \(image_id 6\) has no score, entry 0 has one: give every box a score, or none",
    ),
    "empty": ([], r"no box"),
    "unknown image": (
        {
            "images": [{"id": 5}],
            "annotations": [{"image_id": 5, "bbox": [0, 0, 4, 4]}, {"image_id": 9, "bbox": [0, 0, 4, 4]}],
        },
        r'entry 1 \(image_id 9\): the image_id is not in the file\'s "images" list',
    ),
    "images": (
        {"images": [5], "annotations": [{"image_id": 5, "bbox": [0, 0, 4, 4]}]},
        r'"images" is a list',
    ),
}


@pytest.mark.parametrize("case", JSON_CASES)
def test_a_bad_json_of_boxes_is_one_line_naming_the_file_the_entry_and_the_field(case, tmp_path):
    content, message = JSON_CASES[case]
    path = _json(tmp_path / "boxes.json", content)
    with pytest.raises(ValueError, match=message) as error:
        load_proposals(path)
    assert str(error.value).startswith(str(path)) and "\n" not in str(error.value)


def _d2(path: Path, **fields) -> Path:
    content = {
        "ids": [5, 7],
        "boxes": [np.array([[0, 0, 10, 10], [2, 2, 8, 9]], np.float32), np.array([[1, 1, 4, 4]], np.float32)],
        "objectness_logits": [np.array([-1.0, 3.0], np.float32), np.array([0.5], np.float32)],
        "bbox_mode": 0,
        **fields,
    }
    path.write_bytes(pickle.dumps(content, protocol=4))
    return path


def test_detectron2s_proposal_pickle_keeps_its_objectness_as_scores(tmp_path):
    proposals = load_proposals(_d2(tmp_path / "d2.pkl"))
    np.testing.assert_allclose(proposals.scores(5), [-1.0, 3.0])
    np.testing.assert_allclose(proposals[5], [[0, 0, 10, 10], [2, 2, 8, 9]])
    xywh = load_proposals(_d2(tmp_path / "xywh.pkl", bbox_mode=1))
    np.testing.assert_allclose(xywh[5], [[0, 0, 10, 10], [2, 2, 10, 11]])
    with pytest.raises(ValueError, match=r"field 'bbox_mode' is 2; expected 0 \(detectron2's XYXY_ABS\)"):
        load_proposals(_d2(tmp_path / "rel.pkl", bbox_mode=2))
    with pytest.raises(
        ValueError, match=r"image 7 has 2 scores for 1 boxes \(field 'objectness_logits', entry 1\)"
    ):
        load_proposals(_d2(tmp_path / "bad.pkl", objectness_logits=[np.zeros(2), np.zeros(2)]))


def test_a_folder_of_arrays_is_read_by_image_id_with_or_without_scores(tmp_path):
    scored = tmp_path / "scored"
    (scored / "cats").mkdir(parents=True)
    np.save(scored / "000005.npy", np.array([[0, 0, 9, 9, 0.5], [1, 1, 5, 5, 0.7]]))
    (scored / "cats" / "001.jpg.txt").write_text("# x1 y1 x2 y2 score\n2, 3, 8, 9, 0.25\n\n1 1 4 4 0.5\n")
    proposals = load_proposals(scored)
    assert set(proposals.image_ids) == {"000005", "cats/001.jpg"}
    np.testing.assert_allclose(proposals[5], [[0, 0, 9, 9], [1, 1, 5, 5]])
    np.testing.assert_allclose(proposals.scores("cats/001.jpg"), [0.25, 0.5])
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "000007.txt").write_text("0 0 9 9\n")
    np.save(plain / "000008.npy", np.zeros((0, 4)))
    unscored = load_proposals(plain)
    assert unscored.scores(7) is None and len(unscored[8]) == 0


FOLDER_CASES = {
    "object array": (
        lambda d: np.save(d / "1.npy", np.array([None, 1], dtype=object)),
        r"1.npy: not a numeric",
    ),
    "columns": (lambda d: np.save(d / "1.npy", np.zeros((2, 3))), r"1.npy: boxes of shape \(2, 3\)"),
    "words": (lambda d: (d / "1.txt").write_text("0 0 x 9\n"), r"1.txt: line 1 is '0 0 x 9'"),
    "ragged": (lambda d: (d / "1.txt").write_text("0 0 9 9\n0 0 9\n"), r"1.txt: line 2 has 3 numbers"),
    "mixed": (
        lambda d: (np.save(d / "1.npy", np.ones((1, 5))), np.save(d / "2.npy", np.ones((1, 4)))),
        r"2.npy has no score column, .*1.npy has one",
    ),
    "empty": (lambda d: (d / "notes.md").write_text("x"), r"no .npy or .txt file"),
}


@pytest.mark.parametrize("case", FOLDER_CASES)
def test_a_bad_box_folder_is_one_line_naming_the_file(case, tmp_path):
    write, message = FOLDER_CASES[case]
    folder = tmp_path / "boxes"
    folder.mkdir()
    write(folder)
    with pytest.raises(ValueError, match=message) as error:
        load_proposals(folder)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("destination", ["out.pkl", "out.proposals"])
def test_scores_survive_a_pickle_and_a_store(tmp_path, destination):
    entries = [
        {"image_id": i, "bbox": [i, 0, 5, 5], "score": s}
        for i, s in ((5, 0.5), (5, 0.25), (6, 0.75), (7, 0.125))
    ]
    source = load_proposals(_json(tmp_path / "boxes.json", entries))
    save_proposals(source, tmp_path / destination)
    again = load_proposals(tmp_path / destination)
    for image_id in (5, 6, 7):
        np.testing.assert_array_equal(again[image_id], source[image_id])
        np.testing.assert_array_equal(again.scores(image_id), source.scores(image_id))


def _naive_top_k(boxes, scores, size, min_size, top_k):
    """Clip, drop small and empty boxes, order by score (ties: file order), drop repeats, keep top_k."""
    height, width = size
    kept = []
    for box, score in zip(boxes.tolist(), scores.tolist(), strict=True):
        x1, y1 = min(max(box[0], 0), width - 1), min(max(box[1], 0), height - 1)
        x2, y2 = min(max(box[2], 0), width - 1), min(max(box[3], 0), height - 1)
        w, h = x2 - x1, y2 - y1
        if w + 1 >= min_size and h + 1 >= min_size and w > 0 and h > 0:
            kept.append(((x1, y1, x2, y2), score))
    order = sorted(range(len(kept)), key=lambda i: -kept[i][1])  # Python's sort is stable
    out = []
    for i in order:
        if kept[i][0] not in out:
            out.append(kept[i][0])
    return out[:top_k]


@pytest.mark.parametrize("seed", range(4))
def test_the_cap_keeps_the_best_scored_boxes_as_a_naive_sort_does(seed):
    g = np.random.default_rng(seed)
    boxes = (
        np.sort(g.integers(-5, 60, (40, 2, 2)), axis=1).transpose(0, 2, 1).reshape(40, 4).astype(np.float32)
    )
    boxes[10] = boxes[3]  # a repeat
    scores = g.integers(0, 5, 40).astype(np.float32)  # many ties
    got = filter_proposals(boxes, (50, 55), min_size=3.0, top_k=12, scores=scores)
    want = _naive_top_k(boxes, scores, (50, 55), 3.0, 12)
    assert got.tolist() == [list(b) for b in want]
    # Without scores, or with all-zero ones, the first in file order.
    first = filter_proposals(boxes, (50, 55), min_size=3.0, top_k=12)
    zeros = filter_proposals(boxes, (50, 55), min_size=3.0, top_k=12, scores=np.zeros(40))
    assert torch.equal(first, zeros) and first.tolist() == [
        list(b) for b in _naive_top_k(boxes, np.zeros(40), (50, 55), 3.0, 12)
    ]


def test_make_proposals_converts_a_json_of_boxes_to_a_store(tmp_path):
    source = _json(tmp_path / "sam.json", [{"image_id": 5, "bbox": [0, 0, 9, 9], "score": 0.9}])
    destination = tmp_path / "sam.proposals"
    result = subprocess.run(
        [sys.executable, "tools/make_proposals.py", "convert", str(source), str(destination)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(load_proposals(destination).scores(5), [0.9])


def test_make_proposals_refuses_a_json_whose_box_names_an_image_it_does_not_list(tmp_path):
    content = {"images": [{"id": 5}], "annotations": [{"image_id": 7, "bbox": [0, 0, 9, 9]}]}
    source = _json(tmp_path / "coco.json", content)
    destination = tmp_path / "coco.proposals"
    result = subprocess.run(
        [sys.executable, "tools/make_proposals.py", "convert", str(source), str(destination)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and not destination.exists()
    last = result.stderr.strip().splitlines()[-1]
    assert str(source) in last and "image_id 7" in last and '"images"' in last, result.stderr


def test_the_union_of_proposal_sets_joins_each_images_boxes_in_order(tmp_path):
    first = ProposalSet(["000005", 7], [np.ones((2, 4)), np.zeros((1, 4))], [np.zeros(2), np.zeros(1)])
    second = ProposalSet([5, 9], [np.full((1, 4), 2.0), np.full((3, 4), 3.0)], [np.ones(1), np.ones(3)])
    union = union_proposals([first, second])
    assert union.image_ids == ["000005", 7, 9]  # the first set's names, then the new images
    np.testing.assert_array_equal(union[5], [[1, 1, 1, 1], [1, 1, 1, 1], [2, 2, 2, 2]])
    assert union.scores(5) is None  # the first set's all-zero scores are the pickle writer's placeholder
    scored = union_proposals([second, ProposalSet([5], [np.zeros((1, 4))], [np.full(1, 0.5)])])
    np.testing.assert_array_equal(scored.scores(5), [1.0, 0.5])
    sized = ProposalSet([5], [np.zeros((1, 4))], image_sizes=[(10, 20)], source="b.pkl")
    with pytest.raises(
        ValueError, match=r"image 5 is \(10, 30\) in one proposal set and \(10, 20\) in b.pkl"
    ):
        union_proposals([ProposalSet([5], [np.zeros((1, 4))], image_sizes=[(10, 30)]), sized])
    save_proposals(first, tmp_path / "a.pkl")
    save_proposals(second, tmp_path / "b.proposals")
    sources = [str(tmp_path / "a.pkl"), str(tmp_path / "b.proposals")]
    command = [
        sys.executable,
        "tools/make_proposals.py",
        "merge",
        *sources,
        "--output",
        str(tmp_path / "u.proposals"),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert load_proposals(tmp_path / "u.proposals").num_boxes == 7
