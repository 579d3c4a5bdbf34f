"""Reading proposal pickles without running what they ask for (issue 33).

A pickle is a program: ``pickle.load`` calls any function a file names, so a ``.pkl`` given as
``proposals=`` could run ``os.system``. Proposal pickles (the reference format of
``wsod.data.proposals.io`` and the shards of ``wsod.data.proposals.selective_search``) hold only dicts,
lists, tuples, plain numbers and strings, which need no function at all, and numpy arrays, dtypes and
scalars, which need a handful. ``RestrictedUnpickler`` allows exactly those and refuses anything else
with ``UnsafePickleError``, one line naming the file and the refused ``module.name``, before calling it.

What the allowed names are, found by reading the globals of pickles written by numpy 1.26.4 and 2.4.6
at protocols 0 to 5 (float, int, string, object, empty, non-contiguous and Fortran-order arrays, numpy
scalars, bytes) and of pickles written the way Python 2 with numpy 1 wrote the reference VOC Selective
Search files (protocol 2, byte strings as Python 2's ``str``):

- ``numpy.core.multiarray._reconstruct`` / ``numpy._core.multiarray._reconstruct`` with
  ``numpy.ndarray`` and ``numpy.dtype``: an array at protocols 0-4, and at 5 when it is not contiguous
  or holds objects (numpy 1 names ``numpy.core``, numpy 2 ``numpy._core``; both are accepted and mapped
  to the installed numpy's function, so a numpy-1 file loads under numpy 2 without its deprecation
  warning, and a numpy-2 file under numpy 1, whose own unpickler finds no ``numpy._core.numeric``);
- ``numpy.core.numeric._frombuffer`` / ``numpy._core.numeric._frombuffer``: a contiguous array at 5;
- ``numpy.core.multiarray.scalar`` / ``numpy._core.multiarray.scalar``: a numpy scalar (an image id
  read from an array is one);
- ``_codecs.encode``: how Python 3 writes every ``bytes`` object at protocols 0-2, the raw data of each
  numpy array among them, as ``_codecs.encode(<str>, 'latin1')``; so protocol-2 files written by Python
  3 need it. Only that exact call is allowed: any other codec is refused, since a codec lookup imports
  ``encodings`` modules and runs the codec search functions other packages register;
- ``__builtin__.bytes`` / ``builtins.bytes``: how the same protocols write an empty ``bytes`` (the data
  of an empty array, an image without proposals), as ``bytes()``; only the call without arguments is
  allowed (``bytes(n)`` would allocate ``n`` bytes).

Python-2 pickles name no other global: their byte strings are ``str`` opcodes, read as text with
``encoding="latin1"`` (numpy takes latin1 text for array and scalar data); sets (``builtins.set``)
and every class of the standard library or of a package are refused.

Why BUILD is checked too: numpy's ``dtype.__setstate__`` takes a pickle's word for a dtype's flags,
fields and item size. A pickle made of the allowed names alone can so declare an object dtype whose
flags say it holds no objects (its array's raw bytes, chosen by the file, then read as pointers), or a
field far past the end of its 8-byte item, which numpy writes to while it sets the state of an array of
that dtype: the interpreter dies with a write out of bounds during ``pickle.load`` (tested). So every
BUILD (``__setstate__``) goes through ``load_build`` here: only dtypes and arrays are built; a dtype must
be of a plain kind (bool, integer, float, complex, str, bytes or object: no structured, sub-array or
datetime dtypes) and its state exactly the one numpy itself writes for its type string; an array's state
must name such a dtype and hold exactly as many bytes, or list entries, as its shape says. The functions
a pickle can call take the same care (the dtypes, the buffer types and sizes), look at an argument's
type before comparing it (``==`` on an array reads its elements), and none returns a class, so the
``NEWOBJ`` and ``INST`` opcodes cannot build anything.

The C unpickler gives no hook for BUILD, so ``RestrictedUnpickler`` subclasses the pure-Python
``pickle._Unpickler``, the reference implementation that ``pickle.Unpickler`` mirrors (in CPython since
3.0, and the fallback where the C module is missing), and replaces its BUILD opcode. Its cost, measured
on 2 cores: 1.0 s against the C unpickler's 0.7 s for VOC 2007 trainval's size (5,011 images of 2,000
float32 boxes and scores, protocol 2; 0.25 s against 0.17 s at protocol 5), 5 s against 1.4 s for
120,000 images of 100 boxes (protocol 5). A set that large belongs in a ``.proposals`` store, which is
memory-mapped, not unpickled.

Not covered: resources. A file takes the memory it describes; the checks keep only a single request
from allocating more than the file's own bytes (an array's data must match its shape; the shape numpy
writes into ``_reconstruct`` is ignored).
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable
from typing import IO, Any

import numpy as np

__all__ = ["UnsafePickleError", "RestrictedUnpickler", "load_restricted_pickle", "ALLOWED_GLOBALS"]

# The installed numpy's own rebuild functions, taken from what it pickles with rather than imported
# from a private module: numpy 1 keeps them in numpy.core, numpy 2 in numpy._core (whose numpy.core
# shim warns on use).
_RECONSTRUCT: Callable[..., np.ndarray] = np.zeros(1).__reduce__()[0]
_SCALAR: Callable[..., np.generic] = np.float64(0).__reduce__()[0]
_FROMBUFFER: Callable[..., np.ndarray] = np.zeros(1).__reduce_ex__(5)[0]

# ``numpy.ndarray`` is only ever the first argument of ``_reconstruct``. The pickle gets this marker in
# its place, not the class, so that it cannot call ``numpy.ndarray(shape, dtype, buffer)`` itself.
_NDARRAY = object()

# The global names a proposal pickle may use (module docstring), each with the method of
# ``RestrictedUnpickler`` (or the marker) it resolves to.
ALLOWED_GLOBALS: dict[str, str] = {
    **{f"{m}.multiarray._reconstruct": "_reconstruct" for m in ("numpy.core", "numpy._core")},
    **{f"{m}.multiarray.scalar": "_scalar" for m in ("numpy.core", "numpy._core")},
    **{f"{m}.numeric._frombuffer": "_frombuffer" for m in ("numpy.core", "numpy._core")},
    "numpy.ndarray": "_NDARRAY",
    "numpy.dtype": "_dtype",
    "_codecs.encode": "_latin1",
    # Below protocol 3, Python 3 writes builtins under their Python 2 module name.
    "__builtin__.bytes": "_empty_bytes",
    "builtins.bytes": "_empty_bytes",
}

# dtype kinds a proposal pickle may hold: bool, signed and unsigned integers, floats, complex, str,
# bytes and objects (an object array of per-image arrays). Not void (structured), datetimes, timedeltas.
_KINDS = frozenset("biufcUSO")

ALLOWED = "a proposal pickle may hold only numpy arrays, lists, dicts and plain numbers and strings"
FIX = (
    "if you trust the file, load it with Python's pickle and save the boxes and ids again with"
    " wsod.data.proposals.save_proposals"
)


class UnsafePickleError(ValueError):
    """A pickle asked for something no proposal pickle needs: a global outside ``ALLOWED_GLOBALS``, or a
    dtype or array state that numpy would not write. What was refused was not called or set; the
    message is one line naming the file and what was refused."""


class _Opcodes(dict):
    """pickle's opcode table, answering an unknown opcode (a JPEG or text renamed ``.pkl``) with the C
    unpickler's ``UnpicklingError`` rather than the pure-Python one's bare ``KeyError``."""

    def __missing__(self, code: int) -> Callable[[pickle._Unpickler], None]:
        raise pickle.UnpicklingError(f"invalid load key, {repr(bytes([code]))[1:]}.")


def _is_plain(value: object) -> bool:
    """Whether ``value`` is None, an int or a str exactly: the only types in the states numpy writes
    for plain dtypes. Checked before comparing, since ``==`` on an array reads its elements."""
    return value is None or type(value) in (int, str)


def _is_shape(value: object) -> bool:
    return type(value) is tuple and all(type(n) is int and n >= 0 for n in value)


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler that builds only what a proposal pickle holds (module docstring), reading ``file``
    (a binary file object) whose name for messages is ``source``. ``encoding`` is pickle's: "latin1"
    reads Python-2 pickles, whose byte strings become text."""

    def __init__(self, file: IO[bytes], *, source: str, encoding: str = "ASCII") -> None:
        super().__init__(file, encoding=encoding)
        self.source = source

    def load(self) -> Any:
        """The unpickled object. An empty or cut file is an ``EOFError`` with the C unpickler's words
        (the pure-Python one gives none)."""
        try:
            return super().load()
        except EOFError as e:
            if e.args:
                raise
            raise EOFError("Ran out of input") from None

    def refusal(self, what: str) -> UnsafePickleError:
        """The one-line error for refusing ``what`` (a ``module.name``, or a dtype or state)."""
        return UnsafePickleError(f"{self.source}: refused to unpickle {what}: {ALLOWED} ({FIX})")

    def find_class(self, module: str, name: str) -> Any:
        """The allowed globals, resolved to this class's checked versions; anything else is refused
        here, before it is imported or called."""
        attribute = ALLOWED_GLOBALS.get(f"{module}.{name}")
        if attribute is None and not all(p.isidentifier() for p in f"{module}.{name}".split(".")):
            # Not a name at all: a text file whose first letter is an opcode (``i`` reads the next two
            # lines as a global). Such a file is damaged, not dangerous, and is said to be so.
            raise pickle.UnpicklingError(f"not a global name: {module!r} {name!r}")
        if attribute is None:
            raise self.refusal(f"{module}.{name}")
        return _NDARRAY if attribute == "_NDARRAY" else getattr(self, attribute)

    # The functions a pickle may call (through find_class). Each checks its arguments as numpy writes them.

    def _dtype(self, spec: object, align: object = False, copy: object = False) -> np.dtype:
        """``numpy.dtype(spec, align, copy)``: always a new dtype, since BUILD then sets its state and
        ``numpy.dtype("f4")`` without a copy is numpy's shared float32 dtype."""
        if type(spec) is not str or type(align) not in (bool, int) or type(copy) not in (bool, int):
            raise self.refusal(f"numpy.dtype of a {type(spec).__name__}")
        dtype = np.dtype(spec, bool(align), True)
        self._check_dtype(dtype)
        return dtype

    def _check_dtype(self, dtype: object, *, objects: bool = True) -> np.dtype:
        """``dtype`` if it is a plain dtype (module docstring) whose state is the one numpy builds from
        its type string, and holds no objects unless ``objects``; else the refusal."""
        if not isinstance(dtype, np.dtype):
            raise self.refusal(f"a {type(dtype).__name__} where numpy writes a dtype")
        if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None:
            raise self.refusal(f"numpy dtype {dtype.str!r} (only numbers, strings and objects)")
        if dtype.__reduce__()[2] != np.dtype(dtype.str).__reduce__()[2]:
            raise self.refusal(f"numpy dtype {dtype.str!r} with a state numpy does not write")
        if dtype.hasobject and not objects:
            raise self.refusal(f"numpy dtype {dtype.str!r} over raw bytes")
        return dtype

    def _reconstruct(self, subtype: object, shape: object = None, typecode: object = None) -> np.ndarray:
        """``_reconstruct(numpy.ndarray, (0,), b"b")``, an empty array that BUILD then fills. ``shape``
        and ``typecode`` are ignored (numpy always writes these two): BUILD sets both, checked, and a
        crafted shape here would only allocate."""
        if subtype is not _NDARRAY:
            raise self.refusal(f"an array of type {type(subtype).__name__}")
        return _RECONSTRUCT(np.ndarray, (0,), "b")

    def _frombuffer(self, buffer: object, dtype: object, shape: object, order: object) -> np.ndarray:
        """Protocol 5's array from an in-band buffer (``bytearray``, or ``bytes`` if it was read-only)."""
        dtype = self._check_dtype(dtype, objects=False)
        plain = type(buffer) in (bytes, bytearray) and _is_shape(shape) and type(order) is str
        if not plain or order not in ("C", "F"):  # types first: == on an array would read its elements
            raise self.refusal("numpy._frombuffer with arguments numpy does not write")
        if len(buffer) != math.prod(shape) * dtype.itemsize:
            raise self.refusal(f"an array of shape {shape} over {len(buffer)} bytes of {dtype.str}")
        return _FROMBUFFER(buffer, dtype, shape, order)

    def _scalar(self, dtype: object, data: object = None) -> np.generic:
        """``scalar(dtype, data)``: a numpy scalar from its raw bytes (latin1 text in Python-2 files)."""
        dtype = self._check_dtype(dtype, objects=False)
        if type(data) not in (bytes, str) or len(data) != dtype.itemsize:
            raise self.refusal(f"a numpy scalar of {dtype.str} from a {type(data).__name__}")
        return _SCALAR(dtype, data)

    def _latin1(self, text: object, encoding: object = None) -> bytes:
        """``_codecs.encode(text, "latin1")``, the one call Python 3 writes for bytes (module docstring)."""
        if type(encoding) is not str:  # checked first: == on an array would read its elements
            raise self.refusal("_codecs.encode")
        if type(text) is not str or encoding != "latin1":
            raise self.refusal(f"_codecs.encode to {encoding!r}")
        return text.encode("latin1")

    def _empty_bytes(self, *arguments: object) -> bytes:
        """``bytes()``: how an empty bytes object is written below protocol 3."""
        if arguments:
            raise self.refusal(f"bytes() with {len(arguments)} argument(s)")
        return b""

    # BUILD: the state of a dtype or an array, checked before numpy sees it.

    def load_build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if isinstance(target, np.dtype):
            self._build_dtype(target, state)
        elif type(target) is np.ndarray:
            self._build_array(target, state)
        else:
            raise self.refusal(f"the state of a {type(target).__name__}")

    dispatch = _Opcodes(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build

    def _build_dtype(self, dtype: np.dtype, state: object) -> None:
        """A dtype's state must be the one numpy writes for it in the byte order the state names."""
        if (
            type(state) is not tuple
            or not all(map(_is_plain, state))
            or len(state) < 2
            or state[1] not in ("<", ">", "=", "|")
            or state != dtype.newbyteorder(state[1]).__reduce__()[2]
        ):
            raise self.refusal(f"numpy dtype {dtype.str!r} with a state numpy does not write")
        dtype.__setstate__(state)

    def _build_array(self, array: np.ndarray, state: object) -> None:
        """An array's state ``(version, shape, dtype, fortran order, data)``: a checked dtype, and data of
        exactly the shape's size: raw bytes (latin1 text in Python-2 files), or a list for objects."""
        if type(state) is not tuple or len(state) != 5 or not _is_shape(state[1]):
            raise self.refusal("a numpy array state numpy does not write")
        _, shape, dtype, _, data = state
        dtype = self._check_dtype(dtype)
        count = math.prod(shape)
        if dtype.hasobject:
            fits = type(data) is list and len(data) == count
        else:
            fits = type(data) in (bytes, bytearray, str) and len(data) == count * dtype.itemsize
        if not fits:
            raise self.refusal(f"a numpy array of shape {shape} and {dtype.str} from a {type(data).__name__}")
        array.__setstate__(state)


def load_restricted_pickle(path: str | os.PathLike, *, encoding: str = "ASCII") -> Any:
    """Unpickle the file at ``path`` with ``RestrictedUnpickler`` (``encoding="latin1"`` for Python-2
    files). Raises ``UnsafePickleError`` for what it refuses; a damaged file raises what pickle raises."""
    with open(path, "rb") as f:
        return RestrictedUnpickler(f, source=str(path), encoding=encoding).load()
