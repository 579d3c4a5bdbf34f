"""The parts of ``tools/gpu_check.sh`` that are Python: environment, synthetic VOC data, a short
real-size training run, a 14-view evaluation, and the markdown report.

Each part is a subcommand run in its own process under ``timeout`` by the shell script, and writes
what it found as json into the work directory, so that a part that fails or hangs costs only itself and
``report`` always has something to say:

    python -m wsod.benchmarks.gpu_check env    --work W --device cuda
    python -m wsod.benchmarks.gpu_check data   --work W [--tiny]
    python -m wsod.benchmarks.gpu_check train  --work W --device cuda [--tiny]
    python -m wsod.benchmarks.gpu_check eval   --work W --device cuda [--tiny]
    python -m wsod.benchmarks.gpu_check report --work W --out OUT

``--tiny`` is the CPU dry run's size (``tools/gpu_check.sh --dry-run``, run by the test suite so that
the script cannot rot): 64x48 images with 60 proposals, a quarter-width ResNet-18, 4 iterations, test
views scaled down to 48..120 px (still 7 scales x 2 flips).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import pickle
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["make_voc_like", "loss_trend", "main"]

# The real sizes: VOC 2007's typical 500x375 image, 2,000 proposals (the reference keeps at most 2,000
# Selective Search boxes per image), 50 optimizer steps of 2 accumulated images, 4 test images.
FULL = {
    "size": (500, 375),
    "proposals": 2000,
    "train_images": 100,
    "test_images": 4,
    "iterations": 50,
    "log_period": 5,
    "model": "r50_c4",
    # From random weights the recipe's frozen BatchNorm is the identity and a ResNet-50 without
    # normalisation diverged within 3 steps in a CPU try; train-mode BatchNorm in the base and GroupNorm
    # in res5 (per ROI, as sequential backprop needs) train from scratch, like the toy model.
    "norms": ["model.norm=bn", "model.neck_norm=gn"],
}
TINY = {
    "size": (64, 48),
    "proposals": 60,
    "train_images": 8,
    "test_images": 4,
    "iterations": 4,
    "log_period": 1,
    "model": "r18_c4",
    "norms": [],  # the toy model's own: bn base, gn neck
}
TTA_SCALES = [800, 480, 576, 688, 864, 1000, 1200]  # the reference's 14 views with flips (configs/data)
TINY_TTA_SCALES = [80, 48, 56, 64, 88, 100, 120]
PARTS = ("env", "rois_r50_c4", "rois_compile", "rois_vgg16", "budget_16gb", "data", "train", "eval")


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, default=str) + "\n")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- synthetic VOC-layout data ---------------------------------------------------------------------


def _annotation(image_id: str, size: tuple[int, int], boxes: np.ndarray, names: Sequence[str]) -> bytes:
    """The VOC xml of one image (``size`` = width, height) with 0-based inclusive ``boxes`` (N, 4)."""
    # Imported here, as the other wsod modules in this file: the env and report parts run without torch.
    from wsod.data.box_formats import to_one_based

    width, height = size
    root = ET.Element("annotation")
    ET.SubElement(root, "filename").text = f"{image_id}.jpg"
    size_node = ET.SubElement(root, "size")
    for tag, value in (("width", width), ("height", height), ("depth", 3)):
        ET.SubElement(size_node, tag).text = str(value)
    for box, name in zip(to_one_based(boxes), names, strict=True):  # VOC files are 1-based
        obj = ET.SubElement(root, "object")
        ET.SubElement(obj, "name").text = name
        ET.SubElement(obj, "difficult").text = "0"
        bndbox = ET.SubElement(obj, "bndbox")
        for tag, value in zip(("xmin", "ymin", "xmax", "ymax"), box, strict=True):
            ET.SubElement(bndbox, tag).text = str(int(value))
    return ET.tostring(root)


def _random_boxes(rng: np.random.Generator, count: int, width: int, height: int) -> np.ndarray:
    """``count`` distinct boxes, 0-based inclusive pixels, at least 4 px, log-uniform sizes."""
    boxes = np.zeros((0, 4), np.float32)
    while len(boxes) < count:
        n = 2 * (count - len(boxes))
        w = np.exp(rng.uniform(np.log(4), np.log(width), n))
        h = np.exp(rng.uniform(np.log(4), np.log(height), n))
        x1 = rng.uniform(0, width - w)
        y1 = rng.uniform(0, height - h)
        new = np.floor(np.stack([x1, y1, x1 + w - 1, y1 + h - 1], 1)).astype(np.float32)
        boxes = np.unique(np.concatenate([boxes, new]), axis=0)
    return rng.permutation(boxes)[:count]


def make_voc_like(
    root: str | Path,
    *,
    size: tuple[int, int],
    proposals: int,
    train_images: int,
    test_images: int,
    seed: int = 0,
) -> dict[str, Path]:
    """A VOC 2007-layout dataset of generated images (``size`` = width, height): 1-3 objects of random
    VOC classes drawn as coloured rectangles on noise, with ``proposals`` random boxes per image in the
    reference pickle format. Returns the devkit and the two proposal files."""
    from PIL import Image

    from wsod.data.voc import VOC_CLASSES

    root = Path(root)
    base = root / "VOCdevkit" / "VOC2007"
    for folder in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (base / folder).mkdir(parents=True, exist_ok=True)
    (root / "proposals").mkdir(exist_ok=True)
    width, height = size
    rng = np.random.default_rng(seed)
    colours = rng.uniform(0, 255, (len(VOC_CLASSES), 3))
    splits = {"trainval": range(train_images), "test": range(train_images, train_images + test_images)}
    files = {"devkit": root / "VOCdevkit"}
    for split, numbers in splits.items():
        ids, all_boxes = [], []
        for number in numbers:
            image_id = f"{number:06d}"
            image = rng.uniform(40, 200, (height // 8 + 1, width // 8 + 1, 3)).repeat(8, 0).repeat(8, 1)
            image = image[:height, :width] + rng.normal(0, 10, (height, width, 3))
            classes = rng.choice(len(VOC_CLASSES), size=int(rng.integers(1, 4)), replace=False)
            objects = _random_boxes(rng, len(classes), width, height)
            for (x1, y1, x2, y2), cls in zip(objects.astype(int), classes, strict=True):
                image[y1 : y2 + 1, x1 : x2 + 1] = colours[cls] + rng.normal(
                    0, 10, (y2 - y1 + 1, x2 - x1 + 1, 3)
                )
            Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(
                base / "JPEGImages" / f"{image_id}.jpg"
            )
            names = [VOC_CLASSES[c] for c in classes]
            (base / "Annotations" / f"{image_id}.xml").write_bytes(
                _annotation(image_id, size, objects, names)
            )
            ids.append(image_id)
            all_boxes.append(_random_boxes(rng, proposals, width, height))
        (base / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{i}\n" for i in ids))
        data = {
            "boxes": all_boxes,
            "scores": [np.zeros(len(b), np.float32) for b in all_boxes],
            "indexes": ids,
        }
        files[split] = root / "proposals" / f"random_{split}.pkl"
        with open(files[split], "wb") as handle:
            pickle.dump(data, handle, protocol=pickle.HIGHEST_PROTOCOL)
    return files


# --- training and evaluation -----------------------------------------------------------------------


def _compose(name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _point_at_data(cfg, work: Path, sizes: dict[str, Any], test_scales: list[int]) -> None:
    """The composed voc07 data config, pointed at the generated set (plus the tiny sizes)."""
    data = work / "data"
    cfg.data.devkit = str(data / "VOCdevkit")
    cfg.data.train.sets = [
        {
            "year": "2007",
            "image_set": "trainval",
            "proposals": str(data / "proposals" / "random_trainval.pkl"),
        }
    ]
    cfg.data.test.set = {
        "year": "2007",
        "image_set": "test",
        "proposals": str(data / "proposals" / "random_test.pkl"),
    }
    cfg.data.test.scales = test_scales
    if sizes is TINY:
        cfg.data.train.scales = [48, 64]
        cfg.data.train.max_size = 128
        cfg.data.test.max_size = 200


def loss_trend(rows: Sequence[dict[str, Any]], window: int = 3) -> dict[str, Any]:
    """First and last ``window`` logged ``loss_total`` values of a run: finite? decreasing (mean of the
    last window below the mean of the first)?"""
    losses = [r["loss_total"] for r in rows if r.get("kind") == "train"]
    window = max(1, min(window, len(losses) // 2))
    first, last = losses[:window], losses[-window:]
    finite = bool(losses) and all(math.isfinite(v) for v in losses)
    first_mean = sum(first) / len(first) if first else math.nan
    last_mean = sum(last) / len(last) if last else math.nan
    return {
        "losses": losses,
        "finite": finite,
        "first_mean": first_mean,
        "last_mean": last_mean,
        "decreasing": finite and len(losses) >= 2 and last_mean < first_mean,
    }


def _workers(device: str) -> int:
    return 0 if device == "cpu" else 2


def _train(work: Path, device: str, sizes: dict[str, Any]) -> dict[str, Any]:
    from wsod.runs.train import train_from_config

    run_dir = work / "train_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        "data=voc07", f"model={sizes['model']}", "model.weights=null", "model.chunk_size=auto",
        "solver=voc", f"solver.max_iter={sizes['iterations']}", "solver.milestones=[]",
        "solver.accumulation=2", "solver.ims_per_batch=1", "solver.amp=bf16",
        f"device={device}", f"output_dir={run_dir}", f"log_period={sizes['log_period']}",
        "checkpoint_period=10", "eval_period=0", "progress=false", "random_baseline=false",
        f"data.train.num_workers={4 if device != 'cpu' else 0}", f"data.test.num_workers={_workers(device)}",
        *sizes["norms"],
    ]  # fmt: skip
    if device == "cpu":  # the dry run: off CUDA auto needs a budget; this one chunks the tiny model
        overrides.append("model.memory_budget_gb=0.005")
    cfg = _compose("train", overrides)
    _point_at_data(cfg, work, sizes, [sizes["size"][1]])  # one quick view: the eval part does the 14
    start = time.perf_counter()
    summary = train_from_config(cfg)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.copy(run_dir / "metrics.jsonl", work / "train_metrics.jsonl")
    trend = loss_trend(rows)
    log = (run_dir / "log.txt").read_text()
    train_rows = [r for r in rows if r.get("kind") == "train"]
    # Random labels on random images: 50 steps teach nothing (the H200 run of 2026-12-04 logged 0.466
    # first and 0.470 last), so a finite loss at every logged step and every iteration run is the check;
    # the trend is reported beside it.
    return {
        **trend,
        "ok": trend["finite"] and summary["iteration"] == sizes["iterations"],
        "iterations": summary["iteration"],
        "skipped_steps": summary["skipped_steps"],
        "seconds": seconds,
        "seconds_per_iter": [r.get("seconds_per_iter") for r in train_rows],
        "max_memory_mb": max((r.get("max_memory_mb", 0) for r in train_rows), default=None),
        "auto_log": [line.split("] ", 1)[-1] for line in log.splitlines() if "chunk_size=auto" in line],
        "settings": f"{sizes['model']} at width {cfg.model.width} (random weights, base {cfg.model.norm},"
        f" neck {cfg.model.neck_norm}) on {device},"
        f" {sizes['size'][0]}x{sizes['size'][1]} images at the training scales {list(cfg.data.train.scales)},"
        f" {sizes['proposals']} proposals each, bf16 autocast (CUDA only), accumulation 2, chunk_size=auto",
    }


def _evaluate(work: Path, device: str, sizes: dict[str, Any]) -> dict[str, Any]:
    from wsod.engine.checkpoint import list_checkpoints
    from wsod.runs.evaluate import evaluate_from_config

    run_dir = work / "train_run"
    checkpoint = run_dir / "model_final.pth"
    if not checkpoint.exists():
        saved = list_checkpoints(run_dir)
        if not saved:
            raise FileNotFoundError(f"no checkpoint in {run_dir}: the training part did not get far enough")
        checkpoint = saved[0]
    out_dir = work / "eval_run"
    shutil.rmtree(out_dir, ignore_errors=True)
    overrides = ["data=voc07", f"checkpoint={checkpoint}", f"device={device}", f"output_dir={out_dir}"]
    overrides += ["progress=false", "random_baseline=false", f"data.test.num_workers={_workers(device)}"]
    cfg = _compose("eval", overrides)
    scales = TINY_TTA_SCALES if sizes is TINY else TTA_SCALES
    _point_at_data(cfg, work, sizes, scales)
    cfg.data.test.flip = True
    start = time.perf_counter()
    metrics = evaluate_from_config(cfg)
    seconds = time.perf_counter() - start
    images = sizes["test_images"]
    return {
        "ok": all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)),
        "checkpoint": checkpoint.name,
        "views": 2 * len(scales),
        "images": images,
        "seconds": seconds,
        "seconds_per_image": seconds / images,
        "metrics": metrics,
    }


def _environment(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
        free, total = torch.cuda.mem_get_info(0)
        info["memory_gb"] = round(total / 2**30, 1)
        info["free_gb"] = round(free / 2**30, 1)
        info["bf16"] = torch.cuda.is_bf16_supported()
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()  # fmt: skip
    else:
        info["cpu"] = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return info


# --- the report ------------------------------------------------------------------------------------


def _parts(work: Path) -> dict[str, dict[str, Any]]:
    """``parts.tsv`` written by the shell script: name, exit status, seconds, limit."""
    parts = {}
    path = work / "parts.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds, limit = (line.split("\t") + ["", "", ""])[:4]
            parts[name] = {"rc": rc, "seconds": seconds, "limit": limit}
    return parts


def _status(part: dict[str, Any] | None) -> str:
    if part is None:
        return "not run"
    if part["rc"] == "0":
        return "ok"
    if part["rc"] in ("124", "137"):
        return f"TIMED OUT at {part['limit']} s"
    if part["rc"] == "skipped":
        return "skipped"
    return f"FAILED (exit {part['rc']}, see gpu_check.log)"


def _rois_section(work: Path, name: str, title: str) -> list[str]:
    folder = work / name
    if (folder / "results.csv").exists():
        with open(folder / "results.csv") as handle:
            first = next(csv.DictReader(handle), None)
        if first:
            title += f": {first['model']}, one {first['image_size']} image, {first['device']}"
    lines = [f"## {title}", ""]
    markdown = folder / "results.md"
    if markdown.exists():
        lines += [f"Peak memory above baseline (MB) / median step time (ms); raw rows: `{name}.csv`.", ""]
        lines += [markdown.read_text().rstrip(), ""]
        if (folder / "memory_time.png").exists():
            lines += [f"![memory and time]({name}.png)", ""]
    elif (folder / "results.csv").exists():
        with open(folder / "results.csv") as handle:
            rows = list(csv.DictReader(handle))
        lines += ["Interrupted; the rows measured before (peak MB / step ms):", ""]
        lines += [f"- {r['strategy']} chunk={r['chunk']} {r['dtype']} {r['rois']} ROIs: {r['peak_mb']} /"
                  f" {r['step_ms']} {r['status']} {r.get('auto_chunk', '')}" for r in rows]  # fmt: skip
        lines.append("")
    else:
        lines += ["No results.", ""]
    return lines


def write_report(work: Path, out: Path) -> Path:
    """``report.md`` in ``out`` from whatever the parts left in ``work``, with the ROI tables' csv and
    png and the training metrics copied beside it under flat names."""
    out.mkdir(parents=True, exist_ok=True)
    parts = _parts(work)
    env = _read_json(work / "env.json") or {}
    dry = (work / "DRY_RUN").exists()
    lines = [
        "# GPU check" + (" (DRY RUN on CPU, tiny sizes: not a measurement)" if dry else ""),
        "",
        f"`bash tools/gpu_check.sh` on {env.get('gpu') or env.get('cpu', '?')}"
        f" ({env.get('memory_gb', '?')} GB), torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')},"
        f" {env.get('date', '?')}. {env.get('nvidia_smi', '')}",
        "",
        "| part | status | seconds (limit) |",
        "|---|---|---|",
    ]
    for name in PARTS:
        part = parts.get(name)
        seconds = f"{part['seconds']} ({part['limit']})" if part else ""
        lines.append(f"| {name} | {_status(part)} | {seconds} |")
    lines.append("")
    lines += _rois_section(work, "rois_r50_c4", "ROI benchmark (ResNet-50 C4)")
    lines += _rois_section(work, "rois_compile", "ROI benchmark, torch.compile (ResNet-50 C4)")
    lines += _rois_section(work, "rois_vgg16", "ROI benchmark (VGG16)")
    lines += _rois_section(work, "budget_16gb", "Most ROIs within a budget (16 GB, the allocator capped)")

    train = _read_json(work / "train.json")
    lines += ["## Training at real size", ""]
    if train:
        trend = "falling" if train["decreasing"] else "not falling (random labels: not expected to)"
        verdict = f"finite, {trend}" if train["finite"] else "NOT finite"
        peak = f"peak {train['max_memory_mb']:.0f} MB allocated" if train["max_memory_mb"] else "CPU"
        lines += [
            f"{train['settings']}: {train['iterations']} iterations in {train['seconds']:.0f} s"
            f" ({peak}); loss {verdict}: first"
            f" {train['first_mean']:.4f}, last {train['last_mean']:.4f} (means of the first and last"
            f" logged windows); skipped steps {train['skipped_steps']}.",
            "",
            "Logged loss_total: " + ", ".join(f"{v:.4f}" for v in train["losses"]),
            "",
            "chunk_size=auto said:",
            "",
            *[f"    {line}" for line in train["auto_log"]],
            "",
        ]
    else:
        lines += ["No result (see the status table and gpu_check.log).", ""]
    evaluation = _read_json(work / "eval.json")
    lines += ["## Evaluation: test-time augmentation", ""]
    if evaluation:
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in evaluation["metrics"].items() if isinstance(v, float))
        lines += [
            f"{evaluation['views']} views on {evaluation['images']} images (checkpoint"
            f" {evaluation['checkpoint']}): {evaluation['seconds']:.1f} s,"
            f" {evaluation['seconds_per_image']:.2f} s per image; {metrics} (random weights and data: only"
            " finiteness matters).",
            "",
        ]
    else:
        lines += ["No result (see the status table and gpu_check.log).", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    # At most 8 files come back from a device machine: the two ROI tables' plots, every part's csv. The
    # training losses are in the report itself.
    plots = ("rois_r50_c4", "rois_vgg16")
    for name in ("rois_r50_c4", "rois_compile", "rois_vgg16", "budget_16gb"):
        for suffix in ("csv", "png") if name in plots else ("csv",):
            source = work / name / ("results.csv" if suffix == "csv" else "memory_time.png")
            if source.exists():
                shutil.copy(source, out / f"{name}.{suffix}")
    return report


# --- command line ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["env", "data", "train", "eval", "report"])
    parser.add_argument("--work", type=Path, required=True, help="the work directory shared by the parts")
    parser.add_argument("--out", type=Path, help="report: where report.md and its files go")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run's sizes")
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    args.work.mkdir(parents=True, exist_ok=True)
    if args.part == "env":
        _write_json(args.work / "env.json", _environment(args.device))
    elif args.part == "data":
        files = make_voc_like(
            args.work / "data", size=sizes["size"], proposals=sizes["proposals"],
            train_images=sizes["train_images"], test_images=sizes["test_images"],
        )  # fmt: skip
        print(f"generated {files['devkit']}")
    elif args.part == "train":
        result = _train(args.work, args.device, sizes)
        _write_json(args.work / "train.json", result)
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}, default=str))
        if not result["ok"]:
            sys.exit("training check failed: the loss is not finite and decreasing (train.json)")
    elif args.part == "eval":
        result = _evaluate(args.work, args.device, sizes)
        _write_json(args.work / "eval.json", result)
        print(json.dumps(result, default=str))
        if not result["ok"]:
            sys.exit("evaluation check failed: non-finite metrics (eval.json)")
    else:
        print(f"wrote {write_report(args.work, args.out or args.work)}")


if __name__ == "__main__":
    main()
