"""Dataset formats: what each ``data.kind`` (configs/data/*.yaml) means, registered by name.

A ``DatasetFormat`` says how to open one set of its data (a ``data.train.sets`` entry or ``data.test.set``)
from plain settings, what to do on first use, and the other decisions that belong to a kind: whether
training drops its unlabelled images, and, for data whose train/test split is made at run time (a folder
without a split column), how to show that split and when an evaluation's split differs from training's.
``wsod.build`` looks ``data.kind`` up here once (``dataset_format``); how an evaluation writes a set's
detections is the opened dataset's own answer (``WeakDetectionDataset.result_format``).

``DATASET_FORMATS`` maps each name to its format; ``register_dataset_format`` adds one (a name given
twice is refused). The built-in formats, registered below::

    toy      the generated toy set (``wsod.data.toy``): made on first use; sets by ``image_set``
    toy_voc  the generated VOC-like benchmark (``wsod.data.toy_voc``): as toy, drawn by ``generator_seed``
    voc      a VOCdevkit (``data.devkit``); sets by ``year``, ``image_set`` and ``proposals``
    coco     COCO-format json; sets by ``annotations``, ``images`` and ``proposals``; training drops the
             images without a label (docs/METHOD.md §9)
    folder   your own images (``data.root``, ``wsod.data.folder``); sets by ``split``; its proposals
             must exist (made by tools/make_proposals.py, never at training time)

A format of your own, e.g. images listed in some other file::

    def open_my_set(data, source, **options):
        records, classes = read_my_list(data["root"], source["list"])
        return WeakDetectionDataset(records, classes, source["proposals"], **options)

    register_dataset_format(DatasetFormat("my_list", open_my_set))

then ``data.kind=my_list`` (its module imported before the config is built, e.g. by the script that
runs). Settings arrive as plain dicts (no OmegaConf): ``data`` is the whole ``data`` node, ``source`` the
set's node; ``options`` are ``WeakDetectionDataset``'s keyword arguments (``transform``,
``max_proposals``, ``min_proposal_size``, ``drop_unlabelled``, ``partial_labels``), to pass on unchanged.

This module sits below ``wsod.build`` (tests/test_imports.py): it imports the dataset classes, never the
builder, Hydra or OmegaConf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from wsod.data.coco import CocoDataset
from wsod.data.dataset import WeakDetectionDataset
from wsod.data.folder import (
    FolderDataset,
    has_split_column,
    require_proposals,
    write_split_csv,
)
from wsod.data.toy import ToyDataset, ensure_toy_dataset
from wsod.data.toy_voc.generator import ToyVOCDataset, check_generator_seed, ensure_toy_voc_dataset
from wsod.data.toy_voc.pretraining import BASE_FILE as TOY_VOC_BASE_FILE
from wsod.data.toy_voc.pretraining import BASE_STEPS as TOY_VOC_BASE_STEPS
from wsod.data.toy_voc.pretraining import ensure_toy_voc_base
from wsod.data.voc import VOCDataset

__all__ = [
    "DATASET_FORMATS",
    "DatasetFormat",
    "Opener",
    "Settings",
    "dataset_format",
    "register_dataset_format",
]

# A config node as plain data: ``OmegaConf.to_container`` of ``data`` or of one of its sets.
Settings = Mapping[str, Any]


class Opener(Protocol):
    """``open(data, source, **options)``: one set of a format's data as a dataset."""

    def __call__(self, data: Settings, source: Settings, /, **options: Any) -> WeakDetectionDataset: ...


@dataclass(frozen=True)
class DatasetFormat:
    """One ``data.kind``.

    Attributes:
        name: the ``data.kind`` value that selects it.
        open: ``open(data, source, **options)`` -> the ``WeakDetectionDataset`` of one set: ``data`` the
            ``data`` node and ``source`` the set's node (``data.train.sets[i]``, ``data.test.set``), plain
            dicts; ``options`` ``WeakDetectionDataset``'s keyword arguments, passed on unchanged.
        prepare: ``prepare(data, progress)``, run once before any set is opened (on the main process
            first, the others waiting): make what the data needs on first use, or refuse data that lacks
            what it must bring; ``progress``: whether to show progress bars. None: nothing to do.
        drop_unlabelled_in_training: whether training leaves out the images without any image-level
            label (``drop_unlabelled``; evaluation always keeps them).
        write_split: ``write_split(data, path)``: for data whose train/test split is made at run time
            rather than stated in its files, write that split to ``path`` for the user to see and keep,
            and return ``path``; None (returned) when the files state it. None: the format's files always
            state their split.
        split_conflict: ``split_conflict(trained, data)``: when an evaluation on ``data`` would test on
            another run-time split than the one the checkpoint was trained on (``trained``: its training
            ``data`` node, of this same kind), the problem, as the rest of a sentence after the
            checkpoint's path; else None. None: the format's splits never depend on settings.
    """

    name: str
    open: Opener
    prepare: Callable[[Settings, bool], object] | None = None
    drop_unlabelled_in_training: bool = False
    write_split: Callable[[Settings, Path], Path | None] | None = None
    split_conflict: Callable[[Settings, Settings], str | None] | None = None


# ``data.kind`` -> its format. A new format is one ``register_dataset_format`` call.
DATASET_FORMATS: dict[str, DatasetFormat] = {}


def register_dataset_format(dataset_format: DatasetFormat) -> DatasetFormat:
    """Add ``dataset_format`` to ``DATASET_FORMATS`` under its name and return it; a name already
    registered is a ``ValueError`` (a second format would silently replace the first)."""
    if not isinstance(dataset_format, DatasetFormat):
        raise TypeError(f"expected a DatasetFormat, got {type(dataset_format).__name__}")
    name = dataset_format.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"a dataset format's name is a non-empty string (its data.kind), got {name!r}")
    if name in DATASET_FORMATS:
        raise ValueError(
            f"dataset format '{name}' is registered already (registered: {', '.join(DATASET_FORMATS)});"
            " give yours another name"
        )
    DATASET_FORMATS[name] = dataset_format
    return dataset_format


def dataset_format(kind: str) -> DatasetFormat:
    """The format registered as ``kind``; an unknown kind is a one-line ``ValueError`` naming the
    registered ones (read at each call, so that a format registered later is named too)."""
    try:
        return DATASET_FORMATS[kind]
    except (KeyError, TypeError):  # TypeError: an unhashable value (a list)
        raise ValueError(
            f"unknown data.kind='{kind}': expected one of {sorted(DATASET_FORMATS)} (a format of your own:"
            " wsod.data.formats.register_dataset_format)"
        ) from None


def _setting(node: Settings, key: str, kind: str, set_node: bool = False) -> Any:
    """``node[key]`` (of ``data``, or of one of its sets), or a one-line ``ValueError`` naming the key."""
    if key not in node:
        where = f"the set {dict(node)}" if set_node else "data"
        raise ValueError(f"{where} has no '{key}', which data.kind={kind} needs")
    return node[key]


def _set_keys(source: Settings, kind: str, *keys: str) -> list[Any]:
    return [_setting(source, key, kind, set_node=True) for key in keys]


# -- toy --------------------------------------------------------------------------------------------------


def _toy(data: Settings, progress: bool = False) -> ToyDataset:
    return ensure_toy_dataset(
        _setting(data, "root", "toy"),
        num_train=_setting(data, "num_train", "toy"),
        num_test=_setting(data, "num_test", "toy"),
        object_size=tuple(_setting(data, "object_size", "toy")),
        progress=progress,
    )


def _open_toy(data: Settings, source: Settings, /, **options: Any) -> WeakDetectionDataset:
    split = _setting(source, "image_set", "toy", set_node=True)
    return _toy(data).dataset(split, source.get("proposals"), **options)


# -- toy_voc ----------------------------------------------------------------------------------------------


def _toy_voc(data: Settings, progress: bool = False) -> ToyVOCDataset:
    return ensure_toy_voc_dataset(
        _setting(data, "root", "toy_voc"),
        generator_seed=check_generator_seed(_setting(data, "generator_seed", "toy_voc")),
        num_train=_setting(data, "num_train", "toy_voc"),
        num_test=_setting(data, "num_test", "toy_voc"),
        progress=progress,
    )


def _prepare_toy_voc(data: Settings, progress: bool = False) -> None:
    """The set, then its pretrained base when ``data.base_weights`` names the one made under
    ``{root}/base`` (a file of the user's is theirs to bring; null: no base)."""
    dataset = _toy_voc(data, progress)
    weights = data.get("base_weights")
    generated = dataset.root / "base" / TOY_VOC_BASE_FILE
    if weights is not None and Path(weights) == generated:
        ensure_toy_voc_base(
            generated.parent,
            generator_seed=check_generator_seed(_setting(data, "generator_seed", "toy_voc")),
            steps=data.get("base_steps", TOY_VOC_BASE_STEPS),
            progress=progress,
        )


def _open_toy_voc(data: Settings, source: Settings, /, **options: Any) -> WeakDetectionDataset:
    split = _setting(source, "image_set", "toy_voc", set_node=True)
    return _toy_voc(data).dataset(split, source.get("proposals"), **options)


# -- voc, coco --------------------------------------------------------------------------------------------


def _open_voc(data: Settings, source: Settings, /, **options: Any) -> WeakDetectionDataset:
    year, image_set, proposals = _set_keys(source, "voc", "year", "image_set", "proposals")
    return VOCDataset(_setting(data, "devkit", "voc"), str(year), image_set, proposals, **options)


def _open_coco(data: Settings, source: Settings, /, **options: Any) -> WeakDetectionDataset:
    annotations, images, proposals = _set_keys(source, "coco", "annotations", "images", "proposals")
    return CocoDataset(annotations, images, proposals, **options)


# -- folder -----------------------------------------------------------------------------------------------


def _split_settings(data: Settings) -> dict[str, Any]:
    """The settings of a folder's seeded split (a labels.csv without a split column). Both keys are in
    every config (their schema's defaults) and in every saved one (``wsod.config_compat``)."""
    return {"split_seed": data["split_seed"], "test_fraction": data["test_fraction"]}


def _open_folder(data: Settings, source: Settings, /, **options: Any) -> WeakDetectionDataset:
    classes = data.get("classes")
    classes = None if classes is None else list(classes)
    root, split = _setting(data, "root", "folder"), _setting(source, "split", "folder", True)
    return FolderDataset(root, split, classes=classes, **_split_settings(data), **options)


def _prepare_folder(data: Settings, progress: bool = False) -> None:
    # Never made here: Selective Search deserves its own command and progress bar (the error gives it).
    require_proposals(_setting(data, "root", "folder"))


def _write_folder_split(data: Settings, path: Path) -> Path | None:
    return write_split_csv(_setting(data, "root", "folder"), path, **_split_settings(data))


def _folder_split_conflict(trained: Settings, data: Settings) -> str | None:
    """Another seeded split of the same folder (no split column) than the one trained on: its test
    images would include training images, silently."""
    root = _setting(data, "root", "folder")
    if Path(trained["root"]).resolve() != Path(root).resolve() or has_split_column(root):
        return None
    saved, given = _split_settings(trained), _split_settings(data)
    if saved == given:
        return None
    return (
        f"was trained on the seeded split of {Path(root) / 'labels.csv'} (no split column) made with"
        f" {_words(saved)}; this evaluation's {_words(given)} makes another, whose test images include"
        f" training images: evaluate with {_words(saved)}"
    )


def _words(values: dict[str, Any]) -> str:
    return " ".join(f"data.{k}={v}" for k, v in values.items())


register_dataset_format(DatasetFormat("toy", _open_toy, prepare=_toy))
register_dataset_format(DatasetFormat("toy_voc", _open_toy_voc, prepare=_prepare_toy_voc))
register_dataset_format(DatasetFormat("voc", _open_voc))
register_dataset_format(DatasetFormat("coco", _open_coco, drop_unlabelled_in_training=True))
register_dataset_format(
    DatasetFormat(
        "folder",
        _open_folder,
        prepare=_prepare_folder,
        write_split=_write_folder_split,
        split_conflict=_folder_split_conflict,
    )
)
