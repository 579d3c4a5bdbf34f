"""Every config file composes and builds; experiment recipes carry the reference numbers (their match
with docs/RECIPES.md: tests/test_recipes.py); struct mode is on."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from composed import composed
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from wsod.build import build_method, build_model
from wsod.config_checks import PREDICT_RULES, TRAIN_RULES, ConfigError, check_config, flatten, resume_changes
from wsod.config_compat import MOVED_TO_METHOD
from wsod.engine.inference import tta_views
from wsod.modeling import METHODS

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["data", "model", "method", "solver", "experiment"])
def test_every_group_option_composes(group):
    assert _names(group), f"no configs in {group}/"
    for name in _names(group):
        cfg = composed("train", (f"{group}={name}",))
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        assert {"data", "model", "method", "solver", "seed", "output_dir"} <= set(cfg)


@pytest.mark.parametrize("model", _names("model"))
def test_every_model_config_builds_a_detector(model):
    # A misspelt key or value in a model yaml must fail here, not at the start of a user's run. Random
    # weights: ImageNet weights cannot be fetched here and are checked by the backbone tests.
    cfg = _compose("train", [f"model={model}", "model.weights=null"])
    detector = build_model(cfg.model, num_classes=3, method_cfg=cfg.method)
    assert sum(p.numel() for p in detector.parameters()) > 0


@pytest.mark.parametrize("method", _names("method"))
def test_every_method_config_builds_its_method_with_every_setting(method):
    cfg = _compose("train", [f"method={method}"])
    built = build_method(cfg.method)
    assert type(built) is METHODS[cfg.method.name]
    settings = OmegaConf.to_container(cfg.method)
    for key, value in settings.items():  # every setting reaches the method: changing it changes it
        if key in ("name", "num_students"):
            continue
        changed = "kept" if key == "suppress" else value + 1 if isinstance(value, int) else value / 2
        assert build_method({**settings, key: changed}) != built, key
    with pytest.raises(TypeError, match=f"method '{cfg.method.name}'"):
        build_method({**settings, "typo": 1})
    students = 2 if built.trains_students else 0
    detector = build_model(_compose("train", []).model, 3, {**cfg.method, "num_students": students})
    assert len(detector.students) == students


def test_method_settings_live_in_the_method_configs_only():
    # Every setting of a method is in configs/method/ (the student count and weighting included).
    for model in _names("model"):
        keys = set(_compose("train", [f"model={model}"]).model)
        assert not keys & {"num_students", "first_student_loss_weight", "p", "tau", "fg_iou"}, model


def test_a_config_saved_before_the_method_settings_moved_resumes_without_a_change():
    new = OmegaConf.to_container(_compose("train", []), resolve=True)
    saved = {**new, "model": dict(new["model"]), "method": dict(new["method"])}
    for key in MOVED_TO_METHOD:  # where checkpoints before the method seam held them
        saved["model"][key] = saved["method"].pop(key)
    assert resume_changes(saved, new) == []
    changed = {**new, "method": {**new["method"], "first_student_loss_weight": 1.0}}
    assert resume_changes(saved, changed) == ["method.first_student_loss_weight: 3.0 -> 1.0"]  # applied
    with pytest.raises(ConfigError, match="method.num_students: 3 -> 2 .the saved weights hold"):
        resume_changes(saved, {**new, "method": {**new["method"], "num_students": 2}})


def test_a_method_named_by_import_path_passes_the_checks_and_a_misspelt_name_does_not():
    check_config(_compose("train", ["method.name=my_methods:PCL"]), TRAIN_RULES)
    with pytest.raises(
        ConfigError, match="method.name='mits': expected one of mist, oicr, pcl, wsddn, cbl, or an import"
    ):
        check_config(_compose("train", ["method.name=mits"]), TRAIN_RULES)


def test_eval_config_needs_an_explicit_checkpoint():
    cfg = _compose("eval", ["checkpoint=some/model_final.pth", "data=voc07"])
    assert cfg.checkpoint == "some/model_final.pth" and cfg.predictions is None
    assert OmegaConf.is_missing(_compose("eval", []), "checkpoint")


def test_defaults_are_the_cpu_toy_run_with_sequential_backprop():
    cfg = _compose("train", [])
    assert cfg.data.kind == "toy" and cfg.model.backbone == "resnet18" and cfg.model.width == 0.25
    assert cfg.model.chunk_size is not None and cfg.model.neck_norm in ("gn", "frozen_bn")


# (lr, images per step, milestones, max_iter, warm-up) of the reference configs (docs/RECIPES.md).
REFERENCE_SCHEDULES = {
    "voc07": (0.01, 8, [20000, 26700], 30000, 200),
    "voc0712": (0.02, 16, [30000, 35000], 40000, 200),
    "voc12": (0.02, 16, [20000, 26700], 30000, 200),
    "coco14": (0.01, 8, [90000, 120000], 130000, 500),
}


@pytest.mark.parametrize("name", [n for n in _names("experiment") if n.startswith("mist_")])
def test_experiments_carry_the_reference_recipe(name):
    cfg = _compose("train", [f"experiment={name}"])
    s = cfg.solver
    lr, images, milestones, max_iter, warmup = REFERENCE_SCHEDULES[name.split("_")[2]]
    voc = cfg.data.kind == "voc"
    assert (s.optimizer, s.lr, s.momentum, s.weight_decay, s.momentum_rescale) == ("sgd", lr, 0.9, 1e-4, True)
    assert (s.bias_lr_factor, s.bias_weight_decay) == (2.0, 0.0)
    assert (s.warmup_iters, s.warmup_factor) == (warmup, pytest.approx(1 / 3))
    assert (list(s.milestones), s.max_iter, s.gamma) == (milestones, max_iter, 0.1)
    processes = 1 if name.endswith("_1gpu") else 8
    assert processes * s.ims_per_batch * s.accumulation == images
    assert s.ims_per_batch == 1 or not name.endswith("_1gpu")
    assert cfg.seed == 1234
    assert list(cfg.data.train.scales) == [480, 576, 688, 864, 1000, 1200] and cfg.data.train.max_size == 2000
    assert cfg.data.train.flip and cfg.data.kind in ("voc", "coco")
    assert cfg.model.weights == "IMAGENET1K_V1"
    assert cfg.model.get("norm", "frozen_bn") == "frozen_bn"  # ResNet's; VGG16 has no normalisation
    assert cfg.model.dropblock == voc  # the reference's VOC recipes train with DropBlock, COCO's without
    if cfg.model.backbone == "vgg16":
        assert (cfg.model.pooler, cfg.model.roi_size, cfg.model.freeze_at) == ("pool", 7, 2)


@pytest.mark.parametrize(
    "data", [n for n in _names("data") if n not in ("toy", "toy_parts", "toy_voc", "folder")]
)
def test_voc_and_coco_evaluate_with_the_reference_14_views(data):
    # Reference engine/bbox_aug.py: the 800-px test view, its flip, then each BBOX_AUG scale and its flip.
    test = _compose("train", [f"data={data}"]).data.test
    expected = [(s, f) for s in (800, 480, 576, 688, 864, 1000, 1200) for f in (False, True)]
    assert tta_views(list(test.scales), test.flip) == expected and test.max_size == 2000
    toy = _compose("train", []).data.test
    assert tta_views(list(toy.scales), toy.flip) == [(160, False)]


def test_the_folder_config_is_small_data_sized_and_needs_only_its_root():
    cfg = _compose("train", ["data=folder", "data.root=data/my_images"])
    check_config(cfg, TRAIN_RULES)
    test = cfg.data.test
    assert tta_views(list(test.scales), test.flip) == [(576, False)]  # the plain test view
    assert cfg.data.train.num_workers <= 2 and test.num_workers <= 2 and cfg.data.classes is None
    assert OmegaConf.is_missing(_compose("train", ["data=folder"]).data, "root")
    bad = ["data=folder", "data.root=x", "data.classes=[cat,cat]", "data.test.set.split=val"]
    with pytest.raises(ConfigError) as error:
        check_config(_compose("train", bad), TRAIN_RULES)
    assert "data.classes=['cat', 'cat']: expected null or a list of distinct class names" in str(error.value)
    assert "data.test.set.split='val': expected one of train, test" in str(error.value)


def test_the_readme_coco_json_overrides_compose():
    # The second bash block of the own-data guide (linked from the README): its overrides, parsed as the
    # shell would.
    text = (CONFIGS.parent / "docs" / "guides" / "own_data.md").read_text()
    block = re.findall(r"```bash\n(.*?)```", text, re.S)[1]
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:2] == ["python", "tools/train.py"]
    cfg = _compose("train", words[2:])
    assert cfg.data.kind == "coco" and cfg.data.train.sets[0].annotations == "my_train.json"
    assert cfg.data.test.set.proposals == "data/proposals/my_test.pkl"


def test_predict_config_needs_a_checkpoint_and_an_input_and_checks_every_key():
    cfg = _compose("predict", ["checkpoint=runs/r/model_final.pth", "input=photos"])
    check_config(cfg, PREDICT_RULES)
    assert cfg.score_threshold == 0.3 and cfg.proposals is None and cfg.scales is None
    assert set(PREDICT_RULES) <= set(flatten(cfg))  # every rule names a key (bounds; types: the schema)
    with pytest.raises(ConfigCompositionException):
        _compose("predict", ["checkpoint=x", "input=y", "treshold=0.5"])


def test_a_mistyped_override_is_an_error():
    with pytest.raises(ConfigCompositionException):
        _compose("train", ["solver.learning_rate=0.1"])
    with pytest.raises(ConfigCompositionException):
        _compose("train", ["model=r50"])


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (
            ["method=wsddn", "method.num_students=3"],
            "method=wsddn trains no refinement students; it must be 0",
        ),
        (["method=pcl", "method.num_students=0"], "method=pcl trains refinement students; at least 1"),
        (["method=mist", "method.num_students=-1"], "method.num_students=-1: expected an integer >= 0"),
        # The method's own settings: checked by building it, its constructor naming the key.
        (["method=pcl", "method.bg_iou=1.5"], "PCL needs 0 <= bg_iou <= fg_iou <= 1, got bg_iou=1.5"),
        (["method=pcl", "method.kmeans_groups=1"], "PCL's kmeans_groups must be at least 2, got 1"),
    ],
)
def test_method_students_and_pcl_settings_are_checked_naming_the_key(overrides, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)):
        check_config(_compose("train", overrides), TRAIN_RULES)


@pytest.mark.parametrize("method", ["pcl", "wsddn"])
def test_the_pcl_and_wsddn_configs_pass_the_checks_and_build(method):
    cfg = _compose("train", [f"method={method}"])
    check_config(cfg, TRAIN_RULES)
    model = build_model({**OmegaConf.to_container(cfg.model, resolve=True), "weights": None}, 5, cfg.method)
    assert type(model.method).__name__ == {"pcl": "PCLMethod", "wsddn": "WSDDNMethod"}[method]
