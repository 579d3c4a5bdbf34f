"""How many ROIs fit: memory and time of one training step versus ROI count, per back-prop strategy.

Examples:
    python tools/benchmark_rois.py --model r50_c4 --rois 64,128,256 --strategies plain,paper,fused
    python tools/benchmark_rois.py --device cuda --rois 500,1000,2000,4000 --chunk 250,500 \
        --dtypes fp32,bf16 --budget-gb 16 --out benchmark_out/h200

Prints a table and writes results.csv, results.md and memory_time.png into --out.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from wsod.benchmark import (
    MODELS,
    STRATEGIES,
    find_max_rois,
    format_table,
    measure,
    plot,
    slopes,
    write_csv,
    write_markdown,
)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="r50_c4", choices=sorted(MODELS))
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--rois", type=_ints, default=[64, 128, 256], help="comma list of ROI counts")
    parser.add_argument(
        "--strategies", default="plain,paper,fused", help=f"comma list of {','.join(STRATEGIES)}"
    )
    parser.add_argument("--chunk", type=_ints, default=[64], help="comma list of sequential chunk sizes")
    parser.add_argument("--image-size", default="600,1000", help="H,W of the one training image")
    parser.add_argument("--dtypes", default="fp32", help="comma list of fp32, bf16 (bf16 autocast)")
    parser.add_argument(
        "--budget-gb", type=float, default=None, help="also find the largest ROI count within this"
    )
    parser.add_argument(
        "--budget-max-rois", type=int, default=16384, help="stop the budget search here (reported as '>=')"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--out", type=Path, default=Path("benchmark_out"), help="output directory")
    args = parser.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if set(args.dtypes) - {"fp32", "bf16"}:
        parser.error("--dtypes takes fp32 and/or bf16")
    height, width = _ints(args.image_size)
    args.image_size = (height, width)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    options = dict(
        image_size=args.image_size,
        device=args.device,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
    )
    runs = [
        (strategy, chunk, dtype == "bf16")
        for strategy in args.strategies
        for chunk in (args.chunk if strategy in ("paper", "fused") else [None])
        for dtype in args.dtypes
    ]
    measurements = []
    # ROI count outermost, so that a change in machine load hits every strategy alike.
    for rois in args.rois:
        for strategy, chunk, amp in runs:
            m = measure(args.model, strategy, chunk, rois, amp=amp, **options)
            measurements.append(m)
            print(
                f"{strategy:<10} chunk={chunk!s:<5} {m.dtype} rois={rois:<6} peak={m.peak_mb:>9.1f} MB "
                f"step={m.step_ms:>9.1f} ms {m.status}",
                flush=True,
            )

    fit = slopes(measurements)
    summary = [
        f"Peak memory above baseline and median step time; {measurements[0].model}, image "
        f"{measurements[0].image_size}, {measurements[0].device}.",
        "",
        "Per-ROI memory slope (linear fit):",
    ]
    baseline = max(m.baseline_mb for m in measurements)
    for label, (slope, intercept) in fit.items():
        predicted = ", ".join(
            f"{gb} GB: {max(0, int((gb * 1024 - baseline - intercept) / slope)) if slope > 0 else math.inf}"
            for gb in (16, 24, 80)
        )
        summary.append(
            f"- {label}: {slope:.4f} MB/ROI, intercept {intercept:.0f} MB; predicted max ROIs {predicted}"
        )
    by_strategy = {(m.strategy, m.chunk, m.dtype, m.rois): m.step_ms for m in measurements}
    for m in measurements:
        plain_ms = by_strategy.get(("plain", None, m.dtype, m.rois))
        if m.strategy != "plain" and plain_ms and m.status == "ok":
            summary.append(
                f"- time ratio {m.strategy} (chunk {m.chunk}) / plain at {m.rois} ROIs "
                f"{m.dtype}: {m.step_ms / plain_ms:.2f}"
            )

    if args.budget_gb:
        budget_mb = args.budget_gb * 1024
        summary += [
            "",
            f"Largest ROI count within {args.budget_gb} GB, model and batch included (binary search over real"
            " steps; on CUDA the allocator is capped at the budget, so the limit is a real out-of-memory):",
        ]
        for strategy, chunk, amp in runs:

            def fits(rois: int, strategy=strategy, chunk=chunk, amp=amp) -> bool:
                m = measure(
                    args.model,
                    strategy,
                    chunk,
                    rois,
                    amp=amp,
                    timed=False,
                    memory_limit_gb=args.budget_gb,
                    **options,
                )
                ok = m.status == "ok" and m.peak_mb + m.baseline_mb <= budget_mb
                print(
                    f"  probe {strategy} chunk={chunk} rois={rois}: {m.peak_mb + m.baseline_mb:.0f} MB "
                    f"{'fits' if ok else 'does not fit'}",
                    flush=True,
                )
                return ok

            label = f"{strategy}" + (f" (chunk {chunk})" if chunk else "") + (" bf16" if amp else "")
            start = max(args.rois)
            if label in fit and fit[label][0] > 0:  # start the search near the linear prediction
                start = max(1, int((budget_mb - baseline - fit[label][1]) / fit[label][0] / 2))
            found = find_max_rois(fits, min(start, args.budget_max_rois), limit=args.budget_max_rois)
            capped = ">= " if found == args.budget_max_rois else ""
            summary.append(f"- {label}: {capped}{found}")

    table = format_table(measurements)
    text = "\n".join(summary)
    print("\n" + table + "\n\n" + text)
    write_csv(measurements, args.out / "results.csv")
    write_markdown(measurements, args.out / "results.md", extra=text)
    plot(measurements, args.out / "memory_time.png")
    print(f"\nwrote {args.out / 'results.csv'}, results.md, memory_time.png")


if __name__ == "__main__":
    torch.multiprocessing.set_start_method("spawn", force=True)
    main()
