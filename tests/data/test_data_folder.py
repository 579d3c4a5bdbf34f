"""A folder of your own images (wsod/data/folder.py): labels.csv, classes, splits, proposals, bad input,
and tools/make_proposals.py folder."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from wsod.build import build_test_dataset, build_train_dataset, prepare_data
from wsod.data.folder import FolderDataset, proposals_path, read_labels_csv
from wsod.data.proposals import MissingProposalsError, ProposalSet
from wsod.data.proposals.store import write_proposal_store

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
        ("image,split\na.jpg,train\n", "must name the columns image and labels; it has ['image', 'split']"),
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


# --- fields that do not fit the header; a labels.csv without a split column -----------------------------


def _labels_csv(root: Path, lines: list[str], header: str = "image,labels") -> Path:
    """``root/labels.csv`` of ``header`` and ``lines``, no image files (read_labels_csv opens none)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "labels.csv").write_text(header + "\n" + "".join(f"{line}\n" for line in lines))
    return root


def _splits(root: Path, **options) -> dict[str, str]:
    return {row.image: row.split for row in read_labels_csv(root, **options)}


@pytest.mark.parametrize(
    "line,message",
    [
        ("a.jpg,cat,dog,train", "line 2: 4 fields, the header has 3 (image,labels,split); labels are"
         " separated by ';' (e.g. cat;dog), not commas"),
        ("a.jpg,train", "line 2: 2 fields, the header has 3 (image,labels,split): no split field"),
        ('a.jpg,"cat,dog",train', "line 2: label 'cat,dog' contains a comma; labels are separated by ';'"
         " (e.g. cat;dog)"),
    ],
    ids=["comma-separated-labels", "fewer-fields", "quoted-comma"],
)  # fmt: skip
def test_fields_that_do_not_fit_the_header_name_the_line_and_the_label_separator(tmp_path, line, message):
    root = _labels_csv(tmp_path / "mine", [line, "b.jpg,cat,test"], header="image,labels,split")
    with pytest.raises(ValueError) as error:
        read_labels_csv(root)
    assert f"{root / 'labels.csv'} {message}" in str(error.value)


# 22 images: single-label cats (10), dogs (5), birds (2), one fish, 3 negatives, and a cat-and-bird
# image, whose rarest label is bird (3 images against cat's 11): its group is bird's.
SPLIT_LINES = (
    [f"cat_{i:02d}.jpg,cat" for i in range(10)]
    + [f"dogs/dog_{i}.jpg,dog" for i in range(5)]
    + ["bird_0.jpg,bird", "bird_1.jpg,bird", "fish.jpg,fish"]
    + [f"empty_{i}.jpg," for i in range(3)]
    + ["cat_and_bird.jpg,cat;bird"]
)
# test images per group of n at test_fraction=0.2: round(0.2 n), at least 1 and at most n - 1 when n >= 2
GROUPS = {
    "cat": ([f"cat_{i:02d}.jpg" for i in range(10)], 2),
    "dog": ([f"dogs/dog_{i}.jpg" for i in range(5)], 1),
    "bird": (["bird_0.jpg", "bird_1.jpg", "cat_and_bird.jpg"], 1),
    "fish": (["fish.jpg"], 0),
    "no label": ([f"empty_{i}.jpg" for i in range(3)], 1),
}


def test_without_a_split_column_each_class_is_divided_test_train_by_a_seeded_rule(tmp_path):
    root = _labels_csv(tmp_path / "mine", SPLIT_LINES)
    split = _splits(root)
    assert list(split) == [line.split(",")[0] for line in SPLIT_LINES]  # every image once, in file order
    assert set(split.values()) == {"train", "test"}
    for group, (images, num_test) in GROUPS.items():
        assert sum(split[image] == "test" for image in images) == num_test, group
    for label in ("cat", "dog", "bird"):  # every class of >= 2 images lies on both sides
        sides = {split[line.split(",")[0]] for line in SPLIT_LINES if label in line.split(",")[1].split(";")}
        assert sides == {"train", "test"}, label

    assert _splits(root) == split and _splits(root, split_seed=0, test_fraction=0.2) == split  # the defaults
    other = _splits(root, split_seed=1)
    assert other != split
    for group, (images, num_test) in GROUPS.items():  # another seed: other images, the same counts
        assert sum(other[image] == "test" for image in images) == num_test, group
    reversed_lines = _labels_csv(tmp_path / "reversed", SPLIT_LINES[::-1])
    assert _splits(reversed_lines) == split  # the line order does not matter, only the images and labels
    larger = _splits(root, test_fraction=0.5)  # halves round up: 5 of 10, 3 of 5, 2 of 3, 0 of 1, 2 of 3
    assert sum(side == "test" for side in larger.values()) == 5 + 3 + 2 + 0 + 2


def test_the_seeded_split_has_a_test_and_a_train_image_or_refuses(tmp_path):
    singles = _labels_csv(tmp_path / "singles", ["a.jpg,cat", "b.jpg,dog", "c.jpg,bird"])
    for seed in range(4):  # every group a single image: one of them is drawn for test
        assert sorted(_splits(singles, split_seed=seed).values()) == ["test", "train", "train"]
    two = _labels_csv(tmp_path / "two", ["a.jpg,cat", "b.jpg,cat"])
    assert sorted(_splits(two, test_fraction=0.9).values()) == ["test", "train"]
    one = _labels_csv(tmp_path / "one", ["a.jpg,cat"])
    with pytest.raises(ValueError, match=r"labels\.csv has no split column and 1 image: the seeded split"):
        read_labels_csv(one)
    with pytest.raises(ValueError, match=r"test_fraction must be a number > 0 and < 1, got 1\.0"):
        read_labels_csv(two, test_fraction=1.0)
    given = _labels_csv(tmp_path / "given", ["a.jpg,cat,test", "b.jpg,cat,train"], "image,labels,split")
    assert _splits(given, split_seed=5, test_fraction=0.5) == {"a.jpg": "test", "b.jpg": "train"}  # ignored


NO_SPLIT_CSV = "image,labels\na.jpg,cat\nsub/b.png, dog ; cat\nc.jpg,\nd.jpg,dog\n"


def test_a_folder_without_a_split_column_logs_its_split_and_writes_it_for_reuse(tmp_path, jpeg, caplog):
    from wsod.data.folder import write_split_csv

    root = _folder(tmp_path / "mine", jpeg, NO_SPLIT_CSV)
    with caplog.at_level(logging.INFO, logger="wsod"):
        train = FolderDataset(root, "train")
        test = FolderDataset(root, "test", split_seed=0, test_fraction=0.2)
    assert sorted(train.image_ids + test.image_ids) == sorted(SIZES)
    # a and b form cat's group (b: cat and dog each have 2 images, the tie goes to the name): 1 of them
    # is a test image; d (dog's group) and c (no label) are alone in theirs: training images
    assert len(test) == 1 and test.image_ids[0] in ("a.jpg", "sub/b.png")
    made = [r.getMessage() for r in caplog.records if "no split column" in r.getMessage()]
    assert len(made) == 1, made  # once, not once per dataset
    assert f"{root / 'labels.csv'} has no split column" in made[0]
    assert "split_seed=0, test_fraction=0.2" in made[0] and "3 train, 1 test" in made[0]

    written = write_split_csv(root, tmp_path / "run" / "split.csv", split_seed=0, test_fraction=0.2)
    assert written == tmp_path / "run" / "split.csv"
    lines = written.read_text().splitlines()
    assert lines[0] == "image,split" and len(lines) == 5
    split = dict(line.split(",") for line in lines[1:])
    assert [image for image, side in split.items() if side == "test"] == test.image_ids
    # pasted back as a split column, it gives the same datasets
    labels = {line.split(",")[0]: line.split(",", 1)[1] for line in NO_SPLIT_CSV.splitlines()[1:]}
    pasted = "image,labels,split\n" + "".join(f'{i},"{labels[i]}",{split[i]}\n' for i in labels)
    (root / "labels.csv").write_text(pasted)
    assert FolderDataset(root, "test").image_ids == test.image_ids
    assert FolderDataset(root, "train").image_ids == train.image_ids
    assert write_split_csv(root, tmp_path / "run2" / "split.csv") is None  # a split column: nothing to write
    assert not (tmp_path / "run2").exists()


def test_the_split_settings_are_checked_and_reach_the_datasets(tmp_path, jpeg):
    from hydra import compose, initialize_config_dir

    from wsod.config_checks import ConfigError, check_config, resume_changes

    root = _folder(tmp_path / "mine", jpeg, NO_SPLIT_CSV)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data=folder", f"data.root={root}"])
        bad = compose(
            config_name="train",
            overrides=["data=folder", f"data.root={root}", "data.split_seed=-1", "data.test_fraction=1"],
        )
    assert cfg.data.split_seed == 0 and cfg.data.test_fraction == 0.2
    check_config(cfg)
    with pytest.raises(ConfigError) as error:
        check_config(bad)
    assert "data.split_seed=-1: expected an integer >= 0" in str(error.value)
    assert "data.test_fraction=1.0: expected a number > 0 and < 1, e.g. 0.2" in str(error.value)
    with pytest.raises(ConfigError, match=r"data\.split_seed: 0 -> 3 \(the seeded split of a folder"):
        resume_changes(cfg, {**OmegaConf.to_container(cfg), "data": {**cfg.data, "split_seed": 3}})
    expected = _splits(root, split_seed=3, test_fraction=0.5)
    cfg.data.split_seed, cfg.data.test_fraction = 3, 0.5
    test = build_test_dataset(cfg.data)
    assert test.image_ids == [image for image, side in expected.items() if side == "test"]
    assert sorted(build_train_dataset(cfg.data).image_ids + test.image_ids) == sorted(SIZES)


def test_a_training_run_on_a_folder_without_a_split_column_writes_its_split_and_eval_keeps_it(tmp_path, jpeg):
    from hydra import compose, initialize_config_dir

    from wsod.runs.train import train_from_config

    root = _folder(tmp_path / "mine", jpeg, NO_SPLIT_CSV)
    run_dir = tmp_path / "run"
    overrides = [
        "data=folder", f"data.root={root}", f"output_dir={run_dir}", "data.train.scales=[48]",
        "data.test.scales=[48]", "data.train.num_workers=0", "solver.max_iter=1", "solver.warmup_iters=0",
        "solver.milestones=[]", "solver.ims_per_batch=1", "model.chunk_size=8", "progress=false",
        "random_baseline=false", "data.test.num_workers=0",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    threads = torch.get_num_threads()
    try:
        train_from_config(cfg)
    finally:
        torch.set_num_threads(threads)
    assert (run_dir / "model_final.pth").is_file()
    split = (run_dir / "split.csv").read_text().splitlines()
    assert split[0] == "image,split" and sorted(line.split(",")[0] for line in split[1:]) == sorted(SIZES)
    assert "has no split column" in (run_dir / "log.txt").read_text()

    # tools/eval.py on another seeded split would test on training images: refused, naming the fix.
    from wsod.config_checks import ConfigError
    from wsod.runs.evaluate import evaluate_from_config

    common = [
        f"checkpoint={run_dir / 'model_final.pth'}", "data=folder", f"data.root={root}",
        "data.test.scales=[48]", "data.test.num_workers=0", "progress=false", "random_baseline=false",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        other = compose(
            config_name="eval", overrides=[*common, "data.split_seed=3", f"output_dir={tmp_path / 'e1'}"]
        )
        same = compose(config_name="eval", overrides=[*common, f"output_dir={tmp_path / 'e2'}"])
    with pytest.raises(ConfigError, match="evaluate with data.split_seed=0 data.test_fraction=0.2"):
        evaluate_from_config(other)
    assert "cls_mAP" in evaluate_from_config(same)


def test_an_image_replaced_by_one_of_another_size_is_refused_with_the_command(tmp_path, jpeg):
    from wsod.data.proposals import ProposalSizeError
    from wsod.data.proposals.selective_search import generate_proposals

    root = _folder(tmp_path / "mine", jpeg, proposals=False)
    images = [(name, root / "images" / name) for name in SIZES]
    generate_proposals(images, proposals_path(root), workers=1, progress=False)
    assert len(FolderDataset(root, "train")) == 2  # made for these images: accepted
    jpeg(root / "images" / "a.jpg", 40, 30, seed=9)  # a.jpg was (30, 40): replaced afterwards
    command = f"python tools/make_proposals.py folder --root {root}"
    with pytest.raises(ProposalSizeError) as error:
        FolderDataset(root, "train")
    message = str(error.value)
    assert "image 'a.jpg'" in message and "(40, 30)" in message and "(30, 40)" in message
    assert str(proposals_path(root)) in message and message.endswith(command)
    assert len(FolderDataset(root, "test")) == 2  # the other split's images did not change
