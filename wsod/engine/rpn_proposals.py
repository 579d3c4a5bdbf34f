"""Proposals learned by the second stage (issue 39): the region proposal network of a trained Faster R-CNN
(``FasterRCNNDetector.propose``) run over a dataset's images, its class-agnostic boxes and objectness
scores gathered into a ``ProposalSet`` that ``wsod.data.proposals.save_proposals`` writes as a store
(tools/rpn_proposals.py, ``wsod.runs.rpn_proposals``).

Each image is seen once, at one deterministic view (shorter side ``scale``, no flip), and the boxes come
back in the image's original pixels (wsod's inclusive convention), best first, so that
``data.*.max_proposals`` keeps the best-scored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from wsod.data.loader import collate, model_inputs
from wsod.data.proposals import ProposalSet
from wsod.data.transforms import test_transform
from wsod.engine.inference import MultiViewDataset
from wsod.progress import progress_bar

__all__ = ["rpn_proposal_set"]


@torch.no_grad()
def rpn_proposal_set(
    model: Any,
    dataset: Dataset,
    *,
    scale: int,
    max_size: int | None,
    pre_nms_top_n: int,
    post_nms_top_n: int,
    nms_iou: float,
    device: torch.device | str = "cpu",
    batch_size: int = 1,
    num_workers: int = 0,
    progress: bool = False,
) -> ProposalSet:
    """``model``'s (a ``FasterRCNNDetector``) region proposals for every image of ``dataset`` (built
    without a transform), in dataset order, with their objectness scores and the images' sizes."""
    views = MultiViewDataset(dataset, [test_transform(scale, max_size)])
    loader = DataLoader(views, batch_size=batch_size, num_workers=num_workers, collate_fn=collate)
    ids, boxes, scores, sizes = [], [], [], []
    for batch in progress_bar(loader, shown=progress, desc="rpn proposals"):
        inputs = model_inputs(batch, device)
        found = model.propose(
            inputs["images"], inputs["image_sizes"], inputs["original_sizes"], pre_nms_top_n=pre_nms_top_n,
            post_nms_top_n=post_nms_top_n, nms_iou=nms_iou,
        )  # fmt: skip
        for image_id, original, proposals in zip(
            batch["image_ids"], batch["original_sizes"], found, strict=True
        ):
            ids.append(image_id)
            boxes.append(proposals["boxes"].float().cpu().numpy())
            scores.append(proposals["scores"].float().cpu().numpy())
            sizes.append(tuple(original))
    return ProposalSet(
        ids, boxes, scores, image_sizes=sizes, source=f"{type(model).__name__} region proposals"
    )
