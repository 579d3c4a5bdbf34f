"""The one place that turns a Hydra config into objects: data, models, optimizers and schedules,
evaluators, and what a training run holds besides (its loader, checkpointer, companions and previews).
Modules never see the config: besides this file only the entry points read it (``wsod.runs``, each
reading only what is its own: the run directory, the resume policy, logging; the thin scripts in tools/)
and ``wsod.config_checks`` checks it. See configs/ for the fields and their meaning."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from wsod.config_compat import upgrade_model_settings
from wsod.config_schema import plain
from wsod.data.dataset import ConcatWeakDataset, WeakDetectionDataset
from wsod.data.formats import DatasetFormat, dataset_format
from wsod.data.labelled_split import read_split
from wsod.data.loader import build_train_loader
from wsod.data.pseudo_boxes import attach_pseudo_boxes
from wsod.data.roi_sampling import PartialLabelRoiSampler
from wsod.data.strong_augmentation import WeakStrongViews
from wsod.data.targets import check_supervision
from wsod.data.transforms import MultiViewTransform, train_transform
from wsod.distributed import main_process_first
from wsod.engine.adversarial import DropBlockAdversary
from wsod.engine.amp import resolve_amp
from wsod.engine.balancing import LossBalancer
from wsod.engine.checkpoint import Checkpointer, load_checkpoint
from wsod.engine.companion import Companion
from wsod.engine.ema import EMATeacher
from wsod.engine.evaluate import Evaluator
from wsod.engine.pseudo_label_preview import TAG as PREVIEW_TAG
from wsod.engine.pseudo_label_preview import PseudoLabelPreview
from wsod.engine.solver import build_optimizer as _build_optimizer
from wsod.engine.solver import build_scheduler as _build_scheduler
from wsod.modeling.detector import (
    WeaklySupervisedDetector,
    build_detector,
    partial_label_readers,
    resolve_method_class,
)
from wsod.modeling.faster_rcnn import ARCHITECTURE as FASTER_RCNN
from wsod.modeling.faster_rcnn import FasterRCNNDetector, build_faster_rcnn
from wsod.modeling.method import RefinementMethod
from wsod.modeling.protocol import Detector
from wsod.modeling.refinement import MISTLabeler, OICRLabeler, PseudoLabeler
from wsod.modeling.semi_supervised_rcnn import SemiSupervisedFasterRCNN
from wsod.modeling.teacher_student import TeacherStudentPair

__all__ = [
    "LABELERS",
    "resolve_device",
    "resolve_threads",
    "build_method",
    "build_labeler",
    "build_model",
    "build_stage2_model",
    "load_detector",
    "prepare_data",
    "build_train_dataset",
    "check_partial_labels_read",
    "build_test_dataset",
    "build_export_datasets",
    "build_stage2_train_dataset",
    "build_evaluator",
    "build_optimizer",
    "build_adversary",
    "build_balancer",
    "build_ema_teacher",
    "build_scheduler",
    "COMPANIONS",
    "build_companions",
    "build_loader",
    "build_checkpointer",
    "build_pseudo_label_preview",
]

logger = logging.getLogger(__name__)

# The per-image labeller of each built-in method (``METHODS`` in wsod/modeling/detector.py holds the methods).
LABELERS: dict[str, type] = {"mist": MISTLabeler, "oicr": OICRLabeler}


def resolve_device(name: str) -> torch.device:
    """ "auto" -> this process's CUDA device when CUDA is available (LOCAL_RANK under torchrun), else CPU."""
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_threads(threads: int | str | None, loader_workers: int) -> int | None:
    """torch's intra-op threads on CPU for a ``threads`` setting: a number as given; ``auto``: the cores
    this process may use (its CPU affinity) shared among the local processes of a torchrun
    (``LOCAL_WORLD_SIZE``), less the data-loader workers, which decode and transform on cores of their
    own, at least 1; ``None`` or 0: torch's own default (every core)."""
    if threads != "auto":
        return int(threads) if threads else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, cores // local_processes - loader_workers)


def _plain(node: DictConfig | dict | None) -> dict[str, Any]:
    """A config node as keyword arguments: plain values, choices as strings (``config_schema.plain``)."""
    if node is None:
        return {}
    return plain(node) if isinstance(node, DictConfig) else dict(node)


def build_method(method_cfg: DictConfig | dict | None) -> RefinementMethod:
    """The refinement method of a ``configs/method`` node: ``name`` picks the class (a name of
    ``METHODS`` or an import path ``module:ClassName``), every other key but ``num_students`` (the
    detector's) is its keyword argument, so ``+method.my_key=1`` reaches a user's method. ``None``
    gives MIST with its defaults."""
    options = _plain(method_cfg)
    options.pop("num_students", None)  # the detector's: it builds the students
    name = options.pop("name", "mist")
    method_class = resolve_method_class(name)
    try:
        return method_class(**options)
    except TypeError as error:
        raise TypeError(f"method '{name}': {error} (keys of the method config are its arguments)") from error


def build_labeler(method_cfg: DictConfig | dict | None) -> PseudoLabeler:
    """The per-image labeller of a built-in method's ``configs/method`` node (``build_method().labeler``)."""
    method = build_method(method_cfg)
    if not hasattr(method, "labeler"):
        raise ValueError(f"method {type(method).__name__} has no per-image labeller: use build_method")
    return method.labeler


def build_model(
    model_cfg: DictConfig | dict, num_classes: int, method_cfg: DictConfig | dict | None = None
) -> WeaklySupervisedDetector:
    """The detector from a ``configs/model`` node (every key is a ``build_detector`` argument) and a
    ``configs/method`` node (the refinement method, and ``num_students``: how many students it trains;
    ``build_detector``'s default when absent)."""
    method_settings = _plain(method_cfg)
    students = {"num_students": method_settings["num_students"]} if "num_students" in method_settings else {}
    model_settings = _plain(model_cfg)
    model_settings.pop("eval_weights", None)  # which weights evaluations use: the EMA teacher's concern
    return build_detector(
        num_classes=num_classes, method=build_method(method_settings), **students, **model_settings
    )


def build_stage2_model(detector_cfg: DictConfig | dict, num_classes: int) -> FasterRCNNDetector:
    """The second-stage detector of a ``configs/detector`` node (every key but ``name`` is a
    ``build_faster_rcnn`` argument)."""
    options = _plain(detector_cfg)
    options.pop("eval_weights", None)  # a third-stage checkpoint's: which weights evaluations use
    name = options.pop("name", FASTER_RCNN)
    if name != FASTER_RCNN:
        raise ValueError(f"detector.name='{name}': the second stage has one detector, {FASTER_RCNN}")
    return build_faster_rcnn(num_classes, **options)


def build_stage3_model(
    detector_cfg: DictConfig | dict, num_classes: int, semi_cfg: DictConfig | dict
) -> SemiSupervisedFasterRCNN:
    """The third stage's student: the ``configs/detector`` node's Faster R-CNN as a
    ``SemiSupervisedFasterRCNN`` with the settings of ``semi_supervised`` (configs/stage3.yaml)."""
    base = build_stage2_model(detector_cfg, num_classes)
    settings = _plain(semi_cfg)
    return SemiSupervisedFasterRCNN(
        base.detector, num_classes, unlabelled_weights=settings["unlabelled_weights"],
        focal_gamma=settings["focal_gamma"], score_threshold=settings["score_threshold"],
        filter_by_image_labels=settings["filter_by_image_labels"],
    )  # fmt: skip


def load_detector(
    checkpoint_path: str | Path,
    map_location: str | torch.device = "cpu",
    *,
    trust: bool = False,
    eval_weights: str | None = None,
) -> tuple[Detector, dict[str, Any]]:
    """The detector a wsod checkpoint holds, rebuilt from the settings stored in it, with its weights;
    returns ``(model, metadata)`` (``metadata["classes"]``: the class names). The model is in eval mode
    on ``map_location``. ImageNet weights are never fetched: the checkpoint holds every weight. A
    second-stage checkpoint (``metadata["architecture"] == "faster_rcnn"``, tools/train_stage2.py) gives
    its ``FasterRCNNDetector``. ``trust``: read the file with the full unpickler (``load_checkpoint``;
    the tools' ``trust_checkpoint=true``). ``eval_weights``: ``student``, ``teacher`` (the EMA
    teacher's weights the file holds) or ``mix`` (both, ``TeacherStudentPair``); None: the run's own
    ``model.eval_weights``."""
    checkpoint = load_checkpoint(checkpoint_path, map_location, trust=trust)
    metadata = dict(checkpoint.get("metadata") or {})
    if "model" not in metadata or "classes" not in metadata:
        raise ValueError(
            f"{checkpoint_path} holds no model settings (metadata.model, metadata.classes): not a wsod"
            " checkpoint?"
        )
    model = _rebuild(metadata)
    model.load_state_dict(checkpoint["model"])
    eval_weights = eval_weights or str(metadata["model"].get("eval_weights", "student"))
    if eval_weights != "student":
        # model_final.pth holds the teacher under "teacher"; a periodic checkpoint in its companion's state.
        state = checkpoint.get("teacher") or (checkpoint.get(EMATeacher.name) or {}).get("teacher")
        if state is None:
            raise ValueError(
                f"{checkpoint_path}: eval_weights={eval_weights} needs the EMA teacher's weights, which the"
                " file does not hold (trained without solver.ema.enabled?): evaluate the student"
            )
        teacher = _rebuild(metadata)
        teacher.load_state_dict(state)
        model = teacher if eval_weights == "teacher" else TeacherStudentPair(model, teacher)
    return model.to(map_location).eval(), metadata


def _rebuild(metadata: dict[str, Any]) -> Detector:
    """A checkpoint's detector from its stored settings, without weights (ImageNet's never fetched)."""
    num_classes = len(metadata["classes"])
    if metadata.get("architecture") == FASTER_RCNN:
        return build_stage2_model({**metadata["model"], "weights": None}, num_classes)
    # Settings in an older checkpoint's layout (the method's among the model's) are read too.
    model_settings, method_settings = upgrade_model_settings(
        metadata["model"], _plain(metadata.get("method"))
    )
    return build_model({**model_settings, "weights": None}, num_classes, method_settings)


def prepare_data(data_cfg: DictConfig, progress: bool = False) -> None:
    """Run the data format's first-use step (``DatasetFormat.prepare``: the toy set is generated, a
    folder's proposals must exist), with progress bars if asked: the main process first, the others
    waiting and then finding it in place, so that ranks never generate it concurrently. A folder
    dataset's proposals are never made here: their absence is an error giving the
    ``tools/make_proposals.py folder`` command (Selective Search deserves its own progress bar)."""
    data_format = _format(data_cfg)
    with main_process_first():
        if data_format.prepare is not None:
            data_format.prepare(_settings(data_cfg), progress)


def _format(data_cfg: DictConfig) -> DatasetFormat:
    """The format ``data.kind`` names (``wsod.data.formats.DATASET_FORMATS``); one line when unknown."""
    return dataset_format(data_cfg.get("kind"))


def _settings(node: DictConfig | dict) -> dict[str, Any]:
    """A config node as the plain dict a dataset format reads (choices as strings); a mandatory value
    left unset (``???``, e.g. a folder's data.root) is OmegaConf's error naming it."""
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True, throw_on_missing=True, enum_to_str=True)
    return dict(node)


def _open(
    data_cfg: DictConfig, source: DictConfig, *, transform, limits: DictConfig, drop_unlabelled: bool
) -> WeakDetectionDataset:
    """One set (``source``: a ``data.train.sets`` entry or ``data.test.set``), opened by its format, its
    proposals cut by ``limits`` (``data.train`` or ``data.test``: ``max_proposals``,
    ``min_proposal_size``)."""
    return _format(data_cfg).open(
        _settings(data_cfg),
        _settings(source),
        transform=transform,
        max_proposals=limits.max_proposals,
        min_proposal_size=limits.get("min_proposal_size", 2.0),
        drop_unlabelled=drop_unlabelled,
        partial_labels=source.get("partial_labels"),  # a train set's side file (wsod.data.partial_labels)
    )


def _train_transform(train: DictConfig, *, sample_rois: bool = False, true_boxes: bool = False):
    """The random training transform of a ``data.train`` node (scales, flip, lighting), then the ROI
    sampling of images with points or scribbles when ``sample_rois`` (and ``data.train.roi_sampling`` is
    set), as one per-view transform; with ``data.train.views`` > 1, that transform drawn once per view
    (``MultiViewTransform``: each view samples its own ROIs). One view keeps the plain transform, so
    items stay the dicts they were. ``true_boxes``: the images' ground truth rides along in their
    targets (``true_boxes``, ``true_labels``) for the pseudo-label quality log, no method reading it."""
    flip = 0.5 if train.flip else 0.0
    scales, lighting = list(train.scales), train.lighting_std
    transform = train_transform(
        scales, train.max_size, flip_prob=flip, lighting_std=lighting, true_boxes=true_boxes
    )
    sampling = train.get("roi_sampling") if sample_rois else None
    if sampling is not None:  # images with points or scribbles train on a sample of their ROIs
        sampler = PartialLabelRoiSampler(sampling.rois_per_image, sampling.positive_fraction)
        transform = v2.Compose([transform, sampler])
    views = train.get("views", 1)
    return transform if views == 1 else MultiViewTransform(transform, views)


def build_train_dataset(data_cfg: DictConfig) -> Dataset:
    """The training images of ``data.train`` (several sets are concatenated) with random transforms;
    an image with ground-truth boxes carries them in its targets as ``true_boxes`` / ``true_labels``, in
    the batch's pixels, for the training log's pseudo-label precision (``wsod.engine.pseudo_label_quality``;
    no method reads them)."""
    train = data_cfg.train
    transform = _train_transform(train, sample_rois=True, true_boxes=True)
    # docs/METHOD.md §9: COCO images without any label are dropped from training (the format says).
    drop = _format(data_cfg).drop_unlabelled_in_training
    sets = [
        _open(data_cfg, source, transform=transform, limits=train, drop_unlabelled=drop)
        for source in train.sets
    ]
    return sets[0] if len(sets) == 1 else ConcatWeakDataset(sets)


def check_partial_labels_read(train_set: Dataset, method: RefinementMethod) -> None:
    """Refuse training images that carry partial labels (a side file's, or a COCO json's own ``point`` /
    ``scribble`` / ``use_as``) when the method's class declares it does not read them
    (``RefinementMethod.reads_partial_labels``), before step 1: the detector's own check fires only on a
    batch that draws a labelled image, at a random step or never. ``check_config`` refuses a side file
    for such a method earlier still; this also covers labels inside the annotation file and a method
    given by import path. One ``ValueError`` naming the file and the method."""
    if method.reads_partial_labels:
        return
    readers = partial_label_readers()
    for i, dataset in enumerate(getattr(train_set, "datasets", [train_set])):
        labelled = sum(1 for r in dataset.records if r.supervision)
        if not labelled:
            continue
        if dataset.partial_labels_file is not None:  # a side file: the labels come from it alone
            source, drop = dataset.partial_labels_file, f"drop data.train.sets.{i}.partial_labels"
        else:  # a COCO json's own point / scribble / use_as fields
            source = getattr(dataset, "annotation_file", f"data.train.sets.{i}")
            drop = f"give data.train.sets.{i}.annotations a file without point, scribble and use_as"
        raise ValueError(
            f"{source}: partial labels (points, scribbles, boxes) on {labelled} of {len(dataset.records)}"
            f" training images, which {type(method).__name__} does not read (it would train on the image"
            f" labels alone); train with a method that reads them ({readers}) or {drop}"
        )


def build_export_datasets(data_cfg: DictConfig) -> list[WeakDetectionDataset]:
    """The training sets of ``data.train`` without a transform, their unlabelled images left out, for
    tools/export_pseudo_labels.py to predict (at the test views) and label."""
    train = data_cfg.train
    return [
        _open(data_cfg, source, transform=None, limits=train, drop_unlabelled=True) for source in train.sets
    ]


def build_proposal_datasets(data_cfg: DictConfig) -> dict[str, WeakDetectionDataset]:
    """Every image of ``data.train``'s sets and of ``data.test``'s, without a transform and with the
    unlabelled ones kept, by name (``train_<i>``, ``test``): what tools/rpn_proposals.py makes proposals
    for."""
    train = data_cfg.train
    sets = {
        f"train_{i}": _open(data_cfg, source, transform=None, limits=train, drop_unlabelled=False)
        for i, source in enumerate(train.sets)
    }
    sets["test"] = _open(
        data_cfg, data_cfg.test.set, transform=None, limits=data_cfg.test, drop_unlabelled=False
    )
    return sets


def build_stage2_train_dataset(
    data_cfg: DictConfig, pseudo_labels: str | Path, transform: Callable[[dict], Any] | None = None
) -> Dataset:
    """The training images of ``data.train`` with the pseudo boxes of ``pseudo_labels`` (a json of
    tools/export_pseudo_labels.py) as their supervision, under ``transform`` (None: the training
    transform, scales, flip, lighting); images the json does not hold are left out
    (``wsod.data.pseudo_boxes``)."""
    train = data_cfg.train
    transform = _train_transform(train) if transform is None else transform
    sets = [
        _open(data_cfg, source, transform=transform, limits=train, drop_unlabelled=True)
        for source in train.sets
    ]
    records = [r for d in sets for r in d.records]
    partial = sum(1 for r in records if r.supervision)
    if partial:  # a train set's partial_labels side file: the first stage's supervision, not the second's
        logger.warning(
            "%d training images carry partial labels (data.train.sets.*.partial_labels): the second stage"
            " trains on the pseudo boxes of %s alone", partial, pseudo_labels,
        )  # fmt: skip
    labelled = attach_pseudo_boxes(records, sets[0].classes, pseudo_labels)
    by_path = {r.path: r for r in labelled}
    for dataset in sets:
        dataset.records = [by_path[r.path] for r in dataset.records if r.path in by_path]
        for r in dataset.records:
            check_supervision(
                r.supervision, (r.height, r.width), f"{pseudo_labels}: image {r.image_id!r} ({r.path})"
            )
    sets = [d for d in sets if d.records]  # a set none of whose images the json holds: left out
    return sets[0] if len(sets) == 1 else ConcatWeakDataset(sets)


def build_stage3_train_datasets(
    data_cfg: DictConfig, pseudo_labels: str | Path, split: str | Path
) -> tuple[Dataset, Dataset]:
    """The third stage's training images: ``(labelled, unlabelled)``, the images of ``pseudo_labels``
    that the split file ``split`` (tools/split_pseudo_labels.py) marks labelled, with their pseudo boxes,
    and the others with their image labels alone; every item a weak and a strong view of one geometry
    (``WeakStrongViews`` around the training transform)."""
    if data_cfg.train.get("views", 1) != 1:
        raise ValueError(
            f"data.train.views={data_cfg.train.views}: the third stage makes its own two views (weak,"
            " strong) of each image; leave data.train.views at 1"
        )
    views = WeakStrongViews(_train_transform(data_cfg.train))
    dataset = build_stage2_train_dataset(data_cfg, pseudo_labels, transform=views)
    labelled_of = read_split(split)
    sets = list(getattr(dataset, "datasets", [dataset]))
    missing = [r.image_id for d in sets for r in d.records if r.image_id not in labelled_of]
    if missing:
        raise ValueError(
            f"split file {split}: {len(missing)} images of {pseudo_labels} are not in it (the first:"
            f" {missing[0]!r}); make the split from this pseudo-label json (tools/split_pseudo_labels.py)"
        )
    parts = {}
    for kind, wanted in (("labelled", True), ("unlabelled", False)):
        subsets = []
        for d in sets:
            subset = copy.copy(d)  # the same images, proposals and transform; its own records
            subset.records = [
                r if wanted else replace(r, supervision=None)  # unlabelled: the image labels alone
                for r in d.records
                if labelled_of[r.image_id] == wanted
            ]
            subsets += [subset] if subset.records else []
        if not subsets:
            raise ValueError(
                f"split file {split}: no {kind} image among the {len(labelled_of)}; the third stage trains"
                " on both (give tools/split_pseudo_labels.py a k between 1 and the images - 1)"
            )
        parts[kind] = subsets[0] if len(subsets) == 1 else ConcatWeakDataset(subsets)
    return parts["labelled"], parts["unlabelled"]


def build_test_dataset(data_cfg: DictConfig) -> WeakDetectionDataset:
    """The images of ``data.test.set`` without a transform (``wsod.engine.inference.predict`` applies
    the test scales and flips)."""
    test = data_cfg.test
    return _open(data_cfg, test.set, transform=None, limits=test, drop_unlabelled=False)


def build_evaluator(
    data_cfg: DictConfig, device: torch.device, progress: bool = True, random_baseline: bool = False
) -> Evaluator:
    """The test set of ``data.test`` and its evaluation settings (views, precision, metric): the same
    for evaluation during training and for tools/eval.py. ``random_baseline``: every evaluation also
    reports the chance level (``Evaluator``)."""
    test = data_cfg.test
    return Evaluator(
        build_test_dataset(data_cfg),
        scales=list(test.scales),
        max_size=test.max_size,
        flip=test.flip,
        batch_size=test.batch_size,
        num_workers=test.num_workers,
        amp=test.amp,
        metric=test.metric,
        device=device,
        progress=progress,
        random_baseline=random_baseline,
    )


def build_optimizer(solver_cfg: DictConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The detector's optimizer; a DropBlock's parameters belong to the adversary's (``build_adversary``)."""
    dropblock = getattr(model, "dropblock", None)
    return _build_optimizer(
        model,
        name=solver_cfg.optimizer,
        lr=solver_cfg.lr,
        momentum=solver_cfg.momentum,
        weight_decay=solver_cfg.weight_decay,
        bias_lr_factor=solver_cfg.bias_lr_factor,
        bias_weight_decay=solver_cfg.bias_weight_decay,
        exclude=dropblock.parameters() if dropblock is not None else (),
    )


def build_balancer(
    solver_cfg: DictConfig, model: WeaklySupervisedDetector, device: torch.device
) -> LossBalancer | None:
    """GradNorm loss weights (``solver.gradnorm``) for the detector's losses (``model.loss_names``: the
    MIL loss, then the refinement method's), or None when off."""
    settings = solver_cfg.gradnorm
    if not settings.enabled:
        return None
    follow = settings.follow_milestones
    schedule = {"milestones": list(solver_cfg.milestones), "gamma": solver_cfg.gamma} if follow else {}
    balancer = LossBalancer(
        len(model.loss_names),
        alpha=settings.alpha,
        lr=settings.lr,
        min_weight=settings.min_weight,
        start_iter=settings.start_iter,
        window=settings.window,
        balance=str(settings.balance),
        normalize_rates=settings.normalize_rates,
        **schedule,
    )
    return balancer.to(device)


def build_adversary(
    solver_cfg: DictConfig, model: WeaklySupervisedDetector, device: torch.device
) -> DropBlockAdversary | None:
    """The adversarial DropBlock step (``solver.dropblock``) when the model has a DropBlock, else None.
    Its schedule shares the detector's milestones (the reference's steps are the same)."""
    if getattr(model, "dropblock", None) is None:  # only the weakly-supervised detector may have one
        return None
    settings = solver_cfg.dropblock
    optimizer = _build_optimizer(
        model.dropblock,
        name="sgd",
        lr=settings.lr,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
        bias_lr_factor=settings.bias_lr_factor,
        bias_weight_decay=settings.bias_weight_decay,
    )
    scheduler = _build_scheduler(
        optimizer,
        milestones=list(solver_cfg.milestones),
        gamma=settings.gamma,
        warmup_iters=settings.warmup_iters,
        warmup_factor=settings.warmup_factor,
        momentum_rescale=solver_cfg.momentum_rescale,
    )
    amp = resolve_amp(solver_cfg.amp, device)
    return DropBlockAdversary(
        model,
        optimizer,
        scheduler,
        weight=settings.weight,
        amp=amp,
        device=device,
        single_pass=settings.single_pass,
    )


def build_scheduler(
    solver_cfg: DictConfig, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LambdaLR:
    """The warm-up + multi-step schedule; with ``solver.momentum_rescale`` its ``step()`` also rescales
    SGD momentum buffers at large learning-rate changes (``wsod.engine.solver.rescale_momentum``)."""
    return _build_scheduler(
        optimizer,
        milestones=list(solver_cfg.milestones),
        gamma=solver_cfg.gamma,
        warmup_iters=solver_cfg.warmup_iters,
        warmup_factor=solver_cfg.warmup_factor,
        momentum_rescale=solver_cfg.momentum_rescale,
    )


# -- what a training run holds besides its model, data and optimizer (wsod.runs.train, wsod.runs.stage2) --


def build_ema_teacher(
    solver_cfg: DictConfig, model: Detector, device: torch.device, eval_weights: str = "student"
) -> EMATeacher | None:
    """The EMA teacher of ``model`` (``solver.ema``), evaluated as ``eval_weights`` says
    (``model.eval_weights``), or None when off."""
    settings = solver_cfg.get("ema")
    if settings is None or not settings.enabled:
        return None
    # A method may make some teacher tensors follow a weighted mix of student tensors (CBL's classifier).
    sources = model.teacher_sources() if hasattr(model, "teacher_sources") else {}
    return EMATeacher(
        model,
        momentum=settings.momentum,
        schedule=str(settings.schedule),
        follow=[str(group) for group in settings.follow],
        eval_weights=str(eval_weights),
        sources=sources,
    )


# The training extras of a run (``wsod.engine.companion``), by name: each builder takes the run's config
# (configs/train.yaml), the (unwrapped) model and the device, and returns its companion, or None when the
# config leaves it off. The order is the order the training step calls them: the adversary's update runs
# before GradNorm's, and the EMA teacher averages the weights both have updated. A new companion is one
# entry here.
COMPANIONS: dict[str, Callable[[DictConfig, Detector, torch.device], Companion | None]] = {
    "dropblock_adversary": lambda cfg, model, device: build_adversary(cfg.solver, model, device),
    "gradnorm": lambda cfg, model, device: build_balancer(cfg.solver, model, device),
    "ema_teacher": lambda cfg, model, device: build_ema_teacher(
        cfg.solver, model, device, (cfg.get("model") or {}).get("eval_weights", "student")
    ),
}


def build_companions(cfg: DictConfig, model: Detector, device: torch.device) -> list[Companion]:
    """The training extras the run config ``cfg`` turns on for ``model``, in ``COMPANIONS``' order."""
    built = (build(cfg, model, device) for build in COMPANIONS.values())
    return [companion for companion in built if companion is not None]


def build_loader(cfg: DictConfig, train_set: Dataset, device: torch.device) -> DataLoader:
    """The training loader of a training config (configs/train.yaml, configs/stage2.yaml):
    ``solver.ims_per_batch`` images per batch on each process, ``data.train.num_workers`` workers,
    shuffled from ``seed``; pinned memory on CUDA (``wsod.data.loader.build_train_loader``)."""
    return build_train_loader(
        train_set, cfg.solver.ims_per_batch, num_workers=cfg.data.train.num_workers, seed=cfg.seed,
        pin_memory=device.type == "cuda",
    )  # fmt: skip


def build_checkpointer(
    cfg: DictConfig, run_dir: str | Path, metadata: dict[str, Any], *, enabled: bool
) -> Checkpointer:
    """The run's checkpointer: a checkpoint every ``checkpoint_period`` steps, the newest
    ``keep_checkpoints`` kept, ``metadata`` in every file; ``enabled``: this process writes (the main one
    under torchrun); ``trust_checkpoint``: how the files it reads back are unpickled."""
    return Checkpointer(
        run_dir,
        period=cfg.checkpoint_period,
        keep=cfg.keep_checkpoints,
        metadata=metadata,
        enabled=enabled,
        trust=cfg.trust_checkpoint,
        keep_at=list(cfg.get("keep_at") or []),
    )


def build_pseudo_label_preview(
    cfg: DictConfig, train_set: Dataset, device: torch.device
) -> PseudoLabelPreview | None:
    """The tensorboard previews of each student's pseudo-labels (``cfg.pseudo_label_preview``), or None
    when ``period`` is 0: the first ``images`` training images at the first training scale."""
    settings = cfg.pseudo_label_preview
    if not settings.period:
        return None
    preview = PseudoLabelPreview.from_dataset(
        train_set, train_set.classes, num_images=settings.images, scale=cfg.data.train.scales[0],
        max_size=cfg.data.train.max_size, period=settings.period, device=device,
    )  # fmt: skip
    logger.info(
        "pseudo-label previews every %d steps: %d training image(s) x each student, tensorboard %s/...",
        settings.period, len(preview.images), PREVIEW_TAG,
    )  # fmt: skip
    return preview
