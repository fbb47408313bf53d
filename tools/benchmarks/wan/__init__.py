"""Every algorithm over a real emulated WAN (tools/wan's namespaces) beside the ceiling, and the
simulated clock checked against it: wan_bench.py (`python -m tools.bench wan`), wan_report.py
(its logs into tables and plots, `wan report`), validate_clock.py (`validate`)."""
