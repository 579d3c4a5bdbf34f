"""Memory of proposal sets: a reference pickle held in RAM versus a memory-mapped ``.proposals`` store.

A synthetic set (random integer-valued boxes, integer ids like COCO's) is written twice, as a reference
pickle and as a float32 store, and each is measured in a fresh (spawned) process:

* ``access``: resident memory of the interpreter with wsod imported (the baseline), after opening the
  file (and building the id index), and after reading ``reads`` random images (lookup and a sum over the
  boxes, so that every box is read); the peak during opening; lookups per second (the lookup alone) and
  reads per second.
* ``loader``: a ``DataLoader`` with ``workers`` workers (fork or spawn) over a dataset that looks up a
  random image per item, as ``WeakDetectionDataset`` does; after one epoch of ``reads`` items, the
  memory of the main process and of each worker. Source ``none`` makes random boxes without any
  proposal file: the baseline of the same processes.

Memory comes from ``/proc/<pid>/status`` (``VmRSS``; ``VmHWM`` for the peak, reset through
``/proc/self/clear_refs`` after the baseline where the kernel allows; ``RssAnon`` and ``RssFile``) and
``/proc/<pid>/smaps_rollup`` (``Pss``). A memory-mapped page that a process has touched counts in full in
that process's RSS (as ``RssFile``) although the page cache holds it once for all processes; PSS divides
each shared page among the processes that map it, so the sum of PSS over processes is the memory they
really use together. Linux only.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import platform
import shutil
import tempfile
import time
import traceback
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from wsod.data.proposals import ProposalSet, ProposalStore, load_proposals, write_proposal_store

__all__ = [
    "Memory",
    "AccessResult",
    "LoaderResult",
    "BenchmarkResult",
    "read_memory",
    "make_synthetic_proposals",
    "measure_access",
    "measure_loader",
    "measure_index_memory",
    "in_fresh_process",
    "run_benchmark",
    "format_table",
    "write_markdown",
]

MB = 1024 * 1024


# ----------------------------------------------------------------------------------------------------
# Reading memory


@dataclass(frozen=True)
class Memory:
    """One process's memory in MB. ``pss`` is None where ``smaps_rollup`` cannot be read."""

    rss: float
    anon: float
    file: float
    shmem: float
    peak: float
    pss: float | None

    def minus(self, baseline: Memory) -> Memory:
        pss = None if self.pss is None or baseline.pss is None else self.pss - baseline.pss
        return Memory(
            self.rss - baseline.rss,
            self.anon - baseline.anon,
            self.file - baseline.file,
            self.shmem - baseline.shmem,
            self.peak - baseline.rss,  # the peak above the baseline's resident memory
            pss,
        )


def _proc_kb(path: str, keys: Sequence[str]) -> dict[str, float]:
    values = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                values[name] = float(rest.split()[0]) / 1024  # kB -> MB
    return values


def read_memory(pid: int | str = "self") -> Memory:
    """Resident memory of a process from ``/proc/<pid>/status`` and ``smaps_rollup`` (MB)."""
    status = _proc_kb(f"/proc/{pid}/status", ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"))
    try:
        pss = _proc_kb(f"/proc/{pid}/smaps_rollup", ("Pss",)).get("Pss")
    except OSError:
        pss = None
    return Memory(
        status["VmRSS"], status["RssAnon"], status["RssFile"], status["RssShmem"], status["VmHWM"], pss
    )


def reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------------
# The synthetic set


def make_synthetic_proposals(
    directory: str | os.PathLike, num_images: int, boxes_per_image: int, seed: int = 0
) -> tuple[Path, Path]:
    """Write the same random set as ``synthetic.pkl`` (reference format, without scores) and
    ``synthetic.proposals`` (float32 store); returns both paths. Boxes are integer-valued, like
    Selective Search's; ids are integers, like COCO's."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ids = [139 + 7 * i for i in range(num_images)]
    boxes = np.empty((num_images * boxes_per_image, 4), np.float32)
    chunk = max(1, (1 << 20) // max(boxes_per_image, 1))  # images per chunk: about 1M boxes
    for start in range(0, num_images, chunk):
        rows = slice(start * boxes_per_image, min(start + chunk, num_images) * boxes_per_image)
        n = rows.stop - rows.start
        corner = rng.integers(0, 600, (n, 2))
        size = rng.integers(2, 400, (n, 2))
        boxes[rows, :2], boxes[rows, 2:] = corner, corner + size
    offsets = np.arange(num_images + 1, dtype=np.int64) * boxes_per_image
    pickle_path, store_path = directory / "synthetic.pkl", directory / "synthetic.proposals"
    with open(pickle_path, "wb") as f:
        data = {"boxes": [boxes[offsets[i] : offsets[i + 1]] for i in range(num_images)], "indexes": ids}
        pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
    write_proposal_store(ProposalSet.from_flat(ids, boxes, offsets, source="synthetic"), store_path)
    return pickle_path, store_path


# ----------------------------------------------------------------------------------------------------
# Measurements (each meant to run in a fresh process)


@dataclass(frozen=True)
class AccessResult:
    kind: str  # "pickle" or "store"
    baseline: Memory
    opened: Memory
    after_reads: Memory
    open_seconds: float
    reads: int
    reads_per_second: float
    lookups: int
    lookups_per_second: float
    peak_reset: bool  # False: the peak is since the start of the process


def measure_access(kind: str, path: str, reads: int, lookups: int, seed: int = 0) -> AccessResult:
    """Open ``path`` (a pickle or a store), then read ``reads`` random distinct images and time
    ``lookups`` random lookups; memory after each stage (see the module docstring)."""
    gc.collect()
    baseline = read_memory()
    peak_reset = reset_peak()
    start = time.perf_counter()
    proposals = load_proposals(path)
    ids = proposals.image_ids
    _ = ids[0] in proposals  # builds a store's lazy id index: part of opening
    open_seconds = time.perf_counter() - start
    gc.collect()
    opened = read_memory()

    rng = np.random.default_rng(seed)
    chosen = [ids[i] for i in rng.choice(len(ids), size=min(reads, len(ids)), replace=False)]
    total = 0.0
    start = time.perf_counter()
    for image_id in chosen:
        total += float(proposals[image_id].sum())
    read_seconds = time.perf_counter() - start
    gc.collect()
    after_reads = read_memory()

    probes = [ids[i] for i in rng.integers(0, len(ids), lookups)]
    start = time.perf_counter()
    for image_id in probes:
        proposals[image_id]
    lookup_seconds = time.perf_counter() - start
    return AccessResult(
        kind,
        baseline,
        opened,
        after_reads,
        open_seconds,
        len(chosen),
        len(chosen) / max(read_seconds, 1e-9),
        lookups,
        lookups / max(lookup_seconds, 1e-9),
        peak_reset,
    )


class RandomLookupDataset(Dataset):
    """Item ``k``: the boxes of a random image (seeded by ``k``) as a float32 tensor, looked up in
    ``proposals``, or made up (``proposals`` None: the baseline without any proposal file), with the
    process id of the worker that made it."""

    def __init__(
        self, proposals: ProposalSet | None, num_images: int, boxes_per_image: int, length: int, seed: int
    ) -> None:
        self.proposals = proposals
        self.num_images = num_images
        self.boxes_per_image = boxes_per_image
        self.length = length
        self.seed = seed
        if proposals is not None:
            proposals.require(proposals.image_ids[:1])  # the id index, built before workers start

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        rng = np.random.default_rng((self.seed, index))
        position = int(rng.integers(self.num_images))
        if self.proposals is None:
            boxes = rng.integers(0, 600, (self.boxes_per_image, 4)).astype(np.float32)
        else:
            boxes = np.array(self.proposals[self.proposals.image_ids[position]])  # a copy, as filtering makes
        return os.getpid(), torch.from_numpy(boxes)


def _collate(items: list[tuple[int, torch.Tensor]]) -> tuple[list[int], list[torch.Tensor]]:
    return [pid for pid, _ in items], [boxes for _, boxes in items]


@dataclass(frozen=True)
class LoaderResult:
    source: str  # "none", "store" or "pickle"
    context: str
    workers: int
    items: int
    timed_items: int  # the items after the first batch, delivered in ``seconds``
    seconds: float
    main: Memory
    worker_memory: tuple[Memory, ...]

    @property
    def processes(self) -> tuple[Memory, ...]:
        return (self.main, *self.worker_memory)

    def total(self, name: str) -> float | None:
        values = [getattr(m, name) for m in self.processes]
        return None if any(v is None for v in values) else sum(values)


def measure_loader(
    source: str,
    path: str | None,
    num_images: int,
    boxes_per_image: int,
    context: str,
    workers: int,
    items: int,
    batch_size: int = 8,
    seed: int = 0,
) -> LoaderResult:
    """One epoch of ``items`` random lookups through a DataLoader; memory of every process after it,
    with the (persistent) workers still alive."""
    proposals = None if source == "none" else load_proposals(path)
    dataset = RandomLookupDataset(proposals, num_images, boxes_per_image, items, seed)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        multiprocessing_context=context if workers else None,
        persistent_workers=workers > 0,
        collate_fn=_collate,
    )
    pids: set[int] = set()
    count, timed, start = 0, 0, 0.0
    for batch_pids, boxes in loader:
        if count == 0:  # the clock starts at the first batch: worker start-up is not throughput
            start = time.perf_counter()
        else:
            timed += len(boxes)
        pids.update(batch_pids)
        count += len(boxes)
        del boxes
    seconds = time.perf_counter() - start
    gc.collect()
    main = read_memory()
    worker_memory = tuple(read_memory(pid) for pid in sorted(pids - {os.getpid()}))
    del loader
    return LoaderResult(source, context, workers, count, timed, seconds, main, worker_memory)


def _child(connection, function: Callable, args: tuple) -> None:
    try:
        connection.send(("ok", function(*args)))
    except BaseException:
        connection.send(("error", traceback.format_exc()))
    finally:
        connection.close()


def in_fresh_process(function: Callable, *args):
    """``function(*args)`` in a new spawned interpreter (not a pool worker: it may start its own data
    loader workers); its exception, if any, is raised here as a RuntimeError with the child's traceback."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(send, function, args))
    process.start()
    send.close()
    try:
        status, value = receive.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"benchmark process died with exit code {process.exitcode}") from None
    process.join()
    if status != "ok":
        raise RuntimeError(f"benchmark process failed:\n{value}")
    return value


def measure_index_memory(directory: str | os.PathLike, num_ids: int = 120_000) -> dict[str, float]:
    """MB that a store's ids list and id index take once built (``tracemalloc``), for ``num_ids`` COCO-like
    integer ids and VOC-like string ids (``2008_000123``), in stores of one box per image."""
    sizes = {}
    for kind in ("int", "str"):
        ids = [139 + 7 * i for i in range(num_ids)]
        if kind == "str":
            ids = [f"{2008 + i // 100_000}_{i % 100_000:06d}" for i in range(num_ids)]
        path = Path(directory) / f"index_{kind}.proposals"
        boxes = np.ones((num_ids, 4), np.float32)
        offsets = np.arange(num_ids + 1, dtype=np.int64)
        write_proposal_store(ProposalSet.from_flat(ids, boxes, offsets, source="ids"), path)
        del ids, boxes
        store = ProposalStore(path)
        gc.collect()
        tracemalloc.start()
        _ = store.image_ids[0] in store
        sizes[kind] = tracemalloc.get_traced_memory()[0] / MB
        tracemalloc.stop()
        del store
        shutil.rmtree(path)
    return sizes


# ----------------------------------------------------------------------------------------------------
# The whole benchmark


@dataclass
class BenchmarkResult:
    num_images: int
    boxes_per_image: int
    reads: int
    workers: int
    pickle_bytes: int
    store_bytes: int
    access: dict[str, AccessResult] = field(default_factory=dict)
    loader: list[LoaderResult] = field(default_factory=list)
    index_mb: dict[str, float] = field(default_factory=dict)  # id index of 120k ids, by id kind
    index_ids: int = 0
    seconds: float = 0.0
    versions: str = ""


def run_benchmark(
    num_images: int = 20_000,
    boxes_per_image: int = 2_000,
    *,
    reads: int = 5_000,
    lookups: int = 100_000,
    workers: int = 2,
    contexts: Sequence[str] = ("fork", "spawn"),
    loader_sources: Sequence[str] = ("none", "store", "pickle"),
    directory: str | os.PathLike | None = None,
    keep: bool = False,
    seed: int = 0,
    fresh_processes: bool = True,
    index_ids: int = 120_000,
    log: Callable[[str], None] = print,
) -> BenchmarkResult:
    """Write the synthetic set into a new temporary directory (under ``directory`` if given; deleted
    afterwards unless ``keep``) and run every measurement in a fresh process. ``fresh_processes=False``
    runs them in this process instead: a quick check that the code runs (tests), whose memory numbers
    mean nothing."""
    run = in_fresh_process if fresh_processes else (lambda function, *args: function(*args))
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="wsod_proposal_bench_", dir=directory))
    try:
        log(f"writing {num_images} images x {boxes_per_image} boxes to {work}")
        pickle_path, store_path = make_synthetic_proposals(work, num_images, boxes_per_image, seed)
        result = BenchmarkResult(
            num_images,
            boxes_per_image,
            reads,
            workers,
            pickle_path.stat().st_size,
            ProposalStore(store_path).file_bytes,
            versions=f"Python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}",
        )
        paths = {"pickle": str(pickle_path), "store": str(store_path)}
        for kind in ("pickle", "store"):
            log(f"access: {kind}")
            result.access[kind] = run(measure_access, kind, paths[kind], reads, lookups, seed)
        if index_ids:
            log(f"id index of {index_ids:,} ids")
            result.index_mb, result.index_ids = measure_index_memory(work, index_ids), index_ids
        for context in contexts:
            for source in loader_sources:
                log(f"loader: {source}, {workers} workers ({context})")
                result.loader.append(
                    run(
                        measure_loader,
                        source,
                        paths.get(source),
                        num_images,
                        boxes_per_image,
                        context,
                        workers,
                        reads,
                        8,
                        seed,
                    )
                )
    finally:
        if keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result.seconds = time.perf_counter() - start
    return result


# ----------------------------------------------------------------------------------------------------
# Reporting


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _access_rows(result: BenchmarkResult) -> list[list[str]]:
    pickle_, store = result.access.get("pickle"), result.access.get("store")
    runs = [r for r in (pickle_, store) if r is not None]

    def row(label: str, value: Callable[[AccessResult], str]) -> list[str]:
        return [label, *(value(r) for r in runs)]

    return [
        ["", *(r.kind for r in runs)],
        row("baseline RSS (MB)", lambda r: _mb(r.baseline.rss)),
        row("open: seconds", lambda r: f"{r.open_seconds:.3f}"),
        row("open: RSS above baseline (MB)", lambda r: _mb(r.opened.minus(r.baseline).rss)),
        row("open: peak RSS above baseline (MB)", lambda r: _mb(r.opened.minus(r.baseline).peak)),
        row(
            f"after {result.reads:,} reads: RSS above baseline (MB)",
            lambda r: _mb(r.after_reads.minus(r.baseline).rss),
        ),
        row("  of which private (RssAnon) (MB)", lambda r: _mb(r.after_reads.minus(r.baseline).anon)),
        row("  of which file pages (RssFile) (MB)", lambda r: _mb(r.after_reads.minus(r.baseline).file)),
        row("  PSS above baseline (MB)", lambda r: _mb(r.after_reads.minus(r.baseline).pss)),
        row("reads per second (lookup + sum)", lambda r: f"{r.reads_per_second:,.0f}"),
        row("lookups per second", lambda r: f"{r.lookups_per_second:,.0f}"),
    ]


def _loader_rows(result: BenchmarkResult) -> list[list[str]]:
    rows = [
        [
            "start method",
            "proposals",
            "RSS main + workers (MB)",
            "PSS main + workers (MB)",
            "private (RssAnon) (MB)",
            "RSS above 'none' (MB)",
            "PSS above 'none' (MB)",
            "items/s",
        ]
    ]
    baselines = {r.context: r for r in result.loader if r.source == "none"}
    for r in result.loader:
        base = baselines.get(r.context)

        def above(name: str, r=r, base=base) -> str:
            value, reference = r.total(name), None if base is None else base.total(name)
            return "n/a" if value is None or reference is None else _mb(value - reference)

        rows.append(
            [
                r.context,
                r.source,
                _mb(r.total("rss")),
                _mb(r.total("pss")),
                _mb(r.total("anon")),
                above("rss"),
                above("pss"),
                f"{r.timed_items / max(r.seconds, 1e-9):,.0f}",
            ]
        )
    return rows


def _text_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    return "\n".join(lines)


def _markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def _describe(result: BenchmarkResult) -> str:
    boxes = result.num_images * result.boxes_per_image
    return (
        f"{result.num_images:,} images x {result.boxes_per_image:,} boxes"
        f" ({boxes * 16 / MB:,.0f} MB of float32 boxes); pickle {result.pickle_bytes / MB:,.0f} MB,"
        f" store {result.store_bytes / MB:,.0f} MB on disk"
    )


def format_table(result: BenchmarkResult) -> str:
    """Both tables as plain text, for the terminal."""
    parts = [_describe(result), "", _text_table(_access_rows(result))]
    if result.index_mb:
        sizes = ", ".join(f"{kind} ids {mb:.1f} MB" for kind, mb in result.index_mb.items())
        parts += [f"store id list + index for {result.index_ids:,} ids: {sizes}"]
    if result.loader:
        parts += ["", f"DataLoader, {result.workers} workers, one epoch of {result.reads:,} random lookups:"]
        parts += [_text_table(_loader_rows(result))]
    return "\n".join(parts)


def write_markdown(
    result: BenchmarkResult, path: str | os.PathLike, *, command: str, machine: str, date: str
) -> None:
    """The report: both tables, what the numbers mean, the command, the machine and the date."""
    store = result.access.get("store")
    verdict = ""
    if store is not None:
        opened = store.opened.minus(store.baseline)
        after = store.after_reads.minus(store.baseline)
        verdict = (
            f"Target (under 100 MB above the interpreter's baseline for the store): after opening"
            f" {opened.rss:,.0f} MB RSS (peak {opened.peak:,.0f} MB); after {store.reads:,} reads"
            f" {after.anon:,.0f} MB private memory and {after.rss:,.0f} MB RSS, of which {after.file:,.0f} MB"
            f" are page-cache pages of the store file ({_mb(after.pss)} MB PSS)."
            f" **{'met' if max(opened.rss, after.anon) < 100 else 'not met'}** for the memory the"
            " process owns; the file pages grow with the images read, up to the file size, and are shared."
        )
    index = ""
    if result.index_mb:
        sizes = ", ".join(f"{mb:.1f} MB with {kind} ids" for kind, mb in result.index_mb.items())
        index = f"; for {result.index_ids:,} images {sizes}, by tracemalloc"
    text = f"""# Benchmark: proposal pickle versus memory-mapped proposal store

{machine}, {date}; {result.versions}. {_describe(result)}. Whole run {result.seconds:,.0f} s.

```bash
{command}
```

Every measurement runs in a fresh spawned interpreter with wsod (torch, numpy) imported; its resident
memory then is the baseline. *Open* is `load_proposals` plus building the id index; a *read* is a lookup
plus a sum over the image's boxes (every box touched); a *lookup* is `proposals[image_id]` alone.

## One process

{_markdown_table(_access_rows(result))}

## DataLoader, {result.workers} workers

One epoch of {result.reads:,} items, each the boxes of a random image copied into a tensor (as
`WeakDetectionDataset` does before filtering), batch size 8, persistent workers; memory summed over the
main process and its workers after the epoch. `none` makes random boxes without a proposal file: the
memory of the same processes without proposals.

{_markdown_table(_loader_rows(result))}

## Reading the numbers

- **RSS counts shared pages in every process.** A page of the memory-mapped store that a process has
  read is part of its RSS (`RssFile`), but the page cache holds it once for all processes and the
  kernel can drop it and read it again under memory pressure. Summing RSS over processes therefore
  counts the same file pages once per process. **PSS** (`/proc/<pid>/smaps_rollup`) divides each shared
  page among the processes mapping it; its sum is what the processes use together. `RssAnon` is the
  memory a process owns privately (the id index, copies of boxes).
- The pickle is unpickled into private memory: every process that loads it holds all boxes. Its RSS is
  about twice the boxes: unpickling makes one array per image, `ProposalSet` concatenates them into one,
  and the heap freed afterwards is not returned to the system. With fork, workers share the parent's
  pages copy-on-write (they count in each RSS, and reference counting slowly dirties the pages holding
  Python objects); with spawn (and with DDP, one process per GPU) every process unpickles its own copy.
- The store costs each process its ids and id index (a few MB here{index}) plus the pages it has
  mapped, which are shared page cache. The kernel maps whole page-cache folios at a fault (2 MB for a
  one-page read on the machine above), not just the pages read, so after reading a quarter of the
  images at random nearly the whole file is mapped (counted in RSS as `RssFile`); the same pages are in
  the page cache whether mapped or not.

{verdict}
"""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
