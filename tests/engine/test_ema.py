"""The EMA teacher companion: its update against the formula, the groups it follows, what it gives the
student's forward, its checkpoint state, what evaluations use, and the config's rules."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from wsod.build import build_companions, build_model, load_detector
from wsod.config_checks import ConfigError, check_config
from wsod.config_schema import EMASolver, Solver
from wsod.engine.checkpoint import save_checkpoint
from wsod.engine.ema import EMATeacher
from wsod.engine.step import train_step
from wsod.modeling import build_detector
from wsod.modeling.method import MethodBatch, RoiScores
from wsod.modeling.refinement import MISTMethod
from wsod.modeling.teacher_student import TeacherStudentPair

NUM_CLASSES = 3


def _detector(seed: int = 0, **options):
    torch.manual_seed(seed)
    return build_detector("resnet18", num_classes=NUM_CLASSES, chunk_size=4, width=0.25, **options)


def _batch(counts=(13, 6), labels=((1, 0, 1), (0, 1, 0)), views: int = 1):
    """A collated batch of len(counts) image-views (``views`` per image), random boxes inside 64 x 96."""
    g = torch.Generator().manual_seed(0)
    proposals = []
    for n in counts:
        xy = torch.rand(n, 2, generator=g) * torch.tensor([60.0, 40.0])
        proposals.append(torch.cat([xy, xy + 8 + torch.rand(n, 2, generator=g) * 20], dim=1))
    labels = torch.tensor(labels, dtype=torch.float32)
    return {
        "images": torch.randn(len(counts), 3, 64, 96, generator=g),
        "proposals": proposals,
        "image_labels": labels,
        "image_sizes": [(64, 96)] * len(counts),
        "original_sizes": [(64, 96)] * len(counts),
        "targets": [
            {"labels": row, "proposal_ids": torch.arange(n)} for row, n in zip(labels, counts, strict=True)
        ],
        "views": views,
    }


def _step(model, teacher=None, lr=0.1):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    companions = [teacher] if teacher is not None else []
    return train_step(model, optimizer, iter([_batch()]), device=torch.device("cpu"), companions=companions)


def test_each_update_moves_the_followed_groups_by_the_formula_and_copies_the_others():
    model = _detector()
    teacher = EMATeacher(model, momentum=0.9, follow=("backbone", "heads"))
    initial = {n: v.clone() for n, v in teacher.teacher.state_dict().items()}
    _step(model, teacher)  # the student moves; then the teacher follows
    student = model.state_dict()
    followed = ("base.", "mil_head.", "students.")
    for name, value in teacher.teacher.state_dict().items():
        if name.startswith(followed) and value.is_floating_point():
            expected = 0.9 * initial[name] + 0.1 * student[name]
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7, msg=name)
        else:  # the neck (not followed) and integer counters hold the student's values
            assert torch.equal(value, student[name]), name
    assert any(not torch.equal(initial[n], student[n]) for n in initial if n.startswith("mil_head."))
    assert all(not p.requires_grad for p in teacher.teacher.parameters()) and not teacher.teacher.training


def test_a_teacher_tensor_may_follow_a_weighted_mix_of_student_tensors():
    model = _detector()
    name = "students.2.cls_score.weight"  # as CBL's teacher classifier follows its students' classifiers
    mix = {"students.0.cls_score.weight": 0.25, "students.1.cls_score.weight": 0.75}
    teacher = EMATeacher(model, momentum=0.5, follow=("heads",), sources={name: mix})
    before = teacher.teacher.state_dict()[name].clone()
    teacher.update()
    student = model.state_dict()
    expected = 0.5 * before + 0.5 * sum(w * student[n] for n, w in mix.items())
    torch.testing.assert_close(teacher.teacher.state_dict()[name], expected)
    with pytest.raises(ValueError, match="differ from it in shape"):
        EMATeacher(model, sources={name: {"students.0.cls_score.bias": 1.0}})


def test_the_ramp_is_min_of_one_minus_one_over_t_plus_one_and_the_momentum():
    teacher = EMATeacher(_detector(), momentum=0.75, schedule="ramp")
    alphas = []
    for _ in range(6):
        alphas.append(teacher.alpha())
        teacher.update()
    assert alphas == pytest.approx([0.0, 0.5, 2 / 3, 0.75, 0.75, 0.75], abs=1e-12)
    assert EMATeacher(_detector(), momentum=0.75).alpha() == 0.75


def test_the_teachers_scores_reach_the_method_without_a_graph_beside_the_students():
    seen: list[MethodBatch] = []

    class Spy(MISTMethod):
        def batch_losses(self, batch):
            seen.append(batch)
            return {}

    model = _detector(method=Spy())
    initial = copy.deepcopy(model).eval()
    teacher = EMATeacher(model)
    _step(model, teacher)
    (batch,) = seen
    assert isinstance(batch.teacher, RoiScores) and batch.views == 1
    assert batch.teacher.mil.shape == (19, NUM_CLASSES + 1) and not batch.teacher.mil.requires_grad
    assert len(batch.teacher.students) == 3 and all(s.grad_fn is None for s in batch.teacher.students)
    assert batch.student_logits[0].requires_grad  # the student's own, with their graph
    # Before any update the teacher is the student: its scores are the initial student's in eval mode.
    own = initial.roi_scores(_batch()["images"], _batch()["proposals"])
    torch.testing.assert_close(batch.teacher.detection, own.detection)


def test_views_and_proposal_ids_split_a_batch_image_by_image():
    rows = torch.arange(10.0)[:, None]
    batch = MethodBatch(
        proposals=[torch.zeros(n, 4) for n in (3, 3, 2, 2)],
        targets=[{"proposal_ids": torch.tensor(ids)} for ids in ([0, 1, 2], [2, 0, 1], [0, 1], [1, 0])],
        views=2, mil_scores=rows, student_logits=(),
    )  # fmt: skip
    parts = batch.by_view(rows)
    assert [[p.flatten().tolist() for p in image] for image in parts] == [
        [[0, 1, 2], [3, 4, 5]],
        [[6, 7], [8, 9]],
    ]
    assert batch.proposal_ids()[0][1].tolist() == [2, 0, 1]


def test_the_checkpoint_state_restores_the_teacher_and_its_count_exactly():
    model = _detector()
    teacher = EMATeacher(model, schedule="ramp")
    for _ in range(2):
        _step(model, teacher)
    state = teacher.state_dict()
    other = EMATeacher(_detector(seed=1), schedule="ramp")
    other.load_state_dict(state, iteration=2)
    assert other.updates == 2 and other.alpha() == teacher.alpha()
    for name, value in teacher.teacher.state_dict().items():
        assert torch.equal(other.teacher.state_dict()[name], value), name


def test_a_teacher_switched_on_at_a_resume_starts_from_the_resumed_weights_not_the_built_ones():
    model = _detector()
    teacher = EMATeacher(model, momentum=0.9)  # built before the resume loads the student's weights
    resumed = _detector(seed=1).state_dict()
    model.load_state_dict(resumed)  # what the loop's resume does after the companions are built
    teacher.before_forward({**_batch(), "image_labels": None})
    for name, value in teacher.teacher.state_dict().items():
        assert torch.equal(value, resumed[name]), name
    # A checkpoint's teacher is kept as it is, whatever the student holds.
    other = EMATeacher(model)
    state = {"teacher": _detector(seed=2).state_dict(), "updates": 3}
    other.load_state_dict(state, iteration=3)
    other.update()
    assert other.updates == 4 and not torch.equal(
        other.teacher.state_dict()["mil_head.cls_score.weight"],
        model.state_dict()["mil_head.cls_score.weight"],
    )


def test_evaluations_use_the_student_the_teacher_or_the_pair_and_the_pair_keeps_the_teacher_in_eval():
    model = _detector()
    assert EMATeacher(model).evaluation_model(model) is model
    teacher = EMATeacher(model, eval_weights="teacher")
    assert teacher.evaluation_model(model) is teacher.teacher
    pair = EMATeacher(model, eval_weights="mix").evaluation_model(model)
    assert isinstance(pair, TeacherStudentPair)
    pair.eval()
    pair.train()
    assert model.training and not pair.teacher.training
    # The pair's per-ROI scores are the method's mix (the mean by default) of both on the same ROIs.
    pair.eval()
    pair.teacher.load_state_dict(_detector(seed=1).state_dict())  # a teacher that differs from the student
    inputs = {**_batch(), "image_labels": None}
    own = model.predict_view(inputs, [False, True], model.detection_settings)
    theirs = pair.teacher.predict_view(inputs, [False, True], model.detection_settings)
    mixed = pair.predict_view(inputs, [False, True], model.detection_settings)
    for a, b, m in zip(own, theirs, mixed, strict=True):
        assert not torch.allclose(a["scores"], b["scores"])
        torch.testing.assert_close(m["scores"], (a["scores"] + b["scores"]) / 2)
        torch.testing.assert_close(m["boxes"], (a["boxes"] + b["boxes"]) / 2)


def test_model_final_holds_the_teacher_and_load_detector_reads_each_choice(tmp_path):
    model = _detector()
    teacher = EMATeacher(model)
    _step(model, teacher)
    settings = {"backbone": "resnet18", "chunk_size": 4, "width": 0.25, "eval_weights": "teacher"}
    metadata = {"model": settings, "method": {"name": "mist"}, "classes": ["a", "b", "c"]}
    path = save_checkpoint(
        {"model": model.state_dict(), **teacher.final_weights(), "metadata": metadata},
        tmp_path / "model_final.pth",
    )
    loaded, _ = load_detector(path)
    for name, value in teacher.teacher.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    student, _ = load_detector(path, eval_weights="student")
    assert torch.equal(
        student.state_dict()["mil_head.cls_score.weight"], model.state_dict()["mil_head.cls_score.weight"]
    )
    assert isinstance(load_detector(path, eval_weights="mix")[0], TeacherStudentPair)
    without = save_checkpoint({"model": model.state_dict(), "metadata": metadata}, tmp_path / "plain.pth")
    with pytest.raises(ValueError, match="eval_weights=teacher needs the EMA teacher's weights"):
        load_detector(without)


def test_the_config_builds_the_teacher_and_refuses_a_teacher_it_does_not_train():
    solver = Solver(ema=EMASolver(enabled=True, momentum=0.99, schedule="ramp", follow=["heads"]))
    cfg = OmegaConf.create({"solver": OmegaConf.structured(solver), "model": {"eval_weights": "mix"}})
    (companion,) = build_companions(cfg, _detector(), torch.device("cpu"))
    assert isinstance(companion, EMATeacher) and companion.follow == ("heads",)
    assert companion.momentum == 0.99 and companion.eval_weights == "mix"
    with pytest.raises(ConfigError) as refused:
        check_config(
            {"model": {"eval_weights": "teacher"}, "solver": {"ema": {"enabled": False, "momentum": 1.0}}}
        )
    message = str(refused.value)
    assert (
        "model.eval_weights=teacher: evaluates the EMA teacher" in message
        and "solver.ema.enabled=true" in message
    )
    assert "solver.ema.momentum=1.0: expected a number in [0, 1)" in message
    assert (
        build_model({"backbone": "resnet18", "width": 0.25, "eval_weights": "teacher"}, NUM_CLASSES)
        is not None
    )
