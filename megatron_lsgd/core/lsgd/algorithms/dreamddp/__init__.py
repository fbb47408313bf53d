"""DreamDDP (`--lsgd-algorithm dreamddp`): layer-wise partial synchronization after
backward, with a profiler and a scheduler. scheduler.py is the pure search (tested
against brute force), profile.py the measurements and their agreement across ranks,
plan.py the per-stage schedules and their printout, synchronizer.py the algorithm."""

from megatron_lsgd.core.lsgd.algorithms.dreamddp.synchronizer import DreamDDP, DreamDDPOptions  # noqa: F401  (registers)
