import os
import sys

# Tests import pretrain_gpt and megatron_lsgd from the checkout (also when not installed).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need an NVIDIA GPU: skipped, with the reason, where there is none."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU: CUDA is not available here (tools/gpu_check.sh runs it)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
