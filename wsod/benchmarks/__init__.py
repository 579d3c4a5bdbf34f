"""Benchmarks behind the tools/benchmark_*.py scripts: ``rois`` (memory and time of a training step
versus ROI count, per back-propagation strategy), ``loader`` (data-loader throughput) and ``proposals``
(memory of a proposal pickle versus a memory-mapped proposal store)."""
