"""Settings saved by older versions of wsod, read in today's layout: the one place that knows how a
config or checkpoint written before a setting moved or existed is to be read.

Today's configs always hold every key (their schemas, wsod/config_schema.py, give each its default), so
no other module needs a fallback for a missing key. What reaches the code from an older file passes
through here first:

* ``upgrade_saved_config``: a run's saved config (``metadata["config"]`` of a checkpoint, a run's
  config.yaml): what ``resume_changes`` compares the new config with, and what evaluation reads the
  training split from;
* ``upgrade_model_settings``: a checkpoint's ``metadata["model"]`` and ``metadata["method"]``, from which
  ``wsod.build.load_detector`` rebuilds the model.

Each rule fills a key with the value that reproduces what the older code did, so an old run resumes,
evaluates and predicts exactly as it did (tests/engine/test_legacy_checkpoint.py holds such files).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from wsod.data.folder import SPLIT_SEED, TEST_FRACTION
from wsod.data.toy import PART_PRONE_OBJECT_SIZE

__all__ = ["MOVED_TO_METHOD", "upgrade_saved_config", "upgrade_model_settings"]

# Method settings that checkpoints written before the method seam hold among the model's (``model.<key>``).
MOVED_TO_METHOD = ("num_students", "first_student_loss_weight")
# Checkpoints written before configs/method/ existed held MIST's settings among the model's.
_LEGACY_MIST_KEYS = {"mist_p": "p", "mist_tau": "tau", "mist_suppress": "suppress"}
# The DropBlock square before it was a setting.
_DROPBLOCK_BLOCK_SIZE = 3
# GradNorm as it ran before these settings existed: from step 0, every loss balanced, plain rates, a
# constant learning rate for the weights.
_GRADNORM_BEFORE_ITS_SETTINGS = {
    "start_iter": 0,
    "window": 0,
    "balance": "all",
    "normalize_rates": False,
    "follow_milestones": False,
}
# A folder's seeded split before its settings existed: the rule's constants, as today.
_FOLDER_SPLIT_BEFORE_ITS_SETTINGS = {"split_seed": SPLIT_SEED, "test_fraction": TEST_FRACTION}


def upgrade_model_settings(
    model: Mapping[str, Any], method: Mapping[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint's (model, method) settings in today's layout: older checkpoints held the method's
    settings among the model's (``pseudo_labels``, ``mist_*`` before configs/method/; ``num_students``
    and ``first_student_loss_weight`` before the method seam), and had no ``dropblock_block_size``."""
    model, method = dict(model), dict(method or {})
    if "pseudo_labels" in model:  # written before configs/method/ existed
        method = {"name": model.pop("pseudo_labels"), "fg_iou": model.pop("fg_iou", 0.5)}
        mist = {key: model.pop(old) for old, key in _LEGACY_MIST_KEYS.items() if old in model}
        if method["name"] == "mist":
            method.update(mist)
    for key in MOVED_TO_METHOD:
        if key in model:
            method.setdefault(key, model.pop(key))
    if "dropblock" in model:
        model.setdefault("dropblock_block_size", _DROPBLOCK_BLOCK_SIZE)
    return model, method


def upgrade_saved_config(saved: Mapping[str, Any], like: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A saved (plain, nested) config in today's layout, each added key filled as the older code ran.
    ``like``: the config it is compared with (a resume's), whose ROI sampling an older config without
    one takes (below). ``saved`` itself is not changed."""
    config = copy.deepcopy(dict(saved))
    if isinstance(config.get("model"), Mapping):
        config["model"], config["method"] = upgrade_model_settings(config["model"], config.get("method"))
        if "backbone" in config["model"]:  # a first-stage model: before the EMA teacher, the student
            config["model"].setdefault("eval_weights", "student")
        if str(config["model"].get("backbone", "")).startswith("resnet"):  # before the key: pooled
            config["model"].setdefault("stem_pool", True)
    if isinstance(config.get("detector"), Mapping):  # before the key: torchvision's fraction, fixed
        config["detector"].setdefault("rpn_positive_fraction", 0.5)
        config["detector"].setdefault("stem_pool", True)  # before the key: torchvision's stem
    solver = config.get("solver")
    if isinstance(solver, Mapping) and isinstance(solver.get("gradnorm"), Mapping):
        for key, value in _GRADNORM_BEFORE_ITS_SETTINGS.items():
            solver["gradnorm"].setdefault(key, value)
    data = config.get("data")
    if isinstance(data, Mapping):
        if data.get("kind") == "folder":
            for key, value in _FOLDER_SPLIT_BEFORE_ITS_SETTINGS.items():
                data.setdefault(key, value)
        if data.get("kind") == "toy":
            # Before object_size: the toy set drew its objects at 25-70 px (data=toy_parts now).
            data.setdefault("object_size", list(PART_PRONE_OBJECT_SIZE))
            # Before toy sets took a proposal file: their own Selective Search.
            train_sets = (data.get("train") or {}).get("sets")
            test_set = (data.get("test") or {}).get("set")
            for node in [*(train_sets if isinstance(train_sets, list) else []), test_set]:
                if isinstance(node, dict):
                    node.setdefault("proposals", None)
        train = data.get("train")
        if isinstance(train, Mapping):
            train.setdefault("views", 1)  # before views: one view per image, the same run
            train.setdefault("min_proposal_size", 2.0)  # before the key: the datasets' fixed 2 pixels
        # Before partial labels: no roi_sampling, train sets without partial_labels. Sampling acts only on
        # images with points or scribbles, which such a run had none of: the same run with them off.
        if isinstance(train, Mapping) and isinstance(train.get("sets"), list) and "roi_sampling" not in train:
            new_train = ((like or {}).get("data") or {}).get("train") or {}
            if "roi_sampling" in new_train:
                train["roi_sampling"] = copy.deepcopy(new_train["roi_sampling"])
            train["sets"] = [
                {**s, "partial_labels": None} if isinstance(s, Mapping) and "partial_labels" not in s else s
                for s in train["sets"]
            ]
    return config
