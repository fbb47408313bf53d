"""A benchmark run of an hour or more that survives being stopped: it saves a checkpoint every
SAVE_INTERVAL steps into a work directory of its own, and the same command later resumes it
from the last one instead of from step 0 (the quality ladder's cells: docs/quality.md).

Each start is a *segment*: the same flags plus `--save/--load DIR --save-interval N` and a
JSON log of its own. A resumed run is the same run (resumption is bit-exact for every
algorithm: tests/unit_tests/lsgd/test_every_algorithm.py), so only the bookkeeping needs
joining: a segment's counters (inter-site bytes, exposed seconds) start at 0 in its process,
and its logged losses begin after the checkpoint it loaded. A stopped segment counts up to the
checkpoint the next one started from (what it did after that is done again); the last counts
whole. The checkpointing flags are not part of the run's name (its cache digest): a resumed
cell is the cell.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional

from megatron_lsgd.core.output_files import write_json
from megatron_lsgd.training.checkpointing.layout import TRACKER

SAVE_INTERVAL = 500  # steps between a cell's checkpoints: a few minutes of a ladder cell; a multiple of --log-interval
OWN_FLAGS = ("--save", "--load", "--save-interval", "--json-log")
PARTIAL = ".partial"  # under a cache directory: the work directories of unfinished runs (git-ignored)
COUNTERS = ("bytes_sent", "bytes_received", "exposed_seconds", "rounds")


@dataclass
class Segment:
    start: int  # the iteration of the checkpoint it loaded (0: none)
    records: List[Dict]  # its JSON log's interval records (the trainer's --json-log), in order


def checkpointed_iteration(ckpt_dir: str) -> int:
    """The iteration the tracker names (0 when nothing was saved yet)."""
    try:
        with open(os.path.join(ckpt_dir, TRACKER)) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return 0


def read_records(path: str) -> List[Dict]:
    """A segment's interval records; a last line cut by a kill is dropped (the log is flushed per line)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "interval_iters" in record:
                out.append(record)
    return out


def _record_at(segment: Segment, iteration: int, log: str) -> Dict:
    for record in segment.records:
        if record["iteration"] == iteration:
            return record
    raise RuntimeError(f"{log}: no logged interval ends at iteration {iteration}, where the next segment "
                       f"resumed: the checkpoint interval must be a multiple of --log-interval")


def joined(segments: List[Segment], final: Dict) -> Dict:
    """The whole run's result from its segments and the last one's own result (`final`, as the
    benchmark worker writes it: "train", "comm", "seconds", ...): the training curve and the
    counters as if it had run in one piece; "seconds" counts the kept work of each segment."""
    if len(segments) == 1:
        return final
    train: List[float] = []
    totals = {k: 0.0 for k in COUNTERS}
    seconds = 0.0
    for k, (segment, following) in enumerate(zip(segments, segments[1:])):
        end = following.start  # where the next one resumed: this one's work after it is redone
        if end <= segment.start:
            continue  # stopped before its first checkpoint: nothing of it is kept
        at_end = _record_at(segment, end, f"segment {k + 1}")
        train += [r["losses"]["lm loss"] for r in segment.records
                  if segment.start < r["iteration"] <= end and "lm loss" in r["losses"]]
        for key in COUNTERS:
            totals[key] += at_end["inter_site_totals"].get(key, 0)
        seconds += at_end["wall_s"]
    for key in COUNTERS:
        totals[key] += final["comm"].get(key, 0)
    return {**final, "train": train + list(final["train"]), "comm": {**final["comm"], **totals},
            "seconds": seconds + final["seconds"], "segments": len(segments)}


class WorkDir:
    """A run's checkpoints and segment logs, kept until the run finishes. As for finished runs
    (run_cache.load_or_run), a change of the code does not throw them away: the result names the
    code of each segment (`segment_codes`), and the regression fixtures keep refactors bit-exact."""

    def __init__(self, path: str):
        self.path, self.ckpt = path, os.path.join(path, "checkpoints")
        self.meta_path = os.path.join(path, "segments.json")
        self.meta = self._read_meta() or {"segments": []}

    def _read_meta(self) -> Optional[Dict]:
        try:
            with open(self.meta_path, encoding="utf-8") as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def begin_segment(self, code: Optional[str]) -> List[str]:
        """The flags of the next segment (made by `code`); says where it resumes."""
        os.makedirs(self.path, exist_ok=True)
        start = checkpointed_iteration(self.ckpt)
        log = os.path.join(self.path, f"segment-{len(self.meta['segments']) + 1}.jsonl")
        if start:
            print(f"  resuming at iteration {start} (segment {len(self.meta['segments']) + 1})", flush=True)
        self.meta["segments"].append({"start": start, "log": os.path.basename(log), "code": code})
        write_json(self.meta_path, self.meta)
        return ["--save", self.ckpt, "--load", self.ckpt, "--save-interval", str(SAVE_INTERVAL), "--json-log", log]

    def resumed(self) -> bool:
        return bool(self.meta["segments"]) and self.meta["segments"][-1]["start"] > 0

    def codes(self) -> List[Optional[str]]:
        return [s.get("code") for s in self.meta["segments"]]

    def segments(self) -> List[Segment]:
        return [Segment(s["start"], read_records(os.path.join(self.path, s["log"]))) for s in self.meta["segments"]]

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def segment_argv(argv: List[str], flags: List[str]) -> List[str]:
    """The run's flags and its segment's; a run that sets them itself cannot be run in segments."""
    taken = [f for f in OWN_FLAGS if f in argv]
    if taken:
        raise ValueError(f"a run resumed in segments sets {', '.join(taken)} itself")
    return list(argv) + flags
