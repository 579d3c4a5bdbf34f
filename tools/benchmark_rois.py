"""How many ROIs fit: memory and time of one training step versus ROI count, per back-prop strategy.

Examples:
    python tools/benchmark_rois.py --model r50_c4 --rois 64,128,256 --strategies plain,paper,fused
    python tools/benchmark_rois.py --model r50_c4 --rois 128,256 --strategies fused --dropblock
    python tools/benchmark_rois.py --model r50_c4 --rois 1000 --strategies fused --gradnorm
    python tools/benchmark_rois.py --model r50_c4 --rois 250,1000 --strategies fused --ema --steps 0
    python tools/benchmark_rois.py --device cuda --rois 500,1000,2000,4000 --chunk 250,500 \
        --dtypes fp32,bf16 --budget-gb 16 --out benchmark_out/h200
    python tools/benchmark_rois.py --model r50_c4 --rois 256,512 --strategies plain,fused,auto \
        --chunk 8 --auto-budget-gb 4,0.5          # chunk_size=auto with a budget that fits, a tight one
    python tools/benchmark_rois.py --model r50_c4 --image-size 600,800 --rois 64,512 --chunk 32 \
        --strategies plain,fused,ckpt_chunk,offload,compile,vmap_chunk   # wsod against the stock tools

Prints a table and writes results.csv, results.md and memory_time.png into --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from wsod.benchmarks.rois import (
    CHUNKED,
    MODELS,
    STRATEGIES,
    format_table,
    largest_within_budget,
    measure,
    plot,
    predicted_max_rois,
    slopes,
    split_variant,
    strategy_label,
    summarize,
    write_csv,
    write_markdown,
)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _budgets(text: str) -> list[float | None]:
    return [None if v.lower() in ("none", "null") else float(v) for v in text.split(",") if v]


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
    parser.add_argument(
        "--dtypes",
        default="fp32",
        help="comma list of fp32, bf16 (training's amp=bf16: autocast on CUDA only, as training runs it)",
    )
    parser.add_argument(
        "--budget-gb", type=float, default=None, help="also find the largest ROI count within this"
    )
    parser.add_argument(
        "--budget-max-rois", type=int, default=16384, help="stop the budget search here (reported as '>=')"
    )
    parser.add_argument(
        "--auto-budget-gb",
        type=_budgets,
        default=[None],
        help="comma list of model.memory_budget_gb values for the auto strategy, one row set each; 'none':"
        " the CUDA free memory less the margin (CUDA only)",
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per measurement (median reported); 0: memory only"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument(
        "--dropblock",
        action="store_true",
        help="also measure each strategy with Concrete DropBlock: its step adds the adversarial second"
        " forward and backward (reported as '<strategy>+dropblock')",
    )
    parser.add_argument(
        "--gradnorm",
        action="store_true",
        help="also measure each strategy with GradNorm, in wsod's order ('+gradnorm': per-loss norms at"
        " the ROI features, then one backward) and in the usual one ('+gradnorm_retain': the full"
        " backward with retain_graph, then one gradient per loss)",
    )
    parser.add_argument(
        "--ema",
        action="store_true",
        help="also measure each strategy with the EMA teacher ('<strategy>+ema': its no-grad scoring"
        " forward before the student's and its update after the step; its weights are in the baseline)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmark_out"), help="output directory")
    args = parser.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
    variants = [""] + ["+dropblock"] * args.dropblock + ["+gradnorm", "+gradnorm_retain"] * args.gradnorm
    variants += ["+ema"] * args.ema
    args.strategies = [s + variant for s in args.strategies for variant in variants]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if set(args.dtypes) - {"fp32", "bf16"}:
        parser.error("--dtypes takes fp32 and/or bf16")
    if "bf16" in args.dtypes and torch.device(args.device).type != "cuda":
        parser.error("--dtypes bf16 needs --device cuda: training runs no autocast on CPU (amp is CUDA only)")
    height, width = _ints(args.image_size)
    args.image_size = (height, width)
    if "auto" in args.strategies and None in args.auto_budget_gb and torch.device(args.device).type != "cuda":
        parser.error("the auto strategy off CUDA needs --auto-budget-gb with numbers (GB), e.g. 4,0.5")
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
    if args.steps == 0:  # memory only: no timing process (CPU) and no timed steps
        options.update(steps=1, timed=False)
    runs = [
        (strategy, chunk, dtype == "bf16", budget)
        for strategy in args.strategies
        for chunk in (args.chunk if split_variant(strategy)[0] in CHUNKED else [None])
        for budget in (args.auto_budget_gb if split_variant(strategy)[0] == "auto" else [None])
        for dtype in args.dtypes
    ]
    measurements = []
    # ROI count outermost, so that a change in machine load hits every strategy alike.
    for rois in args.rois:
        for strategy, chunk, amp, budget in runs:
            m = measure(args.model, strategy, chunk, rois, amp=amp, auto_budget_gb=budget, **options)
            measurements.append(m)
            chose = f" auto chose {m.auto_chunk} ({m.auto_mb_per_roi} MB/ROI)" if strategy == "auto" else ""
            print(
                f"{strategy:<10} chunk={chunk!s:<5} {m.dtype} rois={rois:<6} peak={m.peak_mb:>9.1f} MB "
                f"step={m.step_ms:>9.1f} ms {m.status}{chose}" + (f" ({m.note})" if m.note else ""),
                flush=True,
            )
            write_csv(measurements, args.out / "results.csv")  # partial results survive an interruption

    summary = summarize(measurements)
    if args.budget_gb:
        summary += [
            "",
            f"Largest ROI count within {args.budget_gb} GB, model and batch included (binary search over real"
            " steps; on CUDA the allocator is capped at the budget, so the limit is a real out-of-memory):",
        ]
        fit = slopes(measurements)
        baseline = max(m.baseline_mb for m in measurements)
        for strategy, chunk, amp, budget in runs:
            label = strategy_label(strategy, chunk, amp, budget)
            start = max(args.rois)
            if label in fit and fit[label][0] > 0:  # start the search near half the linear prediction
                start = max(1, int(predicted_max_rois(*fit[label], baseline, args.budget_gb) / 2))
            found = largest_within_budget(
                args.model, strategy, chunk, amp, budget_gb=args.budget_gb, max_rois=args.budget_max_rois,
                start=start, auto_budget_gb=budget, **options,
            )  # fmt: skip
            summary.append(f"- {label}: {'>= ' if found == args.budget_max_rois else ''}{found}")

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
