"""The one image decoding rule (wsod/data/image_io.py) and every reader that goes through it: training's
``load_image`` and dataset items, the header size, Selective Search's reader (make_proposals) and
predict's: 16-bit greyscale, EXIF orientation, truncated files, modes, missing files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import ExifTags, Image, ImageOps

from wsod.data.dataset import ImageRecord, WeakDetectionDataset, image_size_from_header, load_image
from wsod.data.image_io import read_image_rgb, read_image_size
from wsod.data.proposals import ProposalSet, filter_proposals
from wsod.data.proposals.selective_search import _read_bgr, generate_proposals

REPO = Path(__file__).resolve().parents[2]

# A 16-bit ramp that reaches white only at 65535, with the exact 8-bit values v * 257 and odd values.
GREY16 = np.array(
    [[0, 255, 256, 257, 1000, 32767, 32768], [128 * 257, 200 * 257, 40000, 65279, 65280, 65534, 65535]],
    dtype=np.uint16,
)


def _rgb(path: Path) -> np.ndarray:
    """What training sees: ``load_image`` back as (H, W, 3)."""
    return load_image(path).permute(1, 2, 0).numpy()


def _smooth(height: int, width: int) -> np.ndarray:
    """A smooth, asymmetric uint8 RGB picture: JPEG keeps it within a few grey levels, and a wrong
    rotation or flip shows as a large difference."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([255 * x // width, 255 * y // height, 128 + 0 * x], axis=-1).astype(np.uint8)


def _save_oriented_jpeg(path: Path, pixels: np.ndarray, orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, quality=95, exif=exif)


def _truncated_jpeg(path: Path, jpeg) -> None:
    jpeg(path, 60, 80)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header is intact, half of the pixel data is gone


def _dataset(path: Path, image_id: str = "a") -> WeakDetectionDataset:
    height, width = image_size_from_header(path)
    record = ImageRecord(image_id, str(path), height, width, np.ones(1, np.float32))
    boxes = [np.array([[0, 0, 3, 1]], np.float32)]
    return WeakDetectionDataset([record], ["thing"], ProposalSet([image_id], boxes))


# --- 16-bit greyscale ----------------------------------------------------------------------------------


def _write_pillow_png(path: Path) -> None:
    Image.fromarray(GREY16).save(path)  # mode I;16


def _write_opencv_png(path: Path) -> None:
    cv2.imwrite(str(path), GREY16)


def _write_pillow_tiff(path: Path) -> None:
    Image.fromarray(GREY16).save(path)  # mode I;16 (little-endian TIFF)


def _write_int32_tiff(path: Path) -> None:
    Image.fromarray(GREY16.astype(np.int32)).save(path)  # mode I holding 16-bit values


@pytest.mark.parametrize(
    "name,write",
    [
        ("pillow.png", _write_pillow_png),
        ("opencv.png", _write_opencv_png),
        ("pillow.tif", _write_pillow_tiff),
        ("int32.tif", _write_int32_tiff),
    ],
)
def test_16_bit_greyscale_decodes_to_its_high_byte_in_training_and_selective_search(tmp_path, name, write):
    path = tmp_path / name
    write(path)
    # v >> 8: v * 257 -> v, only 65280..65535 white (Pillow's own conversion made all above 255 white).
    grey = np.array([[0, 0, 1, 1, 3, 127, 128], [128, 200, 156, 254, 255, 255, 255]], np.uint8)
    expected = np.repeat(grey[..., None], 3, axis=2)
    np.testing.assert_array_equal(_rgb(path), expected)
    item = _dataset(path)[0]
    np.testing.assert_array_equal(item["image"].permute(1, 2, 0).numpy(), expected)
    assert item["original_size"] == GREY16.shape
    np.testing.assert_array_equal(_read_bgr(str(path))[..., ::-1], expected)


def test_16_bit_colour_png_keeps_the_high_byte_as_well(tmp_path):
    colour = np.random.default_rng(0).integers(0, 65536, (5, 6, 3)).astype(np.uint16)
    cv2.imwrite(str(tmp_path / "c.png"), colour[..., ::-1])  # OpenCV writes BGR
    np.testing.assert_array_equal(read_image_rgb(tmp_path / "c.png"), (colour >> 8).astype(np.uint8))


def test_mode_i_beyond_16_bits_and_float_images_are_errors_naming_the_file_and_mode(tmp_path):
    Image.fromarray(np.array([[0, 70000]], np.int32)).save(tmp_path / "wide.tif")
    with pytest.raises(
        RuntimeError, match=r"cannot decode image .*wide\.tif: pixel mode I holds values 0\.\.70000"
    ):
        load_image(tmp_path / "wide.tif")
    Image.fromarray(np.ones((3, 4), np.float32)).save(tmp_path / "float.tif")
    for read in (load_image, image_size_from_header, _read_bgr):
        with pytest.raises(
            RuntimeError, match=r"cannot decode image .*float\.tif: pixel mode F has no faithful"
        ):
            read(str(tmp_path / "float.tif"))


@pytest.mark.parametrize("mode", ["1", "L", "P", "LA", "RGBA", "CMYK"])
def test_other_modes_become_rgb_as_pillow_converts_them(tmp_path, mode):
    picture = Image.fromarray(_smooth(9, 13)).convert(mode)
    path = tmp_path / ("x.jpg" if mode == "CMYK" else "x.png")
    picture.save(path)
    with Image.open(path) as image:
        assert image.mode == mode
        expected = np.asarray(image.convert("RGB"))
    np.testing.assert_array_equal(read_image_rgb(path), expected)
    assert read_image_size(path) == (9, 13)


# --- EXIF orientation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_is_applied_as_pillows_exif_transpose_applies_it(tmp_path, orientation):
    path = tmp_path / "o.jpg"
    _save_oriented_jpeg(path, _smooth(10, 16), orientation)
    with Image.open(path) as image:
        viewer = np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    np.testing.assert_array_equal(read_image_rgb(path), viewer)
    assert read_image_size(path) == viewer.shape[:2] == ((16, 10) if orientation >= 5 else (10, 16))


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_an_oriented_tiff_is_turned_once_as_pillows_tiff_reader_turns_it(tmp_path, orientation):
    """Pillow's TIFF reader applies the orientation tag itself (size at open, pixels at load): applying it
    again would turn the picture twice (a 6 came out upside down)."""
    stored, exif = _smooth(10, 16), Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    Image.fromarray(stored).save(tmp_path / "o.tif", exif=exif)
    with Image.open(tmp_path / "o.tif") as image:
        viewer = np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    np.testing.assert_array_equal(read_image_rgb(tmp_path / "o.tif"), viewer)
    assert (
        read_image_size(tmp_path / "o.tif")
        == viewer.shape[:2]
        == ((16, 10) if orientation >= 5 else (10, 16))
    )


def test_an_invalid_orientation_or_unparsable_exif_leaves_the_stored_grid(tmp_path):
    stored = _smooth(10, 16)
    _save_oriented_jpeg(tmp_path / "nine.jpg", stored, 9)
    Image.fromarray(stored).save(tmp_path / "junk.jpg", quality=95, exif=b"Exif\x00\x00not a tiff header")
    for name in ("nine.jpg", "junk.jpg"):
        with Image.open(tmp_path / name) as image:
            expected = np.asarray(image.convert("RGB"))
        np.testing.assert_array_equal(read_image_rgb(tmp_path / name), expected)
        assert read_image_size(tmp_path / name) == (10, 16)


def test_an_exif_rotated_jpeg_is_upright_for_training_and_selective_search(tmp_path):
    stored = _smooth(120, 200)
    path = tmp_path / "phone.jpg"
    _save_oriented_jpeg(path, stored, 6)  # "turn 90 degrees clockwise to view", as phones save portraits
    upright = np.rot90(stored, k=-1)  # what a viewer shows: 200 high, 120 wide
    assert image_size_from_header(path) == (200, 120)
    pixels = _rgb(path)
    assert pixels.shape == upright.shape
    assert np.abs(pixels.astype(int) - upright).mean() < 2  # JPEG tolerance; unrotated it could not match
    np.testing.assert_array_equal(_read_bgr(str(path))[..., ::-1], pixels)  # the same decoder, bit for bit
    item = _dataset(path)[0]
    assert item["original_size"] == (200, 120) and item["image"].shape == (3, 200, 120)


def test_proposals_of_an_exif_rotated_image_lie_inside_it_as_training_decodes_it(tmp_path):
    rng = np.random.default_rng(1)
    stored = np.kron(rng.integers(0, 256, (6, 10, 3)), np.ones((20, 20, 1))).astype(np.uint8)  # 120 x 200
    path = tmp_path / "phone.jpg"
    _save_oriented_jpeg(path, stored, 6)
    proposals, _ = generate_proposals([("phone", str(path))], tmp_path / "p.pkl", workers=1, progress=False)
    boxes = torch.tensor(proposals["phone"])
    height, width = load_image(path).shape[-2:]
    assert (height, width) == (200, 120) and len(boxes) > 10
    assert boxes[:, 3].max() > 120  # made on the upright image: it reaches below the stored height
    assert boxes[:, 2].max() <= width - 1 and boxes[:, 3].max() <= height - 1
    torch.testing.assert_close(filter_proposals(boxes, (height, width)), boxes)  # none clipped or dropped


def test_predict_reads_an_exif_image_as_a_viewer_shows_it(tmp_path):
    from wsod.data.images import ImageFiles

    path = tmp_path / "phone.jpg"
    _save_oriented_jpeg(path, _smooth(30, 50), 8)
    images = ImageFiles([path], ["phone.jpg"], 2, ProposalSet(["phone.jpg"], [np.array([[0, 0, 9, 9]])]))
    assert images[0]["image"].shape == (3, 50, 30) and images[0]["original_size"] == (50, 30)


def test_the_size_is_read_from_the_header_without_decoding_pixels(tmp_path):
    # A PNG whose eXIf chunk precedes its pixel data, then cut inside the pixel data: the size (rotated)
    # is known from the header; decoding the pixels is what fails.
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 70, 3), dtype=np.uint8)).save(
        path, exif=exif
    )
    path.write_bytes(path.read_bytes()[:-2000])
    assert read_image_size(path) == (70, 40)
    with pytest.raises(RuntimeError, match=r"cannot decode image .*cut\.png: "):
        read_image_rgb(path)


# --- truncated, corrupt and missing files --------------------------------------------------------------


def test_a_truncated_jpeg_is_refused_by_make_proposals_with_the_training_message(tmp_path, jpeg):
    path = tmp_path / "cut.jpg"
    _truncated_jpeg(path, jpeg)
    with pytest.raises(RuntimeError) as training:
        load_image(path)
    message = str(training.value)
    assert message.startswith(f"cannot decode image {path}: ") and "truncated" in message
    with pytest.raises(RuntimeError) as reader:
        _read_bgr(str(path))
    assert str(reader.value) == message
    with pytest.raises(RuntimeError) as generation:
        generate_proposals([("cut", str(path))], tmp_path / "p.pkl", workers=1, progress=False)
    assert str(generation.value) == message


def test_make_proposals_folder_refuses_a_truncated_jpeg_naming_it(tmp_path, jpeg):
    root = tmp_path / "mine"
    jpeg(root / "images" / "good.jpg", 30, 40)
    _truncated_jpeg(root / "images" / "cut.jpg", jpeg)
    (root / "labels.csv").write_text("image,split,labels\ngood.jpg,train,cat\ncut.jpg,test,cat\n")
    spec = importlib.util.spec_from_file_location("make_proposals", REPO / "tools" / "make_proposals.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(RuntimeError) as error:
        tool.main(["folder", "--root", str(root), "--workers", "1", "--no-progress"])
    with pytest.raises(RuntimeError) as training:
        load_image(root / "images" / "cut.jpg")
    assert str(error.value) == str(training.value)


def test_a_file_that_is_no_image_and_a_missing_file_are_named_by_every_reader(tmp_path):
    (tmp_path / "junk.png").write_bytes(b"\x89PNG not really")
    for read in (read_image_rgb, read_image_size, load_image, image_size_from_header, _read_bgr):
        with pytest.raises(
            RuntimeError, match=r"cannot decode image .*junk\.png: cannot identify image file"
        ):
            read(str(tmp_path / "junk.png"))
        with pytest.raises(FileNotFoundError, match=r"image file not found: .*gone\.jpg"):
            read(str(tmp_path / "gone.jpg"))
