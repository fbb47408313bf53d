"""How much validation loss an algorithm gives up against `sync` at equal tokens, and for how
many fewer cross-site bytes: lsgd_quality.py (the matrix and its runner, `python -m tools.bench
quality`), quality_frontier.py (the bytes-against-loss frontier and the model-size ladder,
`frontier`), gpu_quality.py (the study on one GPU within a time budget, `quality gpu`)."""
