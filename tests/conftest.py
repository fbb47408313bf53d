import os
import sys

# Tests import pretrain_gpt and megatron_lsgd from the checkout (also when not installed).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
