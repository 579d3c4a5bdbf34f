"""wsod/data/json_files.py and its readers: a file that is not json (a checkpoint, a pickle, binary data,
broken text, a folder) where a COCO json, a partial-label side file, a pseudo-label file or COCO results
are expected is one line naming the file, why, and what was expected; a json of the wrong kind names its
missing field."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from wsod.data.coco import read_coco_json
from wsod.data.json_files import read_json, require_keys, whole_number
from wsod.data.partial_labels import read_partial_labels_file
from wsod.data.pseudo_boxes import read_pseudo_boxes
from wsod.evaluation.coco import evaluate_coco

READERS = {
    "coco annotations": (read_coco_json, "a COCO json"),
    "partial labels side file": (read_partial_labels_file, "a partial labels side file"),
    "pseudo labels": (lambda path: read_pseudo_boxes(path, ("cat",)), "a COCO instances json"),
    # The results file is read before the ground truth is looked at.
    "coco results": (lambda path: evaluate_coco(path, {}), "a COCO results json"),
}


def _checkpoint(path):
    torch.save({"model": {"w": torch.zeros(2)}, "metadata": {}}, path)  # a zip archive, as .pth files are


def _pickle(path):
    path.write_bytes(pickle.dumps({"boxes": [1, 2, 3]}, protocol=4))


def _binary(path):
    path.write_bytes(bytes(range(200, 256)) * 4)


def _truncated(path):
    path.write_text('{"images": [{"id": 1, "file_name": "a.jpg"')


BAD_FILES = {
    "checkpoint": ("model_final.pth", _checkpoint, "a zip archive, as a PyTorch checkpoint .pth is"),
    "pickle": ("proposals.pkl", _pickle, "a Python pickle"),
    "binary": ("image.json", _binary, "binary data, byte 0 is not UTF-8 text"),
    "truncated": ("cut.json", _truncated, "Expecting"),
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("bad", BAD_FILES)
def test_a_file_that_is_not_json_is_one_line_naming_the_file_why_and_what_was_expected(tmp_path, reader, bad):
    read, expected = READERS[reader]
    name, write, why = BAD_FILES[bad]
    path = tmp_path / name
    write(path)
    with pytest.raises(ValueError) as error:
        read(path)
    message = str(error.value)
    assert message.startswith(f"{path}: not a JSON file (") and why in message
    assert f"; expected {expected}" in message
    assert "\n" not in message


def test_a_folder_where_a_json_file_is_expected_is_named(tmp_path):
    folder = tmp_path / "pseudo_labels"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"pseudo_labels: not a JSON file \(a folder\); expected the labels"):
        read_json(folder, "the labels")
    with pytest.raises(FileNotFoundError, match=r"missing.json: no such file; expected the labels"):
        read_json(tmp_path / "missing.json", "the labels")


def test_utf8_with_a_byte_order_mark_reads_as_json(tmp_path):
    path = tmp_path / "windows.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"images": {"a": []}}).encode())
    assert read_json(path, "anything") == {"images": {"a": []}}


def test_a_missing_field_is_named_with_the_file_and_what_is_expected(tmp_path):
    kinds = {"images": list, "categories": list}
    with pytest.raises(ValueError) as error:
        require_keys({"images": [], "info": {}}, tmp_path / "x.json", kinds, "a COCO json")
    assert str(error.value) == (
        f"{tmp_path / 'x.json'}: no 'categories' field (its fields: 'images', 'info'); expected a COCO json"
    )
    with pytest.raises(ValueError, match=r"x.json: 'images' is an object, not a list; expected a COCO json"):
        require_keys({"images": {}, "categories": []}, tmp_path / "x.json", kinds, "a COCO json")
    with pytest.raises(ValueError, match=r"x.json: the json is a list, not an object; expected a COCO"):
        require_keys([1, 2], tmp_path / "x.json", kinds, "a COCO json")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(640, 640), (640.0, 640), ("640", 640), (0, 0), ("640px", None), (640.5, None), ([640], None),
     (True, None), (float("inf"), None), (None, None), ("-5", None), ("６４０", None)],
)  # fmt: skip
def test_whole_number_takes_integers_integral_floats_and_digit_strings_only(value, expected):
    assert whole_number(value) == expected
