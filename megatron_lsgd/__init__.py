"""megatron_lsgd: Megatron-style 3D-parallel LLM pre-training whose data-parallel
dimension can cross slow links (sites joined by a low-communication synchronizer)."""

__version__ = "0.1.0"
