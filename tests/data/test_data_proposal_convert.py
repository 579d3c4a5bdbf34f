"""``tools/make_proposals.py convert`` on bad input: each error is one line naming the file, the field and
what is expected (``wsod.data.proposals.read_proposal_pickle`` / ``read_proposal_mat``)."""

from __future__ import annotations

import importlib.util
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import scipy.io

from wsod import cli
from wsod.data.proposals import ProposalSet, convert_proposals, save_proposals

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("make_proposals", REPO / "tools" / "make_proposals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pickle(data: object) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(pickle.dumps(data))


def _jpeg(path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (8, 6), (200, 10, 10)).save(path, format="JPEG")  # a JPEG renamed .pkl


def _mat(**variables) -> Callable[[Path], None]:
    return lambda path: scipy.io.savemat(path, variables)


def _cells(*arrays: np.ndarray) -> np.ndarray:
    cells = np.empty((1, len(arrays)), dtype=object)
    for i, array in enumerate(arrays):
        cells[0, i] = array
    return cells


BOX = np.array([[0.0, 0.0, 9.0, 9.0]])

# (source file name, how to write it, what the message must say after the file name)
CASES = {
    "text": ("text.pkl", lambda p: p.write_text("image,boxes\na.jpg,1 2 3 4\n"), r"not a readable pickle"),
    "jpeg": ("photo.pkl", _jpeg, r"not a readable pickle"),
    "empty": ("empty.pkl", lambda p: p.write_bytes(b""), r"not a readable pickle"),
    "truncated": ("cut.pkl", lambda p: p.write_bytes(pickle.dumps({"boxes": [BOX] * 50})[:40]), "pickle"),
    "list": ("list.pkl", _pickle([BOX]), r"expected a dict with fields 'boxes'.* and 'indexes'.*got a list"),
    "no boxes": ("nob.pkl", _pickle({"indexes": [5]}), r"no field 'boxes' \(it has \['indexes'\]\)"),
    "no ids": ("noid.pkl", _pickle({"boxes": [BOX]}), r"no field 'indexes' \(or 'ids'\)"),
    "boxes not a list": ("int.pkl", _pickle({"boxes": 5, "indexes": [5]}), r"field 'boxes' is an int"),
    "ids not a list": ("ids.pkl", _pickle({"boxes": [BOX], "indexes": 5}), r"field 'indexes' is an int"),
    "lengths": (
        "len.pkl",
        _pickle({"boxes": [BOX, BOX], "indexes": [5]}),
        r"field 'boxes' has 2 entries and field 'indexes' 1; expected one box array per image id",
    ),
    "box shape": (
        "five.pkl",
        _pickle({"boxes": [np.zeros((4, 5))], "indexes": [5]}),
        r"image 5 has boxes of shape \(4, 5\) \(field 'boxes', entry 0\); expected \(R, 4\)",
    ),
    "box values": (
        "words.pkl",
        _pickle({"boxes": [[["a", "b", "c", "d"]]], "indexes": [5]}),
        r"image 5 has boxes that are not numbers \(field 'boxes', entry 0",
    ),
    "scores": (
        "scores.pkl",
        _pickle({"boxes": [BOX], "scores": [np.zeros(3)], "indexes": [5]}),
        r"image 5 has 3 scores for 1 boxes \(field 'scores', entry 0\)",
    ),
    "suffix": ("boxes.txt", lambda p: p.write_text("0 0 9 9\n"), r"unknown proposal file type"),
    "mat without boxes": ("nob.mat", _mat(images=np.array(["000005"])), r"no variable 'boxes'"),
    "mat without images": ("noi.mat", _mat(boxes=_cells(BOX)), r"no variable 'images'"),
    "not a mat": ("text.mat", lambda p: p.write_text("boxes = [1 2 3 4]\n"), r"not a readable MATLAB file"),
    "mat counts": (
        "count.mat",
        _mat(boxes=_cells(BOX, BOX), images=np.array(["000005"])),
        r"variable 'boxes' has 2 cells and variable 'images' 1",
    ),
    "mat not cells": (
        "matrix.mat",
        _mat(boxes=np.zeros((2, 4)), images=np.array(["000005", "000007"])),
        r"variable 'boxes' is a float64 \(2, 4\) matrix; expected a cell array",
    ),
    "mat box shape": (
        "five.mat",
        _mat(boxes=_cells(np.zeros((4, 5))), images=np.array(["000005"])),
        r"image '000005' has boxes of shape \(4, 5\) \(variable 'boxes', cell 0\)",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_convert_names_the_file_and_the_field(case, tmp_path):
    name, write, expected = CASES[case]
    source = tmp_path / name
    write(source)
    with pytest.raises(ValueError) as error:
        convert_proposals(source, tmp_path / "out.proposals")
    message = str(error.value)
    assert re.match(rf"{re.escape(str(source))}: .*{expected}", message), message
    assert "\n" not in message
    assert not (tmp_path / "out.proposals").exists()
    # The tool raises the same error, which wsod.cli.run_tool prints as one line.
    with pytest.raises(ValueError, match=re.escape(message)):
        _tool().main(["convert", str(source), str(tmp_path / "out.pkl")])


def test_an_unknown_destination_suffix_is_refused_before_the_source_is_read(tmp_path):
    save_proposals(ProposalSet([5], [BOX]), tmp_path / "p.pkl")
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(tmp_path / 'p.json'))}: unknown proposal file type"
    ):
        convert_proposals(tmp_path / "p.pkl", tmp_path / "p.json")
    # An unreadable source with a bad destination: the destination, the cheaper check, is named.
    (tmp_path / "bad.pkl").write_text("text")
    with pytest.raises(ValueError, match=r"p\.json: unknown proposal file type"):
        convert_proposals(tmp_path / "bad.pkl", tmp_path / "p.json")


def test_the_tool_prints_one_line_naming_the_file_and_exits_1(tmp_path, capsys, monkeypatch):
    # What the tool's __main__ does (run_tool around main), in this process: a subprocess would spend
    # seconds importing torch. No run directory: run_tool prints the error, as from a shell.
    monkeypatch.setattr(cli, "_logging_to_a_file", lambda: False)
    source = tmp_path / "photo.pkl"
    _jpeg(source)
    tool = _tool()
    with pytest.raises(SystemExit) as exit_:
        cli.run_tool(lambda _: tool.main(["convert", str(source), str(tmp_path / "o.pkl")]), None)
    assert exit_.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: ValueError: {source}: not a readable pickle (UnpicklingError: ")
