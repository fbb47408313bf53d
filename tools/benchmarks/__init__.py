"""The benchmarks, one package per family; run them through `python -m tools.bench SUBCOMMAND`
(tools/bench.py lists the subcommands).

- quality/: quality at equal tokens and the bytes-against-loss frontier,
- board/: the leaderboard (time to a validation loss per WAN scenario, simulated clock),
- wan/: every algorithm over an emulated WAN, and the simulated clock checked against it,
- step/: one rank's training step (throughput, MFU, framework and clock overhead),
- elastic/: elastic sites killed and restarted (the chaos run and its toy site),
- parts/: one part of the library measured alone (data pipeline, checkpoint conversion,
  DreamDDP's scheduler).

Here, the kit more than one family (or the tests) imports: recipes.py (every algorithm's
settings), run_cache.py (finished runs kept as JSON), spawned_ranks.py (a run's ranks as child
processes), process_tree.py (killing a launcher's whole tree), tool_input.py (one `error:` line
for a bad input file); scenarios/ holds the WAN scenarios (TOML) the board, the planner and
pretrain_gpt.py's --simulate-scenario read.
"""
