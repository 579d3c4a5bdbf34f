"""wsod/config_checks.py: every key of every composed config has a rule (and every rule a key), the
checks import no builder, model.chunk_size=auto and model.memory_budget_gb (the other rules are exercised
through tools/train.py in test_reliability.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from composed import composed
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from wsod.config_checks import (
    EVAL_RULES,
    EXPORT_RULES,
    PREDICT_RULES,
    STAGE2_RULES,
    STAGE3_RULES,
    TRAIN_RULES,
    ConfigError,
    check_config,
    flatten,
    resume_changes,
)
from wsod.modeling import METHODS
from wsod.modeling.pcl import PCLMethod
from wsod.modeling.refinement import MISTMethod

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
RULES = {
    "train": ("TRAIN_RULES", TRAIN_RULES),
    "eval": ("EVAL_RULES", EVAL_RULES),
    "predict": ("PREDICT_RULES", PREDICT_RULES),
    "export": ("EXPORT_RULES", EXPORT_RULES),
    "stage2": ("STAGE2_RULES", STAGE2_RULES),
}


def _config(overrides: list[str], name: str = "train"):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _composed(name: str, overrides: tuple[str, ...]):
    """The session's one read-only composition (tests/composed.py): the coverage tests only read it."""
    return composed(name, overrides)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


# Every config a user can compose from the repository's files: each entry point's defaults, training
# with each option of each group and each experiment, evaluation with each data option (eval.yaml has
# no other group); predict has none.
COMPOSED = (
    [("train", []), ("eval", []), ("predict", [])]
    + [("train", [f"{group}={option}"]) for group in ("data", "model", "method", "solver", "experiment")
       for option in _options(group)]
    + [("eval", [f"data={option}"]) for option in _options("data")]
    + [("export", []), ("stage2", [])]
    + [("export", [f"data={option}"]) for option in _options("data")]
    + [("stage2", [f"{group}={option}"]) for group in ("data", "detector", "stage2_experiment")
       for option in _options(group)]
)  # fmt: skip


@functools.cache
def _keys(name: str, overrides: tuple[str, ...]) -> frozenset[str]:
    return frozenset(flatten(_composed(name, overrides)))


def _untyped_keys(node, prefix: str = "") -> list[str]:
    """The keys of ``node`` no dataclass schema declares (below the method node, whose keys are its
    class's arguments)."""
    found = []
    typed = dataclasses.is_dataclass(OmegaConf.get_type(node))
    for key in node:
        name = f"{prefix}{key}"
        if name == "method":
            continue
        child = node._get_node(key)
        if not typed:
            found.append(name)
        if isinstance(child, DictConfig):
            found += _untyped_keys(child, f"{name}.")
    return found


@pytest.mark.parametrize(("name", "overrides"), COMPOSED, ids=[f"{n} {' '.join(o)}" for n, o in COMPOSED])
def test_every_key_of_a_composed_config_is_declared_in_a_schema(name, overrides):
    # Its type, default and choices come from wsod/config_schema.py; the method's keys from its class.
    untyped = _untyped_keys(_composed(name, tuple(overrides)))
    assert not untyped, (
        f"configs/{name}.yaml with {overrides or 'its defaults'}: {', '.join(untyped)} not declared in a"
        " schema (wsod/config_schema.py): declare it there, with its type and default"
    )


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_names_a_key_some_composed_config_has(name):
    table, rules = RULES[name]
    keys = set().union(*(_keys(n, tuple(o)) for n, o in COMPOSED if n == name))
    stale = sorted(set(rules) - keys)
    assert not stale, (
        f"{table} (wsod/config_checks.py) has rules for {', '.join(stale)}, which no composed {name}"
        " config has (a key renamed or moved?): rename or remove them"
    )


def test_the_checks_import_no_builder_or_engine():
    # In a fresh interpreter (this one has imported everything already); parent packages count too.
    script = "import json, sys, wsod.config_checks; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    loaded = set(json.loads(result.stdout))
    assert "wsod.config_checks" in loaded
    assert not loaded & {"wsod.build", "wsod.runs", "wsod.engine.evaluate", "wsod.engine.train"}


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.chunk_size=auto", "model.memory_budget_gb=4", "device=cpu"],
        ["model.chunk_size=auto", "model.memory_budget_gb=0.5"],
        ["model.chunk_size=auto", "device=cuda"],  # CUDA finds its own budget
        ["model.chunk_size=null"],
        ["model.chunk_size=64"],
        ["solver.gradnorm.enabled=true", "solver.gradnorm.min_weight=null"],  # GradNorm as published
        ["solver.gradnorm.balance=all", "solver.gradnorm.start_iter=0", "solver.gradnorm.window=0"],
        ["model.dropblock=true", "model.dropblock_block_size=5", "solver.dropblock.single_pass=true"],
    ],
)
def test_auto_and_the_budget_are_accepted(overrides):
    check_config(_config(overrides))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.chunk_size=big"], "model.chunk_size='big': expected null, auto or an integer >= 1"),
        (
            ["model.chunk_size=auto", "model.memory_budget_gb=-1"],
            "model.memory_budget_gb=-1.0: expected null",
        ),
        (["model.memory_budget_gb=4"], "model.memory_budget_gb=4.0: used only with model.chunk_size=auto"),
        (["model.chunk_size=auto", "device=cpu"], "model.chunk_size=auto on device='cpu' (no CUDA) needs"),
        (
            ["solver.gradnorm.enabled=true", "solver.gradnorm.min_weight=2"],
            "solver.gradnorm: GradNorm: min_weight must lie in [0, 1] or be None, got 2.0",
        ),
        (
            ["solver.gradnorm.enabled=true", "solver.gradnorm.lr=0"],
            "solver.gradnorm: LossBalancer: alpha must be >= 0 and lr > 0, got alpha=1.5, lr=0.0",
        ),
        (
            ["method=wsddn", "solver.gradnorm.enabled=true"],
            "solver.gradnorm: LossBalancer: balance='students' leaves no loss to balance among 1",
        ),
        (["method.tau=1.5"], "method=mist (MISTMethod) refuses its settings: MIST's tau and fg_iou must be"),
        (["+method.my_key=1"], "method=mist (MISTMethod) refuses its settings: MISTMethod.__init__() got an"),
        (["model.dropblock_block_size=4"], "model.dropblock_block_size=4: expected an odd integer >= 1"),
    ],
)
def test_impossible_auto_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match="invalid configuration") as error:
        check_config(_config(overrides))
    assert message in str(error.value)


def test_auto_without_a_budget_on_device_auto_depends_on_cuda(monkeypatch):
    cfg = _config(["model.chunk_size=auto"])  # device: auto
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="model.memory_budget_gb"):
        check_config(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_config(cfg)


def test_a_resume_may_change_the_chunking_and_the_budget():
    before = _config(["model.chunk_size=64"])
    after = _config(["model.chunk_size=auto", "model.memory_budget_gb=2"])
    assert resume_changes(before, after) == [
        "model.chunk_size: 64 -> 'auto'",
        "model.memory_budget_gb: null -> 2.0",
    ]


def test_a_config_saved_before_partial_labels_resumes_and_a_new_side_file_is_refused():
    from omegaconf import OmegaConf

    after = _config([])
    before = OmegaConf.to_container(after, resolve=True)
    del before["data"]["train"]["roi_sampling"]
    before["data"]["train"]["sets"] = [{"image_set": "trainval"}]  # no partial_labels key
    assert resume_changes(before, after) == []
    with pytest.raises(ConfigError, match="data.train.sets"):
        resume_changes(after, _config(["data.train.sets.0.partial_labels=data/toy/partial/points.json"]))
    with pytest.raises(ConfigError, match="data.train.roi_sampling.rois_per_image"):
        resume_changes(after, _config(["data.train.roi_sampling.rois_per_image=512"]))


def test_a_config_saved_before_views_and_the_ema_teacher_resumes_and_changing_views_is_refused():
    from omegaconf import OmegaConf

    after = _config([])
    before = OmegaConf.to_container(after, resolve=True)
    del before["data"]["train"]["views"], before["model"]["eval_weights"], before["solver"]["ema"]
    changes = resume_changes(before, after)  # one view, the student evaluated: the same run
    assert changes and all(line.startswith("solver.ema.") for line in changes)  # a companion may start
    with pytest.raises(ConfigError, match=r"data.train.views: 1 -> 2 \(the training images"):
        resume_changes(after, _config(["data.train.views=2"]))
    assert resume_changes(after, _config(["model.eval_weights=teacher"])) == [
        "model.eval_weights: 'student' -> 'teacher'"
    ]


def test_a_toy_config_saved_before_object_size_is_the_part_prone_set_and_the_new_default_is_refused():
    """Saved before data.object_size (and the toy's 28-px proposals): it trained on 25-70 px objects with
    every proposal, which is data=toy_parts; resuming it on the new default set would change its images."""
    from omegaconf import OmegaConf

    parts = _config(["data=toy_parts", "data.root=data/toy"])
    before = OmegaConf.to_container(parts, resolve=True)
    del before["data"]["object_size"]
    assert resume_changes(before, parts) == []
    with pytest.raises(ConfigError, match=r"data.object_size: \[25, 70\] -> \[30, 60\] \(the toy set"):
        resume_changes(before, _config([]))


def test_the_roi_sampling_keys_are_checked():
    with pytest.raises(ConfigError) as error:
        check_config(
            _config(
                ["data.train.roi_sampling.rois_per_image=0", "data.train.roi_sampling.positive_fraction=0"]
            )
        )
    assert "rois_per_image=0: expected an integer >= 1" in str(error.value)
    assert "positive_fraction=0.0: expected a number > 0 and <= 1" in str(error.value)


@pytest.mark.parametrize(
    "name,overrides,message",
    [
        ("train", ["model.score_threshold=2"], "model.score_threshold=2.0: expected a number >= 0 and <= 1"),
        ("train", ["model.weights=''"], "model.weights='': expected null, a torchvision weights name"),
        ("train", ["data=voc07", "data.test.set.year=VOC07"], "data.test.set.year='VOC07': expected a VOC"),
        ("train", ["data=voc07", "data.devkit=''"], "data.devkit='': expected a path"),
        ("train", ["output_dir=''"], "output_dir='': expected null or a folder"),
        ("eval", [], "checkpoint='???': expected a path, e.g. checkpoint=runs/my_run/model_final.pth"),
        ("eval", ["checkpoint=m.pth", "data.train.num_workers=-1"], "data.train.num_workers=-1: expected"),
        ("train", ["threads=two"], "threads='two': expected auto, null or an integer >= 0"),
        ("stage2", ["pseudo_labels=p.json", "threads=-1"], "threads=-1: expected auto, null or an integer"),
    ],
)
def test_the_rules_added_with_the_coverage_test_name_the_key(name, overrides, message):
    rules = RULES[name][1]
    with pytest.raises(ConfigError, match="invalid configuration") as error:
        check_config(_config(overrides, name), rules)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["solver.lr=abc"], "solver.lr=abc"),
        (["solver.max_iter=2.5"], "solver.max_iter=2.5"),
        (["solver.optimizer=adam"], "Invalid value 'adam', expected one of [sgd, adamw]"),
        (["solver.gradnorm.balance=teacher"], "expected one of [all, students]"),
        (["model.memory_budget_gb=lots"], "model.memory_budget_gb=lots"),
        (["model.pooler=roi"], "Invalid value 'roi', expected one of [align, pool]"),
        (["data=voc07", "data.devkit=null"], "data.devkit=null"),
        (["progress=maybe"], "progress=maybe"),
        (["solver.no_such_key=1"], "solver.no_such_key"),
    ],
)
def test_a_value_of_the_wrong_type_or_choice_is_refused_when_composing_naming_the_key(overrides, message):
    # The schema's types and Enums: Hydra refuses the override before check_config is reached.
    with pytest.raises(ConfigCompositionException) as error:
        _config(overrides)
    assert message in f"{error.value} {error.value.__cause__}"


@pytest.mark.parametrize("year", ["data.test.set.year=2012", "data.test.set.year='2012'"])
def test_a_voc_year_is_accepted_as_hydra_parses_it_number_or_string(year):
    check_config(_config(["data=voc07", year]))


class _MISTWithoutPartialLabels(MISTMethod):
    """MIST as a user's method that declares it does not read partial labels."""

    reads_partial_labels = False


class _PCLReadingPartialLabels(PCLMethod):
    """PCL as a user's method that declares it does read them."""

    reads_partial_labels = True


def _refusal(index: int, path: str, method: str, cls: str) -> str:
    return (
        f"data.train.sets.{index}.partial_labels='{path}': method={method} ({cls}) does not read partial"
        " labels (points, scribbles, boxes) and would train on the image labels alone; train with a method"
        f" that reads them (method=mist or method=oicr) or drop data.train.sets.{index}.partial_labels"
    )


@pytest.mark.parametrize(("method", "cls"), [("pcl", "PCLMethod"), ("wsddn", "WSDDNMethod")])
def test_partial_labels_for_a_method_that_does_not_read_them_are_refused_before_anything_runs(
    tmp_path, method, cls
):
    """Through train_from_config, what tools/train.py calls: PCL and WSDDN refused a labelled image only
    when a batch drew one, so a file labelling 0.1% of the images trained to the end with its labels
    unused. The refusal comes before a run folder or the toy set is made, whatever the file holds."""
    from wsod.runs.train import train_from_config

    side = tmp_path / "one_image_in_a_thousand.json"
    side.write_text(json.dumps({"images": {"000000": [{"class": "red_circle", "point": [5, 5]}]}}))
    run, root = tmp_path / "run", tmp_path / "toy"
    overrides = [f"method={method}", f"data.train.sets.0.partial_labels={side}"]
    cfg = _config([*overrides, f"output_dir={run}", f"data.root={root}"])
    with pytest.raises(ConfigError) as error:
        train_from_config(cfg)
    assert str(error.value) == "invalid configuration:\n  " + _refusal(0, str(side), method, cls)
    assert not run.exists() and not root.exists()


def test_the_refusal_follows_the_methods_declaration_not_its_name(monkeypatch):
    side = ["data.train.sets.0.partial_labels=points.json"]
    for method in ("mist", "oicr"):
        check_config(_config([f"method={method}", *side]))
    check_config(_config(["method=pcl"]))  # no partial labels: nothing to refuse
    monkeypatch.setitem(METHODS, "pcl_reading", _PCLReadingPartialLabels)
    check_config(_config(["method=pcl", "method.name=pcl_reading", *side]))
    monkeypatch.setitem(METHODS, "mist_ignoring", _MISTWithoutPartialLabels)
    with pytest.raises(ConfigError) as error:
        check_config(_config(["method.name=mist_ignoring", *side]))
    # The methods named as the fix are the ones that declare they read partial labels, this one too.
    expected = _refusal(0, "points.json", "mist_ignoring", "_MISTWithoutPartialLabels")
    readers = "(method=mist or method=oicr or method=pcl_reading)"
    assert str(error.value).splitlines()[1].strip() == expected.replace(
        "(method=mist or method=oicr)", readers
    )


def test_a_method_given_by_import_path_is_checked_by_its_declaration():
    name = f"{__name__}:_MISTWithoutPartialLabels"
    with pytest.raises(
        ConfigError, match=r"method=.*:_MISTWithoutPartialLabels \(_MISTWithoutPartialLabels\)"
    ):
        check_config(_config([f"method.name={name}", "data.train.sets.0.partial_labels=points.json"]))
    check_config(
        _config(
            [
                "method=pcl",
                f"method.name={__name__}:_PCLReadingPartialLabels",
                "data.train.sets.0.partial_labels=p.json",
            ]
        )
    )
    # One that cannot be imported is left to the build, which names the import problem.
    check_config(_config(["method.name=no_such_module:Method", "data.train.sets.0.partial_labels=p.json"]))


def test_every_train_set_with_partial_labels_is_named():
    sets = (
        "data.train.sets=[{image_set:train,partial_labels:a.json},{image_set:val,partial_labels:null},"
        "{image_set:test,partial_labels:b.json}]"
    )
    with pytest.raises(ConfigError) as error:
        check_config(_config(["method=pcl", sets]))
    lines = str(error.value).splitlines()[1:]
    assert [line.strip() for line in lines] == [
        _refusal(0, "a.json", "pcl", "PCLMethod"),
        _refusal(2, "b.json", "pcl", "PCLMethod"),
    ]


@pytest.mark.parametrize("name,node", [("train", "model"), ("stage2", "detector"), ("stage3", "detector")])
def test_a_model_on_the_toy_voc_base_must_build_its_stem_as_the_base_was_pretrained(name, node):
    rules = {"train": TRAIN_RULES, "stage2": STAGE2_RULES, "stage3": STAGE3_RULES}[name]
    data = {
        "train": ("data=toy_voc",),
        "stage2": ("data=toy_voc", "pseudo_labels=run/pseudo_labels.json"),
        "stage3": (
            "data=toy_voc",
            "pseudo_labels=run/pseudo_labels.json",
            "split=run/split.json",
            "initial_weights=run/model_final.pth",
        ),
    }[name]
    check_config(_composed(name, data), rules)  # the defaults agree
    with pytest.raises(ConfigError, match=rf"{node}.stem_pool=true: {node}.weights is the data's toy base"):
        check_config(_composed(name, (*data, f"{node}.stem_pool=true")), rules)
    # Other weights (or none) may build either stem.
    check_config(_composed(name, (*data, f"{node}.stem_pool=true", f"{node}.weights=null")), rules)


def test_the_toy_solver_trains_toy_voc_heads_at_the_sets_own_learning_rate():
    """``data.heads_lr`` (toy_voc's frozen base leaves only the heads to train) is the toy solver's
    ``solver.lr`` there; the quick start's set keeps the toy's 1e-3; a command line's solver.lr wins."""
    assert composed("train", ("data=toy_voc",)).solver.lr == pytest.approx(1e-2)
    assert composed("train", ("data=toy_voc", "data.heads_lr=3e-3")).solver.lr == pytest.approx(3e-3)
    assert composed("train", ("data=toy_voc", "solver.lr=1e-3")).solver.lr == pytest.approx(1e-3)
    assert composed("train", ()).solver.lr == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match=r"data.heads_lr=0"):
        check_config(composed("train", ("data=toy_voc", "data.heads_lr=0")), TRAIN_RULES)


def test_the_toy_solver_runs_toy_voc_on_the_sets_own_schedule():
    """``data.heads_max_iter`` and ``data.heads_milestones`` are the toy solver's schedule on toy_voc (3,000
    steps, the step down at 2,400); the quick start's set keeps 2,000 and [1600]; the command line wins."""
    voc = composed("train", ("data=toy_voc",)).solver
    assert (voc.max_iter, list(voc.milestones)) == (3000, [2400])
    toy = composed("train", ()).solver
    assert (toy.max_iter, list(toy.milestones)) == (2000, [1600])
    short = composed("train", ("data=toy_voc", "solver.max_iter=500", "solver.milestones=[400]")).solver
    assert (short.max_iter, list(short.milestones)) == (500, [400])
    check_config(composed("train", ("data=toy_voc",)), TRAIN_RULES)
    with pytest.raises(ConfigError, match=r"data.heads_max_iter=0"):
        check_config(composed("train", ("data=toy_voc", "data.heads_max_iter=0")), TRAIN_RULES)
    with pytest.raises(ConfigError, match=r"data.heads_milestones=\[0\]"):
        check_config(composed("train", ("data=toy_voc", "data.heads_milestones=[0]")), TRAIN_RULES)
