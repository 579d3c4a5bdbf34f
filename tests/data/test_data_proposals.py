"""Proposal files: pickle and .mat round trips, the .mat coordinate convention, lookup, filtering."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import scipy.io
import torch

from wsod.data.proposals import (
    MissingProposalsError,
    ProposalSet,
    convert_proposals,
    filter_proposals,
    load_proposals,
    proposal_key,
    read_proposal_mat,
    save_proposals,
    whole_image_box,
)

BOXES = {
    "000005": np.array([[0, 0, 10, 20], [3.5, 4.25, 50, 60]], np.float32),
    "000007": np.zeros((0, 4), np.float32),  # an image without proposals must survive a round trip
    "2008_000008": np.array([[1, 2, 3, 4]], np.float32),
}


def _assert_same(proposals: ProposalSet, expected: dict) -> None:
    assert len(proposals) == len(expected)
    for image_id, boxes in expected.items():
        np.testing.assert_array_equal(proposals[image_id], boxes)
        assert proposals[image_id].dtype == np.float32


def test_pickle_round_trip(tmp_path):
    scores = [np.array([0.9, 0.1], np.float32), np.zeros(0, np.float32), np.array([0.5], np.float32)]
    original = ProposalSet(list(BOXES), list(BOXES.values()), scores)
    save_proposals(original, tmp_path / "p.pkl")
    back = load_proposals(tmp_path / "p.pkl")
    _assert_same(back, BOXES)
    assert back.image_ids == list(BOXES)
    np.testing.assert_array_equal(back.scores("000005"), scores[0])
    with open(tmp_path / "p.pkl", "rb") as f:
        raw = pickle.load(f)
    assert sorted(raw) == ["boxes", "indexes", "scores"] and raw["indexes"] == list(BOXES)


def test_reference_pickle_with_integer_ids_is_found_by_voc_string_ids(write_pickle):
    # Reference VOC pickles store 000005 as 5 and 2008_000008 as 2008000008, written by Python 2.
    path = write_pickle({5: [[1, 2, 3, 4]], 2008000008: [[5, 6, 7, 8]]}, protocol=2)
    proposals = load_proposals(path)
    np.testing.assert_array_equal(proposals["000005"], [[1, 2, 3, 4]])
    np.testing.assert_array_equal(proposals["2008_000008"], [[5, 6, 7, 8]])
    np.testing.assert_array_equal(proposals[np.int64(5)], [[1, 2, 3, 4]])
    assert "000006" not in proposals
    assert proposal_key("img_01") == "img_01" and proposal_key(b"0012") == 12


def test_detectron2_ids_key_is_accepted(tmp_path):
    path = tmp_path / "d2.pkl"
    path.write_bytes(pickle.dumps({"ids": ["a", "b"], "boxes": [np.ones((1, 4)), np.ones((2, 4))]}))
    assert load_proposals(path)["b"].shape == (2, 4)


def test_missing_image_id_names_the_id_and_the_file(write_pickle):
    path = write_pickle({"000005": [[1, 2, 3, 4]]})
    proposals = load_proposals(path)
    with pytest.raises(MissingProposalsError, match=rf"image id '000009' is not in the proposal file {path}"):
        proposals["000009"]
    with pytest.raises(MissingProposalsError, match=rf"2 of 3 images have no proposals in {path}"):
        proposals.require(["000005", "000009", "000010"])


def test_bad_files_are_errors_naming_them(tmp_path, write_pickle):
    (tmp_path / "list.pkl").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(ValueError, match=r"list\.pkl: expected a dict"):
        load_proposals(tmp_path / "list.pkl")
    with pytest.raises(ValueError, match="appears more than once"):
        load_proposals(write_pickle({"5": [[0, 0, 1, 1]], 5: [[0, 0, 1, 1]]}, "dup.pkl"))
    with pytest.raises(ValueError, match=r"image 'x' has boxes of shape \(2, 5\)"):
        ProposalSet(["x"], [np.zeros((2, 5))], source="five.pkl")
    with pytest.raises(FileNotFoundError, match=r"nope\.pkl"):
        load_proposals(tmp_path / "nope.pkl")
    (tmp_path / "p.txt").write_text("")
    with pytest.raises(ValueError, match="unknown proposal file type"):
        load_proposals(tmp_path / "p.txt")


def test_mat_release_convention_is_one_based_y1_x1_y2_x2(tmp_path):
    # Written the way the Selective Search VOC release is: a 1 x N cell of (R, 4) doubles [y1 x1 y2 x2]
    # (1-based) and an N x 1 cell of image names.
    boxes = np.empty((1, 2), dtype=object)
    boxes[0, 0] = np.array([[11.0, 21.0, 51.0, 81.0], [1.0, 1.0, 100.0, 200.0]])
    boxes[0, 1] = np.array([[5.0, 6.0, 7.0, 8.0]])
    images = np.empty((2, 1), dtype=object)
    images[0, 0], images[1, 0] = "000005", "000007"
    scipy.io.savemat(tmp_path / "ss.mat", {"boxes": boxes, "images": images})

    proposals = load_proposals(tmp_path / "ss.mat")
    np.testing.assert_array_equal(proposals["000005"], [[20, 10, 80, 50], [0, 0, 199, 99]])
    np.testing.assert_array_equal(proposals["000007"], [[5, 4, 7, 6]])
    # The other conventions, for releases that differ.
    as_given = read_proposal_mat(tmp_path / "ss.mat", box_order="xyxy", one_based=False)
    np.testing.assert_array_equal(as_given["000005"][0], [11, 21, 51, 81])


def test_mat_with_char_matrix_and_numeric_ids(tmp_path):
    boxes = np.empty((1, 2), dtype=object)
    boxes[0, 0], boxes[0, 1] = np.array([[1.0, 2.0, 3.0, 4.0]]), np.array([[2.0, 2.0, 9.0, 9.0]])
    scipy.io.savemat(tmp_path / "chars.mat", {"boxes": boxes, "images": np.array(["000001", "000002"])})
    assert load_proposals(tmp_path / "chars.mat").image_ids == ["000001", "000002"]
    scipy.io.savemat(tmp_path / "numbers.mat", {"boxes": boxes, "images": np.array([[139.0, 285.0]])})
    numbers = load_proposals(tmp_path / "numbers.mat")
    assert numbers.image_ids == [139, 285]
    np.testing.assert_array_equal(numbers[285], [[1, 1, 8, 8]])


def test_mat_round_trip_and_conversion_to_pickle(tmp_path):
    original = ProposalSet(list(BOXES), list(BOXES.values()))
    save_proposals(original, tmp_path / "p.mat")
    raw = scipy.io.loadmat(tmp_path / "p.mat")
    # On disk: 1-based y1 x1 y2 x2.
    np.testing.assert_array_equal(raw["boxes"].ravel()[0], [[1, 1, 21, 11], [5.25, 4.5, 61, 51]])
    _assert_same(load_proposals(tmp_path / "p.mat"), BOXES)
    convert_proposals(tmp_path / "p.mat", tmp_path / "p.pkl")
    _assert_same(load_proposals(tmp_path / "p.pkl"), BOXES)
    convert_proposals(tmp_path / "p.pkl", tmp_path / "q.mat")
    _assert_same(load_proposals(tmp_path / "q.mat"), BOXES)


def test_integer_ids_round_trip_through_mat(tmp_path):
    original = ProposalSet([139, 285], [np.ones((1, 4)), 2 * np.ones((2, 4))])
    save_proposals(original, tmp_path / "c.mat")
    back = load_proposals(tmp_path / "c.mat")
    assert back.image_ids == [139, 285]
    np.testing.assert_array_equal(back[285], 2 * np.ones((2, 4)))


def test_filter_clips_drops_small_dedupes_and_caps():
    boxes = np.array(
        [
            [10, 10, 30, 30],  # kept
            [-5, -3, 12, 8],  # clipped to [0, 0, 12, 8]
            [5, 5, 5.9, 40],  # 1.9 px wide inclusive (x2 - x1 + 1): dropped
            [5, 5, 6, 40],  # exactly 2 px inclusive (pixels 5 and 6): kept
            [7, 5, 7, 40],  # 1 px inclusive, no continuous width: dropped
            [10, 10, 30, 30],  # duplicate of the first: dropped
            [90, 40, 120, 70],  # clipped to [90, 40, 99, 49], 9 px: kept
            [95, 45, 130, 90],  # clipped to [95, 45, 99, 49]
            [95, 45, 140, 80],  # clipped to the same box as the previous one: duplicate
            [120, 60, 150, 90],  # entirely outside: clipped to a point, dropped
        ],
        np.float32,
    )
    kept = filter_proposals(boxes, (50, 100))
    expected = [[10, 10, 30, 30], [0, 0, 12, 8], [5, 5, 6, 40], [90, 40, 99, 49], [95, 45, 99, 49]]
    torch.testing.assert_close(kept, torch.tensor(expected, dtype=torch.float32))
    torch.testing.assert_close(filter_proposals(boxes, (50, 100), top_k=2), kept[:2])
    # Inclusive sizes: [0, 0, 12, 8] is 9 px tall, [90, 40, 99, 49] is 10 x 10.
    assert filter_proposals(boxes, (50, 100), min_size=10).tolist() == [[10, 10, 30, 30], [90, 40, 99, 49]]
    # A minimum of 1 or less adds the 1.9 px box, never the zero-width one.
    for min_size in (1, 0):
        smaller = filter_proposals(boxes, (50, 100), min_size=min_size)
        torch.testing.assert_close(smaller, torch.cat([kept[:2], torch.from_numpy(boxes[2:3]), kept[2:]]))
    assert filter_proposals(np.zeros((0, 4)), (50, 100)).shape == (0, 4)
    # The input (possibly a read-only view into a ProposalSet) is not modified.
    assert boxes[1].tolist() == [-5, -3, 12, 8]


def test_lookup_returns_read_only_views_and_whole_image_box():
    proposals = ProposalSet(["a"], [np.array([[-1, 0, 5, 5]], np.float32)])
    with pytest.raises(ValueError, match="read-only"):
        proposals["a"][0, 0] = 3
    filter_proposals(proposals["a"], (10, 10))
    assert proposals["a"].tolist() == [[-1, 0, 5, 5]]
    assert whole_image_box((30, 40)).tolist() == [[0, 0, 39, 29]]
