"""Your own images: a folder holding ``images/`` and a ``labels.csv`` of image-level labels.

Layout (``data/README.md`` shows it too)::

    <root>/
      images/            the images, in any sub-folders; an image's id is its path relative to images/
      labels.csv         one line per image: image,labels,split
      classes.txt        optional: the class names, one per line (line order = class index)
      proposals/selective_search.proposals
                         written by ``python tools/make_proposals.py folder --root <root>``

``labels.csv`` is comma-separated with a header line naming its columns (any order; other columns are
ignored)::

    image,labels,split
    cat_001.jpg,cat,train
    park/0002.jpg,cat;dog,train
    empty_room.jpg,,test

- ``image``: the file's path relative to ``images/`` (``/``-separated); it is the image id.
- ``labels``: the classes present, separated by ``;`` (spaces around names are ignored). Empty: none of
  the classes; such an image is kept in training too, as a negative for every class.
- ``split``: ``train`` or ``test``. This is the one split rule (no separate train.csv / test.csv): one
  file holds every image, moving an image between the splits is one edit, and since proposals are
  made for every line of the file, a changed split needs no new proposals.

Classes, the first that applies: the ``classes`` argument (``data.classes`` in configs/data/folder.yaml);
``<root>/classes.txt``; the sorted union of the labels of every line of labels.csv (both splits, so that
training and test agree on the class indices). With a given list, a label outside it is an error naming
the csv, the line, the label and the known classes.

Image sizes come from the file headers, read at construction: a missing or unreadable image is an error
naming the file and its labels.csv line. Proposals: one memory-mapped store for every image of the file
(``proposals_path``); without it, or when it lacks images the file lists, the error gives the command
that makes it.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from wsod.data.dataset import ImageRecord, Transform, WeakDetectionDataset, image_size_from_header
from wsod.data.proposals import MissingProposalsError, ProposalSet

__all__ = [
    "FolderDataset",
    "FolderRow",
    "SPLITS",
    "folder_classes",
    "load_folder_records",
    "proposals_command",
    "proposals_path",
    "read_labels_csv",
    "require_proposals",
]

SPLITS = ("train", "test")
COLUMNS = ("image", "labels", "split")
LABEL_SEPARATOR = ";"


@dataclass(frozen=True)
class FolderRow:
    """One line of labels.csv: its line number, the image (relative to images/), labels and split."""

    line: int
    image: str
    labels: tuple[str, ...]
    split: str


def proposals_path(root: str | os.PathLike) -> Path:
    """Where ``tools/make_proposals.py folder`` writes a folder's proposals and the dataset reads them."""
    return Path(root) / "proposals" / "selective_search.proposals"


def proposals_command(root: str | os.PathLike) -> str:
    return f"python tools/make_proposals.py folder --root {root}"


def require_proposals(root: str | os.PathLike) -> Path:
    """The folder's proposal store, or an error giving the command that makes it. Training never makes
    proposals itself: Selective Search takes long enough to deserve its own command and progress bar."""
    path = proposals_path(root)
    if not path.exists():
        raise FileNotFoundError(
            f"no proposals for the images of {root} ({path}): make them with {proposals_command(root)}"
        )
    return path


def read_labels_csv(root: str | os.PathLike) -> list[FolderRow]:
    """The lines of ``<root>/labels.csv`` (see the module docstring), checked: header, split values,
    image paths inside images/, no image twice, at least one image."""
    root = Path(root)
    path = root / "labels.csv"
    if not root.is_dir():
        raise FileNotFoundError(
            f"folder dataset {root}: no such folder (data.root names the folder of images/ and labels.csv)"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: a folder dataset lists its images in labels.csv, a header line"
            f" '{','.join(COLUMNS)}' and one line per image (see data/README.md)"
        )
    rows: list[FolderRow] = []
    first_line: dict[str, int] = {}
    with open(path, newline="", encoding="utf-8-sig") as f:  # utf-8-sig: spreadsheets write a BOM
        reader = csv.DictReader(f)
        header = [name.strip() for name in reader.fieldnames or []]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise ValueError(
                f"{path}: the header line must name the columns {', '.join(COLUMNS)}; it has {header}"
                f" (missing {', '.join(missing)})"
            )
        reader.fieldnames = header
        for values in reader:
            line = reader.line_num
            image = (values["image"] or "").strip()
            if not image and not any((v or "").strip() for v in values.values() if isinstance(v, str)):
                continue  # a blank line
            split = (values["split"] or "").strip()
            if split not in SPLITS:
                raise ValueError(f"{path} line {line}: split {split!r}; expected one of {', '.join(SPLITS)}")
            relative = PurePosixPath(image.replace("\\", "/"))
            if not image or relative.is_absolute() or ".." in relative.parts:
                raise ValueError(
                    f"{path} line {line}: image {image!r}; expected a path relative to {root / 'images'}"
                )
            image = relative.as_posix()
            if image in first_line:
                raise ValueError(
                    f"{path} line {line}: image {image!r} is listed again (first on line {first_line[image]})"
                )
            first_line[image] = line
            labels = tuple(n.strip() for n in (values["labels"] or "").split(LABEL_SEPARATOR) if n.strip())
            rows.append(FolderRow(line, image, labels, split))
    if not rows:
        raise ValueError(f"{path} lists no image")
    return rows


def folder_classes(
    root: str | os.PathLike, rows: Sequence[FolderRow], classes: Sequence[str] | None = None
) -> tuple[tuple[str, ...], str]:
    """(class names, where they came from) by the rule of the module docstring; checks every label."""
    root = Path(root)
    classes_file = root / "classes.txt"
    if classes is not None:
        names, source = tuple(str(c).strip() for c in classes), "data.classes"
    elif classes_file.is_file():
        names = tuple(line.strip() for line in classes_file.read_text().splitlines() if line.strip())
        source = str(classes_file)
    else:
        names = tuple(sorted({label for row in rows for label in row.labels}))
        source = None
        if not names:
            raise ValueError(f"{root / 'labels.csv'}: no image has a label, so there is no class to learn")
    if not names or len(set(names)) != len(names) or not all(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"{source}: the class list must be non-empty names without repeats; got {list(names)}"
            f" (repeated: {duplicates})"
        )
    if source is not None:
        known = set(names)
        for row in rows:
            for label in row.labels:
                if label not in known:
                    raise ValueError(
                        f"{root / 'labels.csv'} line {row.line}: label {label!r} is not in the class list"
                        f" {list(names)} (from {source}): correct the label, or add the class to {source}"
                    )
    return names, source or f"the labels of {root / 'labels.csv'}"


def load_folder_records(
    root: str | os.PathLike, split: str | None = None, classes: Sequence[str] | None = None
) -> tuple[list[ImageRecord], tuple[str, ...]]:
    """The records of one split (None: every line) in labels.csv order, and the class names."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"folder split must be one of {SPLITS}, got {split!r}")
    root = Path(root)
    rows = read_labels_csv(root)
    names, _ = folder_classes(root, rows, classes)
    index = {name: i for i, name in enumerate(names)}
    chosen = [row for row in rows if split is None or row.split == split]
    if not chosen:
        raise ValueError(
            f"{root / 'labels.csv'}: no image has split {split!r}; the split column marks each image"
            f" {' or '.join(SPLITS)}"
        )
    records = []
    for row in chosen:
        path = root / "images" / row.image
        if not path.is_file():
            raise FileNotFoundError(f"{root / 'labels.csv'} line {row.line}: image file {path} not found")
        try:
            height, width = image_size_from_header(path)
        except RuntimeError as error:
            raise RuntimeError(
                f"{root / 'labels.csv'} line {row.line}: cannot read image {path}"
                f" ({error.__cause__ or error}); replace the file with a readable image or remove its line"
            ) from error
        labels = np.zeros(len(names), dtype=np.float32)
        labels[[index[label] for label in row.labels]] = 1.0
        records.append(ImageRecord(row.image, str(path), height, width, labels))
    return records, names


class FolderDataset(WeakDetectionDataset):
    """One split of a folder dataset, e.g. ``FolderDataset("data/my_images", "train")``.

    ``proposals``: a ``ProposalSet`` or a proposal file; None reads the folder's store
    (``proposals_path``). ``classes``: the class list (see the module docstring). The other arguments are
    ``WeakDetectionDataset``'s. Image ids are the paths relative to ``images/``.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        split: str | None,
        proposals: ProposalSet | str | os.PathLike | None = None,
        *,
        classes: Sequence[str] | None = None,
        transform: Transform | None = None,
        min_proposal_size: float = 2.0,
        max_proposals: int | None = None,
        drop_unlabelled: bool = False,
        check_files: bool = True,
    ) -> None:
        self.root, self.split = Path(root), split
        records, names = load_folder_records(root, split, classes)
        try:
            super().__init__(
                records,
                names,
                require_proposals(root) if proposals is None else proposals,
                transform=transform,
                min_proposal_size=min_proposal_size,
                max_proposals=max_proposals,
                drop_unlabelled=drop_unlabelled,
                check_files=check_files,
            )
        except MissingProposalsError as error:
            raise MissingProposalsError(
                f"{error} labels.csv lists images the proposals were not made for: run"
                f" {proposals_command(root)} again"
            ) from None
