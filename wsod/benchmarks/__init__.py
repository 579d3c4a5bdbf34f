"""Benchmarks behind the tools/benchmark_*.py scripts: ``rois`` (memory and time of a training step
versus ROI count, per back-propagation strategy) and ``loader`` (data-loader throughput)."""
