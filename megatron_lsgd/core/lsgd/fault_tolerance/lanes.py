"""Elastic sites of different data-parallel sizes: one torchft Manager per lane.

torchft joins the ranks with the same group rank of every replica group (site) in one
process group. Sites of different sizes cut what crosses sites into L = lcm(DP_s) lanes
(parallel_state), and a rank of a site with DP_s < L holds L / DP_s of them. So every site
presents TP x PP x L torchft group ranks, one Manager per (tp, lane, pp): each lane's group
then joins one rank of every site, as a plain run's lane group does, and the synchronizer's
lane-by-lane means (SiteSplit) run on those groups unchanged.

`LaneManagers` shows a rank's Managers to TorchftMembership as one Manager: the calls the
site's manager server answers for every group rank together (the quorum, `should_commit`)
run on all of them at once (one after the other would wait for each other), the others on
each. A heal arrives per lane, each from the same lane of a live site, laid out as that
site's rank holds it: the payloads are kept and merged on the main thread once the quorum
is complete (`merge`: elastic.py takes each lane's share of the per-parameter state from
the lane's own payload), then loaded once. `LaneGroups` runs the membership's few
collectives (who is present, the loop's means) on every lane group, each with its own
copy: every lane joins every site once, so each returns the same result.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence

import torch


def group_rank(tp: int, lane: int, pp: int, tp_size: int, lanes: int) -> int:
    """The torchft group rank of lane `lane` at (tp, pp): a site's order (tp, dp, pp) with the
    lanes as its replicas, so with equal sites (L = DP) it is the rank's place in its site."""
    return tp + tp_size * (lane + lanes * pp)


class LaneManagers:
    def __init__(self, managers: Sequence, device=None):
        self.managers, self.device = list(managers), device
        self._pool = ThreadPoolExecutor(max_workers=len(self.managers), thread_name_prefix="lane_quorum")
        self._received: List[Dict[str, object]] = [{} for _ in self.managers]
        self._loaders: Dict[str, tuple] = {}  # key -> (load_state_dict, merge)

    def _all(self, call: Callable) -> list:
        """`call(manager)` on every lane at once (the site's manager server waits for all)."""
        def on_device(m):
            if self.device is not None and self.device.type == "cuda":  # a thread starts on GPU 0: torchft reads it
                torch.cuda.set_device(self.device)
            return call(m)

        return [f.result() for f in [self._pool.submit(on_device, m) for m in self.managers]]

    # ---- the calls answered for the whole site ------------------------------------------------
    def start_quorum(self, timeout=None) -> None:
        self._all(lambda m: m.start_quorum(timeout=timeout))
        self._load_received()

    def should_commit(self) -> bool:
        return all(self._all(lambda m: m.should_commit()))  # one decision for the site: equal on every lane

    # ---- per lane ---------------------------------------------------------------------------------
    def register_state_dict_fn(self, key: str, load_state_dict: Callable, state_dict: Callable,
                               merge: Optional[Callable[[List[object]], object]] = None) -> None:
        self._loaders[key] = (load_state_dict, merge)
        for lane, m in enumerate(self.managers):
            m.register_state_dict_fn(key, lambda state, lane=lane, key=key: self._received[lane].__setitem__(
                key, state), state_dict)

    def _load_received(self) -> None:
        """A heal's payloads, one per lane, merged and loaded once (here: the main thread)."""
        if not any(self._received):
            return
        received, self._received = self._received, [{} for _ in self.managers]
        missing = [lane for lane, got in enumerate(received) if set(got) != set(self._loaders)]
        if missing:  # a lane's transfer failed: torchft reported it, the round will not commit
            return
        for key, (load, merge) in self._loaders.items():
            payloads = [got[key] for got in received]
            load(merge(payloads) if merge is not None else payloads[0])

    def report_error(self, err: Exception) -> None:
        for m in self.managers:
            m.report_error(err)

    def errored(self):
        return next((e for e in (m.errored() for m in self.managers) if e is not None), None)

    def num_participants(self) -> int:
        return self.managers[0].num_participants()

    def current_step(self) -> int:
        return self.managers[0].current_step()

    @property
    def _quorum_id(self):
        return getattr(self.managers[0], "_quorum_id", None)

    def state_dict(self) -> Dict:
        return self.managers[0].state_dict()

    def load_state_dict(self, state: Dict) -> None:
        for m in self.managers:
            m.load_state_dict(state)

    def shutdown(self, wait: bool = False) -> None:
        for m in self.managers:
            m.shutdown(wait=wait)
        self._pool.shutdown(wait=False)


class LaneGroups:
    """The lane groups of a rank as one group for the membership's own collectives: the
    given tensors on the first lane, a copy on each other (the same sum comes back)."""

    def __init__(self, pgs: Sequence):
        self.pgs = list(pgs)
        self.primary = self.pgs[0]

    def allreduce(self, tensors, opts):
        return _Works([pg.allreduce(t, opts) for pg, t in zip(self.pgs, self._copies(tensors))])

    def allgather(self, outputs, inputs, opts):
        outs = [outputs] + [[[o.clone() for o in out] for out in outputs] for _ in self.pgs[1:]]
        return _Works([pg.allgather(o, i, opts) for pg, o, i in zip(self.pgs, outs, self._copies(inputs))])

    def _copies(self, tensors) -> list:
        return [tensors] + [[t.clone() for t in tensors] for _ in self.pgs[1:]]

    def abort(self) -> None:
        for pg in self.pgs:
            pg.abort()


class _Works:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True
