"""What tools/predict.py does, importable: a checkpoint and some images in, detections out as
``predictions.json`` and one PNG per image with its boxes drawn.

Inputs (``input=``): an image file, a folder (its images with the extensions of ``IMAGE_EXTENSIONS``,
sub-folders included) or a glob pattern (``"input=photos/*.jpg"``; ``**`` reaches into sub-folders).
Each image is known by its ``file_name``: its path relative to the folder, to the file's own folder, or
to the pattern's folder part. Images are taken in sorted ``file_name`` order.

Proposals: Selective Search on each image as it is loaded (in the loader workers, OpenCV's "fast"
strategy by default), or looked up by ``file_name`` in a proposal file or store given as ``proposals=``
(``python tools/make_proposals.py folder --root R`` writes one whose ids are the file names under
``R/images``, so ``input=R/images proposals=R/proposals/selective_search.proposals`` reuses it). The
same loading rules as training apply (``wsod.data.proposals.filter_proposals``).

The model is the checkpoint's (``wsod.build.load_detector``) with its test views (the ``data.test``
settings stored in the checkpoint) unless ``scales=`` says otherwise.

Outputs under ``output=``: ``predictions.json``, a list of COCO results entries ``{"image_id",
"file_name", "category_id", "category_name", "bbox": [x, y, w, h] in image pixels, "score"}`` with the
detections scoring at least ``score_threshold`` (``wsod.evaluation.coco.to_named_results``: integer
image ids in sorted file-name order from 1, category id = class index + 1); ``<file_name>.png`` per image
(suffix replaced; sub-folders kept) with those detections drawn and labelled "class score"; ``log.txt``.
An output folder that is not empty is refused (an earlier prediction's PNGs would stand beside the new
json); ``overwrite=true`` deletes the earlier prediction first, and a folder holding files that no
prediction writes (the input images, say) is refused either way.
"""

from __future__ import annotations

import glob
import logging
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from omegaconf import DictConfig
from torch.utils.data import Dataset
from torchvision import tv_tensors

from wsod.build import load_detector, resolve_device
from wsod.cli import setup_logging, write_failure
from wsod.config_checks import PREDICT_RULES, ConfigError, check_config
from wsod.data.dataset import image_size_from_header, load_image
from wsod.data.proposals import ProposalSet, filter_proposals, load_proposals, whole_image_box
from wsod.data.selective_search import selective_search
from wsod.engine.inference import predict
from wsod.engine.visualize import draw_detections
from wsod.evaluation.coco import save_coco_results, to_named_results
from wsod.run import choose_output_dir

__all__ = ["IMAGE_EXTENSIONS", "ImageFiles", "find_images", "predict_from_config"]

logger = logging.getLogger("wsod")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
# What a prediction writes into its output folder besides one PNG per image.
PREDICTION_FILES = ("predictions.json", "log.txt", "error.txt")


def _is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS


def find_images(spec: str | os.PathLike) -> tuple[list[Path], list[str]]:
    """The image files ``input=`` names and their file names (see the module docstring), sorted."""
    spec = str(spec)
    path = Path(spec)
    if glob.has_magic(spec):
        parts = Path(spec).parts
        fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
        base = Path(*parts[:fixed]) if fixed else Path(".")
        files = [Path(p) for p in glob.glob(spec, recursive=True) if _is_image(Path(p))]
    elif path.is_dir():
        base = path
        files = [p for p in path.rglob("*") if _is_image(p)]
    elif path.is_file():
        base, files = path.parent, [path]
    else:
        raise FileNotFoundError(
            f"input={spec}: no such file or folder (give an image, a folder or a glob pattern)"
        )
    if not files:
        raise ValueError(
            f"input={spec}: no image found (read: {' '.join(IMAGE_EXTENSIONS)}, upper or lower case);"
            " give a folder holding images, an image file, or a pattern such as 'photos/*.jpg'"
        )
    names = [Path(os.path.relpath(f, base)).as_posix() for f in files]
    order = sorted(range(len(files)), key=lambda i: names[i])
    return [files[i] for i in order], [names[i] for i in order]


class ImageFiles(Dataset):
    """Images by path, as ``WeakDetectionDataset`` items without labels (what ``predict`` reads): the
    decoded image, its ``file_name`` as the id, and its proposals, from ``proposals`` (looked up by
    file name) or by Selective Search (``mode``) when it is None."""

    transform = None  # predict applies the test views itself

    def __init__(
        self,
        files: Sequence[Path],
        names: Sequence[str],
        num_classes: int,
        proposals: ProposalSet | None = None,
        *,
        mode: str = "fast",
        max_proposals: int | None = None,
        min_size: float = 2.0,
    ) -> None:
        self.files, self.names = [str(f) for f in files], list(names)
        self.num_classes, self.proposals = num_classes, proposals
        self.mode, self.max_proposals, self.min_size = mode, max_proposals, min_size
        if proposals is not None:
            proposals.require(self.names)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = load_image(self.files[index])
        size = (image.shape[-2], image.shape[-1])
        if self.proposals is None:
            bgr = np.ascontiguousarray(image.permute(1, 2, 0).numpy()[..., ::-1])
            raw = selective_search(bgr, self.mode)
        else:
            raw = self.proposals[self.names[index]]
        boxes = filter_proposals(raw, size, min_size=self.min_size, top_k=self.max_proposals)
        if not len(boxes):
            boxes = whole_image_box(size)  # the detector needs one box; the whole image always exists
        return {
            "image": image,
            "image_id": self.names[index],
            "labels": torch.zeros(self.num_classes),
            "proposals": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=size),
            "original_size": size,
        }


def _check_readable(files: Sequence[Path]) -> None:
    """Read every image's header before any work: a file that is no image stops the run at once,
    named, instead of after minutes of Selective Search (and without a worker's traceback)."""
    for path in files:
        try:
            image_size_from_header(path)
        except RuntimeError as error:
            raise RuntimeError(
                f"cannot read image {path} ({error.__cause__ or error}): replace it with a readable image or"
                " leave it out of input="
            ) from error


def _is_prediction_output(path: Path) -> bool:
    return path.name in PREDICTION_FILES or path.suffix.lower() == ".png"


def _clear_output(out_dir: Path, overwrite: bool, input_spec: str) -> int:
    """Refuse a non-empty output folder (an earlier prediction's PNGs would stand beside the new
    predictions.json, for images this run may not have); with ``overwrite`` delete what a prediction
    writes there first and return how many files that was. A folder holding anything else (the input
    images themselves, say) is never emptied, overwrite or not: deleting a user's files is not ours."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return 0
    own = [p for p in out_dir.rglob("*") if p.is_file()]
    inputs = find_images(input_spec)[0]
    inside = {os.path.realpath(p) for p in inputs} & {os.path.realpath(p) for p in own}
    foreign = [p for p in own if not _is_prediction_output(p)]
    if inside or foreign:
        example = next(iter(inside), None) or foreign[0]
        raise ConfigError(
            f"output={out_dir} holds files that tools/predict.py did not write (e.g. {example}); give an"
            " empty or new folder as output="
        )
    if not overwrite:
        raise ConfigError(
            f"output={out_dir} already holds a prediction ({len(own)} files): overwrite=true replaces it,"
            " another output= keeps it"
        )
    for path in own:
        path.unlink()
    for folder in sorted((p for p in out_dir.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):  # sub-folders of PNGs, deepest first
            folder.rmdir()
    return len(own)


def _views(cfg: DictConfig, metadata: dict[str, Any]) -> tuple[list[int], int | None, bool, int | None]:
    """(scales, max_size, flip, max_proposals): ``cfg``'s where given, else the checkpoint's test settings."""
    test = ((metadata.get("config") or {}).get("data") or {}).get("test") or {}
    if cfg.scales is None and "scales" not in test:
        raise ValueError(f"{cfg.checkpoint} does not record its test views: give them, e.g. scales=[600]")
    scales = list(cfg.scales) if cfg.scales is not None else list(test["scales"])
    max_proposals = cfg.max_proposals if cfg.max_proposals is not None else test.get("max_proposals")
    return scales, test.get("max_size"), bool(test.get("flip", False)), max_proposals


def predict_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Predict ``cfg.input`` with ``cfg.checkpoint`` (configs/predict.yaml); returns a summary."""
    check_config(cfg, PREDICT_RULES)
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir = choose_output_dir(cfg.output, "runs/predict")
    deleted = _clear_output(out_dir, cfg.overwrite, cfg.input)
    out_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(out_dir, True)
    if deleted:
        logger.info("overwrite=true: deleted the %d files of the earlier prediction in %s", deleted, out_dir)
    try:
        return _predict_in(out_dir, cfg, device)
    except Exception as error:
        write_failure(out_dir, error)
        raise


def _predict_in(out_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    files, names = find_images(cfg.input)
    _check_readable(files)
    model, metadata = load_detector(cfg.checkpoint, device)
    classes = list(metadata["classes"])
    scales, max_size, flip, max_proposals = _views(cfg, metadata)
    proposals = None if cfg.proposals is None else load_proposals(cfg.proposals)
    source = f"proposals {cfg.proposals}" if cfg.proposals else f"Selective Search ({cfg.selective_search})"
    logger.info(
        "predicting %d images of %s with %s (%d classes), views %s%s, %s",
        len(files), cfg.input, cfg.checkpoint, len(classes), scales, " + flips" if flip else "", source,
    )  # fmt: skip
    images = ImageFiles(
        files, names, len(classes), proposals, mode=cfg.selective_search, max_proposals=max_proposals
    )
    with torch.no_grad():
        detections = predict(
            model, images, scales=scales, max_size=max_size, flip=flip, num_workers=cfg.num_workers,
            device=device, progress=cfg.progress,
        )  # fmt: skip
    kept = []
    for det in detections:
        keep = det["scores"] >= cfg.score_threshold
        kept.append({key: det[key][keep] for key in ("boxes", "scores", "labels")})
    results = to_named_results(kept, names, classes)
    save_coco_results(results, out_dir / "predictions.json")
    for path, name, det in zip(files, _png_names(names), kept, strict=True):
        drawn = draw_detections(load_image(path), det, classes)
        target = out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        torchvision.io.write_png(drawn, str(target))
    logger.info(
        "%d detections scoring >= %g in %d images: %s and one PNG per image in %s",
        len(results), cfg.score_threshold, len(files), out_dir / "predictions.json", out_dir,
    )  # fmt: skip
    return {"images": len(files), "detections": len(results), "output": str(out_dir)}


def _png_names(names: Sequence[str]) -> list[str]:
    """``a/b.jpg`` -> ``a/b.png``; where two inputs would share a name (``b.jpg``, ``b.png``), both
    keep their suffix (``b.jpg.png``)."""
    plain = [str(Path(n).with_suffix(".png")) for n in names]
    counts = Counter(plain)
    return [p if counts[p] == 1 else f"{n}.png" for p, n in zip(plain, names, strict=True)]
