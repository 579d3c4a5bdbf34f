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


# ----------------------------------------------------------------------------------------------------
# Image sizes: the (H, W) of the image each image's proposals were made on


def test_image_sizes_round_trip_through_pickle_and_conversions(tmp_path):
    sizes = [(30, 40), None, (500, 375)]  # the second image's size is not known
    original = ProposalSet(list(BOXES), list(BOXES.values()), image_sizes=sizes, source="ss")
    assert original.image_size("000005") == (30, 40) and original.image_size("000007") is None
    assert original.image_size("2008000008") == (500, 375)  # looked up by proposal_key like boxes
    save_proposals(original, tmp_path / "p.pkl")
    with open(tmp_path / "p.pkl", "rb") as f:
        raw = pickle.load(f)
    # An extra key that reference readers, which read 'boxes', 'scores' and 'indexes', never look at.
    assert sorted(raw) == ["boxes", "image_sizes", "indexes", "scores"]
    np.testing.assert_array_equal(raw["image_sizes"], [[30, 40], [0, 0], [500, 375]])
    back = load_proposals(tmp_path / "p.pkl")
    _assert_same(back, BOXES)
    assert [back.image_size(i) for i in BOXES] == sizes
    convert_proposals(tmp_path / "p.pkl", tmp_path / "q.pkl")
    assert [load_proposals(tmp_path / "q.pkl").image_size(i) for i in BOXES] == sizes
    # A .mat release records no sizes; neither do reference pickles.
    convert_proposals(tmp_path / "p.pkl", tmp_path / "p.mat")
    assert load_proposals(tmp_path / "p.mat").image_size("000005") is None
    assert ProposalSet(["a"], [np.zeros((0, 4))]).image_size("a") is None

    flat = ProposalSet.from_flat(
        ["a", "b"], np.zeros((3, 4), np.float32), np.array([0, 1, 3]), image_sizes=np.array([[5, 6], [7, 8]])
    )
    assert flat.image_size("b") == (7, 8)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ([(30, 40)], r"image_sizes of shape \(1, 2\); expected \(2, 2\)"),
        ([(30, 40), (-1, 5)], "negative"),
        ([(30, 40), (0, 5)], r"image 2 has size \(0, 5\)"),
        ([(30.5, 40), (1, 5)], "integers"),
    ],
)
def test_malformed_image_sizes_are_errors_naming_the_source(sizes, message):
    with pytest.raises(ValueError, match=rf"ss\.pkl: .*{message}"):
        ProposalSet([1, 2], [np.zeros((0, 4))] * 2, image_sizes=sizes, source="ss.pkl")


def test_a_pickle_with_malformed_image_sizes_names_the_file_and_field(tmp_path):
    path = tmp_path / "p.pkl"
    path.write_bytes(pickle.dumps({"boxes": [np.zeros((1, 4))], "indexes": [5], "image_sizes": [[3, 4, 5]]}))
    expected = rf"{path}: field 'image_sizes' of shape \(1, 3\); expected \(1, 2\)"
    with pytest.raises(ValueError, match=expected):
        load_proposals(path)


def test_a_dataset_refuses_proposals_made_for_an_image_of_another_size(tmp_path):
    from wsod.data.dataset import ImageRecord, WeakDetectionDataset
    from wsod.data.proposals import ProposalSizeError

    labels = np.ones(1, np.float32)
    records = [ImageRecord(i, f"{i}.jpg", 30, 40, labels) for i in ("a", "b", "c")]
    boxes = [np.array([[0, 0, 9, 9]], np.float32)] * 3
    # "b" was 40 x 30 when its proposals were made; "c"'s size is unknown (e.g. an older file).
    made = ProposalSet(["a", "b", "c"], boxes, image_sizes=[(30, 40), (40, 30), None], source="ss.proposals")
    with pytest.raises(ProposalSizeError) as error:
        WeakDetectionDataset(records, ["x"], made, check_files=False)
    message = str(error.value)
    assert "image 'b'" in message and "(30, 40)" in message and "(40, 30)" in message
    assert "ss.proposals" in message and "1 of 3 images" in message
    assert "python tools/make_proposals.py" in message and "\n" not in message
    assert isinstance(error.value, ValueError)
    # Sizes that agree, or are unknown, are accepted.
    same = ProposalSet(["a", "b", "c"], boxes, image_sizes=[(30, 40), (30, 40), None])
    assert len(WeakDetectionDataset(records, ["x"], same, check_files=False)) == 3
    unknown = ProposalSet(["a", "b", "c"], boxes)  # a reference file: no sizes at all
    assert len(WeakDetectionDataset(records, ["x"], unknown, check_files=False)) == 3
    # The error survives pickling (data-loader workers, DDP) with its message.
    assert str(pickle.loads(pickle.dumps(error.value))) == message
