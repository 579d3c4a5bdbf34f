"""wsod/data/proposals/safe_pickle.py: a proposal pickle that would run code is refused by every way a
user reads one (the readers, tools/make_proposals.py convert, tools/predict.py proposals=, tools/train.py
data.train.sets.0.proposals=, the Selective Search shard merge) with one line naming the file and the
refused global, and the code never runs; every genuine proposal pickle still loads (numpy 1 and 2 names,
protocols 0 to 5, Python-2 files read as latin1, object arrays); states that numpy would take but that
corrupt memory are refused too."""

from __future__ import annotations

import io
import os
import pickle
import shlex
import struct
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from wsod.data.proposals import (
    ProposalSet,
    UnsafePickleError,
    convert_proposals,
    load_proposals,
    read_proposal_pickle,
)
from wsod.data.proposals.safe_pickle import ALLOWED, RestrictedUnpickler, load_restricted_pickle
from wsod.data.proposals.selective_search import generate_proposals

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ENV.pop("HYDRA_FULL_ERROR", None)  # the one-line errors a user sees, not tracebacks
SYSTEM = f"{os.system.__module__}.system"  # posix.system on Linux and macOS, nt.system on Windows


class _RunsCommand:
    """Unpickling this runs a shell command that creates ``target``: what a malicious proposal file
    does, through ``os.system``."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.target))}",)


class _TouchesFile:
    """Unpickling this creates ``target`` without a shell: ``pathlib.Path.touch(target)``."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return Path.touch, (Path(self.target),)


def _evil(path: Path, payload: object, protocol: int = 2) -> Path:
    """A proposal pickle (one image, one box) that also holds ``payload``."""
    data = {"boxes": [np.zeros((1, 4), np.float32)], "indexes": ["a"], "payload": payload}
    path.write_bytes(pickle.dumps(data, protocol=protocol))
    return path


def _refused(message: str, path: Path, name: str) -> None:
    assert message.startswith(f"{path}: refused to unpickle {name}: {ALLOWED} ("), message
    assert "\n" not in message


def test_the_payloads_run_code_when_unpickled_by_pickle_itself(tmp_path):
    # The guard of the tests below: each payload does create its file with a plain pickle.load.
    for n, payload in enumerate((_RunsCommand(tmp_path / "shell"), _TouchesFile(tmp_path / "touch"))):
        pickle.loads(_evil(tmp_path / f"{n}.pkl", payload).read_bytes())
    assert (tmp_path / "shell").is_file() and (tmp_path / "touch").is_file()


@pytest.mark.parametrize("reader", [read_proposal_pickle, load_proposals, load_restricted_pickle])
@pytest.mark.parametrize(
    "payload,protocol,name",
    [(_RunsCommand, 2, SYSTEM), (_RunsCommand, 5, SYSTEM), (_TouchesFile, 5, "pathlib.Path.touch")],
)
def test_a_pickle_that_would_run_code_is_refused_naming_the_file_and_the_global(
    reader, payload, protocol, name, tmp_path
):
    target = tmp_path / "created"
    path = _evil(tmp_path / "evil.pkl", payload(target), protocol)
    with pytest.raises(UnsafePickleError) as error:
        reader(path)
    _refused(str(error.value), path, name)
    assert not target.exists()
    assert isinstance(error.value, ValueError)  # callers that catch a bad file's ValueError still do


def test_converting_a_pickle_that_would_run_code_is_refused_and_writes_nothing(tmp_path):
    target = tmp_path / "created"
    path = _evil(tmp_path / "evil.pkl", _RunsCommand(target))
    with pytest.raises(UnsafePickleError) as error:
        convert_proposals(path, tmp_path / "out.proposals")
    _refused(str(error.value), path, SYSTEM)
    assert not target.exists() and not (tmp_path / "out.proposals").exists()


def _user_runs(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A tool run as a user runs it, from a shell in ``cwd``."""
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )


def _one_error_line(result: subprocess.CompletedProcess, path: Path, name: str) -> str:
    """The one line naming the refusal in a failed tool's output (the console, or its log)."""
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if "refused to unpickle" in line]
    assert len(lines) == 1, output[-3000:]
    _refused(lines[0].split("UnsafePickleError: ", 1)[1], path, name)
    return lines[0]


def test_make_proposals_convert_refuses_it_as_a_user_runs_it(tmp_path):
    target = tmp_path / "created"
    path = _evil(tmp_path / "evil.pkl", _RunsCommand(target))
    result = _user_runs(
        [str(ROOT / "tools" / "make_proposals.py"), "convert", str(path), "out.pkl"], tmp_path
    )
    line = _one_error_line(result, path, SYSTEM)
    assert line.startswith(f"error: UnsafePickleError: {path}: refused to unpickle {SYSTEM}: ")
    assert result.stderr.strip() == line  # the whole console output: one line
    assert not target.exists() and not (tmp_path / "out.pkl").exists()


def test_predict_refuses_it_as_proposals_as_a_user_runs_it(tmp_path, jpeg):
    from wsod.build import build_model
    from wsod.data.toy import TOY_CLASSES
    from wsod.engine.checkpoint import save_checkpoint

    # An untrained checkpoint with its test views, as training writes them (tests/test_predict.py).
    model = {"backbone": "resnet18", "width": 0.25, "weights": None, "chunk_size": 16}
    test = {"scales": [64], "max_size": 1000, "flip": False, "max_proposals": None}
    metadata = {"model": model, "method": {"name": "mist"}, "classes": list(TOY_CLASSES)}
    metadata["config"] = {"data": {"test": test}}
    torch.manual_seed(0)
    state = build_model(model, len(TOY_CLASSES)).state_dict()
    save_checkpoint({"model": state, "metadata": metadata}, tmp_path / "c.pth")
    jpeg(tmp_path / "in" / "a.jpg", 40, 50)
    target = tmp_path / "created"
    path = _evil(tmp_path / "evil.pkl", _RunsCommand(target))
    args = ["checkpoint=c.pth", "input=in", "output=out", f"proposals={path}", "progress=false"]
    result = _user_runs([str(ROOT / "tools" / "predict.py"), *args, "num_workers=0"], tmp_path)
    _one_error_line(result, path, SYSTEM)
    assert not target.exists()
    assert "refused to unpickle" in (tmp_path / "out" / "error.txt").read_text()
    assert not (tmp_path / "out" / "predictions.json").exists()


def test_training_refuses_it_as_a_train_set_s_proposals_as_a_user_runs_it(tmp_path, make_voc):
    devkit = make_voc({"000005": (40, 50, [("dog", ("3", "4", "31", "21"), 0)])}, {"trainval": ["000005"]})
    target = tmp_path / "created"
    path = _evil(tmp_path / "evil.pkl", _RunsCommand(target))
    overrides = ["data=voc07", f"data.devkit={devkit}", f"data.train.sets.0.proposals={path}"]
    overrides += ["data.train.num_workers=0", "output_dir=run", "progress=false", "device=cpu"]
    result = _user_runs([str(ROOT / "tools" / "train.py"), *overrides], tmp_path)
    _one_error_line(result, path, SYSTEM)
    assert not target.exists()
    assert "refused to unpickle" in (tmp_path / "run" / "error.txt").read_text()
    assert not list((tmp_path / "run").glob("*.pth"))


def test_the_selective_search_merge_refuses_a_planted_shard(tmp_path, jpeg):
    images = [(f"i{n}", tmp_path / f"{n}.jpg") for n in range(2)]
    for n, (_, image) in enumerate(images):
        jpeg(image, 24, 32, seed=n)
    output = tmp_path / "ss.pkl"
    generate_proposals(images, output, workers=1, shard_size=1, progress=False, keep_parts=True)
    # A parts folder with one shard replaced (copied from elsewhere, or written by another user), and the
    # merged file not written yet: a rerun merges the shards it finds.
    shard = tmp_path / "ss.pkl.parts" / "shard_00001.pkl"
    target = tmp_path / "created"
    shard.write_bytes(pickle.dumps({"ids": ["i1"], "boxes": [_RunsCommand(target)], "sizes": [(24, 32)]}))
    output.unlink()
    with pytest.raises(UnsafePickleError) as error:
        generate_proposals(images, output, workers=1, shard_size=1, progress=False)
    _refused(str(error.value), shard, SYSTEM)
    assert not target.exists() and not output.exists()


# Genuine pickles: every layout the readers take, as numpy 1 and 2 and Python 2 and 3 write them.

BOXES = [
    np.array([[0, 1, 20, 30], [2.5, 3, 40, 50]], np.float32),
    np.zeros((0, 4), np.float32),  # an image without proposals: an empty array's data is empty bytes
    np.array([[1, 2, 3, 4]], np.float64),
    np.array([[5, 6, 7, 8]], np.uint16),  # integer boxes, as some releases store them
    np.asfortranarray(np.arange(8, dtype=np.int64).reshape(2, 4)),
    np.arange(32, dtype=np.float32).reshape(4, 8)[:, ::2],  # not contiguous: protocol 5 reduces it too
]
IDS = ["000005", 7, np.int64(2008000008), "img_b", 11, 12]  # str, int and numpy integer ids
SIZES = np.array([[40, 50], [0, 0], [60, 70], [10, 10], [9, 9], [8, 8]], np.int32)


def _scores(boxes: np.ndarray) -> np.ndarray:
    return np.linspace(1, 0, len(boxes), dtype=np.float32)


def _proposal_dict(boxes_as_object_array: bool = False) -> dict:
    boxes: object = list(BOXES)
    if boxes_as_object_array:  # one object array of per-image arrays instead of a list
        boxes = np.empty(len(BOXES), dtype=object)
        boxes[:] = BOXES
    scores = [_scores(b) for b in BOXES]
    return {"boxes": boxes, "scores": scores, "indexes": list(IDS), "image_sizes": SIZES}


def _assert_read(proposals: ProposalSet) -> None:
    assert proposals.image_ids == IDS
    for image_id, boxes in zip(IDS, BOXES, strict=True):
        np.testing.assert_array_equal(proposals[image_id], boxes)
        np.testing.assert_array_equal(proposals.scores(image_id), _scores(boxes))
    assert [proposals.image_size(i) for i in IDS[:3]] == [(40, 50), None, (60, 70)]


def _read(tmp_path: Path, data: bytes) -> ProposalSet:
    (tmp_path / "p.pkl").write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy 2's numpy.core shim warns when a numpy-1 name is imported
        return read_proposal_pickle(tmp_path / "p.pkl")


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("object_array", [False, True], ids=["list", "object array"])
def test_genuine_proposal_pickles_load_at_every_protocol(protocol, object_array, tmp_path):
    _assert_read(_read(tmp_path, pickle.dumps(_proposal_dict(object_array), protocol=protocol)))


class _Numpy1Pickler(pickle._Pickler):
    """Writes numpy's functions under numpy 1's module names (``numpy.core.multiarray._reconstruct``,
    ``numpy.core.numeric._frombuffer``, ...), as numpy 1.x (1.26.4 checked) does; numpy 2 writes
    ``numpy._core``."""

    def __init__(self, file, protocol):
        super().__init__(file, protocol)
        # No memo: at protocol 5 Python 3.11's pure-Python pickler memoizes the shared empty bytes of
        # two empty arrays twice and fails an assertion. Nothing pickled here refers to itself.
        self.fast = True

    def save_global(self, obj, name=None):
        module = obj.__module__.replace("numpy._core", "numpy.core")
        if self.proto >= 4:
            self.save(module)
            self.save(name or obj.__qualname__)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[types.FunctionType] = save_global  # numpy's _frombuffer is a Python function


class _Python2Pickler(_Numpy1Pickler):
    """Writes what Python 2 (with numpy 1) wrote at protocol 2, the reference VOC Selective Search
    pickles: its ``str`` for every string (``SHORT_BINSTRING`` / ``BINSTRING``, text and the raw data
    of arrays alike; Python 3 reads them back as text only with ``encoding="latin1"``), no
    ``_codecs.encode``, numpy under ``numpy.core``."""

    dispatch = dict(_Numpy1Pickler.dispatch)

    def save_str(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else bytes(obj)
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[str] = dispatch[bytes] = save_str


def _written_by(pickler: type[pickle._Pickler], data: object, protocol: int) -> bytes:
    f = io.BytesIO()
    pickler(f, protocol=protocol).dump(data)
    return f.getvalue()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_numpy_1_pickles_load_under_any_numpy_without_its_deprecation_warning(protocol, tmp_path):
    data = _written_by(_Numpy1Pickler, _proposal_dict(), protocol)
    assert b"numpy.core" in data and b"numpy._core" not in data
    _assert_read(_read(tmp_path, data))


def test_python_2_pickles_load_with_latin1_decoding(tmp_path):
    data = _written_by(_Python2Pickler, _proposal_dict(), 2)
    assert b"_codecs" not in data and pickle.SHORT_BINSTRING + b"\x06000005" in data
    _assert_read(_read(tmp_path, data))
    # Numpy scalars (an id taken from an array) and object arrays come back too.
    python2 = _written_by(_Python2Pickler, [np.float64(0.125), np.array([b"ab", b"c"], dtype=object)], 2)
    scalar, objects = RestrictedUnpickler(io.BytesIO(python2), source="x", encoding="latin1").load()
    assert scalar == 0.125 and type(scalar) is np.float64 and objects.tolist() == ["ab", "c"]


# What numpy would build from allowed names alone, but no proposal pickle holds.


class _Reduced:
    """Pickles as ``function(*arguments)`` with ``state`` (BUILD), as a hand-made pickle can."""

    def __init__(self, function, arguments, state=None) -> None:
        self.reduced = (function, arguments) if state is None else (function, arguments, state)

    def __reduce__(self):
        return self.reduced


def _dtype(spec: str, state: tuple) -> _Reduced:
    return _Reduced(np.dtype, (spec, False, True), state)


def _array(dtype: object, shape: tuple, data: object) -> _Reduced:
    reconstruct = np.zeros(1).__reduce__()[0]
    return _Reduced(reconstruct, (np.ndarray, (0,), b"b"), (1, shape, dtype, False, data))


OBJECT_STATE = (3, "|", None, None, None, -1, -1, 63)
FORGED = {
    # An object dtype whose flags say "no objects": raw bytes of the file's choosing become pointers.
    "object flags": (_array(_dtype("O8", OBJECT_STATE[:-1] + (0,)), (1,), b"A" * 8), "numpy dtype '|O'"),
    # A field past the end of its 8-byte item: numpy writes there while it sets the array's state.
    "field past the item": (
        _array(_dtype("V8", (3, "|", None, ("a",), {"a": (np.dtype("O"), 1 << 40)}, 8, 1, 27)), (1,), [(1,)]),
        "numpy dtype '|V8'",
    ),
    "structured": (np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")]), "numpy dtype '|V8'"),
    "other codec": (_Reduced(__import__("codecs").encode, ("x", "rot13")), "_codecs.encode to 'rot13'"),
    # Fields on a float dtype (its state sets them): refused before numpy sees the state.
    "fields on a float": (
        _array(_dtype("f8", (3, "<", None, ("a",), {"a": (np.dtype("O"), 1 << 40)}, 8, 1, 27)), (1,), [(1,)]),
        "numpy dtype '<f8' with a state numpy does not write",
    ),
    "large bytes": (_Reduced(bytes, (1 << 40,)), "bytes() with 1 argument"),
    "a set": ({1, 2}, "__builtin__.set"),  # Python 3 writes builtins under their Python 2 module name
    "an ordered dict": (__import__("collections").OrderedDict(a=1), "collections.OrderedDict"),
    "more data than shape": (_array(np.dtype("f4"), (1,), b"\0" * 8), "a numpy array of shape (1,)"),
}


@pytest.mark.parametrize("case", FORGED)
def test_states_and_calls_no_proposal_pickle_holds_are_refused(case, tmp_path):
    payload, refused = FORGED[case]
    path = tmp_path / "forged.pkl"
    path.write_bytes(pickle.dumps({"boxes": [], "indexes": [], "x": payload}, protocol=2))
    with pytest.raises(UnsafePickleError) as error:
        read_proposal_pickle(path)
    message = str(error.value)
    assert message.startswith(f"{path}: refused to unpickle ") and refused in message, message


def test_numpy_alone_crashes_on_the_forged_field_which_is_why_states_are_checked(tmp_path):
    # The guard of the "field past the item" case: plain pickle, numpy-only globals, a dead interpreter.
    path = tmp_path / "forged.pkl"
    path.write_bytes(pickle.dumps(FORGED["field past the item"][0], protocol=2))
    code = f"import pickle; pickle.load(open({str(path)!r}, 'rb'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert result.returncode < 0, result.stderr[-2000:]  # killed by a signal (SIGSEGV), not an exception


def test_damaged_files_are_still_not_readable_pickles(tmp_path):
    # Text whose first letter is a pickle opcode names no real global: damaged, not refused.
    (tmp_path / "text.pkl").write_text("image,boxes\na.jpg,1 2 3 4\n")
    with pytest.raises(ValueError, match=r"not a readable pickle \(UnpicklingError: not a global name"):
        read_proposal_pickle(tmp_path / "text.pkl")
    (tmp_path / "empty.pkl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a readable pickle \(EOFError: Ran out of input\)"):
        read_proposal_pickle(tmp_path / "empty.pkl")
