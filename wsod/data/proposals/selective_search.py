"""Selective Search proposals (OpenCV contrib) over a dataset: parallel, resumable, reference pickle (or
memory-mapped ``.proposals`` store, ``wsod.data.proposals.store``) out.

Work is cut into shards of consecutive images. Each worker process writes a finished shard to
``{output}.parts/shard_XXXXX.pkl`` atomically; a rerun after an interruption skips the shards that
exist and the final file is the merge of all shards in dataset order: a reference pickle, or a proposal
store when ``output`` ends with ``.proposals``. ``{output}.parts/manifest.json``
records the image list and settings, so parts from a different run are refused instead of mixed in.

Each image's size as decoded, ``(H, W)``, is recorded with its boxes, in the shards and the final file
(``ProposalSet.image_size``), so that a dataset refuses proposals made for an image that was replaced or
resized since. Shards written by a wsod that did not record sizes (a run resumed after an upgrade) still
merge: their images' sizes are unknown, never read from the files now, which may have changed since.

Boxes are filtered as at load time (``wsod.data.proposals.sets.filter_proposals``) and keep Selective
Search's ranking order, so a ``top_k`` cap at load time keeps the best-ranked ones. OpenCV returns
``(x, y, w, h)`` rectangles; they become 0-based inclusive ``x1 y1 x2 y2`` (``box_formats``). Scores are
written as zeros: Selective Search ranks boxes but does not score them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import math
import multiprocessing
import os
import pickle
import shutil
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import cv2
import numpy as np

from wsod.atomic import atomic_write
from wsod.data.box_formats import opencv_rects_to_xyxy
from wsod.data.image_io import read_image_rgb
from wsod.data.proposals.io import write_proposal_pickle
from wsod.data.proposals.safe_pickle import load_restricted_pickle
from wsod.data.proposals.sets import ProposalSet, filter_proposals
from wsod.data.proposals.store import is_store_path, write_proposal_store
from wsod.progress import progress_bar

__all__ = ["selective_search", "generate_proposals", "GenerationStats"]

logger = logging.getLogger(__name__)

ImageId = Hashable
MODES = ("fast", "quality", "single")


@functools.cache
def _c_srand() -> Callable[[int], object]:
    """The C library's ``srand``. OpenCV ranks Selective Search regions by hierarchy level times C
    ``rand()``, a generator ``cv2.setRNGSeed`` does not reach; unseeded, the box order (not the set of
    boxes) changes from run to run. Where libc cannot be loaded (Windows) the order stays unseeded."""
    try:
        return ctypes.CDLL(None).srand
    except (OSError, TypeError, AttributeError):
        logger.warning("cannot seed the C library's rand(): Selective Search box order will vary")
        return lambda _: None


def selective_search(image_bgr: np.ndarray, mode: str = "fast", seed: int | None = 0) -> np.ndarray:
    """Selective Search on one uint8 BGR image (H, W, 3) -> boxes (R, 4) float32, ranked, unfiltered.

    ``mode``: "fast" and "quality" are the two strategy sets of the Selective Search paper as OpenCV
    implements them; "single" is one strategy on one colour space (fastest, fewest boxes). ``seed``
    fixes the random part of the ranking (None leaves it as is), so that a run is reproducible.
    """
    if mode not in MODES:
        raise ValueError(f"unknown Selective Search mode {mode!r}; expected one of {MODES}")
    if seed is not None:
        _c_srand()(seed)
    search = cv2.ximgproc.segmentation.createSelectiveSearchSegmentation()
    search.setBaseImage(image_bgr)
    {
        "fast": search.switchToSelectiveSearchFast,
        "quality": search.switchToSelectiveSearchQuality,
        "single": search.switchToSingleStrategy,
    }[mode]()
    return opencv_rects_to_xyxy(search.process())


def _read_bgr(path: str) -> np.ndarray:
    """``path`` as training decodes it (``wsod.data.image_io``: EXIF orientation applied, 16-bit scaled,
    truncated files refused with the same error), uint8 BGR (H, W, 3) for OpenCV. Not ``cv2.imread``:
    its pixels differ from training's, so proposals would be made for another image."""
    return np.ascontiguousarray(read_image_rgb(path)[..., ::-1])


def _init_worker() -> None:
    # One OpenCV thread per worker process: the processes are the parallelism.
    cv2.setNumThreads(1)


class _ShardTask(NamedTuple):
    path: str
    image_ids: list[ImageId]
    image_paths: list[str]
    mode: str
    top_k: int | None
    min_size: float


def _run_shard(task: _ShardTask) -> tuple[int, float]:
    """Selective Search on one shard of images; writes the shard file, a pickle of ``{"ids", "boxes",
    "sizes"}`` (sizes: (H, W) per image as decoded), returns (images, seconds)."""
    start = time.perf_counter()
    boxes, sizes = [], []
    for path in task.image_paths:
        image = _read_bgr(path)
        raw = selective_search(image, task.mode)
        boxes.append(filter_proposals(raw, image.shape[:2], min_size=task.min_size, top_k=task.top_k).numpy())
        sizes.append((int(image.shape[0]), int(image.shape[1])))  # the pixels the boxes were made on
    with atomic_write(task.path) as f:
        shard = {"ids": task.image_ids, "boxes": boxes, "sizes": sizes}
        pickle.dump(shard, f, protocol=pickle.HIGHEST_PROTOCOL)
    return len(task.image_paths), time.perf_counter() - start


@dataclass(frozen=True)
class GenerationStats:
    """What a run did: images processed now (not resumed), their Selective Search seconds (summed over
    workers) and the wall-clock seconds of the run."""

    images: int
    compute_seconds: float
    wall_seconds: float

    @property
    def seconds_per_image(self) -> float:
        """Selective Search time per image on one core."""
        return self.compute_seconds / max(self.images, 1)


def _check_manifest(parts: Path, manifest: dict) -> None:
    path = parts / "manifest.json"
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous != manifest:
            raise ValueError(
                f"{parts} holds partial results of a different run (other images or settings);"
                f" delete it to start over. Stored: {previous}; now: {manifest}"
            )
    else:
        with atomic_write(path, "w") as f:
            json.dump(manifest, f)


def generate_proposals(
    images: Sequence[tuple[ImageId, str]],
    output: str | os.PathLike,
    *,
    workers: int = 2,
    shard_size: int = 25,
    mode: str = "fast",
    top_k: int | None = None,
    min_size: float = 2.0,
    progress: bool = True,
    keep_parts: bool = False,
) -> tuple[ProposalSet, GenerationStats]:
    """Selective Search over ``images`` ((image id, path) pairs) -> reference pickle at ``output``, or a
    float32 proposal store when ``output`` ends with ``.proposals``.

    Resumable (see the module docstring). ``workers`` processes run shards of ``shard_size`` images;
    ``workers`` <= 1 runs them in this process. ``top_k`` caps the boxes kept per image, after the
    ``filter_proposals`` rules with ``min_size``. The parts folder is removed after the merge unless
    ``keep_parts``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown Selective Search mode {mode!r}; expected one of {MODES}")
    output = Path(output)
    parts = output.with_name(output.name + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    ids = [image_id for image_id, _ in images]
    digest = hashlib.sha1(json.dumps([str(i) for i in ids]).encode()).hexdigest()
    settings = {"shard_size": shard_size, "mode": mode, "top_k": top_k, "min_size": min_size}
    _check_manifest(parts, {"images": len(ids), "ids_sha1": digest, **settings})
    num_shards = math.ceil(len(images) / shard_size)
    shard_paths = [parts / f"shard_{number:05d}.pkl" for number in range(num_shards)]
    tasks = []
    for number, path in enumerate(shard_paths):
        if not path.is_file():  # a finished shard of an interrupted run is kept
            chunk = images[number * shard_size : (number + 1) * shard_size]
            ids_, paths_ = [i for i, _ in chunk], [str(p) for _, p in chunk]
            tasks.append(_ShardTask(str(path), ids_, paths_, mode, top_k, min_size))
    done = len(images) - sum(len(t.image_ids) for t in tasks)
    if done:
        logger.info("resuming: %d of %d images already have proposals in %s", done, len(images), parts)

    start = time.perf_counter()
    processed, compute = 0, 0.0
    with progress_bar(
        total=len(images), initial=done, desc="selective search", unit="img", shown=progress
    ) as bar:
        if workers <= 1 or not tasks:
            results, pool = map(_run_shard, tasks), None
        else:
            # spawn: a fresh interpreter per worker, safe whatever threads the parent (torch, OpenCV) runs.
            pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker)
            results = pool.imap_unordered(_run_shard, tasks)
        try:
            for count, seconds in results:
                processed, compute = processed + count, compute + seconds
                bar.update(count)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    wall = time.perf_counter() - start

    merged: dict[str, list] = {"ids": [], "boxes": [], "sizes": []}
    unsized = 0  # images of shards from a wsod that did not record sizes
    for path in shard_paths:
        # Restricted like any proposal pickle: a parts folder can be copied from elsewhere, or written to
        # by another user, and the merge must not run what a planted shard asks for.
        shard = load_restricted_pickle(path)
        merged["ids"] += shard["ids"]
        merged["boxes"] += shard["boxes"]
        if "sizes" not in shard:
            unsized += len(shard["ids"])
        merged["sizes"] += shard.get("sizes", [None] * len(shard["ids"]))
    if unsized:
        logger.warning(
            "%d of %d images come from shards written by an older wsod and have no recorded size: a dataset"
            " cannot check that they are unchanged since; make the proposals again from scratch to record"
            " them",
            unsized,
            len(merged["ids"]),
        )
    proposals = ProposalSet(merged["ids"], merged["boxes"], image_sizes=merged["sizes"], source=str(output))
    if is_store_path(output):
        write_proposal_store(proposals, output)
    else:
        write_proposal_pickle(proposals, output)
    if not keep_parts:
        shutil.rmtree(parts)
    stats = GenerationStats(processed, compute, wall)
    logger.info(
        "wrote %s: %d images, %.1f boxes per image; %.3f s per image per worker, %.1f s wall",
        output,
        len(proposals),
        proposals.num_boxes / max(len(proposals), 1),
        stats.seconds_per_image,
        wall,
    )
    return proposals, stats
