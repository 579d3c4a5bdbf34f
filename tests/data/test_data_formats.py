"""wsod/data/formats.py: every built-in data.kind is a registered DatasetFormat that opens its files from
plain settings (with the dataset options passed on), prepares what it needs, and says what else its kind
decides (unlabelled training images, a folder's run-time split); registration and unknown kinds."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from wsod.config_compat import upgrade_saved_config
from wsod.data.coco import CocoDataset
from wsod.data.dataset import RESULT_FORMATS, WeakDetectionDataset
from wsod.data.folder import FolderDataset, proposals_path, write_split_csv
from wsod.data.formats import DATASET_FORMATS, DatasetFormat, dataset_format, register_dataset_format
from wsod.data.proposals import ProposalSet
from wsod.data.proposals.store import write_proposal_store
from wsod.data.toy import OBJECT_SIZE
from wsod.data.voc import VOCDataset

BUILT_IN = ("toy", "voc", "coco", "folder")
# The options wsod.build passes to every format's open.
OPTIONS = {
    "transform": None, "max_proposals": None, "min_proposal_size": 2.0, "drop_unlabelled": False,
    "partial_labels": None,
}  # fmt: skip


def _open(kind: str, data: dict, source: dict, **options) -> WeakDetectionDataset:
    return DATASET_FORMATS[kind].open({"kind": kind, **data}, source, **{**OPTIONS, **options})


def test_the_built_in_formats_are_registered_with_what_each_kind_decides():
    assert set(BUILT_IN) <= set(DATASET_FORMATS)
    assert all(DATASET_FORMATS[k].name == k and dataset_format(k) is DATASET_FORMATS[k] for k in BUILT_IN)
    # docs/METHOD.md §9: COCO training drops its images without a label; the others keep them.
    assert [k for k in BUILT_IN if DATASET_FORMATS[k].drop_unlabelled_in_training] == ["coco"]
    assert [k for k in BUILT_IN if DATASET_FORMATS[k].prepare is not None] == ["toy", "folder"]
    assert [k for k in BUILT_IN if DATASET_FORMATS[k].write_split is not None] == ["folder"]
    assert [k for k in BUILT_IN if DATASET_FORMATS[k].split_conflict is not None] == ["folder"]


def test_the_toy_format_opens_a_split_of_the_generated_set(tiny_toy):
    data = {"root": str(tiny_toy.root), "num_train": 10, "num_test": 6, "object_size": list(OBJECT_SIZE)}
    assert DATASET_FORMATS["toy"].prepare({"kind": "toy", **data}, False) == tiny_toy  # made already: found
    test = _open("toy", data, {"image_set": "test"}, max_proposals=3)
    assert isinstance(test, VOCDataset) and test.result_format == "voc"
    assert test.image_ids == tiny_toy.dataset("test").image_ids and test.max_proposals == 3
    assert len(_open("toy", data, {"image_set": "trainval"})) == 10
    with pytest.raises(ValueError, match=r"^the set \{'split': 'test'\} has no 'image_set', which data.kind"):
        _open("toy", data, {"split": "test"})


def test_the_voc_format_opens_a_devkit_set(make_voc, write_pickle):
    devkit = make_voc(
        {"000001": (20, 30, [("dog", ("2", "3", "12", "14"), 0)]), "000002": (24, 32, [])},
        {"trainval": ["000001", "000002"]},
    )
    proposals = write_pickle({"000001": [[0, 0, 9, 9]], "000002": [[1, 1, 8, 8]]})
    source = {"year": 2007, "image_set": "trainval", "proposals": str(proposals)}  # a year as a number too
    voc = _open("voc", {"devkit": str(devkit)}, source)
    assert isinstance(voc, VOCDataset) and voc.result_format == "voc" and voc.year == "2007"
    assert voc.image_ids == ["000001", "000002"] and voc.has_ground_truth
    assert _open("voc", {"devkit": str(devkit)}, source, drop_unlabelled=True).image_ids == ["000001"]
    with pytest.raises(ValueError, match=r"^data has no 'devkit', which data.kind=voc needs$"):
        _open("voc", {}, source)


def test_the_coco_format_opens_a_json_set(tmp_path, jpeg, write_json, write_pickle):
    for image_id in (1, 2):
        jpeg(tmp_path / "images" / f"{image_id}.jpg", 20, 30, seed=image_id)
    annotations = write_json(
        {
            "images": [{"id": 1, "file_name": "1.jpg"}, {"id": 2, "file_name": "2.jpg"}],
            "categories": [{"id": 3, "name": "cat"}],
            "annotations": [{"image_id": 1, "category_id": 3, "bbox": [1, 1, 5, 5]}],
        }
    )
    proposals = write_pickle({1: [[0, 0, 9, 9]], 2: [[1, 1, 8, 8]]})
    images = str(tmp_path / "images")
    source = {"annotations": str(annotations), "images": images, "proposals": str(proposals)}
    coco = _open("coco", {}, source)
    assert isinstance(coco, CocoDataset) and coco.result_format == "coco"
    assert coco.image_ids == [1, 2] and coco.category_ids == (3,) and coco.classes == ("cat",)
    assert _open("coco", {}, source, drop_unlabelled=True).image_ids == [1]


def _folder(root: Path, jpeg, split_column: bool = True, proposals: bool = True) -> Path:
    names = ["a.jpg", "b.jpg", "c.jpg", "d.jpg"]
    for n, name in enumerate(names):
        jpeg(root / "images" / name, 20, 24, seed=n)
    if split_column:
        lines = ["image,labels,split", "a.jpg,cat,train", "b.jpg,dog,train", "c.jpg,cat,test", "d.jpg,,test"]
    else:
        lines = ["image,labels", "a.jpg,cat", "b.jpg,dog", "c.jpg,cat", "d.jpg,dog"]
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    if proposals:
        boxes = [np.array([[0, 0, 9, 9]], np.float32) for _ in names]
        write_proposal_store(ProposalSet(names, boxes), proposals_path(root))
    return root


def test_the_folder_format_opens_a_split_and_requires_its_proposals(tmp_path, jpeg):
    root = _folder(tmp_path / "mine", jpeg)
    data = {"root": str(root), "classes": None, "split_seed": 0, "test_fraction": 0.2}
    train = _open("folder", data, {"split": "train"})
    assert isinstance(train, FolderDataset) and train.result_format == "named"
    assert train.image_ids == ["a.jpg", "b.jpg"] and train.classes == ("cat", "dog")
    assert _open("folder", {**data, "classes": ["dog", "cat", "bird"]}, {"split": "test"}).classes == (
        "dog", "cat", "bird",
    )  # fmt: skip
    assert _open("folder", {**data, "classes": None}, {"split": "test"}).image_ids == ["c.jpg", "d.jpg"]
    DATASET_FORMATS["folder"].prepare({"kind": "folder", **data}, False)  # the proposals are there

    bare = _folder(tmp_path / "bare", jpeg, proposals=False)
    with pytest.raises(FileNotFoundError, match="make them with python tools/make_proposals.py folder"):
        DATASET_FORMATS["folder"].prepare({"kind": "folder", "root": str(bare)}, False)


def test_a_folder_without_a_split_column_writes_its_split_and_names_another_one(tmp_path, jpeg):
    folder = DATASET_FORMATS["folder"]
    root = _folder(tmp_path / "seeded", jpeg, split_column=False)
    data = {"kind": "folder", "root": str(root), "split_seed": 0, "test_fraction": 0.2}
    written = folder.write_split(data, tmp_path / "run" / "split.csv")
    assert written == tmp_path / "run" / "split.csv"
    assert written.read_text() == write_split_csv(root, tmp_path / "direct.csv").read_text()  # the defaults
    given = _folder(tmp_path / "given", jpeg)
    assert folder.write_split({**data, "root": str(given)}, tmp_path / "none.csv") is None

    assert folder.split_conflict(data, data) is None
    # A config saved before the split settings existed, read in today's layout: the rule's defaults, the same.
    saved = upgrade_saved_config({"data": {"kind": "folder", "root": str(root)}})["data"]
    assert folder.split_conflict(saved, data) is None
    other = {**data, "split_seed": 3}
    assert folder.split_conflict(data, other) == (
        f"was trained on the seeded split of {root / 'labels.csv'} (no split column) made with"
        " data.split_seed=0 data.test_fraction=0.2; this evaluation's data.split_seed=3"
        " data.test_fraction=0.2 makes another, whose test images include training images: evaluate"
        " with data.split_seed=0 data.test_fraction=0.2"
    )
    assert folder.split_conflict({**data, "root": str(given)}, other) is None  # other data: no such rule
    given_data = {**data, "root": str(given)}
    assert folder.split_conflict(given_data, {**given_data, "split_seed": 3}) is None  # a split column


def test_a_format_registers_once_and_an_unknown_kind_names_the_registered_ones(request):
    def open_nothing(data, source, /, **options):
        raise AssertionError("not opened here")

    mine = DatasetFormat("formats_test_kind", open_nothing)
    request.addfinalizer(lambda: DATASET_FORMATS.pop("formats_test_kind", None))
    assert register_dataset_format(mine) is mine and dataset_format("formats_test_kind") is mine
    with pytest.raises(ValueError, match=r"^dataset format 'formats_test_kind' is registered already"):
        register_dataset_format(DatasetFormat("formats_test_kind", open_nothing))
    with pytest.raises(ValueError, match="^dataset format 'voc' is registered already"):
        register_dataset_format(DatasetFormat("voc", open_nothing))
    assert DATASET_FORMATS["voc"].open is not open_nothing and dataset_format("formats_test_kind") is mine
    with pytest.raises(TypeError, match="expected a DatasetFormat, got dict"):
        register_dataset_format({"name": "dict_kind"})
    with pytest.raises(ValueError, match="a dataset format's name is a non-empty string"):
        register_dataset_format(DatasetFormat("", open_nothing))

    with pytest.raises(ValueError) as error:
        dataset_format("vocc")
    assert str(error.value) == (
        f"unknown data.kind='vocc': expected one of {sorted(DATASET_FORMATS)} (a format of your own:"
        " wsod.data.formats.register_dataset_format)"
    )
    assert "'formats_test_kind'" in str(error.value)  # read at each call: a format added later is named
    with pytest.raises(ValueError, match=r"^unknown data.kind='\['voc'\]'"):
        dataset_format(["voc"])


def test_every_dataset_names_a_result_format():
    assert WeakDetectionDataset.result_format == "voc"  # the base class: devkit files, as before
    classes = {"voc": VOCDataset, "coco": CocoDataset, "named": FolderDataset}
    assert {name: cls.result_format for name, cls in classes.items()} == {n: n for n in classes}
    assert set(classes) == set(RESULT_FORMATS)


def test_the_formats_module_reads_plain_settings_below_the_builder():
    # wsod.build imports it (tests/test_imports.py forbids the way back); settings arrive as plain dicts.
    import wsod.data.formats as formats

    tree = ast.parse(Path(formats.__file__).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
    assert not {m for m in modules if m.split(".")[0] in ("hydra", "omegaconf") or m.startswith("wsod.build")}
