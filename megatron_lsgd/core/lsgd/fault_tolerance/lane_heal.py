"""A heal into a site of another data-parallel size (fault_tolerance/lanes.py): a rank's state
from the live ranks holding its lanes, one payload per lane, each laid out as that rank holds
it (its site's DP size, `site_dp` in the payload).

Without ZeRO-1 (the only case arguments.py lets through) a rank's tensors shaped like the main
shards are whole buckets, alike on every site, and lane j is the j-th L-th of each (buckets
are padded to L). What a rank holds of a set of units (SiteSplit.mine) is the part of its
ranges inside the rank's block of every bucket, its lanes' blocks; so is the sender's. Either
way each lane's values come from that lane's own payload, the one place they are right."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from megatron_lsgd.core.optimizer.shard_views import ShardRange


def merge_lanes(payloads: Sequence[Dict], lanes: Sequence[int], num_lanes: int, per_parameter: Dict,
                per_part=lambda state: [], my_dp: int = 1, shard_sizes: Sequence[int] = ()) -> Dict:
    """The receiver's state: everything from the first payload, except the synchronizer's
    per-parameter state (`Synchronizer.per_parameter_state`: the anchor and outer momentum,
    right on a rank only on the part it sends across sites), taken lane by lane, and its
    per-part lists (`per_part(state)`, Synchronizer.per_part_state: one tensor per non-empty
    range of the rank's part), re-cut for this rank (`my_dp`: its site's DP size)."""
    state = payloads[0]
    for path in per_parameter:
        keys = path.split("/")
        mine = _walk(state["synchronizer"], keys)
        for lane, payload in zip(lanes, payloads):
            for dst, src in zip(mine, _walk(payload["synchronizer"], keys)):
                width = dst.numel() // num_lanes
                dst.view(-1)[lane * width:(lane + 1) * width] = src.view(-1)[lane * width:(lane + 1) * width]
    parts = [per_part(p["synchronizer"]) for p in payloads]
    for k, (target, full) in enumerate(parts[0]):
        index = lanes[0] // (num_lanes // my_dp)
        target[:] = recut([p[k][0] for p in parts], [p.get("site_dp", my_dp) for p in payloads], full, lanes,
                          num_lanes, my_dp, index, shard_sizes)
    return state


def part_ranges(full, dp: int, index: int, shard_sizes: Sequence[int]) -> List[ShardRange]:
    """The non-empty ranges of `full` (whole-site ShardViews) a replica `index` of a site of
    `dp` holds: inside its block of every bucket (SiteSplit.mine with the shard sizes)."""
    out = []
    for r in full.ranges:
        n = shard_sizes[r.shard]
        lo, hi = max(r.lo, index * n // dp), min(r.hi, (index + 1) * n // dp)
        if lo < hi:
            out.append(ShardRange(r.shard, lo, hi))
    return out


def recut(lists: Sequence[List[torch.Tensor]], dps: Sequence[int], full, lanes: Sequence[int], num_lanes: int,
          my_dp: int, my_index: int, shard_sizes: Sequence[int]) -> List[torch.Tensor]:
    """One per-part list for replica `my_index` of a site of `my_dp`, from each lane's sender's
    (`lists[i]`, from a site of `dps[i]`, holding lane `lanes[i]`)."""
    mine = part_ranges(full, my_dp, my_index, shard_sizes)
    like = next((t for lst in lists for t in lst), None)
    if like is None:
        return []
    out = [torch.empty(r.hi - r.lo, dtype=like.dtype, device=like.device) for r in mine]
    for lane, values, dp in zip(lanes, lists, dps):
        theirs = part_ranges(full, dp, lane // (num_lanes // dp), shard_sizes)
        for s, t in zip(theirs, values):
            n = shard_sizes[s.shard]
            a, b = max(s.lo, lane * n // num_lanes), min(s.hi, (lane + 1) * n // num_lanes)
            for r, o in zip(mine, out):
                lo, hi = max(a, r.lo), min(b, r.hi)
                if r.shard == s.shard and lo < hi:
                    o[lo - r.lo:hi - r.lo] = t.view(-1)[lo - s.lo:hi - s.lo]
    return out


def _walk(state, keys):
    for key in keys:
        state = state[key]
    return state
