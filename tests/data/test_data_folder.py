"""A folder of your own images (wsod/data/folder.py): labels.csv, classes, splits, proposals, bad input,
and tools/make_proposals.py folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from wsod.build import build_test_dataset, build_train_dataset, prepare_data
from wsod.data.folder import FolderDataset, proposals_path, read_labels_csv
from wsod.data.proposal_store import write_proposal_store
from wsod.data.proposals import MissingProposalsError, ProposalSet

REPO = Path(__file__).resolve().parents[2]

CSV = """image,split,labels,notes
a.jpg,train,cat,first
sub/b.png,train, dog ; cat ,
c.jpg,test,,a negative

d.jpg,test,dog,
"""
SIZES = {"a.jpg": (30, 40), "sub/b.png": (50, 20), "c.jpg": (24, 24), "d.jpg": (60, 80)}


def _folder(root: Path, jpeg, csv: str = CSV, proposals: bool = True) -> Path:
    for n, (name, (height, width)) in enumerate(SIZES.items()):
        jpeg(root / "images" / name, height, width, seed=n)
    (root / "labels.csv").write_text(csv)
    if proposals:
        boxes = [np.array([[0, 0, 9, 9], [2, 3, 15, 20]], np.float32) for _ in SIZES]
        write_proposal_store(ProposalSet(list(SIZES), boxes), proposals_path(root))
    return root


def test_records_classes_splits_and_proposals_of_a_folder(tmp_path, jpeg):
    root = _folder(tmp_path / "mine", jpeg)
    train = FolderDataset(root, "train")
    assert train.classes == ("cat", "dog")  # the sorted labels of every line, both splits
    assert train.image_ids == ["a.jpg", "sub/b.png"]
    assert train.image_sizes == [(30, 40), (50, 20)]  # from the file headers
    assert train.records[1].labels.tolist() == [1.0, 1.0] and not train.has_ground_truth
    item = train[1]
    assert item["image"].shape == (3, 50, 20) and item["image_id"] == "sub/b.png"
    assert item["proposals"].tolist() == [[0, 0, 9, 9], [2, 3, 15, 20]] and "gt_boxes" not in item
    test = FolderDataset(root, "test")
    assert test.image_ids == ["c.jpg", "d.jpg"] and test.records[0].labels.tolist() == [0.0, 0.0]
    assert len(FolderDataset(root, None)) == 4

    (root / "classes.txt").write_text("dog\ncat\nbird\n")  # the file's order is the class index
    assert FolderDataset(root, "train").classes == ("dog", "cat", "bird")
    assert FolderDataset(root, "train", classes=["cat", "dog", "cow"]).classes == ("cat", "dog", "cow")


def test_the_folder_config_needs_only_the_root(tmp_path, jpeg):
    from hydra import compose, initialize_config_dir

    root = _folder(tmp_path / "mine", jpeg)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data=folder", f"data.root={root}"])
    prepare_data(cfg.data)
    assert build_train_dataset(cfg.data).image_ids == ["a.jpg", "sub/b.png"]
    test = build_test_dataset(cfg.data)
    assert test.image_ids == ["c.jpg", "d.jpg"] and test.transform is None
    assert cfg.data.test.scales == [576] and not cfg.data.test.flip  # the plain test view


def test_a_label_outside_the_class_list_names_the_csv_line_label_and_classes(tmp_path, jpeg):
    root = _folder(tmp_path / "mine", jpeg)
    (root / "classes.txt").write_text("cat\n")
    with pytest.raises(ValueError) as error:
        FolderDataset(root, "train")
    message = str(error.value)
    assert f"{root / 'labels.csv'} line 3: label 'dog' is not in the class list ['cat']" in message
    assert f"(from {root / 'classes.txt'}): correct the label, or add the class to" in message
    with pytest.raises(ValueError, match=r"line 3: label 'dog' .* \(from data\.classes\)"):
        FolderDataset(root, "train", classes=["cat", "cow"])


def test_an_unreadable_image_names_the_file_its_line_and_the_fix(tmp_path, jpeg):
    root = _folder(tmp_path / "mine", jpeg)
    (root / "images" / "d.jpg").write_bytes(b"not an image")
    with pytest.raises(RuntimeError) as error:
        FolderDataset(root, "test")
    assert f"line 6: cannot read image {root / 'images' / 'd.jpg'}" in str(error.value)
    assert "replace the file with a readable image or remove its line" in str(error.value)
    (root / "images" / "d.jpg").unlink()
    with pytest.raises(FileNotFoundError, match=r"line 6: image file .*d\.jpg not found"):
        FolderDataset(root, "test")


@pytest.mark.parametrize(
    "csv,message",
    [
        ("image,labels\na.jpg,cat\n", "must name the columns image, labels, split; it has ['image', 'lab"),
        ("image,labels,split\na.jpg,cat,val\n", "line 2: split 'val'; expected one of train, test"),
        ("image,labels,split\na.jpg,cat,train\na.jpg,dog,test\n", "line 3: image 'a.jpg' is listed again"),
        ("image,labels,split\n../a.jpg,cat,train\n", "line 2: image '../a.jpg'; expected a path relative to"),
        ("image,labels,split\n", "lists no image"),
        ("image,labels,split\na.jpg,cat,train\n", "no image has split 'test'; the split column marks each"),
    ],
    ids=["columns", "split", "twice", "outside", "empty", "no-test"],
)  # fmt: skip
def test_a_malformed_labels_csv_names_the_file_line_and_problem(tmp_path, jpeg, csv, message):
    root = _folder(tmp_path / "mine", jpeg, csv)
    with pytest.raises(ValueError) as error:
        FolderDataset(root, "test")
    assert message in str(error.value) and str(root / "labels.csv") in str(error.value)


def test_missing_proposals_give_the_command_that_makes_them(tmp_path, jpeg):
    root = _folder(tmp_path / "mine", jpeg, proposals=False)
    data_cfg = OmegaConf.create({"kind": "folder", "root": str(root)})
    command = f"python tools/make_proposals.py folder --root {root}"
    with pytest.raises(FileNotFoundError, match=f"no proposals for the images of .*make them with {command}"):
        prepare_data(data_cfg)
    boxes = [np.array([[0, 0, 9, 9]], np.float32)] * 3
    write_proposal_store(ProposalSet(["a.jpg", "sub/b.png", "c.jpg"], boxes), proposals_path(root))
    with pytest.raises(MissingProposalsError, match=f"image id 'd.jpg'.* run {command} again"):
        FolderDataset(root, "test")


def test_make_proposals_folder_writes_them_where_the_dataset_reads_them(tmp_path, jpeg, capsys):
    root = _folder(tmp_path / "mine", jpeg, proposals=False)
    spec = importlib.util.spec_from_file_location("make_proposals", REPO / "tools" / "make_proposals.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["folder", "--root", str(root), "--workers", "1", "--no-progress"]) == 0
    assert "4 images -> " in capsys.readouterr().out
    assert read_labels_csv(root)[0].image == "a.jpg"
    dataset = FolderDataset(root, "train")
    assert len(dataset.proposals) == 4 and len(dataset.proposals_of(0)) >= 1
