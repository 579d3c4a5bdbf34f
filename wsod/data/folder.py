"""Your own images: a folder holding ``images/`` and a ``labels.csv`` of image-level labels.

Layout (``data/README.md`` shows it too)::

    <root>/
      images/            the images, in any sub-folders; an image's id is its path relative to images/
      labels.csv         one line per image: image,labels,split (split optional)
      classes.txt        optional: the class names, one per line (line order = class index)
      proposals/selective_search.proposals
                         written by ``python tools/make_proposals.py folder --root <root>``

``labels.csv`` is comma-separated with a header line naming its columns (any order; other columns are
ignored; a line may leave out trailing fields of ignored columns, never those of image, labels, split)::

    image,labels,split
    cat_001.jpg,cat,train
    park/0002.jpg,cat;dog,train
    empty_room.jpg,,test

- ``image``: the file's path relative to ``images/`` (``/``-separated); it is the image id.
- ``labels``: the classes present, separated by ``;`` (spaces around names are ignored). Empty: none of
  the classes; such an image is kept in training too, as a negative for every class. Labels separated by
  commas make a line of more fields than the header, and a quoted label holding a comma (``"cat,dog"``)
  would be a class of its own: both are errors naming the line and the ``;`` separator.
- ``split``: ``train`` or ``test``. This is the one split rule (no separate train.csv / test.csv): one
  file holds every image, moving an image between the splits is one edit, and since proposals are
  made for every line of the file, a changed split needs no new proposals.

Without a ``split`` column (header ``image,labels``: images and labels, nothing else) ``seeded_split``
makes the split, a pure function of the images, their labels, ``split_seed`` and ``test_fraction``
(``data.split_seed`` and ``data.test_fraction`` of configs/data/folder.yaml, defaults 0 and 0.2), so that
training and evaluation agree on it without storing it (make_proposals needs none: it covers every line):

1. Each image joins the group of its rarest label: of its labels, the one on the fewest lines of the
   file, a tie going to the first name in sorted order; the images without labels form one group.
2. A group of n >= 2 images sends round(n * test_fraction) of them (halves up), at least 1 and at most
   n - 1, to test and the others to train: every group lies on both sides, so does every class that is
   the rarest label of two or more images (every class of >= 2 images, with one label per image). The
   test images are drawn from the group's images (sorted by id) by a generator seeded with ``split_seed``
   and the group's name: a group's draw depends on its own images only. A group of one image trains.
3. When no group has two images (so no image went to test), one image drawn with ``split_seed`` is the
   test set. A file of one image is refused: the split needs one image to train on and one to test.

The line order plays no part. The split is logged (once per process), and a training run writes it to
``<run_dir>/split.csv`` (``write_split_csv``: image,split in labels.csv's order); pasted into labels.csv
as its split column, it fixes the split (e.g. before images are added, which could move others). With
a split column, ``split_seed`` and ``test_fraction`` are ignored.

Classes, the first that applies: the ``classes`` argument (``data.classes`` in configs/data/folder.yaml);
``<root>/classes.txt``; the sorted union of the labels of every line of labels.csv (both splits, so that
training and test agree on the class indices). With a given list, a label outside it is an error naming
the csv, the line, the label and the known classes.

Image sizes come from the file headers, read at construction: a missing or unreadable image is an error
naming the file and its labels.csv line. Proposals: one memory-mapped store for every image of the file
(``proposals_path``); without it, when it lacks images the file lists, or when an image's size differs
from the one its proposals were made on (the image was replaced since), the error gives the command
that makes it.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from wsod.atomic import atomic_write
from wsod.data.dataset import ImageRecord, WeakDetectionDataset, image_size_from_header
from wsod.data.proposals import MissingProposalsError, ProposalSet, ProposalSizeError

__all__ = [
    "FolderDataset",
    "FolderRow",
    "SPLITS",
    "SPLIT_SEED",
    "TEST_FRACTION",
    "folder_classes",
    "has_split_column",
    "load_folder_records",
    "proposals_command",
    "proposals_path",
    "read_labels_csv",
    "require_proposals",
    "seeded_split",
    "write_split_csv",
]

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")
COLUMNS = ("image", "labels", "split")
REQUIRED_COLUMNS = ("image", "labels")  # without split, seeded_split makes one
LABEL_SEPARATOR = ";"
SPLIT_SEED = 0  # the defaults of seeded_split, as in configs/data/folder.yaml
TEST_FRACTION = 0.2
# (labels.csv, split_seed, test_fraction) of the splits made and logged: training builds two datasets
# of one split, and one log line says it.
_LOGGED_SPLITS: set[tuple[str, int, float]] = set()


@dataclass(frozen=True)
class FolderRow:
    """One line of labels.csv: its line number, the image (relative to images/), labels and split
    (``""`` until ``seeded_split`` gives one to the lines of a file without a split column)."""

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


def read_labels_csv(
    root: str | os.PathLike, *, split_seed: int = SPLIT_SEED, test_fraction: float = TEST_FRACTION
) -> list[FolderRow]:
    """The lines of ``<root>/labels.csv`` (see the module docstring), checked: header, fields per line,
    labels, split values, image paths inside images/, no image twice, at least one image. Without a split
    column the split is ``seeded_split(rows, split_seed, test_fraction)``; with one, both are ignored."""
    rows, has_split = _read_rows(Path(root))
    return rows if has_split else _split_by_rule(Path(root), rows, split_seed, test_fraction)


def _read_rows(root: Path) -> tuple[list[FolderRow], bool]:
    """labels.csv's checked lines, and whether it has a split column (without one, each split is "")."""
    path = root / "labels.csv"
    if not root.is_dir():
        raise FileNotFoundError(
            f"folder dataset {root}: no such folder (data.root names the folder of images/ and labels.csv)"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: a folder dataset lists its images in labels.csv, a header line"
            f" '{','.join(COLUMNS)}' (split optional) and one line per image (see data/README.md)"
        )
    rows: list[FolderRow] = []
    first_line: dict[str, int] = {}
    with open(path, newline="", encoding="utf-8-sig") as f:  # utf-8-sig: spreadsheets write a BOM
        reader = csv.DictReader(f)  # fields beyond the header go to the None key, missing ones are None
        header = [name.strip() for name in reader.fieldnames or []]
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            raise ValueError(
                f"{path}: the header line must name the columns {' and '.join(REQUIRED_COLUMNS)}; it has"
                f" {header} (missing {', '.join(missing)}); a split column (train or test) is optional"
            )
        has_split = "split" in header
        used = [c for c in COLUMNS if c in header]
        reader.fieldnames = header
        for values in reader:
            line = reader.line_num
            extra = values.pop(None, [])
            if not any((v or "").strip() for v in [*values.values(), *extra]):
                continue  # a blank line
            _check_fields(path, line, header, values, extra, used)
            image = values["image"].strip()
            split = values["split"].strip() if has_split else ""
            if has_split and split not in SPLITS:
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
            labels = tuple(n.strip() for n in values["labels"].split(LABEL_SEPARATOR) if n.strip())
            for label in labels:
                if "," in label:  # a quoted "cat,dog": one class named "cat,dog", never what was meant
                    raise ValueError(
                        f"{path} line {line}: label {label!r} contains a comma; labels are separated by"
                        f" {LABEL_SEPARATOR!r} (e.g. cat;dog), and a class name cannot hold a comma"
                    )
            rows.append(FolderRow(line, image, labels, split))
    if not rows:
        raise ValueError(f"{path} lists no image")
    return rows, has_split


def has_split_column(root: str | os.PathLike) -> bool:
    """Whether ``<root>/labels.csv`` has a split column (read from its header line only)."""
    with open(Path(root) / "labels.csv", newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    return "split" in (name.strip() for name in header)


def _check_fields(
    path: Path, line: int, header: list[str], values: dict, extra: list[str], used: list[str]
) -> None:
    """A line of as many fields as the header: more are labels separated by commas (the usual mistake),
    fewer leave a column without a value (trailing fields of ignored columns may be left out)."""
    fields = sum(v is not None for v in values.values()) + len(extra)
    columns = f"the header has {len(header)} ({','.join(header)})"
    if extra:
        raise ValueError(
            f"{path} line {line}: {fields} fields, {columns}; labels are separated by {LABEL_SEPARATOR!r}"
            " (e.g. cat;dog), not commas"
        )
    absent = [c for c in used if values[c] is None]
    if absent:
        raise ValueError(
            f"{path} line {line}: {fields} fields, {columns}: no {' or '.join(absent)} field; write every"
            " field, an empty one too (e.g. an image without labels under image,labels,split: img.jpg,,train)"
        )


def _split_by_rule(
    root: Path, rows: list[FolderRow], split_seed: int, test_fraction: float
) -> list[FolderRow]:
    """``seeded_split`` of the lines of a labels.csv without a split column, refusing a one-image file."""
    _check_split_options(split_seed, test_fraction)
    if len(rows) < 2:
        raise ValueError(
            f"{root / 'labels.csv'} has no split column and 1 image: the seeded split needs one image to"
            " train on and one to test; add images, or a split column"
        )
    return seeded_split(rows, split_seed, test_fraction)


def _check_split_options(split_seed: int, test_fraction: float) -> None:
    if not (isinstance(split_seed, int) and not isinstance(split_seed, bool) and split_seed >= 0):
        raise ValueError(f"split_seed must be an integer >= 0, got {split_seed!r} (e.g. data.split_seed=0)")
    if not (isinstance(test_fraction, int | float) and 0 < test_fraction < 1):
        raise ValueError(
            f"test_fraction must be a number > 0 and < 1, got {test_fraction!r} (e.g. data.test_fraction=0.2)"
        )


def seeded_split(rows: Sequence[FolderRow], seed: int, test_fraction: float) -> list[FolderRow]:
    """``rows`` (at least 2) in their order, each with the split of the module docstring's seeded rule:
    by rarest-label group, ``round(n * test_fraction)`` of a group of n >= 2 (at least 1, at most n - 1)
    to test, a generator seeded with ``seed`` and the group's name drawing them; one test image drawn
    with ``seed`` when no group has two images. A pure function of the (image, labels) pairs and
    ``seed``: training and evaluation, in any process, get the same split."""
    _check_split_options(seed, test_fraction)
    if len(rows) < 2:
        raise ValueError(
            f"the seeded split needs at least 2 images (one to train on, one to test), got {len(rows)}"
        )
    frequency = Counter(label for row in rows for label in set(row.labels))
    groups: dict[str, list[str]] = {}
    for row in rows:
        # the rarest label; "" (not a label name: names are non-empty) groups the images without labels
        group = min(row.labels, key=lambda label: (frequency[label], label)) if row.labels else ""
        groups.setdefault(group, []).append(row.image)
    test: set[str] = set()
    for group, images in groups.items():
        if len(images) < 2:
            continue
        count = min(len(images) - 1, max(1, math.floor(len(images) * test_fraction + 0.5)))
        generator = np.random.default_rng([seed, zlib.crc32(group.encode("utf-8"))])
        ordered = sorted(images)  # not the line order: reordering labels.csv changes nothing
        test.update(ordered[i] for i in generator.permutation(len(ordered))[:count])
    if not test:  # every group a single image
        ordered = sorted(row.image for row in rows)
        test.add(ordered[int(np.random.default_rng(seed).integers(len(ordered)))])
    return [replace(row, split="test" if row.image in test else "train") for row in rows]


def write_split_csv(
    root: str | os.PathLike,
    path: str | os.PathLike,
    *,
    split_seed: int = SPLIT_SEED,
    test_fraction: float = TEST_FRACTION,
) -> Path | None:
    """Write the split ``seeded_split`` makes for a labels.csv without a split column to ``path`` (a csv,
    ``image,split`` in labels.csv's order: paste its column into labels.csv to keep the split) and return
    ``path``; a labels.csv with a split column has nothing to show: None, nothing written."""
    root, path = Path(root), Path(path)
    rows, has_split = _read_rows(root)
    if has_split:
        return None
    rows = _split_by_rule(root, rows, split_seed, test_fraction)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")  # quotes an image name that holds a comma
    writer.writerow(["image", "split"])
    writer.writerows([row.image, row.split] for row in rows)
    with atomic_write(path) as f:
        f.write(text.getvalue().encode("utf-8"))
    logger.info(
        "the split made for %s (no split column) is in %s: paste its split column into labels.csv to keep it",
        root / "labels.csv",
        path,
    )
    return path


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
    root: str | os.PathLike,
    split: str | None = None,
    classes: Sequence[str] | None = None,
    *,
    split_seed: int = SPLIT_SEED,
    test_fraction: float = TEST_FRACTION,
) -> tuple[list[ImageRecord], tuple[str, ...]]:
    """The records of one split (None: every line) in labels.csv order, and the class names.
    ``split_seed``, ``test_fraction``: the seeded split of a labels.csv without a split column."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"folder split must be one of {SPLITS}, got {split!r}")
    root = Path(root)
    rows, has_split = _read_rows(root)
    if not has_split:
        rows = _split_by_rule(root, rows, split_seed, test_fraction)
        if split is not None:  # make_proposals (every line) has no use for the split
            _log_seeded_split(root, rows, split_seed, test_fraction)
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


def _log_seeded_split(root: Path, rows: Sequence[FolderRow], split_seed: int, test_fraction: float) -> None:
    """Say once per process that labels.csv's split was made by the seeded rule, with its counts."""
    key = (str(root / "labels.csv"), split_seed, test_fraction)
    if key in _LOGGED_SPLITS:
        return
    _LOGGED_SPLITS.add(key)
    counts = Counter(row.split for row in rows)
    logger.info(
        "%s has no split column: split made by the seeded rule of wsod/data/folder.py (split_seed=%d,"
        " test_fraction=%g): %d train, %d test images",
        key[0],
        split_seed,
        test_fraction,
        counts["train"],
        counts["test"],
    )


class FolderDataset(WeakDetectionDataset):
    """One split of a folder dataset, e.g. ``FolderDataset("data/my_images", "train")``.

    ``proposals``: a ``ProposalSet`` or a proposal file; None reads the folder's store
    (``proposals_path``). ``classes``: the class list; ``split_seed``, ``test_fraction``: the split of a
    labels.csv without a split column (see the module docstring). ``options``: ``WeakDetectionDataset``'s
    keyword arguments (transform, max_proposals, ...). Image ids are the paths relative to ``images/``;
    detections are written under them, tools/predict.py's ``predictions.json`` (``result_format``
    "named").
    """

    result_format = "named"

    def __init__(
        self,
        root: str | os.PathLike,
        split: str | None,
        proposals: ProposalSet | str | os.PathLike | None = None,
        *,
        classes: Sequence[str] | None = None,
        split_seed: int = SPLIT_SEED,
        test_fraction: float = TEST_FRACTION,
        **options: Any,
    ) -> None:
        self.root, self.split = Path(root), split
        records, names = load_folder_records(
            root, split, classes, split_seed=split_seed, test_fraction=test_fraction
        )
        proposals = require_proposals(root) if proposals is None else proposals
        try:
            super().__init__(records, names, proposals, **options)
        except MissingProposalsError as error:
            raise MissingProposalsError(
                f"{error} labels.csv lists images the proposals were not made for: run"
                f" {proposals_command(root)} again"
            ) from None
        except ProposalSizeError as error:  # an image replaced after its proposals were made
            fix = f"make them again with {proposals_command(root)}"
            raise ProposalSizeError(error.problem, fix) from None
