"""wsod/build.py: refinement methods from method configs (by name or import path), checkpoints back into
detectors (load_detector, old layouts included), GradNorm's loss count, the training transform and the
scheduler from their configs, the refusal of partial labels for a method that does not read them, and the
data functions' one look-up of data.kind among the registered dataset formats (wsod.data.formats)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tiny_run import TINY_TOY

from wsod.build import (
    build_balancer,
    build_labeler,
    build_method,
    build_model,
    build_optimizer,
    build_scheduler,
    build_test_dataset,
    build_train_dataset,
    check_partial_labels_read,
    load_detector,
)
from wsod.config_schema import Balance, GradNormSolver, Solver
from wsod.data.toy import TOY_CLASSES
from wsod.engine.checkpoint import save_checkpoint
from wsod.modeling.pcl import PCLMethod, WSDDNMethod
from wsod.modeling.refinement import MISTLabeler, MISTMethod, OICRLabeler, OICRMethod

TINY_MODEL = {"backbone": "resnet18", "width": 0.25, "weights": None, "chunk_size": 8}


def _checkpoint(tmp_path, metadata, model):
    path = tmp_path / "model_final.pth"
    save_checkpoint({"model": model.state_dict(), "iteration": 3, "metadata": metadata}, path)
    return path


def test_load_detector_rebuilds_the_model_its_weights_and_its_method(tmp_path):
    torch.manual_seed(0)
    model = build_model(TINY_MODEL, 3, {"name": "oicr", "fg_iou": 0.6})
    metadata = {"model": TINY_MODEL, "method": {"name": "oicr", "fg_iou": 0.6}, "classes": ["a", "b", "c"]}
    loaded, saved = load_detector(_checkpoint(tmp_path, metadata, model))
    assert saved["classes"] == ["a", "b", "c"] and not loaded.training
    assert loaded.method == OICRMethod(fg_iou=0.6) and loaded.labeler == OICRLabeler(fg_iou=0.6)
    for (name, ours), theirs in zip(loaded.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name


def test_load_detector_reads_checkpoints_written_before_method_configs(tmp_path):
    model = build_model(TINY_MODEL, 2)
    legacy = {**TINY_MODEL, "pseudo_labels": "mist", "mist_p": 0.3, "mist_tau": 0.4, "mist_suppress": "kept"}
    loaded, _ = load_detector(
        _checkpoint(tmp_path, {"model": {**legacy, "fg_iou": 0.55}, "classes": ["a", "b"]}, model)
    )
    assert loaded.labeler == MISTLabeler(p=0.3, tau=0.4, suppress="kept", fg_iou=0.55)


def test_load_detector_reads_checkpoints_that_held_the_student_settings_among_the_models(tmp_path):
    # Before the method seam, num_students and first_student_loss_weight were model settings.
    model = build_model(TINY_MODEL, 2, {"name": "oicr", "num_students": 2, "first_student_loss_weight": 2.0})
    legacy = {**TINY_MODEL, "num_students": 2, "first_student_loss_weight": 2.0}
    metadata = {"model": legacy, "method": {"name": "oicr", "fg_iou": 0.5}, "classes": ["a", "b"]}
    loaded, saved = load_detector(_checkpoint(tmp_path, metadata, model))
    assert len(loaded.students) == 2 and loaded.method == OICRMethod(first_student_loss_weight=2.0)
    assert saved["model"]["num_students"] == 2  # the metadata is returned as stored


def test_load_detector_refuses_what_is_not_a_wsod_checkpoint(tmp_path):
    path = tmp_path / "weights.pth"
    save_checkpoint({"state_dict": {}}, path)
    with pytest.raises(ValueError, match="weights.pth holds no model settings"):
        load_detector(path)
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_detector(tmp_path / "missing.pth")


def test_unknown_method_names_the_key_the_choices_and_the_import_path_form():
    expected = r"expected one of \['cbl', 'mist', 'oicr', 'pcl', 'wsddn'\] or an import path module:ClassName"
    with pytest.raises(ValueError, match=r"unknown method.name='pcll': " + expected):
        build_method({"name": "pcll"})
    with pytest.raises(ValueError, match=r"method.name='no_such_module:PCL': cannot import no_such_module"):
        build_method({"name": "no_such_module:PCL"})
    with pytest.raises(ValueError, match=r"method.name='wsod.build:Path': wsod.build has no Refinement"):
        build_method({"name": "wsod.build:Path"})
    assert build_method(None) == MISTMethod() and build_labeler(None) == MISTLabeler()


def test_a_method_by_import_path_gets_the_other_keys_as_arguments():
    method = build_method({"name": "wsod.modeling.refinement:OICRMethod", "fg_iou": 0.7, "num_students": 2})
    assert method == OICRMethod(fg_iou=0.7)  # num_students is the detector's, not an argument
    assert build_method({"name": "wsod.modeling.refinement.MISTMethod", "p": 0.3}) == MISTMethod(p=0.3)
    with pytest.raises(TypeError, match="method 'oicr': .*'p'"):
        build_method({"name": "oicr", "p": 0.3})


def test_the_student_count_comes_from_the_method_config_and_gradnorm_counts_the_methods_losses():
    model = build_model(TINY_MODEL, 3, {"name": "mist", "num_students": 2})
    assert len(model.students) == 2 and len(model.loss_names) == 5
    # GradNorm over every loss (balance=all), the schema's other defaults.
    solver = OmegaConf.structured(Solver(gradnorm=GradNormSolver(enabled=True, balance=Balance("all"))))
    balancer = build_balancer(solver, model, torch.device("cpu"))
    assert balancer.gradnorm.num_losses == 5


@pytest.mark.parametrize("lighting_std", [0.0, 0.1])
def test_train_dataset_gets_the_configured_lighting_noise(tiny_toy_root, lighting_std):
    train = {"sets": [{"image_set": "trainval"}], "scales": [64], "max_size": 200, "flip": True}
    train.update(max_proposals=None, lighting_std=lighting_std)
    data_cfg = OmegaConf.create({"kind": "toy", "root": str(tiny_toy_root), **TINY_TOY, "train": train})
    transform = build_train_dataset(data_cfg).transform
    assert transform.lighting_std == lighting_std and transform.flip_prob == 0.5


def test_the_proposal_limits_of_data_train_and_data_test_reach_their_datasets(tiny_toy_root):
    train = {"sets": [{"image_set": "trainval"}], "scales": [64], "max_size": 200, "flip": True}
    train.update(max_proposals=5, min_proposal_size=30.0, lighting_std=0.0)
    test = {"set": {"image_set": "test"}, "max_proposals": None, "min_proposal_size": 40.0}
    data_cfg = OmegaConf.create(
        {"kind": "toy", "root": str(tiny_toy_root), **TINY_TOY, "train": train, "test": test}
    )
    for dataset, smallest, most in (
        (build_train_dataset(data_cfg), 30, 5),
        (build_test_dataset(data_cfg), 40, None),
    ):
        assert dataset.min_proposal_size == smallest and dataset.max_proposals == most
        for index in range(len(dataset)):
            boxes = dataset.proposals_of(index)
            sides = torch.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]) + 1
            assert (sides >= smallest).all() and (most is None or len(boxes) <= most)


@pytest.mark.parametrize("rescale", [True, False])
def test_scheduler_gets_the_configured_momentum_rescale(rescale):
    solver = OmegaConf.create(
        {
            "optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "bias_lr_factor": 2.0,
            "bias_weight_decay": 0.0, "milestones": [1], "gamma": 0.1, "warmup_iters": 0,
            "warmup_factor": 1 / 3, "momentum_rescale": rescale,
        }
    )  # fmt: skip
    model = torch.nn.Linear(2, 1)
    optimizer = build_optimizer(solver, model)
    scheduler = build_scheduler(solver, optimizer)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    scheduler.step()  # lr x0.1
    buffer = optimizer.state[model.weight]["momentum_buffer"]
    assert buffer.flatten().tolist() == pytest.approx([0.1, 0.1] if rescale else [1.0, 1.0])


def test_threads_auto_takes_the_cores_less_the_loader_workers_and_a_number_as_given(monkeypatch):
    from wsod.build import resolve_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_threads("auto", 2) == 6  # an 8-core laptop, two loader workers
    assert resolve_threads("auto", 0) == 8
    assert resolve_threads("auto", 12) == 1  # at least one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun, 4 processes on this node: 2 cores each
    assert resolve_threads("auto", 1) == 1 and resolve_threads("auto", 0) == 2
    assert resolve_threads(3, 2) == 3 and resolve_threads(None, 2) is None and resolve_threads(0, 2) is None


def _toy_sets(tiny_toy_root, partial_labels):
    """A config's train sets (train, val) on the tiny toy set, each with its side file or None."""
    train = {"scales": [64], "max_size": 200, "flip": False, "max_proposals": None, "lighting_std": 0.0}
    sets = [
        {"image_set": split, "partial_labels": None if path is None else str(path)}
        for split, path in zip(("train", "val"), partial_labels, strict=True)
    ]
    data_cfg = OmegaConf.create(
        {"kind": "toy", "root": str(tiny_toy_root), **TINY_TOY, "train": {**train, "sets": sets}}
    )
    return build_train_dataset(data_cfg)


def _side_file_of_one_image(tiny_toy_root, tmp_path, image_set):
    """A side file with one point, on the first image of ``image_set``: 1 of the set's 6 images."""
    from wsod.data.toy import ensure_toy_dataset

    record = ensure_toy_dataset(tiny_toy_root, **TINY_TOY).dataset(image_set).records[0]
    x1, y1, x2, y2 = record.gt_boxes[0].tolist()
    name = TOY_CLASSES[int(record.gt_labels[0])]
    path = tmp_path / f"{image_set}_one_point.json"
    path.write_text(json.dumps({"images": {record.image_id: [{"class": name, "point": [x1 + 1, y1 + 1]}]}}))
    return path


@pytest.mark.parametrize("method", [PCLMethod(), WSDDNMethod()], ids=["pcl", "wsddn"])
def test_training_images_with_partial_labels_are_refused_for_a_method_that_does_not_read_them(
    tiny_toy_root, tmp_path, method
):
    """Before step 1, whichever image carries the labels: the detector's own check waited for a batch
    to draw it. The message names the file (here the second set's) and the method."""
    side = _side_file_of_one_image(tiny_toy_root, tmp_path, "val")
    train_set = _toy_sets(tiny_toy_root, [None, side])
    with pytest.raises(ValueError) as error:
        check_partial_labels_read(train_set, method)
    assert str(error.value) == (
        f"{side}: partial labels (points, scribbles, boxes) on 1 of 6 training images, which"
        f" {type(method).__name__} does not read (it would train on the image labels alone); train with a"
        " method that reads them (method=mist or method=oicr) or drop data.train.sets.1.partial_labels"
    )
    check_partial_labels_read(train_set, MISTMethod())  # MIST reads them
    check_partial_labels_read(_toy_sets(tiny_toy_root, [None, None]), method)  # no labels: nothing to refuse


def test_partial_labels_inside_a_coco_json_are_refused_naming_it(tmp_path):
    from PIL import Image

    from wsod.data.coco import CocoDataset
    from wsod.data.proposals import ProposalSet

    (tmp_path / "images").mkdir()
    Image.new("RGB", (60, 40)).save(tmp_path / "images" / "1.jpg")
    annotations = tmp_path / "instances_points.json"
    annotations.write_text(
        json.dumps(
            {
                "images": [{"id": 1, "file_name": "1.jpg", "height": 40, "width": 60}],
                "categories": [{"id": 1, "name": "cat"}],
                "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "point": [10, 10]}],
            }
        )
    )
    proposals = ProposalSet([1], [np.array([[0, 0, 20, 20]], np.float32)])
    dataset = CocoDataset(annotations, tmp_path / "images", proposals)
    with pytest.raises(ValueError) as error:
        check_partial_labels_read(dataset, PCLMethod())
    assert str(error.value) == (
        f"{annotations}: partial labels (points, scribbles, boxes) on 1 of 1 training images, which PCLMethod"
        " does not read (it would train on the image labels alone); train with a method that reads them"
        " (method=mist or method=oicr) or give data.train.sets.0.annotations a file without point, scribble"
        " and use_as"
    )


# -- dataset formats (wsod.data.formats): build.py's data functions look data.kind up there -------------


@pytest.fixture
def first_images_format(request):
    """A dataset format of this test's own, ``data.kind=first_images``: the first ``count`` images of a
    toy split. Its calls are recorded; it is unregistered afterwards."""
    from wsod.data.dataset import WeakDetectionDataset
    from wsod.data.formats import DATASET_FORMATS, DatasetFormat, register_dataset_format
    from wsod.data.toy import ensure_toy_dataset

    calls = {"open": [], "prepare": []}

    def open_first_images(data, source, /, **options):
        calls["open"].append((data, source, options))
        toy = ensure_toy_dataset(data["root"], **TINY_TOY).dataset(source["image_set"])
        return WeakDetectionDataset(toy.records[: source["count"]], toy.classes, toy.proposals, **options)

    def prepare(data, progress):
        calls["prepare"].append((data, progress))

    request.addfinalizer(lambda: DATASET_FORMATS.pop("first_images", None))
    register_dataset_format(
        DatasetFormat("first_images", open_first_images, prepare=prepare, drop_unlabelled_in_training=True)
    )
    return calls


def _first_images_config(tiny_toy_root, kind="first_images"):
    """A data node made here (not composed by Hydra): a custom kind's settings are its own."""
    train = {"scales": [64], "max_size": 200, "flip": False, "max_proposals": 7, "lighting_std": 0.0}
    train["sets"] = [{"image_set": "trainval", "count": 3, "partial_labels": None}]
    train["sets"].append({"image_set": "test", "count": 2})
    test = {"set": {"image_set": "test", "count": 4}, "scales": [64], "max_size": 200, "flip": False}
    test.update(max_proposals=None, batch_size=1, num_workers=0, amp=None, metric="voc07")
    return OmegaConf.create({"kind": kind, "root": str(tiny_toy_root), "train": train, "test": test})


def test_a_registered_dataset_format_is_what_the_data_kind_builds(tiny_toy_root, first_images_format):
    from wsod.build import build_evaluator, build_export_datasets, prepare_data

    data_cfg = _first_images_config(tiny_toy_root)
    prepare_data(data_cfg, progress=True)
    assert first_images_format["prepare"] == [(OmegaConf.to_container(data_cfg), True)]

    train = build_train_dataset(data_cfg)  # two sets, concatenated
    assert len(train.datasets) == 2 and len(train) == 5 and train.datasets[0].transform is not None
    (data, source, options), _ = first_images_format["open"]
    assert type(data) is dict and data == OmegaConf.to_container(data_cfg)  # plain settings
    assert source == {"image_set": "trainval", "count": 3, "partial_labels": None}
    assert set(options) == {
        "transform",
        "max_proposals",
        "min_proposal_size",
        "drop_unlabelled",
        "partial_labels",
    }
    assert (
        options["max_proposals"] == 7 and options["min_proposal_size"] == 2.0 and options["drop_unlabelled"]
    )  # the format drops them in training

    first_images_format["open"].clear()
    test = build_test_dataset(data_cfg)
    assert len(test) == 4 and test.transform is None
    assert first_images_format["open"][0][2] == {
        "transform": None, "max_proposals": None, "min_proposal_size": 2.0, "drop_unlabelled": False,
        "partial_labels": None,
    }  # fmt: skip
    exported = build_export_datasets(data_cfg)  # to label: their unlabelled images left out
    assert [len(d) for d in exported] == [3, 2]
    assert [o["drop_unlabelled"] for _, _, o in first_images_format["open"][1:]] == [True, True]
    evaluator = build_evaluator(data_cfg, torch.device("cpu"), progress=False)
    assert evaluator.dataset.image_ids == test.image_ids and evaluator.metric == "voc07"


def test_an_unknown_data_kind_is_one_line_naming_the_registered_kinds(tiny_toy_root):
    from wsod.build import build_test_dataset, prepare_data
    from wsod.data.formats import DATASET_FORMATS

    data_cfg = _first_images_config(tiny_toy_root, kind="vocc")
    expected = (
        f"unknown data.kind='vocc': expected one of {sorted(DATASET_FORMATS)} (a format of your own:"
        " wsod.data.formats.register_dataset_format)"
    )
    for build in (prepare_data, build_train_dataset, build_test_dataset):
        with pytest.raises(ValueError) as error:
            build(data_cfg)
        assert str(error.value) == expected
    assert {"toy", "voc", "coco", "folder"} <= set(DATASET_FORMATS)


def test_a_mandatory_data_value_left_unset_is_omegaconfs_error_naming_it():
    from omegaconf.errors import MissingMandatoryValue

    from wsod.build import build_test_dataset

    data_cfg = OmegaConf.create({"data": {"kind": "folder", "root": "???"}}).data
    data_cfg.test = {"set": {"split": "test"}, "max_proposals": None}
    with pytest.raises(MissingMandatoryValue, match="full_key: data.root"):
        build_test_dataset(data_cfg)
