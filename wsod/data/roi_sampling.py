"""ROI sampling of training images with points or scribbles, as a step of the training transform.

The reference code (NVlabs/wetectron ``roi_sampler.py``, UFO2) trains an image that has points or
scribbles on a sample of its proposals, drawn before ROI pooling: at most 1,024, at most a quarter of
them positive (holding a point or covering a scribble). Sampling the item's proposals after the
geometric transform is the same (the proposals reach nothing but the pooling) and draws from the item's
seeded random stream (``WeakDetectionDataset``), so a resumed run samples the same ROIs. The rule itself
is ``wsod.modeling.partial_labels.sample_training_rois``; images without points or scribbles pass
unchanged and draw nothing. The kept proposals keep their ``proposal_ids`` (``DetectionTransform``), so
a method can still tell which ROI of the dataset's list each one is, and match ROIs across views (each
view samples its own).
"""

from __future__ import annotations

from wsod.modeling.partial_labels import sample_training_rois

__all__ = ["PartialLabelRoiSampler"]


class PartialLabelRoiSampler:
    """Item -> item with the proposals of an image with points or scribbles sampled (module docstring),
    their ``proposal_ids`` sampled alike. Runs after ``DetectionTransform``: proposals and targets in the
    same (resized, flipped) pixels. The input item is left as it was (``MultiViewTransform`` needs it)."""

    def __init__(self, rois_per_image: int = 1024, positive_fraction: float = 0.25) -> None:
        if rois_per_image < 1:
            raise ValueError(f"rois_per_image must be >= 1, got {rois_per_image}")
        if not 0.0 < positive_fraction <= 1.0:
            raise ValueError(f"positive_fraction must be in (0, 1], got {positive_fraction}")
        self.rois_per_image, self.positive_fraction = int(rois_per_image), float(positive_fraction)

    def __call__(self, item: dict) -> dict:
        targets = item.get("targets")
        if targets is None:
            return item
        kept = sample_training_rois(item["proposals"], targets, self.rois_per_image, self.positive_fraction)
        if kept is None:
            return item
        out = {**item, "proposals": item["proposals"][kept]}
        if item.get("proposal_ids") is not None:
            out["proposal_ids"] = item["proposal_ids"][kept]
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rois_per_image={self.rois_per_image},"
            f" positive_fraction={self.positive_fraction})"
        )
