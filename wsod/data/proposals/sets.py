"""A set of proposals: many images' boxes with O(1) lookup by image id, the errors of a lookup, and the
loading rules that filter one image's boxes (docs/METHOD.md §9).

Boxes are float32 ``(R, 4)`` ``x1 y1 x2 y2``, 0-based inclusive pixels of the image on disk (see
``wsod.data.box_formats``). Files of proposals are read and written by ``wsod.data.proposals.io``; a
memory-mapped store (``wsod.data.proposals.store``) is a ``ProposalSet`` whose boxes stay on disk.

Image sizes: a ``ProposalSet`` may record, per image, the ``(H, W)`` of the image its proposals were made
on (``image_size``). Selective Search generation (``wsod.data.proposals.selective_search``) records them;
reference pickles and .mat releases do not (None). ``WeakDetectionDataset`` compares them with its
records' sizes and refuses a mismatch (``ProposalSizeError``, which says to remake the proposals): an
image replaced or resized after its proposals were made would otherwise have them clipped, silently, to
another picture.

Image ids are matched after ``proposal_key``: a numeric id, or a string of digits and underscores, is
compared as an integer. Reference VOC pickles store ``000005`` as ``5`` and ``2008_000008`` as
``2008000008``; with this rule the VOC ids from ImageSets files find them, and so do COCO's integer ids.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor
from torchvision.ops import clip_boxes_to_image

__all__ = [
    "MissingProposalsError",
    "ProposalSizeError",
    "ProposalSet",
    "proposal_key",
    "filter_proposals",
    "union_proposals",
    "whole_image_box",
]

ImageId = Hashable
INT32_MAX = int(np.iinfo(np.int32).max)  # sizes are written as int32
REMAKE = (
    "make them again for the current images with python tools/make_proposals.py (the voc, coco, folder or"
    " toy command that made them)"
)


class MissingProposalsError(LookupError):
    """An image id is not in the proposal file (the message names both)."""


class ProposalSizeError(ValueError):
    """Proposals made for an image of another size than the dataset's: the image was replaced or resized
    after they were made. ``problem`` names the image, both sizes and the proposal file; ``fix`` is the
    command that remakes them (a dataset that knows its exact command, ``FolderDataset``, gives it)."""

    def __init__(self, problem: str, fix: str = REMAKE) -> None:
        super().__init__(problem, fix)  # both in args: the error pickles and unpickles whole
        self.problem, self.fix = problem, fix

    def __str__(self) -> str:
        return f"{self.problem}; {self.fix}"


def proposal_key(image_id: ImageId) -> ImageId:
    """The key under which an image id is looked up: numeric ids and digit strings become ``int``."""
    if isinstance(image_id, np.generic):
        image_id = image_id.item()
    if isinstance(image_id, bytes):
        image_id = image_id.decode()
    if isinstance(image_id, str):
        digits = image_id.strip().replace("_", "")
        return int(digits) if digits.isdigit() else image_id.strip()
    return image_id


def _at(location: str | None, index: int) -> str:
    """Where in a file an entry is, for a message: `` (field 'boxes', entry 3)``, or nothing."""
    return "" if location is None else f" ({location} {index})"


def _as_boxes(
    boxes: object, image_id: ImageId, source: str, location: str | None = None, index: int = 0
) -> np.ndarray:
    """Check one image's boxes: (R, 4), a single (4,) box, or empty; anything else (e.g. (R, 5) with a
    score column) is an error rather than silently reshaped into wrong boxes. ``location`` and ``index``
    say where the entry is in the file (e.g. "field 'boxes', entry", 3), for the message."""
    try:
        boxes = np.asarray(boxes, dtype=np.float32)
    except (TypeError, ValueError) as e:  # strings, ragged lists, objects
        raise ValueError(
            f"{source}: image {image_id!r} has boxes that are not numbers{_at(location, index)}: {e};"
            " expected (R, 4) x1 y1 x2 y2"
        ) from None
    if boxes.size == 0 or boxes.shape == (4,):
        return boxes.reshape(-1, 4)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise ValueError(
            f"{source}: image {image_id!r} has boxes of shape {boxes.shape}{_at(location, index)};"
            " expected (R, 4) x1 y1 x2 y2"
        )
    return boxes


def _as_scores(
    scores: object,
    num_boxes: int,
    image_id: ImageId,
    source: str,
    location: str | None = None,
    index: int = 0,
) -> np.ndarray:
    """Check one image's scores: one number per box -> float32 (R,)."""
    try:
        scores = np.asarray(scores, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{source}: image {image_id!r} has scores that are not numbers{_at(location, index)}: {e}"
        ) from None
    if len(scores) != num_boxes:
        raise ValueError(
            f"{source}: image {image_id!r} has {len(scores)} scores for {num_boxes} boxes"
            f"{_at(location, index)}; expected one score per box"
        )
    return scores


def _as_sizes(sizes: object, count: int, id_of: Callable[[int], ImageId], where: str) -> np.ndarray | None:
    """Check per-image sizes: ``count`` (H, W) pairs (None for an unknown one), or an ``(count, 2)``
    integer array with ``(0, 0)`` for an unknown one -> that array, or None when no size is known.
    ``id_of(i)`` is image i's id and ``where`` the file (and field) the sizes came from, for messages."""
    if sizes is None:
        return None
    if not isinstance(sizes, np.ndarray):
        try:
            sizes = [(0, 0) if s is None else s for s in sizes]
        except TypeError:
            raise ValueError(
                f"{where} is {_a(sizes)}; expected {count} (H, W) image sizes, (0, 0) where unknown"
            ) from None
    try:
        array = np.asarray(sizes)
    except ValueError as e:  # ragged
        raise ValueError(f"{where}: {e}; expected {count} (H, W) image sizes, (0, 0) where unknown") from None
    if array.size == 0 and count == 0:
        return None
    if array.shape != (count, 2):
        raise ValueError(
            f"{where} of shape {array.shape}; expected ({count}, 2): the (H, W) of each image, (0, 0)"
            " where unknown"
        )
    if array.dtype.kind not in "iu":
        raise ValueError(f"{where}: {array.dtype} values; expected integers, the (H, W) of each image")
    for bad, what in (
        (np.any(array < 0, axis=1), "negative"),
        ((array[:, 0] == 0) != (array[:, 1] == 0), "half unknown"),
        (np.any(array > INT32_MAX, axis=1), "beyond int32"),
    ):
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"{where}: image {id_of(i)!r} has size ({int(array[i, 0])}, {int(array[i, 1])}) ({what});"
                " expected a positive (H, W), or (0, 0) where unknown"
            )
    return array if array.any() else None


def _a(value: object) -> str:
    """The type of ``value`` with its article, for messages: "an int", "a list"."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class ProposalSet:
    """The proposals of many images with O(1) lookup by image id.

    All boxes live in one float32 ``(sum R_i, 4)`` array with per-image offsets: one buffer instead of
    thousands of small arrays, so that forked data-loader workers share it without copying.

    Args:
        image_ids: N image ids, in file order.
        boxes: N float arrays (R_i, 4), 0-based inclusive ``x1 y1 x2 y2``.
        scores: optional N arrays (R_i,): ``filter_proposals``'s cap keeps the best-scored boxes.
        image_sizes: optional (H, W) of the image each image's proposals were made on: N pairs (None
            for an unknown one) or an (N, 2) integer array ((0, 0) for an unknown one); see the module
            docstring.
        source: where the proposals came from (a file name), quoted in error messages.
    """

    def __init__(
        self,
        image_ids: Sequence[ImageId],
        boxes: Sequence[np.ndarray],
        scores: Sequence[np.ndarray] | None = None,
        *,
        image_sizes: Sequence[tuple[int, int] | None] | np.ndarray | None = None,
        source: str = "<memory>",
    ) -> None:
        if len(image_ids) != len(boxes) or (scores is not None and len(scores) != len(boxes)):
            raise ValueError(
                f"{source}: {len(image_ids)} image ids, {len(boxes)} box arrays and"
                f" {None if scores is None else len(scores)} score arrays; they must match"
            )
        arrays = [_as_boxes(b, image_id, source) for b, image_id in zip(boxes, image_ids, strict=True)]
        counts = np.array([len(b) for b in arrays], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        flat = np.concatenate(arrays) if arrays else np.zeros((0, 4), np.float32)
        flat_scores = None
        if scores is not None:
            score_arrays = [
                _as_scores(s, n, image_id, source)
                for s, n, image_id in zip(scores, counts, image_ids, strict=True)
            ]
            flat_scores = np.concatenate(score_arrays) if score_arrays else np.zeros(0, np.float32)
        self._set_flat(image_ids, flat, offsets, flat_scores, source, image_sizes)

    @classmethod
    def from_flat(
        cls,
        image_ids: Sequence[ImageId],
        boxes: np.ndarray,
        offsets: np.ndarray,
        scores: np.ndarray | None = None,
        *,
        image_sizes: Sequence[tuple[int, int] | None] | np.ndarray | None = None,
        source: str = "<memory>",
    ) -> ProposalSet:
        """The proposals of N images from one float32 ``(M, 4)`` box array, without copying it: image
        ``i`` owns rows ``offsets[i]:offsets[i + 1]`` (``offsets``: N + 1 non-decreasing, 0 to M).
        ``image_sizes`` as for the constructor."""
        boxes, offsets = np.asarray(boxes), np.asarray(offsets, dtype=np.int64)
        if boxes.dtype != np.float32 or boxes.ndim != 2 or boxes.shape[1] != 4:
            raise ValueError(f"{source}: boxes must be float32 (M, 4), got {boxes.dtype} {boxes.shape}")
        if (
            offsets.shape != (len(image_ids) + 1,)
            or offsets[0] != 0
            or offsets[-1] != len(boxes)
            or np.any(np.diff(offsets) < 0)
        ):
            raise ValueError(
                f"{source}: offsets must be {len(image_ids) + 1} non-decreasing values from 0 to {len(boxes)}"
            )
        if scores is not None and np.shape(scores) != (len(boxes),):
            raise ValueError(f"{source}: scores of shape {np.shape(scores)}; expected ({len(boxes)},)")
        proposals = cls.__new__(cls)
        proposals._set_flat(image_ids, boxes, offsets, scores, source, image_sizes)
        return proposals

    def _set_flat(
        self,
        image_ids: Sequence[ImageId],
        boxes: np.ndarray,
        offsets: np.ndarray,
        scores: np.ndarray | None,
        source: str,
        image_sizes: Sequence[tuple[int, int] | None] | np.ndarray | None = None,
    ) -> None:
        self.source = str(source)
        self.image_ids = list(image_ids)
        self._boxes, self._offsets, self._scores = boxes, offsets, scores
        # (N, 2) (H, W), (0, 0) where unknown; None when no size is known (ProposalStore sets it too).
        self._sizes = _as_sizes(
            image_sizes, len(self.image_ids), self.image_ids.__getitem__, f"{source}: image_sizes"
        )
        self._index: dict[ImageId, int] = {}
        for i, image_id in enumerate(self.image_ids):
            key = proposal_key(image_id)
            if key in self._index:
                raise ValueError(f"{source}: image id {image_id!r} appears more than once")
            self._index[key] = i

    def __len__(self) -> int:
        return len(self.image_ids)

    def __contains__(self, image_id: ImageId) -> bool:
        return proposal_key(image_id) in self._index

    def _position(self, image_id: ImageId) -> int:
        try:
            return self._index[proposal_key(image_id)]
        except KeyError:
            raise MissingProposalsError(
                f"image id {image_id!r} is not in the proposal file {self.source} ({len(self)} images)"
            ) from None

    def __getitem__(self, image_id: ImageId) -> np.ndarray:
        """Boxes (R, 4) float32 of one image (a read-only view; filtering makes a new array)."""
        i = self._position(image_id)
        view = self._boxes[self._offsets[i] : self._offsets[i + 1]]
        view.flags.writeable = False
        return view

    def scores(self, image_id: ImageId) -> np.ndarray | None:
        """Scores (R,) of one image, or None when the source had none."""
        if self._scores is None:
            return None
        i = self._position(image_id)
        return self._scores[self._offsets[i] : self._offsets[i + 1]]

    @property
    def image_sizes(self) -> np.ndarray | None:
        """(N, 2) integer (H, W) of the image each image's proposals were made on, in file order,
        ``(0, 0)`` where unknown; None when the source records no size (reference pickles, .mat)."""
        return self._sizes

    def image_size(self, image_id: ImageId) -> tuple[int, int] | None:
        """(H, W) of the image this image's proposals were made on, or None when not recorded."""
        if self._sizes is None:
            return None
        height, width = (int(v) for v in self._sizes[self._position(image_id)])
        return None if height == 0 else (height, width)

    def check_image_sizes(self, image_ids: Sequence[ImageId], sizes: Sequence[tuple[int, int]]) -> None:
        """Raise ``ProposalSizeError`` when an image's recorded size differs from its size in ``sizes``
        ((H, W) per id, e.g. the dataset's records), naming the first such image, both sizes, the count
        and the file. Images without a recorded size pass. One dict lookup per id and array compares:
        a fraction of a second for COCO's 120k images, no file is read."""
        if self._sizes is None or not len(image_ids):
            return
        positions = np.fromiter((self._position(i) for i in image_ids), np.int64, len(image_ids))
        made = np.asarray(self._sizes[positions], dtype=np.int64)
        now = np.asarray(sizes, dtype=np.int64).reshape(len(image_ids), 2)
        differ = (made[:, 0] > 0) & np.any(made != now, axis=1)
        if not differ.any():
            return
        first = int(np.argmax(differ))
        raise ProposalSizeError(
            f"{int(differ.sum())} of {len(image_ids)} images differ in size from the images the proposals"
            f" in {self.source} were made for; the first is image {image_ids[first]!r}: (H, W)"
            f" ({int(now[first, 0])}, {int(now[first, 1])}) in the dataset, ({int(made[first, 0])},"
            f" {int(made[first, 1])}) when its proposals were made (it was replaced or resized since, and"
            " they belong to the old picture)"
        )

    def items(self) -> Iterator[tuple[ImageId, np.ndarray]]:
        """(image id, boxes (R, 4)) in file order."""
        for image_id in self.image_ids:
            yield image_id, self[image_id]

    def missing(self, image_ids: Sequence[ImageId]) -> list[ImageId]:
        """The ids among ``image_ids`` that have no entry here."""
        return [i for i in image_ids if i not in self]

    def require(self, image_ids: Sequence[ImageId]) -> None:
        """Raise ``MissingProposalsError`` naming the first missing id, the count and the file."""
        missing = self.missing(image_ids)
        if missing:
            raise MissingProposalsError(
                f"{len(missing)} of {len(image_ids)} images have no proposals in {self.source}; the first"
                f" is image id {missing[0]!r}. Was the file made for another image set?"
            )

    @property
    def num_boxes(self) -> int:
        return len(self._boxes)


# ----------------------------------------------------------------------------------------------------
# Filtering


def filter_proposals(
    boxes: np.ndarray | Tensor,
    image_size: tuple[int, int],
    *,
    min_size: float = 2.0,
    top_k: int | None = None,
    scores: np.ndarray | Tensor | None = None,
) -> Tensor:
    """docs/METHOD.md §9 loading rules on one image's boxes (R, 4) -> float32 (R', 4), R' <= R.

    In order: clip to the image (0-based inclusive, so to ``[0, W - 1] x [0, H - 1]``); drop boxes whose
    inclusive pixel width ``x2 - x1 + 1`` or height ``y2 - y1 + 1`` is below ``min_size`` (the reference
    code's rule: with the default 2, a box spanning pixels 5 and 6, ``[5, ., 6, .]``, is kept) and boxes
    with ``x2 <= x1`` or ``y2 <= y1`` whatever ``min_size`` (they have no area in the continuous
    convention of IoU and box encoding; the reference's clipping drops them too); with ``top_k`` and
    ``scores`` (R,), order the boxes by decreasing score (a stable sort: equal scores, all-zero ones
    included, keep file order); drop exact duplicates, keeping the first; keep the first ``top_k``
    (without scores, file order is the proposal method's ranking). Deduplication comes after clipping
    because clipping turns boxes that overhang an edge into duplicates, and after the ordering so that
    a duplicate keeps its best-scored copy's place.
    """
    height, width = image_size
    boxes = torch.tensor(np.asarray(boxes, dtype=np.float32)).reshape(-1, 4)
    # The last pixel of an image of width W is W - 1 in the inclusive convention.
    boxes = clip_boxes_to_image(boxes, (height - 1, width - 1))
    widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    keep = (widths + 1 >= min_size) & (heights + 1 >= min_size) & (widths > 0) & (heights > 0)
    boxes = boxes[keep]
    if top_k is not None and scores is not None:
        ranked = torch.tensor(np.asarray(scores, dtype=np.float32)).reshape(-1)
        if len(ranked) != len(keep):
            raise ValueError(f"filter_proposals: {len(ranked)} scores for {len(keep)} boxes")
        boxes = boxes[torch.argsort(ranked[keep], descending=True, stable=True)]
    if len(boxes):
        _, first = np.unique(boxes.numpy(), axis=0, return_index=True)
        boxes = boxes[torch.from_numpy(np.sort(first))]
    if top_k is not None:
        boxes = boxes[:top_k]
    return boxes


def whole_image_box(image_size: tuple[int, int]) -> Tensor:
    """The box (1, 4) covering the whole image: the stand-in for an image left without proposals."""
    height, width = image_size
    return torch.tensor([[0.0, 0.0, width - 1.0, height - 1.0]])


def union_proposals(sets: Sequence[ProposalSet]) -> ProposalSet:
    """The union of proposal sets, image by image (matched by ``proposal_key``, so ``"000005"`` and ``5``
    are one image, named as the first set names it): each image's boxes of every set, in the sets' order.
    Scores are kept only when every set has them (a set without scores, or with the all-zero ones the
    pickle writer puts in their place, would have none to rank by); a size recorded by two sets must
    agree. Images in only some of the sets keep the boxes they have."""
    if not sets:
        raise ValueError("union_proposals needs at least one proposal set")
    names: dict[ImageId, ImageId] = {}
    boxes: dict[ImageId, list[np.ndarray]] = {}
    scores: dict[ImageId, list[np.ndarray]] = {}
    sizes: dict[ImageId, tuple[int, int]] = {}
    scored = all(s._scores is not None and bool(np.any(np.asarray(s._scores) != 0)) for s in sets)
    for proposals in sets:
        for image_id, image_boxes in proposals.items():
            key = proposal_key(image_id)
            names.setdefault(key, image_id)
            boxes.setdefault(key, []).append(np.asarray(image_boxes, dtype=np.float32))
            if scored:
                scores.setdefault(key, []).append(np.asarray(proposals.scores(image_id), dtype=np.float32))
            size = proposals.image_size(image_id)
            if size is not None and sizes.setdefault(key, size) != size:
                raise ValueError(
                    f"image {image_id!r} is {sizes[key]} in one proposal set and {size} in"
                    f" {proposals.source}: they were made on different images"
                )
    keys = list(names)
    return ProposalSet(
        [names[k] for k in keys],
        [np.concatenate(boxes[k]) for k in keys],
        [np.concatenate(scores[k]) for k in keys] if scored else None,
        image_sizes=[sizes.get(k) for k in keys],
        source=" + ".join(s.source for s in sets),
    )
