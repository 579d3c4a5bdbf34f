"""Each image's supervision as one dict (torchvision's ``targets`` convention), and which fields are geometry.

    labels               (C,) float32 multi-hot over the foreground classes 0..C-1; always there
    points, *_points     (P, 2) float32 ``x y``                       geometry: moves with the image
    boxes, *_boxes       (G, 4) float32 ``x1 y1 x2 y2``               geometry: moves with the image
    any other name       carried unchanged: integers as int64, floats as float32, bools as bool

Geometry is recognised by the field's name alone, here (``geometry_kind``): every geometric transform
moves every field named like points or boxes, so a new kind of supervision needs no change to the
transforms, the loader or the detector's forward. The names the methods read:

- points: ``points`` (P, 2) and ``point_labels`` (P,) int64, the class of each point;
- scribbles: points along each stroke, all strokes in one flat array (strokes differ in length):
  ``scribble_points`` (S, 2), ``scribble_labels`` (S,) int64, the class of each point, and
  ``scribble_ids`` (S,) int64, the stroke each point is on (a stroke is the polyline through its
  points in order); a point-based method can read scribbles as many points of one class;
- boxes: ``boxes`` (G, 4) and ``box_labels`` (G,) int64, the class of each box.

Where the dict is in which coordinates:

- ``ImageRecord.supervision`` (a format reader's output, without ``labels``): numbers or arrays in
  pixels of the image on disk, the proposals' coordinates (0-based; see ``wsod.data.box_formats``).
- a dataset item's ``targets`` (``make_targets``): geometry as ``tv_tensors.KeyPoints`` /
  ``tv_tensors.BoundingBoxes`` on the decoded image's canvas, the other fields as tensors.
- after ``wsod.data.transforms.DetectionTransform``, in a batch and at the detector: plain tensors,
  geometry in the resized (and flipped) image's pixels, moved by the proposals' own map (x -> x * w / W,
  y -> y * h / H, and x -> w - x on a flip), so what holds between points, boxes and proposals (a point
  inside a proposal, on its edge) holds after every augmentation too.

Ground-truth boxes for evaluation (``gt_*``, ``WeakDetectionDataset.ground_truth``) are not supervision
and never enter the targets, with one exception that no method reads: a training transform built with
``true_boxes=True`` (``wsod.data.transforms.DetectionTransform``; the first stage's training set) copies
them in as ``true_boxes`` (G, 4) and ``true_labels`` (G,) int64 (``TRUE_BOXES``, ``TRUE_LABELS``), so
that they move with the image like any ``*_boxes`` field and the training loop can score the pseudo
boxes in the batch's own pixels (``wsod.engine.pseudo_label_quality``, logging only). A method must not
read them: they are the answer.

Bad supervision is an error when the dataset is built (``check_supervision``), naming the image and the
field: a field called ``labels`` (those are ``ImageRecord.labels``), values that are not numbers, geometry
of another shape, not finite, outside the image, or boxes with ``x2 < x1`` or ``y2 < y1`` (x y w h boxes
read as x1 y1 x2 y2 look like that). Coordinates outside the image mean another convention (normalised,
or another image's size), which training would silently learn from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import Tensor
from torchvision import tv_tensors

__all__ = [
    "geometry_kind",
    "check_supervision",
    "make_targets",
    "geometry_of",
    "plain_targets",
    "TRUE_BOXES",
    "TRUE_LABELS",
]

GeometryKind = Literal["points", "boxes"]

# The image's ground-truth boxes and their classes (0..C-1) in the training batch's pixels, for the
# pseudo-label quality log alone (the module docstring): named like boxes, so every transform moves them.
TRUE_BOXES, TRUE_LABELS = "true_boxes", "true_labels"

# Coordinates per row of each kind of geometry.
_WIDTH = {"points": 2, "boxes": 4}


def geometry_kind(name: str) -> GeometryKind | None:
    """``"points"`` for a field named ``points`` or ``*_points``, ``"boxes"`` for ``boxes`` or ``*_boxes``,
    None for any other field (carried unchanged by every transform)."""
    for kind in ("points", "boxes"):
        if name == kind or name.endswith(f"_{kind}"):
            return kind
    return None


def _per_row_fields(name: str, kind: GeometryKind) -> tuple[str, ...]:
    """The fields that hold one value per row of geometry field ``name``: ``point_labels`` of ``points``,
    ``box_labels`` of ``boxes``, ``<x>_labels`` and ``<x>_ids`` of ``<x>_points`` / ``<x>_boxes``."""
    if name == kind:
        return (f"{kind[:-1]}_labels",)
    prefix = name[: -len(kind) - 1]
    return (f"{prefix}_labels", f"{prefix}_ids")


def check_supervision(supervision: Mapping[str, ArrayLike], image_size: tuple[int, int], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` (e.g. the image id and file) and the field when
    ``supervision`` breaks a rule of the module docstring; ``image_size`` (H, W) in pixels on disk."""
    height, width = image_size
    for name, value in supervision.items():
        if name == "labels":
            raise ValueError(
                f"{where}: a supervision field is named 'labels', which is the image-level labels"
                " (ImageRecord.labels); rename the field (e.g. point_labels)"
            )
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise ValueError(
                f"{where}: supervision field {name!r} holds {array.dtype} values; only numbers and bools"
                " reach the model: store class names as class indices"
            )
        kind = geometry_kind(name)
        if kind is None:
            continue
        rows = len(array) if array.size else 0
        for other in _per_row_fields(name, kind):
            if other in supervision and len(np.atleast_1d(np.asarray(supervision[other]))) != rows:
                raise ValueError(
                    f"{where}: supervision field {other!r} has {len(np.atleast_1d(supervision[other]))}"
                    f" values for the {rows} rows of {name!r}; it holds one per row"
                )
        if array.size == 0:
            continue
        columns = _WIDTH[kind]
        if array.ndim != 2 or array.shape[1] != columns:
            layout = "x y" if kind == "points" else "x1 y1 x2 y2"
            raise ValueError(
                f"{where}: supervision field {name!r} has shape {array.shape}; {kind} are (N, {columns})"
                f" {layout} rows (the field's name says it is {kind})"
            )
        if not np.isfinite(array).all():
            raise ValueError(f"{where}: supervision field {name!r} holds a NaN or infinite coordinate")
        xs, ys = array[:, 0::2], array[:, 1::2]
        if xs.min() < 0 or ys.min() < 0 or xs.max() > width or ys.max() > height:
            raise ValueError(
                f"{where}: supervision field {name!r} reaches outside the {height}x{width} (HxW) image"
                f" (x in [{xs.min():g}, {xs.max():g}], y in [{ys.min():g}, {ys.max():g}]); coordinates are"
                " pixels of the image on disk: convert normalised or other-size coordinates, clip the rest"
            )
        if kind == "boxes" and ((array[:, 2] < array[:, 0]).any() or (array[:, 3] < array[:, 1]).any()):
            raise ValueError(
                f"{where}: supervision field {name!r} has a box with x2 < x1 or y2 < y1; boxes are"
                " x1 y1 x2 y2 (convert x y w h with wsod.data.box_formats.coco_xywh_to_xyxy)"
            )


def make_targets(
    labels: Tensor, supervision: Mapping[str, ArrayLike] | None, canvas_size: tuple[int, int]
) -> dict[str, Tensor]:
    """A dataset item's targets: ``labels`` (C,) float32, then ``supervision``'s fields (checked by
    ``check_supervision``) as fresh tensors, geometry wrapped as tv_tensors on ``canvas_size`` (H, W)."""
    targets: dict[str, Tensor] = {"labels": labels}
    for name, value in (supervision or {}).items():
        array = np.asarray(value)
        kind = geometry_kind(name)
        if kind is not None:
            array = array.astype(np.float32).reshape(-1, _WIDTH[kind])  # an empty field is (0, 2) or (0, 4)
        elif array.dtype.kind in "iu":
            array = array.astype(np.int64)
        elif array.dtype.kind == "f":
            array = array.astype(np.float32)
        # A copy: an in-place edit of an item must not reach the record every later epoch reads.
        targets[name] = torch.tensor(array)
    targets.update(geometry_of(targets, canvas_size))
    return targets


def geometry_of(
    targets: Mapping[str, Tensor], canvas_size: tuple[int, int]
) -> dict[str, tv_tensors.TVTensor]:
    """The geometric fields of ``targets`` as tv_tensors, the ones given plain wrapped on ``canvas_size``
    (H, W): what a geometric transform moves with the image (``DetectionTransform``)."""
    geometry: dict[str, tv_tensors.TVTensor] = {}
    for name, value in targets.items():
        kind = geometry_kind(name)
        if kind is None:
            if isinstance(value, (tv_tensors.KeyPoints, tv_tensors.BoundingBoxes)):
                # It would pass every transform unmoved, in the wrong place after a resize.
                raise ValueError(
                    f"targets field {name!r} is a {type(value).__name__}, but only fields named points,"
                    " *_points, boxes or *_boxes move with the image: rename it"
                )
            continue
        if isinstance(value, tv_tensors.TVTensor):
            _check_wrapped(name, kind, value, canvas_size)
            geometry[name] = value
            continue
        if value.ndim != 2 or value.shape[1] != _WIDTH[kind]:
            raise ValueError(
                f"targets field {name!r} has shape {tuple(value.shape)}; {kind} are (N, {_WIDTH[kind]})"
            )
        if kind == "points":
            geometry[name] = tv_tensors.KeyPoints(value, canvas_size=canvas_size)
        else:
            geometry[name] = tv_tensors.BoundingBoxes(value, format="XYXY", canvas_size=canvas_size)
    return geometry


def _check_wrapped(
    name: str, kind: GeometryKind, value: tv_tensors.TVTensor, canvas_size: tuple[int, int]
) -> None:
    """A tv_tensor given for a geometric field must be the kind its name says, xyxy, on the image's canvas
    (the resize scales each tv_tensor by its own canvas)."""
    wanted = tv_tensors.KeyPoints if kind == "points" else tv_tensors.BoundingBoxes
    if not isinstance(value, wanted):
        raise ValueError(
            f"targets field {name!r} is a {type(value).__name__}; its name asks for {wanted.__name__}"
        )
    if kind == "boxes" and value.format != tv_tensors.BoundingBoxFormat.XYXY:
        raise ValueError(f"targets field {name!r} is in {value.format.name} format; convert it to XYXY")
    if tuple(value.canvas_size) != tuple(canvas_size):
        raise ValueError(
            f"targets field {name!r} is on a {value.canvas_size} canvas but the image is {canvas_size}:"
            " geometry must be in the pixels of the image it comes with"
        )


def plain_targets(targets: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``targets`` with every tv_tensor as a plain tensor (the batch's and the detector's form)."""
    return {name: value.as_subclass(Tensor) for name, value in targets.items()}
