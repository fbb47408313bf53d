"""One rank's training step against a plain PyTorch loop of the same model (side_by_side.py):
throughput and MFU (mfu.py, `python -m tools.bench step mfu`), framework overhead
(overhead_bench.py, `step overhead`), what the device-synchronised clock costs a step
(clock_cost.py, `step clock`); gpu_report.py turns mfu.py's JSON into tools/gpu_check.sh's
report lines."""
