"""The schema of every config: one dataclass per config group, registered with Hydra's ConfigStore as the
base each option file of that group extends. A setting has one home: its type, its default and, for a
fixed set of choices, its Enum are declared here once; an option file (configs/solver/coco.yaml, ...)
keeps only what differs from its base, with the source of each difference.

The bases and the option files that extend them (``defaults: [<base>, _self_]`` at the top of each file):

===================  ==============================  ==========================================
config group         base (ConfigStore name)         schema
===================  ==============================  ==========================================
data                 ``base_toy``, ``base_toy_voc``,  ``ToyData``, ``ToyVOCData``, ``VOCData``,
                     ``base_voc``, ``base_coco``,     ``CocoData``, ``FolderData`` (one per
                     ``base_folder``                  dataset format)
model                ``base_resnet_c4``, ``base``     ``ResNetC4Model``, ``Model`` (VGG16)
solver               ``base``                         ``Solver`` with ``DropBlockSolver`` and
                                                      ``GradNormSolver``
detector             ``base``                         ``Detector`` (the second stage)
train.yaml           ``schema_train``                 ``TrainRun``
stage2.yaml          ``schema_stage2``                ``Stage2Run`` (``StageSolver``: no
                                                      DropBlock, no GradNorm)
stage3.yaml          ``schema_stage3``                ``Stage3Run`` (``Stage3Solver``: its EMA
                                                      teacher; ``SemiSupervised``)
eval.yaml, ...       ``schema_eval``,                 ``EvalRun``, ``ExportRun``, ``PredictRun``,
                     ``schema_export``,               ``SplitRun``
                     ``schema_predict``,              ``RpnProposalsRun``
                     ``schema_split``,
                     ``schema_rpn_proposals``
===================  ==============================  ==========================================

The refinement method (configs/method/) has no schema here: its keys are its class's keyword arguments
(``+method.my_key=1`` reaches a user's method), and ``wsod.config_checks`` checks them by building it.

Defaults are the values most options of a group share: the reference VOC 2007 recipe for the solver
and data, the ImageNet ResNet C4 for the model. Hydra converts command-line values to the declared type
and refuses what does not fit (``solver.lr=abc``, ``solver.optimizer=adam``) naming the key; bounds and
rules between keys are ``wsod.config_checks``'s.

Importing this module registers the schemas; ``wsod.config_checks`` imports it, and so every entry point
(``wsod.runs``) and ``tests/conftest.py`` have them before Hydra composes a config. Composing wsod's configs
with Hydra's API in your own code: ``import wsod.config_schema`` first.

Choices are ``str`` Enums: ``cfg.solver.optimizer == "sgd"`` holds, and ``plain(cfg)``
(``OmegaConf.to_container(cfg, enum_to_str=True)``) gives plain strings for files and checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from wsod.data.folder import SPLIT_SEED, TEST_FRACTION
from wsod.data.proposals.selective_search import MODES as SELECTIVE_SEARCH_MODES
from wsod.data.toy import OBJECT_SIZE
from wsod.data.toy_voc.generator import NUM_TEST as TOY_VOC_NUM_TEST
from wsod.data.toy_voc.generator import NUM_TRAIN as TOY_VOC_NUM_TRAIN
from wsod.data.toy_voc.pretraining import ARCH as TOY_VOC_BASE_ARCH
from wsod.data.toy_voc.pretraining import BASE_FILE as TOY_VOC_BASE_FILE
from wsod.data.toy_voc.pretraining import BASE_STEPS as TOY_VOC_BASE_STEPS
from wsod.data.transforms import TRAIN_SCALES
from wsod.engine.amp import AMP_DTYPES
from wsod.engine.balancing import BALANCE_CHOICES
from wsod.engine.ema import SCHEDULES as EMA_SCHEDULES
from wsod.evaluation import METRICS
from wsod.modeling.protocol import MODULE_GROUPS
from wsod.modeling.teacher_student import EVAL_WEIGHTS

# OmegaConf 2.3 reads the annotations at runtime and knows ``Optional[X]``, not ``X | None``: the
# fields below keep ``Optional`` (ruff's UP007 and UP045 are silenced for that reason).
# ruff: noqa: UP007, UP045

__all__ = [
    "Choice",
    "Optimizer",
    "Amp",
    "Norm",
    "DetectorNorm",
    "Pooler",
    "Metric",
    "Balance",
    "SelectiveSearchMode",
    "Model",
    "ResNetC4Model",
    "Solver",
    "StageSolver",
    "DropBlockSolver",
    "GradNormSolver",
    "Detector",
    "ToyData",
    "ToyVOCData",
    "VOCData",
    "CocoData",
    "FolderData",
    "TrainRun",
    "Stage2Run",
    "EvalRun",
    "ExportRun",
    "PredictRun",
    "SCHEMAS",
    "plain",
    "register_schemas",
]


class Choice(str, Enum):
    """A setting with a fixed set of string values: equal to its value (``Amp.bf16 == "bf16"``) and
    printed as it (``f"{Amp.bf16}"`` is ``bf16``), so code that compares or formats strings needs no
    change."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


def _choices(name: str, values: tuple[str, ...] | list[str]) -> type[Choice]:
    """An Enum of ``values`` (member names = values) from the tuple its owning module declares."""
    return Choice(name, [(value, value) for value in values])  # type: ignore[return-value]


Optimizer = _choices("Optimizer", ("sgd", "adamw"))  # wsod.engine.solver.build_optimizer
Amp = _choices("Amp", tuple(AMP_DTYPES))  # CUDA only; null: full precision
Norm = _choices("Norm", ("frozen_bn", "bn", "gn"))  # wsod.modeling.resnet.norm_factory
DetectorNorm = _choices("DetectorNorm", ("frozen_bn", "bn"))  # wsod.modeling.faster_rcnn
Pooler = _choices("Pooler", ("align", "pool"))  # RoIAlign | RoIPool (wsod.modeling.roi_head)
Metric = _choices("Metric", METRICS)
Balance = _choices("Balance", BALANCE_CHOICES)
SelectiveSearchMode = _choices("SelectiveSearchMode", SELECTIVE_SEARCH_MODES)
EvalWeights = _choices("EvalWeights", EVAL_WEIGHTS)  # wsod.modeling.teacher_student
EmaSchedule = _choices("EmaSchedule", EMA_SCHEDULES)  # wsod.engine.ema
ModuleGroup = _choices("ModuleGroup", MODULE_GROUPS)  # wsod.modeling.protocol


# -- data ------------------------------------------------------------------------------------------


@dataclass
class RoiSampling:
    """Images with points or scribbles train on a sample of their proposals (wetectron roi_sampler:
    ROI_HEADS.BATCH_SIZE_PER_IMAGE, POSITIVE_FRACTION)."""

    rois_per_image: int = 1024
    positive_fraction: float = 0.25  # at most this share holds a point or covers a scribble


@dataclass
class TrainData:
    """``data.train``: the training sets and their random augmentation."""

    sets: list[Any] = MISSING  # the format's sets (its schema's ``sets`` type), concatenated
    scales: list[int] = field(default_factory=lambda: list(TRAIN_SCALES))  # shorter side, drawn per image
    max_size: Optional[int] = 2000  # longer side cap
    flip: bool = True  # random horizontal flip
    lighting_std: float = 0.1  # PCA lighting noise std (reference INPUT.PCA, on by default: 0.1); 0: off
    # Keep at most this many proposals per image: the best-scored when the file has scores, else the first
    # in file order; null: all.
    max_proposals: Optional[int] = None
    min_proposal_size: float = 2.0  # drop proposals narrower or shorter than this (inclusive pixels)
    roi_sampling: RoiSampling = field(default_factory=RoiSampling)
    # Independently augmented views of each image (scale, flip, lighting, ROI sampling drawn per view),
    # collated image-major with batch["views"] (wsod.data.loader); 1: plain items, as before
    views: int = 1
    num_workers: int = 4  # loader processes


@dataclass
class TestData:
    """``data.test``: the test set, its views and its metric."""

    set: Any = MISSING  # the format's test set
    # Several scales = test-time augmentation, averaged per ROI before NMS. The reference's: its 800-px
    # test view, then BBOX_AUG.SCALES.
    scales: list[int] = field(default_factory=lambda: [800, 480, 576, 688, 864, 1000, 1200])
    max_size: Optional[int] = 2000
    flip: bool = True  # also run each scale flipped (7 scales x 2: 14 views)
    max_proposals: Optional[int] = None  # as data.train's
    min_proposal_size: float = 2.0
    batch_size: int = 1
    num_workers: int = 4
    metric: Metric = Metric.voc07  # voc07: devkit 11-point AP + CorLoc | area: VOC 2010+ AP | coco: COCOeval
    amp: Optional[Amp] = None  # null: full precision; the same in training's evaluation and tools/eval.py


@dataclass
class ToySet:
    image_set: str = MISSING  # trainval | test
    proposals: Optional[str] = None  # a proposal file or store; null: the set's generated Selective Search


@dataclass
class ToyTrainSet(ToySet):
    # A side file of points / scribbles / boxes on some images (wsod.data.partial_labels).
    partial_labels: Optional[str] = None


@dataclass
class ToyTrainData(TrainData):
    sets: list[ToyTrainSet] = MISSING


@dataclass
class ToyTestData(TestData):
    set: ToySet = MISSING


@dataclass
class ToyData:
    """The embedded toy dataset (wsod.data.toy): 160-px images of 5 shape-and-colour classes in VOC
    layout with Selective Search proposals, generated under ``root`` on first use."""

    kind: str = "toy"
    root: str = "data/toy"
    num_train: int = 600  # images of the trainval split (smaller sets are for tests)
    num_test: int = 200
    # [min, max] side of the drawn objects in pixels: 30-60, the default set; 25-70, the part-prone set
    # (configs/data/toy_parts.yaml). Why: wsod/data/toy.py, OBJECT_SIZE.
    object_size: list[int] = field(default_factory=lambda: list(OBJECT_SIZE))
    train: ToyTrainData = field(default_factory=ToyTrainData)
    test: ToyTestData = field(default_factory=ToyTestData)


@dataclass
class ToyVOCData:
    """The VOC-like benchmark (wsod.data.toy_voc): 20 classes of composite objects, 1-6 per cluttered
    200-320 px image, in VOC layout with Selective Search proposals, generated under ``root`` on first
    use. Another ``generator_seed`` draws other images with the same statistics: give it its own root."""

    kind: str = "toy_voc"
    root: str = "data/toy_voc"
    generator_seed: int = 0  # which draw of the images (0: the set the recipes are measured on)
    num_train: int = TOY_VOC_NUM_TRAIN  # images of the trainval split (smaller sets are for tests)
    num_test: int = TOY_VOC_NUM_TEST
    # The benchmark's "ImageNet" (wsod.data.toy_voc.pretraining): the toy trunk pretrained on
    # object-centric images of the classes, made under {root}/base on first use; configs/model/r18_c4.yaml
    # and configs/detector/faster_rcnn_toy.yaml start from it. null: they train from scratch.
    base_weights: Optional[str] = "${data.root}/base/" + TOY_VOC_BASE_FILE
    base_steps: int = TOY_VOC_BASE_STEPS  # the pretraining's steps (fewer are for tests)
    # res5's normalisation in the base, as it was pretrained (the toy detectors load it with it)
    base_neck_norm: Norm = Norm(TOY_VOC_BASE_ARCH["neck_norm"])
    base_stem_pool: bool = TOY_VOC_BASE_ARCH["stem_pool"]  # its stem's max pooling (false: stride 8)
    # How much of the base configs/model/r18_c4.yaml keeps frozen (its model.freeze_at): 5, all of it.
    # Fine-tuning it with the toy solver's AdamW (1e-3 or 1e-4) erases what it knows (docs/RESULTS.md).
    base_freeze_at: int = 5
    # The toy solver's learning rate on this set (configs/solver/toy.yaml reads it as solver.lr): with the
    # base frozen only the heads train, and the from-scratch toy's 1e-3 is slow for them. Chosen on WSDDN
    # alone, 2,000 steps: 12.62 / 18.84 / 19.89 mAP at 1e-3 / 3e-3 / 1e-2 (docs/RESULTS.md).
    heads_lr: float = 1.0e-2
    # The toy solver's schedule on this set (configs/solver/toy.yaml reads them as solver.max_iter and
    # solver.milestones): the shortest measured that meets the benchmark's headroom targets. Seeds 1-3,
    # WSDDN: 19.56 mAP (mean) at 2,000 steps, under its 20, and 22.60 at 3,000; MIST 39.83 at 3,000
    # (docs/RESULTS.md, toy_voc calibration).
    heads_max_iter: int = 3000
    heads_milestones: list[int] = field(default_factory=lambda: [2400])
    train: ToyTrainData = field(default_factory=ToyTrainData)
    test: ToyTestData = field(default_factory=ToyTestData)


@dataclass
class VOCSet:
    year: str = MISSING  # "2007", "2012"
    image_set: str = MISSING  # trainval | test | val
    proposals: str = MISSING  # the reference pickle format (tools/make_proposals.py)


@dataclass
class VOCTrainSet(VOCSet):
    partial_labels: Optional[str] = None


@dataclass
class VOCTrainData(TrainData):
    sets: list[VOCTrainSet] = MISSING


@dataclass
class VOCTestData(TestData):
    set: VOCSet = MISSING


@dataclass
class VOCData:
    """PASCAL VOC under ``devkit`` (wsod.data.voc; data/README.md)."""

    kind: str = "voc"
    devkit: str = "data/VOCdevkit"
    train: VOCTrainData = field(default_factory=VOCTrainData)
    test: VOCTestData = field(default_factory=VOCTestData)


@dataclass
class CocoSet:
    annotations: str = MISSING  # an instances json
    images: str = MISSING  # its image folder
    proposals: str = MISSING


@dataclass
class CocoTrainSet(CocoSet):
    partial_labels: Optional[str] = None


@dataclass
class CocoTrainData(TrainData):
    sets: list[CocoTrainSet] = MISSING


@dataclass
class CocoTestData(TestData):
    set: CocoSet = MISSING
    metric: Metric = Metric.coco


@dataclass
class CocoData:
    """COCO instances json files (wsod.data.coco): crowd boxes excluded, images without labels dropped in
    training (docs/METHOD.md §9)."""

    kind: str = "coco"
    train: CocoTrainData = field(default_factory=CocoTrainData)
    test: CocoTestData = field(default_factory=CocoTestData)


@dataclass
class FolderSet:
    # train | test: the labels.csv lines whose split column (or the seeded split) says so.
    split: str = MISSING


@dataclass
class FolderTrainSet(FolderSet):
    partial_labels: Optional[str] = None


@dataclass
class FolderTrainData(TrainData):
    sets: list[FolderTrainSet] = MISSING


@dataclass
class FolderTestData(TestData):
    set: FolderSet = MISSING


@dataclass
class FolderData:
    """Your own images (wsod.data.folder): ``<root>/images/`` and ``<root>/labels.csv``."""

    kind: str = "folder"
    root: str = MISSING  # required: the folder holding images/ and labels.csv
    classes: Optional[list[str]] = None  # null: <root>/classes.txt if present, else the sorted labels
    split_seed: int = SPLIT_SEED  # labels.csv without a split column: the seed of the split made by rule,
    test_fraction: float = TEST_FRACTION  # which tests this fraction of each class's images
    train: FolderTrainData = field(default_factory=FolderTrainData)
    test: FolderTestData = field(default_factory=FolderTestData)


# -- model -----------------------------------------------------------------------------------------


@dataclass
class Model:
    """The weakly-supervised detector (``wsod.modeling.detector.build_detector``'s arguments): a backbone
    of ``wsod.modeling.BACKBONES``, its per-ROI neck under sequential backprop, the test-time NMS."""

    backbone: str = MISSING  # a name of wsod.modeling.BACKBONES
    weights: Optional[str] = "IMAGENET1K_V1"  # torchvision weights name or a local .pth path; null: random
    freeze_at: int = 2  # 0: train all; 1: freeze the stem; 2: stem and res2 (VGG16: conv1_x and conv2_x)
    pooler: Pooler = Pooler.align
    roi_size: int = 14
    # ROIs per sequential-backprop chunk; null: plain autograd; auto: plain autograd when a step's ROIs
    # fit memory_budget_gb, else the largest chunk that does.
    chunk_size: Any = 256
    test_chunk_size: Optional[int] = None  # ROIs per chunk at evaluation (no graph kept); null: chunk_size
    fuse_pooling: bool = True  # recompute ROI pooling with the neck (false: the paper's variant, pooled kept)
    # chunk_size=auto only: GB for ROI pooling + neck; null: CUDA free memory at the first step less
    # max(2 GB, 25%) (docs/METHOD.md §7); required on CPU.
    memory_budget_gb: Optional[float] = None
    dropblock: bool = False  # Concrete DropBlock on the pooled features (docs/METHOD.md §6)
    # Scorer width; 256: a full-width (1024) 3x3 scorer at 14x14 costs more than res5; null: the pooled
    # features' channels (the reference's).
    dropblock_hidden: Optional[int] = 256
    dropblock_block_size: int = 3  # side of each dropped square (odd) on the ROI map (RECIPES, DropBlock)
    nms_iou: float = 0.3
    score_threshold: float = 0.0
    detections_per_image: int = 100
    # What evaluations predict with: the trained weights (student), the EMA teacher's (teacher; needs
    # solver.ema.enabled), or both on the same ROIs, mixed by the method's mix_scores (mix).
    eval_weights: EvalWeights = EvalWeights.student


@dataclass
class ResNetC4Model(Model):
    """A ResNet C4 (res2-res4 the base, res5 the per-ROI neck; docs/METHOD.md §2)."""

    width: float = 1.0
    norm: Norm = Norm.frozen_bn  # the base's
    neck_norm: Optional[Norm] = Norm.frozen_bn  # res5's (train-mode bn is refused under sequential backprop)
    stem_pool: bool = True  # the stem's max pooling; false: C4 at stride 8 (the toy_voc base, its ARCH)


# -- solver ----------------------------------------------------------------------------------------


@dataclass
class StageSolver:
    """The optimizer and schedule (``wsod.engine.solver``), shared by both stages. Defaults: the
    reference VOC 2007 recipe (reference configs/voc/V_16_voc07.yaml; docs/RECIPES.md), written for 8
    processes x 1 image per step; with fewer GPUs keep the global batch through ``accumulation``."""

    optimizer: Optimizer = Optimizer.sgd
    lr: float = 0.01  # for the global batch of 8 images
    momentum: float = 0.9  # sgd only
    weight_decay: float = 1.0e-4
    bias_lr_factor: float = 2.0  # biases at twice the lr
    bias_weight_decay: float = 0.0  # and without weight decay
    ims_per_batch: int = 1  # images per process per forward
    accumulation: int = 1  # forwards per optimizer step
    max_iter: int = 30000  # optimizer steps
    milestones: list[int] = field(default_factory=lambda: [20000, 26700])  # lr x gamma at these steps
    gamma: float = 0.1
    warmup_iters: int = 200  # linear warm-up from warmup_factor x lr
    warmup_factor: float = 1.0 / 3.0
    # SGD momentum buffers x new_lr / old_lr when the lr changes by a factor > 1.1 (reference trainer).
    momentum_rescale: bool = True
    amp: Optional[Amp] = Amp.bf16  # null | bf16 | fp16 (CUDA only): base and neck only, heads in float32


@dataclass
class DropBlockSolver:
    """The adversarial Concrete DropBlock step, when model.dropblock is on (reference SOLVER_CDB): its own
    SGD, with momentum 0.9, weight decay 1e-4, biases x2 without decay."""

    lr: float = 1.0e-4
    momentum: float = 0.9
    weight_decay: float = 1.0e-4
    bias_lr_factor: float = 2.0
    bias_weight_decay: float = 0.0
    gamma: float = 3.0  # its lr x3 at each of solver.milestones
    warmup_iters: int = 500  # the reference's default warm-up for it (SOLVER_CDB)
    warmup_factor: float = 1.0 / 3.0
    weight: float = 0.01  # it descends on -weight x the detector's total loss (reference DB.WEIGHT)
    # true: the scorer learns from the detector's own backward, no second forward (toy: 1.21x the step
    # without DropBlock, two passes 2x; not the reference's: docs/METHOD.md §6).
    single_pass: bool = False


@dataclass
class GradNormSolver:
    """GradNorm loss weights (Chen et al., ICML 2018; wsod/engine/gradnorm.py): not part of the paper's
    method."""

    enabled: bool = False
    # 0 equalises the losses' gradient norms at the ROI features; larger favours the slower losses.
    alpha: float = 1.5
    lr: float = 0.01  # Adam learning rate of the loss weights
    min_weight: Optional[float] = 0.01  # floor of each weight; null: none (published)
    start_iter: int = 3000  # weights at 1 (a plain sum) until this step (~10% of max_iter)
    window: int = 1000  # L_i(0) = each rate value's mean over the window steps before start_iter
    balance: Balance = Balance.students  # students: loss_mil stays at weight 1 | all: every loss (published)
    normalize_rates: bool = True  # rates from each student loss / its mean pseudo-label weight
    follow_milestones: bool = True  # the weights' lr x solver.gamma at solver.milestones


@dataclass
class EMASolver:
    """An EMA (mean) teacher of the detector (wsod/engine/ema.py): its per-ROI scores reach the method
    (RefinementMethod.batch_losses), and model.eval_weights may evaluate it. Not part of the paper's
    method: off unless a method uses it."""

    enabled: bool = False
    momentum: float = 0.999  # teacher <- momentum x teacher + (1 - momentum) x student, after each step
    schedule: EmaSchedule = EmaSchedule.constant  # ramp: min(1 - 1/(t+1), momentum) (mean teacher, CBL)
    # The module groups the teacher averages; the others hold the student's values.
    follow: list[ModuleGroup] = field(default_factory=lambda: list(ModuleGroup))


@dataclass
class Solver(StageSolver):
    """The first stage's solver: the detector's, the adversarial DropBlock step's, GradNorm's, the EMA
    teacher's."""

    dropblock: DropBlockSolver = field(default_factory=DropBlockSolver)
    gradnorm: GradNormSolver = field(default_factory=GradNormSolver)
    ema: EMASolver = field(default_factory=EMASolver)


# -- the second stage's detector -------------------------------------------------------------------


@dataclass
class Detector:
    """torchvision's Faster R-CNN with an FPN (``wsod.modeling.faster_rcnn.build_faster_rcnn``'s
    arguments). Defaults: fasterrcnn_resnet50_fpn's architecture from ImageNet weights."""

    name: str = "faster_rcnn"
    backbone: str = "resnet50"  # resnet18 | resnet34 | resnet50 | resnet101
    width: float = 1.0
    weights: Optional[str] = "IMAGENET1K_V1"  # torchvision weights name or a local .pth path; null: random
    norm: DetectorNorm = DetectorNorm.frozen_bn  # frozen_bn (ImageNet weights) | bn (from scratch)
    # res5's normalisation (null: norm's); gn to load the toy_voc base, pretrained with a GroupNorm res5
    neck_norm: Optional[Norm] = None
    freeze_at: int = 2  # 0: train all; 1: the stem; 2: stem and res2 (torchvision's trainable_layers=3)
    stem_pool: bool = True  # the stem's max pooling; false: FPN levels at half their strides (toy_voc base)
    fpn_channels: int = 256
    anchor_sizes: list[int] = field(default_factory=lambda: [32, 64, 128, 256, 512])  # one per level P2..P6
    aspect_ratios: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    rpn_pre_nms_top_n_train: int = 2000
    rpn_post_nms_top_n_train: int = 2000
    rpn_pre_nms_top_n_test: int = 1000
    rpn_post_nms_top_n_test: int = 1000
    rpn_batch_size_per_image: int = 256
    rpn_positive_fraction: float = (
        0.5  # of the RPN's sampled anchors (torchvision's and detectron2's default)
    )
    box_batch_size_per_image: int = 512
    representation_size: int = 1024  # the box head's two fully-connected layers
    nms_iou: float = 0.5  # per-class NMS of the detections (torchvision box_nms_thresh)
    score_threshold: float = 0.0  # keep every detection for AP (torchvision's default 0.05 drops some)
    detections_per_image: int = 100


# -- the entry points ------------------------------------------------------------------------------


@dataclass
class Entry:
    """What every entry point has: where it runs and how it reports."""

    device: str = "auto"  # auto: cuda when available, else cpu
    # torch intra-op threads on CPU; auto: the cores less the loader's workers (at least 1; measured on 2
    # cores: docs/BENCHMARKS.md, CPU threads); null or 0: torch's default.
    threads: Any = "auto"
    trust_checkpoint: bool = False  # true: read checkpoints with the full unpickler, which can run code
    progress: bool = True  # tqdm progress bars, drawn only when stderr is a terminal (wsod/progress.py)


@dataclass
class Run(Entry):
    """The run-level keys both training stages share (configs/train.yaml, configs/stage2.yaml)."""

    seed: int = 1234
    output_dir: Optional[str] = None  # the run directory; null: runs/<date>_<time>, chosen once (rank 0)
    resume: bool = False  # continue from the newest readable checkpoint in output_dir
    log_period: int = 20  # optimizer steps between log lines / metrics.jsonl rows
    checkpoint_period: int = 500  # optimizer steps between checkpoints
    keep_checkpoints: int = 3
    # Iterations whose checkpoint is also saved and never deleted (the third stage's split reads the
    # second stage's from just before its first lr step: docs/guides/second_stage.md).
    keep_at: list[int] = field(default_factory=list)
    eval_period: int = 0  # optimizer steps between evaluations (0: only at the end)
    max_nonfinite: int = 10  # consecutive non-finite losses before the run aborts
    random_baseline: bool = True  # also report the mAP / CorLoc of random scores over the same proposals
    data: Any = MISSING  # configs/data/ (its format's schema)


@dataclass
class PseudoLabelPreview:
    period: int = 500  # optimizer steps between tensorboard images of each student's pseudo-labels (0: off)
    images: int = 4  # fixed training images drawn (the first of the training set)


@dataclass
class TrainRun(Run):
    """tools/train.py (configs/train.yaml)."""

    model: Any = MISSING  # configs/model/
    method: Any = MISSING  # configs/method/ (the method class's keyword arguments: no schema)
    solver: Any = MISSING  # configs/solver/
    pseudo_label_preview: PseudoLabelPreview = field(default_factory=PseudoLabelPreview)


@dataclass
class Stage2Run(Run):
    """tools/train_stage2.py (configs/stage2.yaml)."""

    pseudo_labels: str = MISSING  # required: the pseudo_labels.json of tools/export_pseudo_labels.py
    detector: Any = MISSING  # configs/detector/
    solver: StageSolver = field(default_factory=StageSolver)


@dataclass
class Stage3Solver(StageSolver):
    """The third stage's solver: the detector's, and its EMA teacher's (on: the teacher labels the
    unlabelled images; SoS voc_ssod.yaml:39 keeps 0.9996 every step over all weights and buffers)."""

    ema: EMASolver = field(default_factory=lambda: EMASolver(enabled=True, momentum=0.9996))


@dataclass
class SemiSupervised:
    """The third stage's teacher-student training (wsod/modeling/semi_supervised_rcnn.py). Defaults:
    SoS-WSOD's VOC 2007 settings (unbias/configs/code_release/voc_ssod.yaml there)."""

    unlabelled_per_batch: int = 1  # unlabelled images per process per forward, beside solver.ims_per_batch
    score_threshold: float = 0.7  # the teacher keeps boxes scoring above it (voc_ssod.yaml:36)
    filter_by_image_labels: bool = True  # and of the image's classes (voc_ssod.yaml:42)
    # Each loss's weight on the unlabelled images (voc_ssod.yaml:40; ubteacher/engine/trainer.py:531-537).
    unlabelled_weights: dict[str, float] = field(
        default_factory=lambda: {
            "loss_classifier": 2.0, "loss_box_reg": 0.0, "loss_objectness": 2.0, "loss_rpn_box_reg": 0.0,
        }
    )  # fmt: skip
    focal_gamma: float = 1.5  # the ROI classifier's focal loss (unbiased-teacher fast_rcnn.py:75)
    eval_weights: EvalWeights = EvalWeights.teacher  # the teacher is the model evaluated (student: the other)


@dataclass
class Stage3Run(Stage2Run):
    """tools/train_stage3.py (configs/stage3.yaml)."""

    initial_weights: str = MISSING  # required: the second stage's model_final.pth (student and teacher start)
    split: str = MISSING  # required: the split.json of tools/split_pseudo_labels.py
    solver: Stage3Solver = field(default_factory=Stage3Solver)
    semi_supervised: SemiSupervised = field(default_factory=SemiSupervised)


@dataclass
class EvalRun(Entry):
    """tools/eval.py (configs/eval.yaml)."""

    checkpoint: str = MISSING  # required: the .pth file to evaluate
    # Which weights of a checkpoint trained with an EMA teacher (CBL, solver.ema): student, teacher or mix
    # (their mean); null: the run's own model.eval_weights
    eval_weights: Optional[EvalWeights] = None
    predictions: Optional[str] = None  # a predictions file of an earlier evaluation, reused
    output_dir: Optional[str] = None  # null: runs/eval/<date>_<time>
    random_baseline: bool = True
    data: Any = MISSING


@dataclass
class PseudoLabelRule:
    """SoS-WSOD's pseudo ground-truth filter (tools/pgf.py there: t_keep 0.2, t_con 0.85)."""

    min_score: float = 0.2  # a class's boxes after its top one are kept from this score up
    containment: Optional[float] = 0.85  # drop a box this share of which lies inside another kept box
    containment_exempt: list[str] = field(default_factory=list)  # class names that skip containment


@dataclass
class ExportRun(Entry):
    """tools/export_pseudo_labels.py (configs/export.yaml)."""

    checkpoint: Optional[str] = None  # the .pth file of a trained run (required unless ground_truth)
    # true: the training sets' annotated boxes, not a checkpoint's (the fully supervised bound: the second
    # stage trained on the true boxes); needs output_dir and no checkpoint
    ground_truth: bool = False
    output_dir: Optional[str] = None  # null: <the checkpoint's folder>/pseudo_labels
    overwrite: bool = False  # an existing pseudo_labels.json there is refused unless true
    rule: PseudoLabelRule = field(default_factory=PseudoLabelRule)
    detections_per_image: Optional[int] = None  # detections per image before the rule; null: all
    data: Any = MISSING


@dataclass
class SplitRun(Entry):
    """tools/split_pseudo_labels.py (configs/split.yaml): the third stage's split (wsod/runs/split.py)."""

    checkpoint: str = (
        MISSING  # required: a second-stage model_<iteration>.pth (SoS: before its first lr step)
    )
    pseudo_labels: str = MISSING  # required: the pseudo-label json that second stage trained on
    k: int = MISSING  # required: the images of lowest loss that keep their boxes (SoS VOC07: 2000 of 5011)
    output_dir: Optional[str] = None  # where split.json goes; null: the pseudo-label json's folder
    overwrite: bool = False  # an existing split.json there is refused unless true
    scale: Optional[int] = None  # the scoring view's shorter side; null: the middle of data.train.scales
    positive_fraction: float = 1.0  # both samplers' (SoS voc_split.yaml:11,17)
    seed: int = 0  # image i's samplers draw from seed + i
    data: Any = MISSING


@dataclass
class RpnProposalsRun(Entry):
    """tools/rpn_proposals.py (configs/rpn_proposals.yaml): a second-stage detector's region proposals."""

    checkpoint: str = MISSING  # required: a second- or third-stage checkpoint (its teacher, for a third)
    output_dir: Optional[str] = None  # null: <the checkpoint's folder>/rpn_proposals
    overwrite: bool = False  # stores already there are refused unless true
    scale: Optional[int] = None  # the one view's shorter side; null: data.test.scales[0] (max: data.test's)
    pre_nms_top_n: int = 1000  # best anchors per FPN level before NMS (torchvision's test default)
    post_nms_top_n: int = 1000  # proposals per image after NMS (torchvision's test default)
    nms_iou: float = 0.7  # the RPN's NMS (torchvision's and detectron2's)
    data: Any = MISSING


@dataclass
class PredictRun(Entry):
    """tools/predict.py (configs/predict.yaml)."""

    checkpoint: str = MISSING  # required: the .pth file of a wsod run
    input: str = MISSING  # required: an image file, a folder or a glob ("photos/*.jpg")
    output: Optional[str] = None  # null: runs/predict/<date>_<time>
    overwrite: bool = False  # true first deletes an earlier prediction there
    score_threshold: float = 0.3  # keep (and draw) the detections scoring at least this
    proposals: Optional[str] = None  # a proposal file or store by file name; null: Selective Search
    selective_search: SelectiveSearchMode = SelectiveSearchMode.fast
    max_proposals: Optional[int] = None  # null: as the checkpoint's data.test
    scales: Optional[list[int]] = None  # test views (shorter sides); null: the checkpoint's data.test.scales
    num_workers: int = 1  # loader processes (they decode the images and run Selective Search)


# The ConfigStore entries: (group or None for a top-level config, name, schema).
SCHEMAS: tuple[tuple[str | None, str, type], ...] = (
    ("data", "base_toy", ToyData),
    ("data", "base_toy_voc", ToyVOCData),
    ("data", "base_voc", VOCData),
    ("data", "base_coco", CocoData),
    ("data", "base_folder", FolderData),
    ("model", "base", Model),
    ("model", "base_resnet_c4", ResNetC4Model),
    ("solver", "base", Solver),
    ("detector", "base", Detector),
    (None, "schema_train", TrainRun),
    (None, "schema_stage2", Stage2Run),
    (None, "schema_stage3", Stage3Run),
    (None, "schema_eval", EvalRun),
    (None, "schema_export", ExportRun),
    (None, "schema_predict", PredictRun),
    (None, "schema_split", SplitRun),
    (None, "schema_rpn_proposals", RpnProposalsRun),
)


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent: a second call replaces the same nodes)."""
    store = ConfigStore.instance()
    for group, name, schema in SCHEMAS:
        store.store(group=group, name=name, node=schema)


def plain(node: DictConfig | Any) -> Any:
    """A config node as plain Python values (dicts, lists, strings for the Enums), resolved: what goes
    into a checkpoint, a json or a builder's keyword arguments."""
    if not isinstance(node, DictConfig):
        return node
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)


register_schemas()
