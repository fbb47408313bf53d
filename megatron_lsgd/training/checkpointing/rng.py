"""Every random stream a rank draws from, as weights_only-safe values.

numpy's state holds an ndarray (not loadable with weights_only=True), so its key array is
stored as a tensor; python's state is a tuple of ints, stored as a list.
"""

from __future__ import annotations

import random
from typing import Dict

import numpy as np
import torch

from megatron_lsgd.core.tensor_parallel.random import RNGStatesTracker


def capture_rng_state(tracker: RNGStatesTracker) -> Dict:
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "tracker": tracker.state_dict(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict, tracker: RNGStatesTracker) -> bool:
    """Restores every stream; False where the tracker's streams (dropout) belong to another
    kind of device (a GPU checkpoint resumed on a CPU, or the reverse): a generator's state
    cannot cross devices, so those streams stay as seeded and the host streams are restored."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if not tracker.fits(state["tracker"]):
        return False
    tracker.load_state_dict(state["tracker"])
    return True
