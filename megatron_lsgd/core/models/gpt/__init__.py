from megatron_lsgd.core.models.gpt.gpt_model import GPTModel, SyncUnit

__all__ = ["GPTModel", "SyncUnit"]
