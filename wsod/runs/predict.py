"""What tools/predict.py does, importable, in the prologue every entry point shares
(``wsod.runs.prologue.run_in_directory``).

``predict_from_config`` (tools/predict.py, configs/predict.yaml): a checkpoint and some images in
(``input=``: an image file, a folder or a glob pattern, ``wsod.data.images``), detections out. Proposals
come from Selective Search on each image as it is loaded (OpenCV's "fast" strategy by default), or are
looked up by ``file_name`` in a proposal file or store given as ``proposals=`` (``python
tools/make_proposals.py folder --root R`` writes one whose ids are the file names under ``R/images``, so
``input=R/images proposals=R/proposals/selective_search.proposals`` reuses it). The model is the
checkpoint's (``wsod.build.load_detector``) with its test views (the ``data.test`` settings stored in the
checkpoint) unless ``scales=`` says otherwise. Outputs under ``output=``: ``predictions.json``, a list of
COCO results entries ``{"image_id", "file_name", "category_id", "category_name", "bbox": [x, y, w, h] in
image pixels, "score"}`` with the detections scoring at least ``score_threshold``
(``wsod.evaluation.coco.to_named_results``: integer image ids in sorted file-name order from 1, category
id = class index + 1); ``<file_name>.png`` per image (suffix replaced; sub-folders kept) with those
detections drawn and labelled "class score"; ``log.txt``. An output folder that is not empty is refused
(an earlier prediction's PNGs would stand beside the new json); ``overwrite=true`` deletes the earlier
prediction first, and a folder holding files that no prediction writes (the input images, say) is
refused either way.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from wsod.build import load_detector
from wsod.config_checks import PREDICT_RULES, ConfigError, check_config
from wsod.data.dataset import load_image
from wsod.data.images import ImageFiles, check_readable, find_images
from wsod.data.proposals import load_proposals
from wsod.directory_lock import LOCK_FILE
from wsod.engine.inference import predict
from wsod.engine.visualize import draw_detections, save_png
from wsod.evaluation.coco import save_coco_results, to_named_results
from wsod.runs.prologue import run_in_directory

__all__ = ["predict_from_config", "PREDICTION_FILES"]

logger = logging.getLogger("wsod")

# What a prediction writes into its output folder besides one PNG per image.
PREDICTION_FILES = ("predictions.json", "log.txt", "error.txt")


def predict_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Predict ``cfg.input`` with ``cfg.checkpoint`` (configs/predict.yaml; the module docstring says
    what is written); returns a summary. One process: no process group is joined."""
    check_config(cfg, PREDICT_RULES)
    return run_in_directory(
        cfg, cfg.output, "runs/predict", _predict_in, claim=_clear_output, option="output"
    )


def _clear_output(out_dir: Path, cfg: DictConfig) -> str | None:
    """Refuse a non-empty output folder (an earlier prediction's PNGs would stand beside the new
    predictions.json, for images this run may not have); with ``overwrite`` delete what a prediction
    writes there first, and say so. A folder holding anything else (the input images themselves, say)
    is never emptied, overwrite or not: deleting a user's files is not ours."""
    own = [p for p in out_dir.rglob("*") if p.is_file() and p != out_dir / LOCK_FILE]  # the lock is ours
    if not own:
        return None
    inputs = find_images(cfg.input)[0]
    inside = {os.path.realpath(p) for p in inputs} & {os.path.realpath(p) for p in own}
    foreign = [p for p in own if not _is_prediction_output(p)]
    if inside or foreign:
        example = next(iter(inside), None) or foreign[0]
        raise ConfigError(
            f"output={out_dir} holds files that tools/predict.py did not write (e.g. {example}); give an"
            " empty or new folder as output="
        )
    if not cfg.overwrite:
        raise ConfigError(
            f"output={out_dir} already holds a prediction ({len(own)} files): overwrite=true replaces it,"
            " another output= keeps it"
        )
    for path in own:
        path.unlink()
    for folder in sorted((p for p in out_dir.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):  # sub-folders of PNGs, deepest first
            folder.rmdir()
    return f"overwrite=true: deleted the {len(own)} files of the earlier prediction in {out_dir}"


def _is_prediction_output(path: Path) -> bool:
    return path.name in PREDICTION_FILES or path.suffix.lower() == ".png"


def _predict_in(out_dir: Path, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    files, names = find_images(cfg.input)
    check_readable(files)
    model, metadata = load_detector(cfg.checkpoint, device, trust=cfg.trust_checkpoint)
    classes = list(metadata["classes"])
    scales, max_size, flip, max_proposals = _views(cfg, metadata)
    proposes_itself = model.makes_proposals  # a second stage: its RPN makes the boxes
    proposals = None if cfg.proposals is None or proposes_itself else load_proposals(cfg.proposals)
    mode = None if proposes_itself else cfg.selective_search
    source = f"proposals {cfg.proposals}" if cfg.proposals else f"Selective Search ({cfg.selective_search})"
    if proposes_itself:
        source = "its own region proposals (a second-stage detector)"
    logger.info(
        "predicting %d images of %s with %s (%d classes), views %s%s, %s",
        len(files), cfg.input, cfg.checkpoint, len(classes), scales, " + flips" if flip else "", source,
    )  # fmt: skip
    images = ImageFiles(files, names, len(classes), proposals, mode=mode, max_proposals=max_proposals)
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
        save_png(drawn, target)
    logger.info(
        "%d detections scoring >= %g in %d images: %s and one PNG per image in %s",
        len(results), cfg.score_threshold, len(files), out_dir / "predictions.json", out_dir,
    )  # fmt: skip
    return {"images": len(files), "detections": len(results), "output": str(out_dir)}


def _views(cfg: DictConfig, metadata: dict[str, Any]) -> tuple[list[int], int | None, bool, int | None]:
    """(scales, max_size, flip, max_proposals): ``cfg``'s where given, else the checkpoint's test settings."""
    test = ((metadata.get("config") or {}).get("data") or {}).get("test") or {}
    if cfg.scales is None and "scales" not in test:
        raise ValueError(f"{cfg.checkpoint} does not record its test views: give them, e.g. scales=[600]")
    scales = list(cfg.scales) if cfg.scales is not None else list(test["scales"])
    max_proposals = cfg.max_proposals if cfg.max_proposals is not None else test.get("max_proposals")
    return scales, test.get("max_size"), bool(test.get("flip", False)), max_proposals


def _png_names(names: Sequence[str]) -> list[str]:
    """``a/b.jpg`` -> ``a/b.png``; where two inputs would share a name (``b.jpg``, ``b.png``), both
    keep their suffix (``b.jpg.png``)."""
    plain = [str(Path(n).with_suffix(".png")) for n in names]
    counts = Counter(plain)
    return [p if counts[p] == 1 else f"{n}.png" for p, n in zip(plain, names, strict=True)]
