"""PCL, proposal cluster learning (Tang et al., TPAMI 2018), and the plain WSDDN teacher, as refinement
methods (``wsod.modeling.method``).

PCL's rules are those of the authors' code, ppengtang/pcl.pytorch branch 0.4.0 (``lib/model/pcl/pcl.py``,
``lib/model/pcl_losses/``, settings in ``lib/core/config.py``); docs/METHOD.md §4 lists where wsod
differs. Per image and per student k, from the source scores S (R, C) (the teacher's for k = 1, student
k-1's softmax after), clipped to [``score_clip``, 1 - ``score_clip``]:

1. Top group. For each class c of the image's labels, in ascending order: the scores S[:, c] of the
   proposals still in the pool are split into ``kmeans_groups`` groups by k-means on the 1-D scores,
   and the group of the highest centre is kept. wsod computes the *exact* optimum (``top_score_group``:
   the groups of an optimal 1-D k-means are runs of the sorted scores, so every split is tried), where
   the reference runs scikit-learn's KMeans (10 random starts, which miss the optimum in some pools).
2. Cluster centres (``graph_centres``). A graph joins top-group proposals of IoU > ``graph_iou``. The
   proposal of most neighbours (itself included) becomes a centre, scored with the highest score among
   those neighbours, and it and its neighbours leave the graph; this repeats until ``max_remaining`` or
   fewer proposals remain (it runs at least once). Ties of degree, which are frequent, go to the
   highest-scoring proposal, then to the lowest proposal index (the reference's unstable numpy sort
   picks one that depends on the numpy version). The class keeps its ``max_centres`` best centres by
   score (ties: the earlier chosen); only those leave the pool for the next classes.
3. Clusters (``pcl_pseudo_labels``). Every ROI joins its centre of highest IoU (the first on ties): a
   member (foreground of the centre's class) at IoU >= ``fg_iou``, background below, with weight the
   centre's score, 0 below ``bg_iou`` (ignored).
4. Loss (``pcl_loss``) per student: -(1/R) [sum over clusters n of s_n M_n log(mean over its M_n members
   of p(class of n)) + sum over background ROIs r of w_r log p_r(background)], a mean over images; p the
   student's softmax. Computed in log space (``log_softmax``, a log-sum-exp per cluster) and
   differentiated by autograd. The reference clamps the probabilities at 1e-6 in its forward and 1e-5 in
   its hand-written backward, which also ignores the incoming gradient (a loss weight does not scale
   it); wsod's loss is the formula itself, equal to the reference's wherever the probabilities exceed
   1e-5. No box regression: PCL's students have none, and its detections keep the proposals' boxes.

Degenerate pools, which crash the reference: a pool with fewer distinct scores than ``kmeans_groups``
keeps the proposals of the highest score as its top group; an empty pool (every proposal already a kept
centre of an earlier class) gives that class no cluster. An image without any positive class has no
cluster: every ROI is background with weight 0 (no loss).

Everything runs on the scores' device, vectorised over proposals: the only host synchronisations are
one per class for the top group's size and one per greedy step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.ops import box_iou

from wsod.modeling.method import PseudoLabels, RefinementMethod, check_init_stds, check_source_scores

__all__ = [
    "PCLMethod",
    "WSDDNMethod",
    "graph_centres",
    "pcl_loss",
    "pcl_pseudo_labels",
    "top_score_group",
]


def top_score_group(scores: Tensor, num_groups: int = 3) -> Tensor:
    """Indices into ``scores`` (P,) of the group of highest centre in an optimal 1-D k-means of the
    scores into ``num_groups`` groups (least total squared distance to the group means).

    The groups of an optimal 1-D partition are runs of the sorted scores that never split equal scores,
    so the optimum is found exactly (to float64 rounding) by dynamic programming over the splits between
    distinct values; each level's minima are found by divide and conquer over the monotone optimal
    splits (the costs form a Monge matrix: Grønlund et al., "Fast exact k-means, k-medians and Bregman
    divergence clustering in 1D", 2017), O(P log P) work instead of O(P^2). Ties between optimal
    partitions go to the one whose top group starts earliest in sorted order (the largest top group).
    Fewer distinct scores than groups (a pool of fewer than ``num_groups`` proposals among them): the
    top group is the proposals of the highest score. Returns indices in ascending order; empty for an
    empty pool.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be (P,), got {tuple(scores.shape)}")
    if num_groups < 2:
        raise ValueError(f"num_groups must be at least 2, got {num_groups}")
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=scores.device)
    values, order = torch.sort(scores.double(), stable=True)
    count = values.numel()
    # Candidate group starts: positions b where the sorted value changes (values[b - 1] < values[b]).
    starts = (values[1:] > values[:-1]).nonzero().squeeze(1) + 1
    if starts.numel() < num_groups - 1:  # fewer distinct values than groups
        return (scores == scores.max()).nonzero().squeeze(1)
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), count)])  # 0, starts..., P
    cost = _RunCost(values, bounds)
    best = cost(torch.zeros_like(bounds), torch.arange(len(bounds), device=bounds.device))  # one group
    for _ in range(num_groups - 2):
        best = _next_level(best, cost)
    last_bound = torch.full_like(bounds, len(bounds) - 1)
    last = best + cost(torch.arange(len(bounds), device=bounds.device), last_bound)  # top group [b_j, P)
    top_start = bounds[torch.argmin(last)]  # the first minimal: the earliest start
    return torch.sort(order[top_start:]).values


class _RunCost:
    """Squared distances to their mean of the sorted values between two candidate bounds, from prefix
    sums of the centred values (centring keeps the float64 sums of squares accurate)."""

    def __init__(self, values: Tensor, bounds: Tensor) -> None:
        centred = values - values.mean()
        zero = centred.new_zeros(1)
        self.first = torch.cat([zero, centred.cumsum(0)])
        self.second = torch.cat([zero, (centred * centred).cumsum(0)])
        self.bounds = bounds

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise cost of the run [bounds[a], bounds[b]) for index tensors a, b; +inf when empty."""
        start, stop = self.bounds[a], self.bounds[b]
        n = (stop - start).double()
        s1, s2 = self.first[stop] - self.first[start], self.second[stop] - self.second[start]
        run = (s2 - s1 * s1 / n.clamp_min(1)).clamp_min(0)
        return torch.where(stop > start, run, torch.inf)


def _next_level(best: Tensor, cost: _RunCost) -> Tensor:
    """next[j] = min over i < j of best[i] + cost(i, j), for every j: the least cost of one group more.

    The leftmost minimising i never decreases with j (a Monge matrix), so divide and conquer finds every
    row's minimum: the middle row of each open interval of rows searches only between the minimisers of
    its neighbours. All intervals of one recursion depth are evaluated at once (a ragged batch), so the
    work is O(n log n) in O(log n) vectorised steps.
    """
    size = best.shape[0]
    device = best.device
    result = torch.full_like(best, torch.inf)
    # Open tasks: rows [j_lo, j_hi] whose minimiser lies in [i_lo, i_hi].
    j_lo = torch.zeros(1, dtype=torch.int64, device=device)
    j_hi = torch.full((1,), size - 1, dtype=torch.int64, device=device)
    i_lo, i_hi = j_lo.clone(), j_hi.clone()
    while j_lo.numel():
        mid = (j_lo + j_hi) // 2
        last = torch.minimum(i_hi, mid - 1)  # i < j: the group [b_i, b_j) must not be empty
        length = (last - i_lo + 1).clamp_min(0)
        total = int(length.sum())
        task = torch.repeat_interleave(torch.arange(len(mid), device=device), length, output_size=total)
        i = i_lo[task] + torch.arange(total, device=device) - (length.cumsum(0) - length)[task]
        value = best[i] + cost(i, mid[task])
        minimum = torch.full_like(mid, torch.inf, dtype=best.dtype).scatter_reduce(0, task, value, "amin")
        leftmost = torch.where(value == minimum[task], i, size)
        argmin = torch.full_like(mid, size).scatter_reduce(0, task, leftmost, "amin")
        argmin = torch.where(length > 0, argmin, i_lo).clamp_max(size - 1)
        result[mid] = minimum
        left, right = j_lo <= mid - 1, mid + 1 <= j_hi
        j_lo, j_hi, i_lo, i_hi = (
            torch.cat([j_lo[left], (mid + 1)[right]]),
            torch.cat([(mid - 1)[left], j_hi[right]]),
            torch.cat([i_lo[left], argmin[right]]),
            torch.cat([argmin[left], i_hi[right]]),
        )
    return result


def graph_centres(
    boxes: Tensor, scores: Tensor, *, graph_iou: float = 0.4, max_remaining: int = 5
) -> tuple[Tensor, Tensor]:
    """The greedy cluster centres of one class's top group: boxes (P, 4), scores (P,), P >= 1.

    Proposals of IoU > ``graph_iou`` are neighbours (each is its own). Repeatedly: the proposal with the
    most remaining neighbours (ties: the highest score, then the lowest index) becomes a centre scored
    with the highest score among those neighbours, and they all leave; until ``max_remaining`` or fewer
    proposals remain (at least one centre). Returns (centre indices (N,) in the order chosen, their
    scores (N,)).
    """
    count = boxes.shape[0]
    if count == 0:
        raise ValueError("graph_centres needs at least one proposal")
    neighbours = box_iou(boxes, boxes) > graph_iou
    neighbours.fill_diagonal_(True)  # a proposal is its own neighbour, whatever its IoU arithmetic gives
    alive = torch.ones(count, dtype=torch.bool, device=boxes.device)
    remaining = count
    centres, centre_scores = [], []
    while True:
        degree = (neighbours & alive[None, :]).sum(dim=1).masked_fill(~alive, -1)
        tied = degree == degree.max()
        # argmax returns the first maximal index: the lowest index among equal scores.
        centre = torch.argmax(torch.where(tied, scores, -torch.inf))
        members = neighbours[centre] & alive
        centres.append(centre)
        centre_scores.append(scores[members].max())
        alive &= ~members
        remaining -= int(members.sum())
        if remaining <= max_remaining:
            break
    return torch.stack(centres), torch.stack(centre_scores)


@torch.no_grad()
def pcl_pseudo_labels(
    proposals: Tensor,
    scores: Tensor,
    image_labels: Tensor,
    *,
    kmeans_groups: int = 3,
    graph_iou: float = 0.4,
    max_remaining: int = 5,
    max_centres: int = 5,
    fg_iou: float = 0.5,
    bg_iou: float = 0.1,
    score_clip: float = 1e-9,
) -> PseudoLabels:
    """PCL's proposal clusters for one image (the module docstring, steps 1-3).

    Args:
        proposals: (R, 4) xyxy boxes with positive width and height.
        scores: (R, C) source scores of the C foreground classes.
        image_labels: (C,) multi-hot; nonzero = present.

    Returns a ``PseudoLabels`` with labels (R,) (c + 1 for a member of a cluster of class c, 0 for
    background), weights (R,) (the assigned centre's score; 0 for ignored ROIs and when the image has no
    cluster), targets zeros (R, 4) (no box regression), ``extra["cluster"]`` (R,) int64 the member's
    cluster, -1 for background; ``pseudo_boxes`` (N, 4), ``pseudo_classes`` (N,), ``pseudo_scores`` (N,)
    the cluster centres, class by class in ascending order and by decreasing score within a class.
    """
    check_source_scores(proposals, scores, image_labels)
    num_rois = proposals.shape[0]
    device = proposals.device
    scores = scores.clamp(score_clip, 1 - score_clip)
    in_pool = torch.ones(num_rois, dtype=torch.bool, device=device)
    centre_index, centre_class, centre_score = [], [], []
    for c in (image_labels > 0).nonzero().flatten().tolist():
        pool = in_pool.nonzero().squeeze(1)
        if pool.numel() == 0:  # every proposal is already a centre of an earlier class
            continue
        top = pool[top_score_group(scores[pool, c], kmeans_groups)]
        chosen, chosen_scores = graph_centres(
            proposals[top], scores[top, c], graph_iou=graph_iou, max_remaining=max_remaining
        )
        best = torch.sort(chosen_scores, descending=True, stable=True).indices[:max_centres]
        kept = top[chosen[best]]
        centre_index.append(kept)
        centre_class.append(torch.full_like(kept, c))
        centre_score.append(chosen_scores[best])
        in_pool[kept] = False
    labels = torch.zeros(num_rois, dtype=torch.int64, device=device)
    cluster = torch.full((num_rois,), -1, dtype=torch.int64, device=device)
    targets = proposals.new_zeros(num_rois, 4)
    if not centre_index:
        return PseudoLabels(
            labels,
            proposals.new_zeros(num_rois),
            targets,
            extra={"cluster": cluster},
            pseudo_boxes=proposals.new_zeros(0, 4),
            pseudo_classes=labels.new_zeros(0),
            pseudo_scores=scores.new_zeros(0),
        )
    index, classes, box_scores = torch.cat(centre_index), torch.cat(centre_class), torch.cat(centre_score)
    boxes = proposals[index]
    overlaps = box_iou(proposals, boxes)  # (R, N)
    assigned = overlaps.argmax(dim=1)  # the first centre of maximal IoU on ties
    max_iou = overlaps.gather(1, assigned[:, None]).squeeze(1)
    member = max_iou >= fg_iou
    labels = torch.where(member, classes[assigned] + 1, labels)
    cluster = torch.where(member, assigned, cluster)
    weights = torch.where(max_iou < bg_iou, 0.0, box_scores[assigned]).to(proposals.dtype)
    return PseudoLabels(
        labels,
        weights,
        targets,
        extra={"cluster": cluster},
        pseudo_boxes=boxes,
        pseudo_classes=classes,
        pseudo_scores=box_scores,
    )


def pcl_loss(logits: Tensor, records: Sequence[PseudoLabels]) -> Tensor:
    """PCL's loss of one student over a batch (the module docstring, step 4): logits (R, C+1) of the
    images concatenated in order, one ``pcl_pseudo_labels`` record per image. Each image's sum is
    divided by its R_i, then averaged over the images."""
    num_images = len(records)
    log_p = F.log_softmax(logits, dim=1)
    labels = torch.cat([r.labels for r in records])
    weights = torch.cat([r.weights for r in records]).to(log_p.dtype)
    roi_norm = torch.cat([log_p.new_full((len(r),), 1 / (len(r) * num_images)) for r in records])
    # Cluster ids made unique over the batch: image i's offset by the clusters of the images before it.
    sizes = [len(r.pseudo_scores) for r in records]
    offsets = list(accumulate([0, *sizes[:-1]]))
    cluster = torch.cat(
        [
            torch.where(r.extra["cluster"] >= 0, r.extra["cluster"] + o, -1)
            for r, o in zip(records, offsets, strict=True)
        ]
    )
    cluster_scores = torch.cat([r.pseudo_scores for r in records]).to(log_p.dtype)
    cluster_norm = torch.cat(
        [log_p.new_full((n,), 1 / (len(r) * num_images)) for r, n in zip(records, sizes, strict=True)]
    )

    background = labels == 0
    background_term = (weights[background] * log_p[background, 0] * roi_norm[background]).sum()

    member = (cluster >= 0).nonzero().squeeze(1)
    member_log_p = log_p[member, labels[member]]  # (M,) log p of each member's cluster class
    ids = cluster[member]
    num_clusters = cluster_scores.shape[0]
    counts = torch.bincount(ids, minlength=num_clusters).to(log_p.dtype)
    # log(mean of p) = max + log(sum of exp(log p - max)) - log(count), per cluster; the shift is a
    # constant (detached), so the value and gradient are the formula's.
    shift = torch.full((num_clusters,), -torch.inf, dtype=log_p.dtype, device=log_p.device)
    shift = shift.scatter_reduce(0, ids, member_log_p.detach(), reduce="amax").nan_to_num(neginf=0.0)
    sums = log_p.new_zeros(num_clusters).index_add(0, ids, torch.exp(member_log_p - shift[ids]))
    has_members = counts > 0
    log_mean = shift[has_members] + torch.log(sums[has_members]) - torch.log(counts[has_members])
    cluster_term = (cluster_scores * counts * cluster_norm)[has_members] @ log_mean
    return -(background_term + cluster_term)


class PCLMethod(RefinementMethod):
    """PCL (Tang et al., TPAMI 2018) as a refinement method: ``pcl_pseudo_labels`` with these settings
    for every student and ``pcl_loss`` (``loss_pcl_k``), student 1's multiplied by
    ``first_student_loss_weight`` (1: the reference weighs every loss 1). No box regression. The
    settings of ``configs/method/pcl.yaml``, each with its source there; ``mil_std`` and
    ``student_cls_std`` the MIL head's and the students' initial weights N(0, std), the reference's 0.01."""

    box_regression = False

    def __init__(
        self,
        *,
        kmeans_groups: int = 3,
        graph_iou: float = 0.4,
        max_remaining: int = 5,
        max_centres: int = 5,
        fg_iou: float = 0.5,
        bg_iou: float = 0.1,
        score_clip: float = 1e-9,
        first_student_loss_weight: float = 1.0,
        mil_std: float = 0.01,
        student_cls_std: float = 0.01,
    ) -> None:
        if kmeans_groups < 2:
            raise ValueError(f"PCL's kmeans_groups must be at least 2, got {kmeans_groups}")
        if max_centres < 1 or max_remaining < 0:
            raise ValueError(
                f"PCL needs max_centres >= 1 and max_remaining >= 0, got {max_centres}, {max_remaining}"
            )
        if not 0.0 <= bg_iou <= fg_iou <= 1.0:
            raise ValueError(f"PCL needs 0 <= bg_iou <= fg_iou <= 1, got bg_iou={bg_iou}, fg_iou={fg_iou}")
        if not 0.0 <= graph_iou <= 1.0:
            raise ValueError(f"PCL's graph_iou must be in [0, 1], got {graph_iou}")
        if not 0.0 <= score_clip < 0.5:
            raise ValueError(f"PCL's score_clip must be in [0, 0.5), got {score_clip}")
        if not first_student_loss_weight >= 0:
            raise ValueError(f"first_student_loss_weight must be >= 0, got {first_student_loss_weight}")
        check_init_stds(mil_std=mil_std, student_cls_std=student_cls_std)
        self.settings = dict(
            kmeans_groups=kmeans_groups,
            graph_iou=graph_iou,
            max_remaining=max_remaining,
            max_centres=max_centres,
            fg_iou=fg_iou,
            bg_iou=bg_iou,
            score_clip=score_clip,
        )
        self.first_student_loss_weight = first_student_loss_weight
        self.mil_std, self.student_cls_std = mil_std, student_cls_std

    @property
    def fg_iou(self) -> float:
        return self.settings["fg_iou"]

    def loss_names(self, num_students: int) -> tuple[str, ...]:
        return tuple(f"loss_pcl_{k}" for k in range(1, num_students + 1))

    def pseudo_labels(
        self, student: int, proposals: Tensor, scores: Tensor, targets: Mapping[str, Tensor]
    ) -> PseudoLabels:
        return pcl_pseudo_labels(proposals, scores, targets["labels"], **self.settings)

    def losses(
        self,
        student: int,
        logits: Tensor,
        deltas: Tensor | None,
        records: Sequence[PseudoLabels],
        proposals: Sequence[Tensor],
    ) -> dict[str, Tensor]:
        factor = self.first_student_loss_weight if student == 1 else 1.0
        return {f"loss_pcl_{student}": factor * pcl_loss(logits, records)}


class WSDDNMethod(RefinementMethod):
    """WSDDN (Bilen & Vedaldi, CVPR 2016), the baseline of every table: the MIL teacher alone, no
    refinement students (``num_students: 0``); its ROI scores (classification softmax x detection
    softmax over the image's ROIs) are the detections. Only ``loss_mil`` trains. ``mil_std``: the MIL
    head's initial weights N(0, std), wetectron's 0.001."""

    trains_students = False
    box_regression = False

    def __init__(self, *, mil_std: float = 0.001) -> None:
        check_init_stds(mil_std=mil_std)
        self.mil_std = mil_std

    def loss_names(self, num_students: int) -> tuple[str, ...]:
        if num_students:
            raise ValueError(
                f"WSDDN trains no refinement students: num_students must be 0, got {num_students}"
            )
        return ()

    def pseudo_labels(
        self, student: int, proposals: Tensor, scores: Tensor, targets: Mapping[str, Tensor]
    ) -> PseudoLabels:
        raise RuntimeError("WSDDN has no students to label for")

    def losses(
        self,
        student: int,
        logits: Tensor,
        deltas: Tensor | None,
        records: Sequence[PseudoLabels],
        proposals: Sequence[Tensor],
    ) -> dict[str, Tensor]:
        raise RuntimeError("WSDDN has no students to train")
