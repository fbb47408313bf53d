"""One part of the library measured alone: the data pipeline (data_bench.py, `python -m
tools.bench parts data`), the checkpoint converter's peak host memory (convert_memory.py,
`parts convert`), DreamDDP's scheduler against brute force (dreamddp_scheduler_bench.py,
`parts dreamddp`)."""
