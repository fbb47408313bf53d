"""The leaderboard: which algorithm reaches a validation loss first per WAN scenario, on the
simulated clock (`python -m tools.bench board`): leaderboard.py trains the cells,
leaderboard_setup.py says what a cell trains, leaderboard_report.py reads the cells into
docs/leaderboard.md."""
