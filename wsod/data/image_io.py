"""The one image decoding rule: every reader of an image file (training, evaluation, predict, Selective
Search in make_proposals) goes through this module, so that all of them see the same pixels and sizes.

``read_image_rgb(path)`` -> uint8 RGB (H, W, 3); ``read_image_size(path)`` -> (H, W) from the header
only, without decoding pixels. Both give the image as a viewer shows it:

- Decoder: Pillow, first frame of multi-frame files. Not OpenCV's ``imread``, not even for Selective
  Search: it decodes a truncated JPEG partially without an error.
- Orientation: the EXIF Orientation tag (or XMP ``tiff:Orientation`` where EXIF has none, as Pillow's
  ``Image.getexif`` reads them) is applied as viewers apply it: 2-8 flip and / or rotate the stored
  grid, 5-8 swap H and W. The tag is read from the metadata Pillow parses on opening, before any pixel
  data, by one function for both the size and the pixels, so the two always agree; ``ImageOps.
  exif_transpose`` is not used because for a PNG it decodes the whole image to look for an eXIf chunk
  after the pixel data, which a header-only read cannot do (such a late chunk is ignored). An absent,
  unreadable or out-of-range tag means orientation 1 (the stored grid), as viewers show it.
- Modes: 1, L, P, LA, PA, RGB, RGBA, RGBX, RGBa, CMYK and YCbCr become RGB as Pillow converts them
  (alpha is dropped, not composited; no ICC colour management). 16-bit greyscale (I;16, I;16L, I;16B,
  I;16N, and I holding values in 0..65535) keeps its high byte, ``v >> 8``: Pillow's own clipping
  conversion would make everything above 255 white. The high byte is the rule Pillow's PNG decoder
  applies to 16-bit colour PNGs (which open as 8-bit RGB) and OpenCV's ``imread`` to 16-bit PNGs, so
  one rule holds for all 16-bit files; it maps 65535 -> 255 and ``v * 257`` -> v exactly, and is at
  most 1 below ``round(v / 257)``. Other modes (F 32-bit float, I beyond 16 bits, LAB, ...) have no
  faithful 8-bit RGB form and are an error.

Errors, one message wherever an image is read: a missing file is ``FileNotFoundError("image file not
found: <path>")``; a truncated, corrupt or unconvertible file is ``RuntimeError("cannot decode image
<path>: <reason>")``, with Pillow's exception as ``__cause__`` where there is one. Pillow refuses a
truncated file unless ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` is set; wsod never sets it.
"""

from __future__ import annotations

import os
import struct

import numpy as np
from PIL import ExifTags, Image

__all__ = ["read_image_rgb", "read_image_size"]

# EXIF orientation -> the transposition a viewer applies to the stored grid (Pillow's ROTATE_* turn
# counter-clockwise: orientation 6, "turn 90 degrees clockwise to view", is ROTATE_270).
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_SIDES = frozenset({5, 6, 7, 8})

_SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
_PILLOW_TO_RGB = frozenset({"1", "L", "P", "LA", "PA", "RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr"})

# What Pillow raises for bad data, depending on the format and where in the file the damage is.
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)


def _check_exists(path: str | os.PathLike) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"image file not found: {path}")


def _check_mode(path: str | os.PathLike, mode: str) -> None:
    """Refuse, at the header, a mode without a faithful 8-bit RGB form (see the module docstring)."""
    if mode not in _PILLOW_TO_RGB and mode not in _SIXTEEN_BIT and mode != "I":
        raise RuntimeError(
            f"cannot decode image {path}: pixel mode {mode} has no faithful 8-bit RGB form; save it as"
            " 8- or 16-bit greyscale or 8-bit RGB"
        )


def _orientation(image: Image.Image) -> int:
    """EXIF orientation 1..8 of an opened, not yet decoded image; 1 when absent, not a valid value or in
    EXIF data that does not parse (viewers then show the stored grid too; the pixels are still fine)."""
    if image.format == "TIFF":
        return 1  # Pillow's TIFF reader applies the tag itself, to the size at open and the pixels at load
    try:
        # The base class's getexif on purpose: PngImageFile's override decodes the pixels first.
        orientation = Image.Image.getexif(image).get(ExifTags.Base.Orientation, 1)
    except _DECODE_ERRORS:
        return 1
    return orientation if isinstance(orientation, int) and orientation in _TRANSPOSE else 1


def _to_rgb(path: str | os.PathLike, image: Image.Image) -> Image.Image:
    """A decoded image of an accepted mode -> mode RGB, 16-bit greyscale by its high byte."""
    if image.mode not in _SIXTEEN_BIT and image.mode != "I":
        return image.convert("RGB")
    values = np.asarray(image)  # uint16 in the file's byte order, or int32 for mode I
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    if low < 0 or high > 65535:
        raise RuntimeError(
            f"cannot decode image {path}: pixel mode {image.mode} holds values {low}..{high}, beyond 16"
            " bits, which have no faithful 8-bit form; save it as 8- or 16-bit greyscale"
        )
    grey = (values.astype(np.uint32) >> 8).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")


def read_image_rgb(path: str | os.PathLike) -> np.ndarray:
    """Decode an image file to a writable uint8 RGB array (H, W, 3), EXIF orientation applied (see the
    module docstring for the rules and errors)."""
    _check_exists(path)
    try:
        with Image.open(path) as image:
            _check_mode(path, image.mode)
            orientation = _orientation(image)
            image.load()  # truncated or corrupt pixel data fails here
            rgb = _to_rgb(path, image)
    except _DECODE_ERRORS as e:
        raise RuntimeError(f"cannot decode image {path}: {e}") from e
    if orientation != 1:
        rgb = rgb.transpose(_TRANSPOSE[orientation])
    return np.array(rgb)  # a copy: writable (torch refuses read-only arrays) and C-contiguous (OpenCV)


def read_image_size(path: str | os.PathLike) -> tuple[int, int]:
    """(H, W) of an image file as ``read_image_rgb`` decodes it, from the header only: EXIF orientations
    5-8 swap the stored sides. Refuses what ``read_image_rgb`` refuses at the header (a corrupt header,
    an unconvertible mode); damage in the pixel data shows only when the pixels are decoded."""
    _check_exists(path)
    try:
        with Image.open(path) as image:
            _check_mode(path, image.mode)
            width, height = image.size
            orientation = _orientation(image)
    except _DECODE_ERRORS as e:
        raise RuntimeError(f"cannot decode image {path}: {e}") from e
    return (width, height) if orientation in _SWAPS_SIDES else (height, width)
