"""The third stage's split file: written and read back, and every bad file refused in one line naming the
file and the entry."""

from __future__ import annotations

import json

import pytest

from wsod.data.labelled_split import read_split, split_json, write_split


def _content():
    losses = [{"loss_a": 0.5, "loss_b": 0.25}, {"loss_a": 2.0, "loss_b": 1.0}, {"loss_a": 0.0, "loss_b": 0.1}]
    per_class = {"cat": {"images": 2, "labelled": 1, "share": 0.5}}
    return split_json(
        ["000005", "000007", 9], ["a.jpg", "b.jpg", "c.jpg"], losses, [True, False, True], per_class, {"k": 2}
    )


def test_a_split_is_written_and_read_back(tmp_path):
    path = write_split(_content(), tmp_path / "split.json")
    assert read_split(path) == {"000005": True, "000007": False, 9: True}
    images = json.loads(path.read_text())["images"]
    assert [image["loss"] for image in images] == [0.75, 3.0, 0.1]
    assert images[0]["losses"] == {"loss_a": 0.5, "loss_b": 0.25} and images[1]["file_name"] == "b.jpg"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["images"].__setitem__(1, {"file_name": "b.jpg"}), r"images\[1\] .* lacks source_id"),
        (lambda c: c["images"][0].__setitem__("labelled", "yes"), r"images\[0\]\.labelled is 'yes'"),
        (lambda c: c["images"][2].__setitem__("source_id", [9]), r"images\[2\]\.source_id is \[9\]"),
        (lambda c: c["images"][2].__setitem__("source_id", "000005"), r"images\[2\] repeats source_id"),
        (lambda c: c.__setitem__("images", []), "no image"),
        (lambda c: c.pop("images"), "no 'images' field"),
    ],
)
def test_a_bad_split_file_is_refused_naming_the_file_and_the_entry(tmp_path, change, message):
    content = _content()
    change(content)
    path = tmp_path / "split.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message) as error:
        read_split(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_missing_split_file_says_which_tool_writes_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="tools/split_pseudo_labels.py"):
        read_split(tmp_path / "split.json")
