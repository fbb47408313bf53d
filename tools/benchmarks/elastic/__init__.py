"""Elastic sites (--lsgd-fault-tolerance torchft) killed and restarted: what survives
(chaos.py, `python -m tools.bench chaos`); ft_site.py is the toy site it and the
fault-tolerance tests run (the real diloco synchronizer, a toy inner step)."""
