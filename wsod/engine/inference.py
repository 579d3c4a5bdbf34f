"""Prediction over a dataset with optional test-time augmentation, and the random-score baseline.

Test-time augmentation (docs/METHOD.md §5): every image is run at each scale, and flipped too when asked;
per-ROI class probabilities and decoded boxes (in original pixels, flipped ones mirrored back) are
averaged over the passes before the per-class NMS. All passes of an image share its proposals, because
proposals are filtered before any transform. A second-stage detector (``FasterRCNNDetector``) has no
shared proposals: each view's detections (flips mirrored back) are pooled and merged by per-class NMS,
the union-then-NMS rule of detectron2's test-time augmentation for boxes. Which rule applies is the
model's (its ``predict_view`` and ``merge_views``, ``wsod.modeling.protocol``): this module never asks
what the model is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from wsod.data.dataset import WeakDetectionDataset
from wsod.data.loader import collate, ignore_interrupts_in_worker, model_inputs
from wsod.data.transforms import test_transform
from wsod.distributed import gather_to_main, get_rank, get_world_size
from wsod.engine.amp import autocast, resolve_amp
from wsod.modeling.protocol import DetectionSettings, Detector
from wsod.progress import progress_bar

__all__ = ["MultiViewDataset", "tta_views", "predict", "random_detections"]

Detections = list[dict[str, Tensor]]


class MultiViewDataset(Dataset):
    """Each item is the list of one image's views, one per transform (scale x flip)."""

    def __init__(self, dataset: Dataset, transforms: Sequence) -> None:
        if getattr(dataset, "transform", None) is not None:
            raise ValueError("MultiViewDataset applies its own transforms: give it a dataset without one")
        self.dataset, self.transforms = dataset, list(transforms)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> list[dict]:
        item = self.dataset[index]
        return [transform(item) for transform in self.transforms]


def tta_views(scales: Sequence[int], flip: bool) -> list[tuple[int, bool]]:
    """The test-time views as (shorter side, flipped), scale-major with the unflipped view first: the
    reference code's order for ``scales=[800, 480, ..., 1200], flip=True`` (its 800-px test view and
    that view flipped, then each of its augmentation scales and its flip; 14 views)."""
    return [(int(scale), flipped) for scale in scales for flipped in ((False, True) if flip else (False,))]


def _collate_views(items: list[list[dict]]) -> list[dict]:
    """B images x V views -> V batches of B images."""
    return [collate([item[v] for item in items]) for v in range(len(items[0]))]


@torch.no_grad()
def predict(
    model: Detector,
    dataset: Dataset,
    *,
    scales: Sequence[int],
    max_size: int | None,
    flip: bool = False,
    batch_size: int = 1,
    num_workers: int = 2,
    device: torch.device | str = "cpu",
    amp: str | None = None,
    progress: bool = True,
    settings: DetectionSettings | None = None,
) -> Detections | None:
    """Detections for every image of ``dataset`` (built without a transform), in dataset order.

    Each detection dict holds CPU tensors ``boxes`` (D, 4) in original pixels, ``scores`` (D,) and
    ``labels`` (D,) in 0..C-1, and the image's class scores ``image_scores`` (C,) (the MIL teacher's,
    ``WeaklySupervisedDetector.image_scores``; averaged over the views like the per-ROI scores). Under
    torch.distributed each process predicts every world_size-th image; the main process receives the
    whole list and the others ``None`` (scoring runs once, on the main process: COCOeval alone holds the
    whole ground truth in memory). ``settings``: the post-processing (the model's own when None; the
    export passes its cap here instead of changing the model). The model is used through its contract
    alone (``wsod.modeling.protocol.Detector``: ``predict_view`` per view, ``merge_views`` per image).
    """
    device = torch.device(device)
    settings = settings or model.detection_settings
    amp = resolve_amp(amp, device)
    rank, world = get_rank(), get_world_size()
    views = [test_transform(scale, max_size, flip=flipped) for scale, flipped in tta_views(scales, flip)]
    indices = list(range(rank, len(dataset), world))
    loader = DataLoader(
        torch.utils.data.Subset(MultiViewDataset(dataset, views), indices),
        batch_size=batch_size,
        collate_fn=_collate_views,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",  # lets the host-to-GPU copies run asynchronously
        worker_init_fn=ignore_interrupts_in_worker,
    )
    was_training = model.training
    model.eval()
    results: Detections = []
    bar = progress_bar(loader, shown=progress and rank == 0, desc=f"predict ({len(views)} views)")
    for batches in bar:
        views = []
        for batch in batches:  # one test view of every image of the batch
            with autocast(device, amp):
                views.append(model.predict_view(model_inputs(batch, device), batch["flipped"], settings))
        for image_views in zip(*views, strict=True):
            detections = model.merge_views(list(image_views), settings)
            results.append({k: v.cpu() for k, v in detections.items()})
    model.train(was_training)
    if world == 1:
        return results
    gathered = gather_to_main(results)
    if gathered is None:
        return None
    ordered: Detections = [None] * len(dataset)  # type: ignore[list-item]
    for r, part in enumerate(gathered):
        for position, detections in zip(range(r, len(dataset), world), part, strict=True):
            ordered[position] = detections
    return ordered


def random_detections(dataset: WeakDetectionDataset, model: Detector, *, seed: int = 0) -> Detections:
    """The chance level: uniformly random class scores over the same proposals, through the model's own
    post-processing (per-class NMS, top detections), and uniformly random image scores (drawn from a
    generator of their own, so that the detections are those of earlier versions)."""
    generator = torch.Generator().manual_seed(seed)
    image_generator = torch.Generator().manual_seed(seed + 1)
    results: Detections = []
    for index in range(len(dataset)):
        boxes = dataset.proposals_of(index).float()
        scores = torch.rand(len(boxes), dataset.num_classes + 1, generator=generator)
        per_class = boxes[:, None, :].expand(-1, dataset.num_classes + 1, -1)
        detections = model.postprocess(scores, per_class)
        detections["image_scores"] = torch.rand(dataset.num_classes, generator=image_generator)
        results.append(detections)
    return results
