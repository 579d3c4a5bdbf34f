"""A refinement method written outside wsod plugs in without touching wsod/: its own per-ROI record
fields, its own loss and loss names, trained from a config that names it by import path."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tiny_run import tiny_overrides
from torch import Tensor
from torchvision.ops import box_iou

from wsod.build import build_balancer, build_model, load_detector
from wsod.config_schema import Balance, GradNormSolver, Solver
from wsod.modeling import PseudoLabels, RefinementMethod, build_detector

ROOT = Path(__file__).resolve().parents[2]
NUM_CLASSES = 3


class ClusterMethod(RefinementMethod):
    """A PCL-like method: per present class, its top-scoring proposal is a cluster centre carrying that
    score; an ROI with IoU >= ``fg_iou`` to a centre belongs to the cluster of its best centre (record
    field ``cluster`` (R,), -1 for background), and the image's clusters keep their scores and classes
    (``cluster_scores`` (G,), ``cluster_classes`` (G,), per-image fields).

    Loss per student, per image (divided by R_i, then averaged over images): for each cluster,
    ``-cluster_weight * score * log(mean over its ROIs of p(its class))``; for each background ROI,
    ``-w_r log p_r(background)``. Student 1's loss x ``first_student_loss_weight``. No box loss."""

    def __init__(
        self, *, fg_iou: float = 0.5, first_student_loss_weight: float = 3.0, cluster_weight: float = 1.0
    ) -> None:
        self.fg_iou = fg_iou
        self.first_student_loss_weight = first_student_loss_weight
        self.cluster_weight = cluster_weight

    def loss_names(self, num_students: int) -> tuple[str, ...]:
        return tuple(f"loss_cluster_{k}" for k in range(1, num_students + 1))

    def pseudo_labels(
        self, student: int, proposals: Tensor, scores: Tensor, targets: Mapping[str, Tensor]
    ) -> PseudoLabels:
        num_rois = len(proposals)
        present = (targets["labels"] > 0).nonzero().flatten().to(proposals.device)
        if present.numel() == 0:
            return PseudoLabels(
                torch.zeros(num_rois, dtype=torch.int64),
                proposals.new_zeros(num_rois),
                proposals.new_zeros(num_rois, 4),
                {
                    "cluster": torch.full((num_rois,), -1, dtype=torch.int64),
                    "cluster_scores": scores.new_zeros(0),
                    "cluster_classes": torch.zeros(0, dtype=torch.int64),
                },
            )
        centres = scores[:, present].argmax(dim=0)  # (G,)
        centre_scores = scores[centres, present]
        best_iou, nearest = box_iou(proposals, proposals[centres]).max(dim=1)
        foreground = best_iou >= self.fg_iou
        return PseudoLabels(
            labels=torch.where(foreground, present[nearest] + 1, 0),
            weights=centre_scores[nearest],
            targets=proposals.new_zeros(num_rois, 4),
            extra={
                "cluster": torch.where(foreground, nearest, -1),
                "cluster_scores": centre_scores,
                "cluster_classes": present + 1,
            },
        )

    def losses(
        self,
        student: int,
        logits: Tensor,
        deltas: Tensor,
        records: Sequence[PseudoLabels],
        proposals: Sequence[Tensor],
    ) -> dict[str, Tensor]:
        # Cluster ids are per image: offset each image's by the clusters of the images before it.
        sizes = [len(r.extra["cluster_scores"]) for r in records]
        offsets = [sum(sizes[:i]) for i in range(len(records))]
        cluster = torch.cat(
            [
                torch.where(r.extra["cluster"] >= 0, r.extra["cluster"] + offset, -1)
                for r, offset in zip(records, offsets, strict=True)
            ]
        )
        cluster_scores = torch.cat([r.extra["cluster_scores"] for r in records])
        cluster_classes = torch.cat([r.extra["cluster_classes"] for r in records])
        roi_norm = torch.cat([logits.new_full((len(r),), 1.0 / (len(r) * len(records))) for r in records])
        cluster_norm = torch.cat(
            [
                logits.new_full((size,), 1.0 / (len(r) * len(records)))
                for r, size in zip(records, sizes, strict=True)
            ]
        )
        weights = torch.cat([r.weights for r in records])

        probs = F.softmax(logits, dim=1)
        member = cluster >= 0
        class_probs = probs[member, cluster_classes[cluster[member]]]
        zeros = logits.new_zeros(len(cluster_scores))
        total = zeros.index_add(0, cluster[member], class_probs)
        count = zeros.index_add(0, cluster[member], torch.ones_like(class_probs))
        mean = (total / count.clamp(min=1)).clamp(min=1e-12)
        cluster_loss = torch.where(count > 0, -cluster_scores * mean.log(), 0.0)
        background = -weights[~member] * F.log_softmax(logits[~member], dim=1)[:, 0]
        loss = self.cluster_weight * (cluster_loss * cluster_norm).sum()
        loss = loss + (background * roi_norm[~member]).sum()
        factor = self.first_student_loss_weight if student == 1 else 1.0
        return {f"loss_cluster_{student}": factor * loss}


def _image(seed: int, count: int, labels: list[float]):
    g = torch.Generator().manual_seed(seed)
    xy = torch.randint(0, 30, (count, 2), generator=g).double()
    proposals = torch.cat([xy, xy + torch.randint(6, 30, (count, 2), generator=g).double()], dim=1)
    return proposals, torch.rand(count, NUM_CLASSES, generator=g, dtype=torch.double), torch.tensor(labels)


def test_the_detector_trains_a_plugin_method_with_its_loss_names_and_gradnorm_counts_them():
    torch.manual_seed(0)
    model = build_detector(
        "resnet18", num_classes=NUM_CLASSES, chunk_size=4, width=0.25, method=ClusterMethod()
    )
    assert model.loss_names == ("loss_mil", "loss_cluster_1", "loss_cluster_2", "loss_cluster_3")
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 64, 96, generator=g)
    proposals = [_image(i, n, [0, 0, 0])[0].float() for i, n in enumerate((13, 6))]
    losses = model(images, proposals, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])).losses
    assert tuple(losses) == model.loss_names and all(v.isfinite() for v in losses.values())
    sum(losses.values()).backward()
    assert all(s.cls_score.weight.grad.abs().sum() > 0 for s in model.students)
    assert all(s.bbox_pred.weight.grad is None for s in model.students)  # this method regresses nothing
    # GradNorm over every loss (balance=all), the schema's other defaults.
    solver = OmegaConf.structured(Solver(gradnorm=GradNormSolver(enabled=True, balance=Balance("all"))))
    assert build_balancer(solver, model, torch.device("cpu")).gradnorm.num_losses == 4


def test_a_method_named_by_import_path_trains_from_the_config_and_its_losses_reach_the_metrics(
    tiny_toy_root, tmp_path
):
    run_dir = tmp_path / "cluster"
    overrides = tiny_overrides(
        tiny_toy_root,
        run_dir,
        **{"solver.max_iter": 2, "solver.milestones": "[1]", "random_baseline": "false"},
    )
    overrides += [
        "method.name=test_method_plugin:ClusterMethod",  # pytest puts this file's folder on sys.path
        "~method.p", "~method.tau", "~method.suppress",  # MIST's settings, which this method has not
        "+method.cluster_weight=0.5",  # a key of its own
        "solver.gradnorm.enabled=true",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    from wsod.runs.train import train_from_config

    threads = torch.get_num_threads()
    try:
        summary = train_from_config(cfg)
    finally:
        torch.set_num_threads(threads)
    assert summary["iteration"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert len(train_rows) == 2
    for row in train_rows:
        assert {"loss_mil", "loss_cluster_1", "loss_cluster_2", "loss_cluster_3"} <= set(row)
        assert not any(key.startswith("loss_ref") for key in row)
    model, metadata = load_detector(run_dir / "model_final.pth")
    assert metadata["method"]["name"] == "test_method_plugin:ClusterMethod"
    assert type(model.method).__name__ == "ClusterMethod" and model.method.cluster_weight == 0.5
    rebuilt = build_model(metadata["model"], 5, metadata["method"])
    assert rebuilt.loss_names == model.loss_names
