"""The split file of the third stage: which pseudo-labelled training images keep their boxes ("labelled")
and which keep only their image labels ("unlabelled"), with the loss each was ranked by
(tools/split_pseudo_labels.py writes it, tools/train_stage3.py reads it; docs/METHOD.md §14).

Layout (a json object):

    info      {"description", "pseudo_labels", "checkpoint", "k", "images", "scale", "max_size", "seed",
               "positive_fraction"}: what made the split
    images    [{"source_id", "file_name", "loss", "losses": {name: value}, "labelled": bool}], one per
              image of the pseudo-label json, in its order: ``source_id`` is the dataset's own image id
              (the pseudo-label json's ``source_id``), by which the third stage matches its images;
              ``loss`` the sum of ``losses``
    per_class {class name: {"images", "labelled", "share"}}: the images holding the class among their
              image labels, how many of them are labelled, and that share (NaN-free: null when none)
    quality   (with ground truth on the training set) {"labelled" | "unlabelled": {"images", "precision",
              "recall"}}: each part's pseudo boxes against the ground truth at IoU 0.5

``read_split`` checks the layout and returns ``{source_id: labelled}``; a wrong file gets one line
naming it, the entry and the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wsod.atomic import atomic_write
from wsod.data.json_files import read_json, require_keys

__all__ = ["SPLIT_FILE", "split_json", "write_split", "read_split"]

SPLIT_FILE = "split.json"

_EXPECTED = "the split json of tools/split_pseudo_labels.py (split.json beside the pseudo-label json)"


def split_json(
    source_ids: Sequence[Any],
    file_names: Sequence[str],
    losses: Sequence[Mapping[str, float]],
    labelled: Sequence[bool],
    per_class: Mapping[str, Mapping[str, Any]],
    info: Mapping[str, Any],
    quality: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The json (module docstring) of image i: ``source_ids[i]``, ``file_names[i]``, its named
    ``losses[i]`` and whether it is ``labelled[i]``; ``quality`` only when given."""
    if not len(source_ids) == len(file_names) == len(losses) == len(labelled):
        raise ValueError("split_json: one source id, file name, loss set and flag per image")
    images = [
        {
            "source_id": source_id,
            "file_name": name,
            "loss": sum(named.values()),
            "losses": dict(named),
            "labelled": bool(flag),
        }
        for source_id, name, named, flag in zip(source_ids, file_names, losses, labelled, strict=True)
    ]
    content = {"info": dict(info), "images": images, "per_class": {k: dict(v) for k, v in per_class.items()}}
    if quality is not None:
        content["quality"] = {part: dict(values) for part, values in quality.items()}
    return content


def write_split(content: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write the json atomically (a killed split leaves the old file or the new one)."""
    with atomic_write(path, mode="w") as stream:
        json.dump(content, stream, indent=1)
    return Path(path)


def read_split(path: str | os.PathLike) -> dict[Any, bool]:
    """``{source_id: labelled}`` of a split file, every entry checked (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"split file {path}: not found; tools/split_pseudo_labels.py writes it beside the pseudo-label"
            " json"
        )
    content = read_json(path, _EXPECTED)
    require_keys(content, path, {"images": list}, _EXPECTED)
    split: dict[Any, bool] = {}
    for i, entry in enumerate(content["images"]):
        if not isinstance(entry, dict) or "source_id" not in entry or "labelled" not in entry:
            raise ValueError(f"split file {path}: images[{i}] {entry!r} lacks source_id or labelled")
        source_id, flag = entry["source_id"], entry["labelled"]
        if not isinstance(source_id, int | str) or isinstance(source_id, bool):
            raise ValueError(f"split file {path}: images[{i}].source_id is {source_id!r}, not an image id")
        if not isinstance(flag, bool):
            raise ValueError(f"split file {path}: images[{i}].labelled is {flag!r}; expected true or false")
        if source_id in split:
            raise ValueError(f"split file {path}: images[{i}] repeats source_id {source_id!r}")
        split[source_id] = flag
    if not split:
        raise ValueError(f"split file {path}: no image; expected {_EXPECTED}")
    return split
