"""Check a composed config before anything runs, and decide what a resumed run may change.

The schemas (wsod/config_schema.py) say each key's type and choices: Hydra converts a command-line value
to the declared type or refuses it, naming the key (``solver.lr=abc``, ``solver.max_iter=2.5``,
``solver.optimizer=adam``). What a schema cannot say is here: bounds (``solver.lr`` > 0, an odd
DropBlock square), rules between keys (milestones within ``max_iter``, ``chunk_size=auto`` and its
budget, students and partial labels for the method), and the resume policy. ``check_config`` names every
such problem at once, before a directory is made or a file is read. The method node, whose keys are its
class's arguments, is checked by building the method; GradNorm's node by building its balancer when it
is on. Keys a config does not have are not checked (a VGG16 model has no ``width``).

``resume_changes`` compares the settings a checkpoint was trained with to the new ones: each change is
either applied for real by the training code (and listed) or refused with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

# The choice lists come from the lowest modules that own them, never from wsod.build: the builder imports
# every part of wsod, and the checks must run before any of it is needed (tests/test_imports.py).
from wsod.config_compat import upgrade_saved_config
from wsod.config_schema import plain
from wsod.data.folder import SPLITS as FOLDER_SPLITS
from wsod.data.formats import DATASET_FORMATS
from wsod.engine.balancing import LossBalancer
from wsod.modeling import BACKBONES, METHODS
from wsod.modeling.detector import partial_label_readers, resolve_method_class

__all__ = [
    "ConfigError",
    "check_config",
    "resume_changes",
    "flatten",
    "TRAIN_RULES",
    "EVAL_RULES",
    "PREDICT_RULES",
    "EXPORT_RULES",
    "SPLIT_RULES",
    "RPN_PROPOSALS_RULES",
    "STAGE3_RULES",
    "STAGE2_RULES",
]


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names every such key."""


@dataclass(frozen=True)
class _Rule:
    accepts: Callable[[Any], bool]
    expected: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _bounds(low: float | None, high: float | None, above: bool = False) -> str:
    parts = ([f"{'>' if above else '>='} {low}"] if low is not None else []) + (
        [f"<= {high}"] if high is not None else []
    )
    return "".join(" " + " and ".join(parts)) if parts else ""


def _in_range(value: float, low: float | None, high: float | None, above: bool = False) -> bool:
    return (low is None or (value > low if above else value >= low)) and (high is None or value <= high)


def _integer(low: int | None = None, high: int | None = None, optional: bool = False) -> _Rule:
    return _Rule(
        lambda v: (optional and v is None) or (_is_int(v) and _in_range(v, low, high)),
        f"{'null or ' if optional else ''}an integer{_bounds(low, high)}",
    )


def _iterations(example: str) -> _Rule:
    return _Rule(
        lambda v: isinstance(v, list | tuple) and all(_is_int(i) and i >= 1 for i in v),
        f"a list of iterations >= 1, e.g. {example}",
    )


def _number(low: float | None = None, high: float | None = None, *, above: bool = False) -> _Rule:
    return _Rule(
        lambda v: _is_number(v) and _in_range(v, low, high, above), f"a number{_bounds(low, high, above)}"
    )


_ODD_SIZE = _Rule(lambda v: _is_int(v) and v >= 1 and v % 2 == 1, "an odd integer >= 1")


def _choice(*options: Any) -> _Rule:
    return _Rule(
        lambda v: v in options, "one of " + ", ".join("null" if o is None else str(o) for o in options)
    )


def _path(example: str) -> _Rule:
    """A path given as a string (not the ``???`` of a required key left out)."""
    return _Rule(lambda v: isinstance(v, str) and v.strip() not in ("", "???"), f"a path, e.g. {example}")


def _optional_path(expected: str) -> _Rule:
    return _Rule(lambda v: v is None or _path("").accepts(v), expected)


def _name(example: str) -> _Rule:
    """A non-empty string that names something the code looks up later (an image set, weights)."""
    return _Rule(lambda v: isinstance(v, str) and v.strip() not in ("", "???"), f"a name, e.g. {example}")


_CLASSES = _Rule(
    lambda v: (
        v is None
        or (
            isinstance(v, list | tuple)
            and len(v) > 0
            and all(isinstance(c, str) and c.strip() for c in v)
            and len(set(v)) == len(v)
        )
    ),
    "null or a list of distinct class names, e.g. [cat,dog]",
)
_CLASSES_OR_EMPTY = _Rule(
    lambda v: v is None or (isinstance(v, list | tuple) and all(isinstance(c, str) and c.strip() for c in v)),
    "a list of class names, e.g. [bottle,chair] (or [] for none)",
)
_SPLIT = _choice(*FOLDER_SPLITS)
# A VOC year: a string in a composed config (its schema types it; Hydra converts 2012 to "2012"), a number
# in a config given as plain values.
_VOC_YEAR = _Rule(
    lambda v: (_is_int(v) and v > 0) or (isinstance(v, str) and v.strip().isdigit()), "a VOC year, e.g. 2007"
)
_FOLDER_SETS = _Rule(
    lambda v: (
        isinstance(v, list | tuple)
        and len(v) > 0
        and all(not isinstance(s, dict) or s.get("split", FOLDER_SPLITS[0]) in FOLDER_SPLITS for s in v)
    ),
    f"a non-empty list of sets; a folder set's split is one of {', '.join(FOLDER_SPLITS)}",
)
_SCALES = _Rule(
    lambda v: isinstance(v, list | tuple) and len(v) > 0 and all(_is_int(s) and s > 0 for s in v),
    "a non-empty list of positive integers, e.g. [480,576]",
)
_MILESTONES = _Rule(
    lambda v: (
        isinstance(v, list | tuple)
        and all(_is_int(s) and s > 0 for s in v)
        and all(a < b for a, b in zip(v, v[1:], strict=False))
    ),
    "a list of increasing positive integers, e.g. [20000,26700] (or [] for none)",
)


def _device(value: Any) -> bool:
    if value == "auto":
        return True
    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        return False
    return True


_COMMON = {
    "device": _Rule(_device, "auto, cpu, cuda or cuda:N"),
    "threads": _Rule(
        lambda v: v is None or v == "auto" or (_is_int(v) and v >= 0),
        "auto, null or an integer >= 0 (0, null: torch's default)",
    ),
    "data.kind": _Rule(  # read at each check: a format registered after import is accepted
        lambda v: v in DATASET_FORMATS,
        "a registered dataset format (wsod.data.formats.DATASET_FORMATS: toy, toy_voc, voc, coco, folder"
        " or yours)",
    ),
    "data.root": _path("data.root=data/my_images"),
    "data.classes": _CLASSES,
    "data.split_seed": _integer(0),
    "data.generator_seed": _integer(0),
    "data.test_fraction": _Rule(lambda v: _is_number(v) and 0 < v < 1, "a number > 0 and < 1, e.g. 0.2"),
    "data.devkit": _path("data.devkit=data/VOCdevkit"),
    "data.test.set.split": _SPLIT,
    "data.test.set.year": _VOC_YEAR,
    "data.test.set.image_set": _name("data.test.set.image_set=test"),
    # null only where the schema allows it (the toy: its generated Selective Search).
    "data.test.set.proposals": _optional_path(
        "a path, e.g. data.test.set.proposals=data/proposals/my_test.pkl"
    ),
    "data.test.set.annotations": _path("data.test.set.annotations=data/coco/my_test.json"),
    "data.test.set.images": _path("data.test.set.images=data/coco/val2017"),
    "data.num_train": _integer(1),
    "data.num_test": _integer(1),
    "data.test.scales": _SCALES,
    "data.test.max_size": _integer(1, optional=True),
    "data.test.max_proposals": _integer(1, optional=True),
    "data.test.min_proposal_size": _number(0),
    "data.test.batch_size": _integer(1),
    "data.test.num_workers": _integer(0),
    # The data group is shared: an evaluation composes data.train too, unused there but checked alike.
    "data.train.sets": _FOLDER_SETS,
    "data.train.scales": _SCALES,
    "data.train.max_size": _integer(1, optional=True),
    "data.train.max_proposals": _integer(1, optional=True),
    "data.train.min_proposal_size": _number(0),
    "data.train.num_workers": _integer(0),
    "data.train.lighting_std": _number(0),
    "data.train.views": _integer(1),
    "data.train.roi_sampling.rois_per_image": _integer(1),
    "data.train.roi_sampling.positive_fraction": _Rule(
        lambda v: _is_number(v) and 0 < v <= 1, "a number > 0 and <= 1, e.g. 0.25"
    ),
    "output_dir": _optional_path("null or a folder, e.g. output_dir=runs/my_run"),
}

TRAIN_RULES: dict[str, _Rule] = {
    **_COMMON,
    "seed": _integer(0),
    "log_period": _integer(1),
    "checkpoint_period": _integer(0),
    "keep_checkpoints": _integer(1),
    "keep_at": _iterations("[12000]"),
    "eval_period": _integer(0),
    "max_nonfinite": _integer(1),
    "pseudo_label_preview.period": _integer(0),
    "pseudo_label_preview.images": _integer(1),
    "model.backbone": _choice(*BACKBONES),
    "model.weights": _Rule(
        lambda v: v is None or _name("").accepts(v),
        "null, a torchvision weights name (e.g. IMAGENET1K_V1) or a local .pth path",
    ),
    "model.width": _number(0, above=True),
    "model.freeze_at": _integer(0, 5),
    "data.base_freeze_at": _integer(0, 5),
    "data.heads_lr": _number(0, above=True),
    "data.heads_max_iter": _integer(1),
    "data.heads_milestones": _iterations("[2400]"),
    "model.roi_size": _integer(1),
    "model.chunk_size": _Rule(
        lambda v: v is None or v == "auto" or (_is_int(v) and v >= 1), "null, auto or an integer >= 1"
    ),
    "model.memory_budget_gb": _Rule(
        lambda v: v is None or (_is_number(v) and v > 0), "null or a number > 0 (GB, with chunk_size=auto)"
    ),
    "model.test_chunk_size": _integer(1, optional=True),
    "model.dropblock_hidden": _integer(1, optional=True),
    "model.dropblock_block_size": _ODD_SIZE,
    "model.nms_iou": _number(0, 1),
    "model.score_threshold": _number(0, 1),
    "model.detections_per_image": _integer(1),
    "method.name": _Rule(
        lambda v: v in METHODS or (isinstance(v, str) and (":" in v or "." in v)),
        f"one of {', '.join(METHODS)}, or an import path module:ClassName of your own method",
    ),
    "method.num_students": _integer(0),  # 0 only for a method without students (_student_problems)
    # The method's other keys are its class's keyword arguments: checked by building it (_method_problems),
    # as GradNorm's are by building its balancer (_gradnorm_problems).
    "solver.lr": _number(0, above=True),
    "solver.momentum": _number(0, 1),
    "solver.weight_decay": _number(0),
    "solver.bias_lr_factor": _number(0),
    "solver.bias_weight_decay": _number(0),
    "solver.ims_per_batch": _integer(1),
    "solver.accumulation": _integer(1),
    "solver.max_iter": _integer(1),
    "solver.milestones": _MILESTONES,
    "solver.gamma": _number(0, above=True),
    "solver.warmup_iters": _integer(0),
    "solver.warmup_factor": _number(0, 1, above=True),
    # 1 would never move the teacher (wsod.engine.ema.EMATeacher refuses it too).
    "solver.ema.momentum": _Rule(lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "solver.dropblock.lr": _number(0, above=True),
    "solver.dropblock.momentum": _number(0, 1),
    "solver.dropblock.weight_decay": _number(0),
    "solver.dropblock.bias_lr_factor": _number(0),
    "solver.dropblock.bias_weight_decay": _number(0),
    "solver.dropblock.gamma": _number(0, above=True),
    "solver.dropblock.warmup_iters": _integer(0),
    "solver.dropblock.warmup_factor": _number(0, 1, above=True),
    "solver.dropblock.weight": _number(0),
}

EVAL_RULES: dict[str, _Rule] = {
    **_COMMON,
    "checkpoint": _path("checkpoint=runs/my_run/model_final.pth"),
    "predictions": _optional_path("null or the predictions.pth of an earlier evaluation of the checkpoint"),
}

PREDICT_RULES: dict[str, _Rule] = {
    "device": _COMMON["device"],
    "threads": _COMMON["threads"],
    "checkpoint": _path("checkpoint=runs/my_run/model_final.pth"),
    "input": _path("input=data/my_images/images"),
    "output": _optional_path("null or a folder, e.g. runs/my_predictions"),
    "score_threshold": _number(0, 1),
    "proposals": _optional_path("null or a proposal file or store"),
    "max_proposals": _integer(1, optional=True),
    "scales": _Rule(lambda v: v is None or _SCALES.accepts(v), "null or " + _SCALES.expected),
    "num_workers": _integer(0),
}


_RUN_KEYS = (
    "seed", "log_period", "checkpoint_period", "keep_checkpoints", "keep_at", "eval_period", "max_nonfinite",
)  # fmt: skip
# tools/train_stage2.py (configs/stage2.yaml, configs/detector/): the run and solver keys as training's.
STAGE2_RULES: dict[str, _Rule] = {
    **_COMMON,
    **{key: TRAIN_RULES[key] for key in _RUN_KEYS},
    **{  # the solver's own keys; the second stage has no DropBlock step, no GradNorm, no EMA teacher
        key: rule
        for key, rule in TRAIN_RULES.items()
        if key.startswith("solver.") and key.split(".")[1] not in ("dropblock", "gradnorm", "ema")
    },
    "pseudo_labels": _path("pseudo_labels=runs/my_run/pseudo_labels/pseudo_labels.json"),
    "detector.name": _choice("faster_rcnn"),
    "detector.backbone": _choice("resnet18", "resnet34", "resnet50", "resnet101"),
    "detector.width": _number(0, above=True),
    "detector.weights": TRAIN_RULES["model.weights"],
    "detector.freeze_at": _integer(0, 5),
    "detector.fpn_channels": _integer(1),
    "detector.anchor_sizes": _Rule(
        lambda v: isinstance(v, list | tuple) and len(v) == 5 and all(_is_int(s) and s > 0 for s in v),
        "five positive integers, one anchor size per FPN level P2..P6, e.g. [32,64,128,256,512]",
    ),
    "detector.aspect_ratios": _Rule(
        lambda v: isinstance(v, list | tuple) and len(v) > 0 and all(_is_number(s) and s > 0 for s in v),
        "a non-empty list of positive numbers, e.g. [0.5,1.0,2.0]",
    ),
    "detector.rpn_pre_nms_top_n_train": _integer(1),
    "detector.rpn_post_nms_top_n_train": _integer(1),
    "detector.rpn_pre_nms_top_n_test": _integer(1),
    "detector.rpn_post_nms_top_n_test": _integer(1),
    "detector.rpn_batch_size_per_image": _integer(1),
    "detector.rpn_positive_fraction": _Rule(lambda v: _is_number(v) and 0 < v <= 1, "a number > 0 and <= 1"),
    "detector.box_batch_size_per_image": _integer(1),
    "detector.representation_size": _integer(1),
    "detector.nms_iou": _number(0, 1),
    "detector.score_threshold": _number(0, 1),
    "detector.detections_per_image": _integer(1),
}

# tools/export_pseudo_labels.py (configs/export.yaml).
EXPORT_RULES: dict[str, _Rule] = {
    **{key: rule for key, rule in _COMMON.items() if key != "random_baseline"},
    "checkpoint": _optional_path("checkpoint=runs/my_run/model_final.pth"),
    "rule.min_score": _number(0, 1),
    "rule.containment": _Rule(
        lambda v: v is None or (_is_number(v) and 0 < v <= 1), "null or a number > 0 and <= 1"
    ),
    "rule.containment_exempt": _CLASSES_OR_EMPTY,
    "detections_per_image": _integer(1, optional=True),
}


def _export_source_problems(flat: Mapping[str, Any]) -> list[str]:
    """tools/export_pseudo_labels.py reads boxes from exactly one place: a checkpoint or the annotations."""
    checkpoint, truth = flat.get("checkpoint"), flat.get("ground_truth")
    if truth is True and checkpoint is not None:
        return [
            f"checkpoint={_show(checkpoint)} with ground_truth=true: the boxes come from one of them; drop"
            " the checkpoint to write the annotated boxes, or ground_truth=true to export the checkpoint's"
        ]
    if truth is True and flat.get("output_dir") is None:
        return ["output_dir=null with ground_truth=true: name the folder, e.g. output_dir=runs/true_boxes"]
    if truth is not True and checkpoint is None:
        return [
            "checkpoint=null: name a trained run's checkpoint (checkpoint=runs/my_run/model_final.pth),"
            " or ground_truth=true output_dir=runs/true_boxes for the annotated boxes"
        ]
    return []


_FASTER_RCNN_LOSSES = ("loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg")
# tools/train_stage3.py (configs/stage3.yaml): the second stage's keys, its EMA teacher's, its own.
STAGE3_RULES: dict[str, _Rule] = {
    **STAGE2_RULES,
    **{key: rule for key, rule in TRAIN_RULES.items() if key.startswith("solver.ema.")},
    "initial_weights": _path("initial_weights=runs/my_stage2/model_final.pth"),
    "split": _path("split=runs/my_run/pseudo_labels/split.json"),
    "semi_supervised.unlabelled_per_batch": _integer(1),
    "semi_supervised.score_threshold": _Rule(lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "semi_supervised.focal_gamma": _number(0),
    **{f"semi_supervised.unlabelled_weights.{name}": _number(0) for name in _FASTER_RCNN_LOSSES},
    "semi_supervised.eval_weights": _choice("teacher", "student"),
    "solver.ema.enabled": _Rule(
        lambda v: v is True, "true: the third stage's teacher labels its unlabelled images"
    ),
}

# tools/split_pseudo_labels.py (configs/split.yaml).
SPLIT_RULES: dict[str, _Rule] = {
    **{key: rule for key, rule in _COMMON.items() if key != "random_baseline"},
    "checkpoint": _path("checkpoint=runs/my_stage2/model_0001500.pth"),
    "pseudo_labels": _path("pseudo_labels=runs/my_run/pseudo_labels/pseudo_labels.json"),
    "k": _integer(1),
    "output_dir": _optional_path("null or a folder, e.g. runs/my_run/pseudo_labels"),
    "scale": _integer(1, optional=True),
    "positive_fraction": _Rule(lambda v: _is_number(v) and 0 < v <= 1, "a number > 0 and <= 1"),
    "seed": _integer(0),
}


# tools/rpn_proposals.py (configs/rpn_proposals.yaml).
RPN_PROPOSALS_RULES: dict[str, _Rule] = {
    **{key: rule for key, rule in _COMMON.items() if key != "random_baseline"},
    "checkpoint": _path("checkpoint=runs/my_stage2/model_final.pth"),
    "output_dir": _optional_path("null or a folder, e.g. runs/my_stage2/rpn_proposals"),
    "scale": _integer(1, optional=True),
    "pre_nms_top_n": _integer(1),
    "post_nms_top_n": _integer(1),
    "nms_iou": _Rule(lambda v: _is_number(v) and 0 < v <= 1, "a number > 0 and <= 1"),
}


def flatten(node: Mapping[str, Any] | DictConfig, prefix: str = "") -> dict[str, Any]:
    """Nested config -> ``{"solver.lr": 0.01, ...}``; lists stay values."""
    if isinstance(node, DictConfig):
        node = plain(node)
    flat: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _show(value: Any) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)


def check_config(cfg: DictConfig | Mapping[str, Any], rules: Mapping[str, _Rule] = TRAIN_RULES) -> None:
    """Raise ``ConfigError`` naming every key of ``cfg`` whose value ``rules`` refuse (and the training
    schedule's cross-key rules); return quietly when everything fits."""
    values = plain(cfg) if isinstance(cfg, DictConfig) else dict(cfg)  # converted once
    flat = flatten(values)
    problems = [
        f"{key}={_show(flat[key])}: expected {rule.expected}"
        for key, rule in rules.items()
        if key in flat and not rule.accepts(flat[key])
    ]
    max_iter, milestones = flat.get("solver.max_iter"), flat.get("solver.milestones")
    if (
        rules in (TRAIN_RULES, STAGE2_RULES)
        and TRAIN_RULES["solver.max_iter"].accepts(max_iter)
        and _MILESTONES.accepts(milestones)
        and any(m > max_iter for m in milestones)
    ):
        problems.append(
            f"solver.milestones={_show(milestones)}: beyond solver.max_iter={max_iter}; a learning-rate step"
            " after the last iteration never happens (shorten them too, e.g."
            f" solver.milestones=[{max(1, max_iter * 4 // 5)}])"
        )
    if rules is TRAIN_RULES:
        problems += _auto_chunk_problems(flat)
        problems += _student_problems(flat)
        problems += _partial_label_problems(flat)
        problems += _teacher_problems(flat)
        method, method_problems = _method_problems(values.get("method"))
        problems += method_problems + _gradnorm_problems(values, method)
    if rules is EXPORT_RULES:
        problems += _export_source_problems(flat)
    problems += _base_stem_problems(flat)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def _method_problems(method: Mapping[str, Any] | None) -> tuple[Any, list[str]]:
    """``(the method, [])`` when the method node builds (``name`` picks the class, the other keys but
    ``num_students`` are its keyword arguments, whose constructor checks their values), else
    ``(None, [the reason])``. A method that names its own settings checks them itself."""
    options = dict(method or {})
    if not options:
        return None, []
    options.pop("num_students", None)  # the detector's
    name = options.pop("name", None)
    try:
        method_class = resolve_method_class(name)
    except (ValueError, TypeError):  # the method.name rule says what is expected
        return None, []
    try:
        return method_class(**options), []
    except (TypeError, ValueError) as error:
        return None, [f"method={name} ({method_class.__name__}) refuses its settings: {error}"]


def _gradnorm_problems(values: Mapping[str, Any], method: Any) -> list[str]:
    """GradNorm's settings (``solver.gradnorm``), checked by building its balancer for the detector's
    losses (the MIL loss, then the method's) when it is on. ``values``: the plain config."""
    settings = dict((values.get("solver") or {}).get("gradnorm") or {})
    students = (values.get("method") or {}).get("num_students")
    if not settings.pop("enabled", False) or method is None or not _is_int(students):
        return []
    settings.pop("follow_milestones", None)  # a schedule, not a constructor argument
    try:
        num_losses = 1 + len(method.loss_names(students))
        LossBalancer(num_losses, **settings)
    except (TypeError, ValueError) as error:
        return [f"solver.gradnorm: {error}"]
    return []


def _base_stem_problems(flat: Mapping[str, Any]) -> list[str]:
    """A model loading the data's pretrained toy base (toy_voc's ``data.base_weights``) must build its
    stem as the base was trained: the weights file cannot tell (the max pooling has no parameters), and
    a mismatch would silently feed every stage features at twice or half the scale they learnt."""
    base, pooled = flat.get("data.base_weights"), flat.get("data.base_stem_pool")
    problems = []
    for node in ("model", "detector"):
        stem_pool = flat.get(f"{node}.stem_pool")
        if base is None or pooled is None or stem_pool is None or flat.get(f"{node}.weights") != base:
            continue
        if stem_pool != pooled:
            want = str(pooled).lower()  # as an override is typed
            problems.append(
                f"{node}.stem_pool={str(stem_pool).lower()}: {node}.weights is the data's toy base"
                f" ({base}), pretrained with data.base_stem_pool={want}; drop the override, or set"
                f" {node}.stem_pool={want}"
            )
    return problems


def _teacher_problems(flat: Mapping[str, Any]) -> list[str]:
    """Evaluating the EMA teacher needs one, as does a method that learns from it (CBL), and a teacher
    that follows nothing is a frozen copy."""
    problems = []
    eval_weights = flat.get("model.eval_weights", "student")
    if eval_weights != "student" and not flat.get("solver.ema.enabled", False):
        problems.append(
            f"model.eval_weights={eval_weights}: evaluates the EMA teacher, which this run does not train;"
            " set solver.ema.enabled=true, or model.eval_weights=student"
        )
    name = flat.get("method.name")
    if name in METHODS and METHODS[name].needs_teacher and not flat.get("solver.ema.enabled", False):
        problems.append(
            f"method.name={name}: learns from an EMA teacher, which this run does not train; set"
            f" solver.ema.enabled=true (configs/method/{name}.yaml does)"
        )
    if flat.get("solver.ema.enabled", False) and not flat.get("solver.ema.follow"):
        problems.append(
            "solver.ema.follow=[]: the teacher would follow no module (a frozen copy of the initial"
            " weights); list some of backbone, neck, heads"
        )
    return problems


def _student_problems(flat: Mapping[str, Any]) -> list[str]:
    """A built-in method's students: none for WSDDN (the teacher alone), at least one for the others."""
    name, students = flat.get("method.name"), flat.get("method.num_students")
    if name not in METHODS or not _is_int(students):
        return []  # a user's method decides itself (its detector refuses what it cannot train)
    if not METHODS[name].trains_students and students != 0:
        return [f"method.num_students={students}: method={name} trains no refinement students; it must be 0"]
    if METHODS[name].trains_students and students < 1:
        return [f"method.num_students={students}: method={name} trains refinement students; at least 1"]
    return []


def _partial_label_problems(flat: Mapping[str, Any]) -> list[str]:
    """A train set's partial-label side file for a method whose class declares it does not read them
    (``RefinementMethod.reads_partial_labels``): refused here, before anything is built, whatever share
    of the images the file labels. The detector's own check fires only on a batch holding a labelled
    image: at a random step, or never, when few images are labelled (the run then ends with the labels
    silently unused)."""
    sets = flat.get("data.train.sets")
    files = [
        (i, s["partial_labels"])
        for i, s in enumerate(sets if isinstance(sets, list | tuple) else [])
        if isinstance(s, Mapping) and s.get("partial_labels") is not None
    ]
    if not files:
        return []
    name = flat.get("method.name")
    try:
        method_class = resolve_method_class(name)
    except (ValueError, TypeError):  # an unknown name: the method rule, or the build, says so in full
        return []
    if method_class.reads_partial_labels:
        return []
    readers = partial_label_readers()
    return [
        f"data.train.sets.{i}.partial_labels={_show(path)}: method={name} ({method_class.__name__}) does not"
        f" read partial labels (points, scribbles, boxes) and would train on the image labels alone; train"
        f" with a method that reads them ({readers}) or drop data.train.sets.{i}.partial_labels"
        for i, path in files
    ]


def _auto_chunk_problems(flat: Mapping[str, Any]) -> list[str]:
    """``model.memory_budget_gb`` belongs to ``model.chunk_size=auto``, which needs it off CUDA."""
    chunk, budget = flat.get("model.chunk_size"), flat.get("model.memory_budget_gb")
    device = flat.get("device")
    if budget is not None and chunk != "auto":
        return [
            f"model.memory_budget_gb={_show(budget)}: used only with model.chunk_size=auto (chunk_size is"
            f" {_show(chunk)}); set model.chunk_size=auto or model.memory_budget_gb=null"
        ]
    if chunk != "auto" or budget is not None or device is None or not _device(device):
        return []
    on_cuda = torch.cuda.is_available() if device == "auto" else torch.device(device).type == "cuda"
    if not on_cuda:
        return [
            f"model.chunk_size=auto on device={_show(device)} (no CUDA) needs model.memory_budget_gb: the GB"
            " the ROI pooling and neck may use (only CUDA measures its free memory), e.g."
            " model.memory_budget_gb=4"
        ]
    return []


# What a resumed run may not change: the saved weights, optimizer state and position in the data belong
# to these settings. Everything else is applied for real (the learning-rate schedule and optimizer
# hyperparameters are rebuilt at the restored iteration; periods, evaluation and logging are read anew).
_FIXED_ON_RESUME = {
    "seed": "the data order and every augmentation are drawn from the seed",
    "solver.optimizer": "the saved optimizer state belongs to the saved optimizer",
    "solver.ims_per_batch": "the position in the data is counted in batches",
    "solver.accumulation": "the position in the data is counted in batches",
    "data.kind": "the training data must be the checkpoint's",
    "data.root": "the training data must be the checkpoint's",
    "data.devkit": "the training data must be the checkpoint's",
    "data.classes": "the class indices of the saved heads must be the checkpoint's",
    "data.split_seed": "the seeded split of a folder without a split column chose the training images",
    "data.test_fraction": "the seeded split of a folder without a split column chose the training images",
    "data.num_train": "the training data must be the checkpoint's",
    "data.num_test": "the toy set must be the checkpoint's",
    "data.object_size": "the toy set must be the checkpoint's",
    "data.generator_seed": "the VOC-like set's images must be the checkpoint's",
    "data.train": "the training images, their order and their augmentation must be the checkpoint's",
    "model": "the saved weights belong to the saved architecture",
    "method.num_students": "the saved weights hold that many students",
    "detector": "the saved weights belong to the saved architecture",
    "pseudo_labels": "the training boxes must be the checkpoint's",
    "split": "the labelled and unlabelled images must be the checkpoint's",
}
# Inside those prefixes, these may change: they do not touch weights or data order.
_FREE_ON_RESUME = (
    "data.train.num_workers",
    "model.eval_weights",  # which weights evaluations read; no weight depends on it
    "model.chunk_size",
    "model.test_chunk_size",
    "model.memory_budget_gb",
    "model.weights",
    "detector.weights",
)


def _unused_dropblock_setting(key: str, old_flat: Mapping[str, Any], new_flat: Mapping[str, Any]) -> bool:
    """A DropBlock setting of a run without DropBlock, before and after: no weight depends on it."""
    unused = not old_flat.get("model.dropblock", False) and not new_flat.get("model.dropblock", False)
    return unused and key in ("model.dropblock_hidden", "model.dropblock_block_size")


def resume_changes(saved: Mapping[str, Any] | DictConfig, new: Mapping[str, Any] | DictConfig) -> list[str]:
    """The settings that differ between a checkpoint's config and the new one, as printable lines.

    Raises ``ConfigError`` naming every change a resumed run cannot honour, with the reason. Run
    bookkeeping (``resume``, ``output_dir``, ``trust_checkpoint``) is ignored.
    """
    new_plain = plain(new) if isinstance(new, DictConfig) else dict(new)
    old_flat = flatten(
        upgrade_saved_config(plain(saved) if isinstance(saved, DictConfig) else saved, new_plain)
    )
    new_flat = flatten(new_plain)
    changes, refused = [], []
    for key in sorted(set(old_flat) | set(new_flat)):
        if key in ("resume", "output_dir", "trust_checkpoint"):
            continue
        before, after = old_flat.get(key, "<absent>"), new_flat.get(key, "<absent>")
        if before == after:
            continue
        line = f"{key}: {_show(before)} -> {_show(after)}"
        fixed = (why for prefix, why in _FIXED_ON_RESUME.items() if f"{key}.".startswith(f"{prefix}."))
        reason = next(fixed, None)
        if (
            reason is not None
            and key not in _FREE_ON_RESUME
            and not _unused_dropblock_setting(key, old_flat, new_flat)
        ):
            refused.append(f"{line} ({reason})")
        else:
            changes.append(line)
    if refused:
        raise ConfigError(
            "cannot resume with these settings changed since the checkpoint:\n  "
            + "\n  ".join(refused)
            + "\nrestore them, or start a new run in another output_dir"
        )
    return changes
