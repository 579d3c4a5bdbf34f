"""A memory-mapped proposal store: the proposals of a whole dataset read from one file, not held in RAM.

A reference pickle is unpickled into every process that uses it: about 3.8 GB for 2,000 boxes of 120k
COCO images, in each DDP process and, with the spawn start method, in each data-loader worker. A store
is a directory ``<name>.proposals/`` that is memory-mapped instead, so the boxes live once in the
operating system's page cache, shared by all processes, and are read in as images are looked up:

    manifest.json    {"format": "wsod-proposal-store", "version": 1, "dtype": "float32" | "float16",
                      "num_images": N, "num_boxes": M, "id_type": "int" | "str" | "mixed",
                      "has_scores": bool, "has_sizes": bool, "uuid": ..., "source": the file it was
                      made from}
    boxes.npy        (M, 4) float32 or float16, the boxes of all images one after the other
    offsets.npy      (N + 1,) int64: image i owns rows offsets[i]:offsets[i + 1]
    ids.npy          (N,) image ids in file order: int64 for integer ids, unicode for string ids;
                     with both kinds ("mixed") unicode, and id_is_int.npy (N,) bool marks the integers
    scores.npy       (M,) same dtype as the boxes; only when the source had scores that are not all zero
    sizes.npy        (N, 2) int32 (H, W) of the image each image's proposals were made on, (0, 0) where
                     unknown; only when the source recorded sizes (has_sizes; see wsod.data.proposals.sets)

``has_sizes`` and ``sizes.npy`` came after the first stores, within version 1: a manifest without
``has_sizes`` is a store without sizes and opens as before, and a wsod that predates them ignores both.

Ids keep their types (VOC's ``"2008_000008"`` stays a string, COCO's ``139`` an int) and are looked up
through ``proposal_key`` like a ``ProposalSet``'s. ``ProposalStore`` is a ``ProposalSet``: lookups give
read-only float32 ``(R, 4)`` arrays (views into the mapping for float32 stores, small copies for float16),
so ``WeakDetectionDataset`` takes a store path wherever it takes a pickle. The id -> index dict is
built at the first lookup (with the id list, 13 MB for 120k integer ids, 20 MB for VOC-style string
ids). Pickling a store (spawned data-loader workers, DDP) pickles its path: the receiving process maps
the same file again, and refuses a store that was rewritten in between (the manifest's uuid differs).

float16 halves the file. It stores integers exactly up to 2048 and rounds other coordinates to a
spacing of 1/2 px below 1024, 1 px up to 2048 and 2 px up to 4096; Selective Search boxes are integers,
so they are exact in images up to 2048 px. Values beyond float16's range (65504) are an error.

Writing goes into a temporary sibling directory that is renamed to ``<name>.proposals`` when complete, so
an interrupted conversion leaves no half store under the final name. An existing store of that name is
replaced (moved aside, then deleted); any other existing path is refused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Hashable, Sequence
from pathlib import Path

import numpy as np

from wsod.data.proposals.sets import ProposalSet, _as_sizes, proposal_key

__all__ = [
    "STORE_SUFFIX",
    "STORE_DTYPES",
    "ProposalStore",
    "ProposalStoreError",
    "is_store_path",
    "write_proposal_store",
]

logger = logging.getLogger(__name__)

ImageId = Hashable
STORE_SUFFIX = ".proposals"
STORE_DTYPES = ("float32", "float16")
FORMAT = "wsod-proposal-store"
VERSION = 1
MANIFEST = "manifest.json"
BOXES, OFFSETS, IDS, ID_IS_INT, SCORES = "boxes.npy", "offsets.npy", "ids.npy", "id_is_int.npy", "scores.npy"
SIZES = "sizes.npy"
CHUNK_ROWS = 1 << 20  # rows converted and written at a time: 16 MB of float32 boxes
INT64 = np.iinfo(np.int64)


class ProposalStoreError(ValueError):
    """A store that is truncated, inconsistent with its manifest, or not a store (names the file)."""


def is_store_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a proposal store (its name ends with ``.proposals``)."""
    return Path(path).name.lower().endswith(STORE_SUFFIX)


# ----------------------------------------------------------------------------------------------------
# Reading


def _read_manifest(path: Path) -> dict:
    if not path.is_dir():
        if path.exists():
            raise ProposalStoreError(f"{path}: a proposal store is a directory; this is a file")
        raise FileNotFoundError(f"proposal store not found: {path}")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"proposal store {path}: missing {manifest_path}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ProposalStoreError(f"{manifest_path}: not a readable JSON manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ProposalStoreError(f"{manifest_path}: not a wsod proposal store manifest")
    if manifest.get("version") != VERSION:
        raise ProposalStoreError(
            f"{manifest_path}: store format version {manifest.get('version')!r}; this wsod reads {VERSION}"
        )
    keys = ("dtype", "num_images", "num_boxes", "id_type", "has_scores", "uuid")
    missing = [k for k in keys if k not in manifest]
    if missing:
        raise ProposalStoreError(f"{manifest_path}: manifest lacks {missing}")
    if manifest["dtype"] not in STORE_DTYPES or manifest["id_type"] not in ("int", "str", "mixed"):
        raise ProposalStoreError(
            f"{manifest_path}: unknown dtype {manifest['dtype']!r} or id_type {manifest['id_type']!r}"
        )
    if not isinstance(manifest.get("has_sizes", False), bool):  # absent: a store from before sizes
        raise ProposalStoreError(
            f"{manifest_path}: has_sizes {manifest['has_sizes']!r}; expected true or false"
        )
    return manifest


def _map_array(file: Path, manifest_path: Path, shape: tuple[int, ...], kinds: str, dtype=None) -> np.ndarray:
    """Memory-map one ``.npy`` file after checking it against the manifest and its own header: shape,
    dtype (``dtype``, or any of the numpy ``kinds`` letters) and size on disk (a truncated file)."""
    if not file.is_file():
        raise FileNotFoundError(f"proposal store {file.parent}: missing {file}")
    try:
        with open(file, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            header_shape, fortran, header_dtype = read_header(f)
            data_start = f.tell()
    except ValueError as e:
        raise ProposalStoreError(f"{file}: not a valid .npy file ({e})") from e
    if header_shape != shape or fortran or header_dtype.kind not in kinds:
        raise ProposalStoreError(
            f"{file}: holds a {header_dtype} array of shape {header_shape}; {manifest_path} says"
            f" {dtype or kinds} of shape {shape}"
        )
    if dtype is not None and header_dtype != np.dtype(dtype):
        raise ProposalStoreError(f"{file}: dtype {header_dtype}; {manifest_path} says {dtype}")
    expected = data_start + int(np.prod(shape)) * header_dtype.itemsize
    size = file.stat().st_size
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise ProposalStoreError(f"{file}: {what}: {size} bytes on disk, expected {expected}")
    # np.asarray: a plain ndarray view (lookups return ndarrays, not np.memmap) that keeps the map alive.
    return np.asarray(np.load(file, mmap_mode="r"))


def _reopen(path: str, store_uuid: str, source: str) -> ProposalStore:
    """Unpickle a store (``ProposalStore.__reduce__``): map the same directory again. Module-level, so
    that pickle names it ``wsod.data.proposals.store._reopen`` and a spawned worker can import it."""
    return ProposalStore(path, expected_uuid=store_uuid, source=source)


class ProposalStore(ProposalSet):
    """A ``ProposalSet`` read from a memory-mapped ``<name>.proposals`` store (see the module docstring).

    Args:
        path: the store directory.
        expected_uuid: refuse a store whose manifest has another uuid (used when unpickling).
        source: the name quoted in error messages (default: ``path``).
    """

    def __init__(
        self, path: str | os.PathLike, *, expected_uuid: str | None = None, source: str | None = None
    ) -> None:
        self.path = Path(os.path.abspath(path))
        self.source = str(path) if source is None else source
        manifest = _read_manifest(self.path)
        manifest_path = self.path / MANIFEST
        if expected_uuid is not None and manifest["uuid"] != expected_uuid:
            raise ProposalStoreError(
                f"{manifest_path}: the store was rewritten since this process's copy was pickled"
                f" (uuid {manifest['uuid']} instead of {expected_uuid})"
            )
        self.manifest = manifest
        self.dtype = np.dtype(manifest["dtype"])
        n, m = int(manifest["num_images"]), int(manifest["num_boxes"])
        self._boxes = _map_array(self.path / BOXES, manifest_path, (m, 4), "f", self.dtype)
        offsets_path = self.path / OFFSETS
        self._offsets = _map_array(offsets_path, manifest_path, (n + 1,), "i", np.int64)
        if self._offsets[0] != 0 or self._offsets[-1] != m or np.any(np.diff(self._offsets) < 0):
            raise ProposalStoreError(
                f"{offsets_path}: offsets must rise from 0 to num_boxes = {m} ({manifest_path})"
            )
        self._ids = _map_array(
            self.path / IDS, manifest_path, (n,), "i" if manifest["id_type"] == "int" else "U"
        )
        self._id_is_int = None
        if manifest["id_type"] == "mixed":
            self._id_is_int = _map_array(self.path / ID_IS_INT, manifest_path, (n,), "b", np.bool_)
        self._scores = None
        if manifest["has_scores"]:
            self._scores = _map_array(self.path / SCORES, manifest_path, (m,), "f", self.dtype)
        self._image_ids: list[ImageId] | None = None
        self._index_dict: dict[ImageId, int] | None = None
        self._sizes = None
        if manifest.get("has_sizes", False):
            sizes_path = self.path / SIZES
            sizes = _map_array(sizes_path, manifest_path, (n, 2), "iu")
            # Checked whole (8 bytes per image): the ids are only read to name a bad one.
            self._sizes = _as_sizes(sizes, n, lambda i: self.image_ids[i], str(sizes_path))

    @classmethod
    def from_flat(cls, *args, **kwargs):
        raise TypeError("a ProposalStore is opened from its directory; use ProposalSet.from_flat")

    @property
    def image_ids(self) -> list[ImageId]:
        """The N image ids in file order, with their stored types (built at first use)."""
        if self._image_ids is None:
            ids = self._ids.tolist()
            if self._id_is_int is not None:
                flags = self._id_is_int.tolist()
                ids = [int(i) if is_int else i for i, is_int in zip(ids, flags, strict=True)]
            self._image_ids = ids
        return self._image_ids

    @property
    def _index(self) -> dict[ImageId, int]:
        """``proposal_key(id) -> position``, built at the first lookup rather than when opening."""
        if self._index_dict is None:
            ids = self.image_ids
            keys = ids if self.manifest["id_type"] == "int" else [proposal_key(i) for i in ids]
            index = {key: i for i, key in enumerate(keys)}
            if len(index) != len(keys):
                seen: set = set()
                duplicate = next(i for i, k in zip(ids, keys, strict=True) if k in seen or seen.add(k))
                raise ProposalStoreError(f"{self.path / IDS}: image id {duplicate!r} appears more than once")
            self._index_dict = index
        return self._index_dict

    def _rows(self, array: np.ndarray, image_id: ImageId) -> np.ndarray:
        i = self._position(image_id)
        rows = array[self._offsets[i] : self._offsets[i + 1]]  # read-only: the mapping is read-only
        if rows.dtype != np.float32:
            rows = rows.astype(np.float32)
            rows.flags.writeable = False
        return rows

    def __getitem__(self, image_id: ImageId) -> np.ndarray:
        """Boxes (R, 4) float32 of one image: a read-only view of the mapping (float32 stores) or a
        read-only float32 copy (float16 stores)."""
        return self._rows(self._boxes, image_id)

    def scores(self, image_id: ImageId) -> np.ndarray | None:
        if self._scores is None:
            return None
        return self._rows(self._scores, image_id)

    def __reduce__(self):
        # The path, not the arrays: the receiving process maps the same file (and the same page cache).
        return _reopen, (str(self.path), self.manifest["uuid"], self.source)

    def __repr__(self) -> str:
        return f"ProposalStore({str(self.path)!r}, {len(self)} images, {self.num_boxes} boxes, {self.dtype})"

    @property
    def file_bytes(self) -> int:
        """Size of the store's files on disk."""
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


# ----------------------------------------------------------------------------------------------------
# Writing


def _encode_ids(image_ids: Sequence[ImageId], source: str) -> tuple[str, np.ndarray, np.ndarray | None]:
    """(id_type, ids array, id_is_int or None) for ids that are ints or strings (numpy scalars too)."""
    values, is_int = [], []
    for image_id in image_ids:
        value = image_id.item() if isinstance(image_id, np.generic) else image_id
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError(
                f"{source}: image id {image_id!r} is a {type(image_id).__name__}; a proposal store holds"
                " int or str image ids"
            )
        values.append(value)
        is_int.append(isinstance(value, int))
    if all(is_int) and all(INT64.min <= v <= INT64.max for v in values):
        return "int", np.array(values, dtype=np.int64), None
    if not any(is_int):
        return "str", np.array(values, dtype=np.str_), None
    return "mixed", np.array([str(v) for v in values], dtype=np.str_), np.array(is_int, dtype=np.bool_)


def _fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk (directories: where the platform allows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_npy(file: Path, array: np.ndarray, dtype: np.dtype, source: str) -> float:
    """Write ``array`` as ``dtype`` chunk by chunk (an on-disk source is never read whole into memory);
    returns the largest absolute change the conversion made."""
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": array.shape}
    largest_change = 0.0
    with open(file, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        for start in range(0, len(array), CHUNK_ROWS):
            chunk = np.asarray(array[start : start + CHUNK_ROWS])
            with np.errstate(over="ignore"):  # overflow is checked below, with a clearer message
                converted = chunk.astype(dtype)
            if dtype != chunk.dtype and chunk.size:
                if dtype.kind == "f" and not np.array_equal(np.isfinite(converted), np.isfinite(chunk)):
                    raise ValueError(
                        f"{source}: values beyond the range of {dtype} (e.g."
                        f" {chunk[~np.isfinite(converted) & np.isfinite(chunk)].flat[0]});"
                        " write a float32 store"
                    )
                finite = np.isfinite(chunk)
                change = np.abs(converted.astype(np.float64) - chunk)[finite]
                largest_change = max(largest_change, float(change.max(initial=0.0)))
            f.write(np.ascontiguousarray(converted).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return largest_change


def _replace_directory(tmp: Path, path: Path) -> None:
    if path.exists() or path.is_symlink():
        if not (path.is_dir() and (path / MANIFEST).is_file()):
            raise FileExistsError(f"{path} exists and is not a proposal store; not replacing it")
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    _fsync(path.parent)


def write_proposal_store(proposals: ProposalSet, path: str | os.PathLike, *, dtype: str = "float32") -> None:
    """Write ``proposals`` as a store at ``path`` (``<name>.proposals``), atomically (module docstring).

    ``dtype``: float32 (exact) or float16 (half the size; see the module docstring for its precision).
    Scores are kept unless they are all zero (Selective Search and most reference pickles), which a
    pickle written back from the store restores anyway; image sizes when the source records any.
    """
    path = Path(path)
    if not is_store_path(path):
        raise ValueError(f"{path}: a proposal store's name must end with {STORE_SUFFIX}")
    if dtype not in STORE_DTYPES:
        raise ValueError(f"store dtype must be one of {STORE_DTYPES}, got {dtype!r}")
    dtype_ = np.dtype(dtype)
    id_type, ids, id_is_int = _encode_ids(proposals.image_ids, proposals.source)
    boxes, offsets, scores = proposals._boxes, np.asarray(proposals._offsets, np.int64), proposals._scores
    sizes = proposals.image_sizes
    if scores is not None and not any(
        np.any(scores[s : s + CHUNK_ROWS]) for s in range(0, len(scores), CHUNK_ROWS)
    ):
        scores = None

    path.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would survive the rename; os.mkdir applies the umask.
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    os.mkdir(tmp)
    try:
        change = _write_npy(tmp / BOXES, boxes, dtype_, str(path))
        _write_npy(tmp / OFFSETS, offsets, np.dtype(np.int64), str(path))
        _write_npy(tmp / IDS, ids, ids.dtype, str(path))
        if id_is_int is not None:
            _write_npy(tmp / ID_IS_INT, id_is_int, id_is_int.dtype, str(path))
        if scores is not None:
            _write_npy(tmp / SCORES, scores, dtype_, str(path))
        if sizes is not None:  # int32: ProposalSet refuses sizes beyond it
            _write_npy(tmp / SIZES, np.asarray(sizes), np.dtype(np.int32), str(path))
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype,
            "num_images": len(ids),
            "num_boxes": len(boxes),
            "id_type": id_type,
            "has_scores": scores is not None,
            "has_sizes": sizes is not None,
            "uuid": uuid.uuid4().hex,
            "source": proposals.source,
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        _replace_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "wrote proposal store %s: %d images, %d boxes, %s%s",
        path,
        len(ids),
        len(boxes),
        dtype,
        f" (largest rounding change {change:g} px)" if dtype_ != np.float32 else "",
    )
