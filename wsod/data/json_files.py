"""Reading a json file a user names (a COCO annotation file, a partial-label side file, a pseudo-label
file): one place that turns "this is not json" into one line naming the file and what was expected.

Without it a checkpoint given where json is expected (``pseudo_labels=runs/x/model_final.pth``: a zip
archive) fails inside the text decoder with a bare ``UnicodeDecodeError`` that names no file, and a
truncated json with a ``JSONDecodeError`` that names none either. ``read_json`` reads the bytes once,
decodes them as UTF-8 (RFC 8259's one encoding; a leading byte-order mark, as some Windows editors write,
is accepted) and parses them; every failure is a ``ValueError``
``<file>: not a JSON file (<why>); expected <what the caller reads>``.

``require_keys`` names the top-level fields a reader needs, so that a json of the wrong kind (a side
file given as a COCO json) says which field is missing instead of a bare ``KeyError: 'categories'``;
``whole_number`` checks the pixel sizes json files state (COCO's ``width`` / ``height``).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["read_json", "require_keys", "whole_number"]

# The first bytes of a zip archive: what torch.save writes (a .pth checkpoint), and .npz files.
_ZIP_MAGIC = b"PK\x03\x04"
# The first bytes of a pickle of protocol 2 or later: torch.save's legacy format, proposal .pkl files.
_PICKLE_MAGIC = b"\x80"


def _not_json(path: Path, why: str, expected: str) -> ValueError:
    return ValueError(f"{path}: not a JSON file ({why}); expected {expected}")


def read_json(path: str | os.PathLike, expected: str) -> Any:
    """The parsed content of the json file ``path``. ``expected`` says what the caller reads, for the
    error (e.g. ``"a COCO instances json with images, annotations and categories"``).

    Raises ``FileNotFoundError`` naming ``path`` when nothing is there, ``ValueError`` (one line: the
    file, why it is not json, what was expected) for a folder, a binary file (a checkpoint, a pickle)
    or text that does not parse. Callers that say more about a missing file (which tool writes it)
    check ``is_file()`` first.
    """
    path = Path(path)
    if path.is_dir():
        raise _not_json(path, "a folder", expected)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file; expected {expected}") from None
    if data.startswith(_ZIP_MAGIC):
        raise _not_json(path, "a zip archive, as a PyTorch checkpoint .pth is", expected)
    if data.startswith(_PICKLE_MAGIC):
        raise _not_json(path, "a Python pickle, as a proposal .pkl is", expected)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise _not_json(path, f"binary data, byte {error.start} is not UTF-8 text", expected) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:  # "Expecting ',' delimiter: line 3 column 5 (char 40)"
        raise _not_json(path, str(error), expected) from None


def require_keys(
    content: Any, path: str | os.PathLike, kinds: Mapping[str, type | tuple[type, ...]], expected: str
) -> None:
    """Refuse ``content`` (a parsed json) unless it is an object holding each key of ``kinds`` with a
    value of that type: one ``ValueError`` naming the file, the first missing or wrong field, and
    ``expected`` (the layout the caller reads)."""
    if not isinstance(content, dict):
        raise ValueError(f"{path}: the json is {_json_type(content)}, not an object; expected {expected}")
    for key, kind in kinds.items():
        if key not in content:
            present = ", ".join(repr(k) for k in list(content)[:6]) or "none"
            raise ValueError(f"{path}: no {key!r} field (its fields: {present}); expected {expected}")
        if not isinstance(content[key], kind):
            raise ValueError(
                f"{path}: {key!r} is {_json_type(content[key])}, not {_json_type_name(kind)};"
                f" expected {expected}"
            )


def whole_number(value: Any) -> int | None:
    """A json value that counts whole units as an ``int``: an integer, a number with no fraction
    (``640.0``, as some writers store it) or a string of digits (``"640"``, which the readers' ``int()``
    took before this check); None for anything else (``"640px"``, ``640.5``, a list, ``true``, infinity)."""
    if isinstance(value, str):
        return int(value) if value.isascii() and value.isdigit() else None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if not math.isfinite(value) or value != int(value):
        return None
    return int(value)


# How the errors name a json value's type, article included ("'images' is an object, not a list").
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}


def _json_type(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return _JSON_NAMES[type(value)]
    if isinstance(value, numbers.Real):
        return "a number"
    return _JSON_NAMES.get(type(value), f"a {type(value).__name__}")


def _json_type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_JSON_NAMES.get(k, f"a {k.__name__}") for k in kinds)
