"""Datasets (full GPT dataset arrives with the data pipeline)."""

from megatron_lsgd.core.datasets.mock_dataset import MockGPTDataset


def build_train_valid_test_datasets(cfg, tokenizer, num_samples):
    if not cfg.mock_data:
        raise ValueError("only --mock-data is available in this build")
    return tuple(MockGPTDataset(n, cfg.seq_length, tokenizer.vocab_size, cfg.seed, split) if n > 0 else None
                 for n, split in zip(num_samples, ("train", "valid", "test")))


__all__ = ["build_train_valid_test_datasets", "MockGPTDataset"]
