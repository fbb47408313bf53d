"""Round membership on torchft: quorum, floor, commit or roll back, healing.

Per outer round (torchft's DiLoCo protocol, with the quorum moved to the round's start;
for the streaming family a round is one fragment's sync, as in torchft's Streaming DiLoCo):
- `round_started`: a blocking quorum on the torchft Manager (use_async_quorum=False),
  taken at the start of a step. torchft reconfigures the cross-site process group for the
  sites present, and a site whose committed-round count is behind the quorum's
  (restarted, or new) receives a live peer's state over the quorum's group (torchft's
  PGTransport) before its step. A fresh site is never the source: torchft heals towards
  the highest committed step, and `init_sync=False` because every site starts from the
  same seeded weights. Below `--lsgd-min-sites` the site waits (a line every `log_every`
  seconds; a site with no other site in its last quorum, or none yet, says so after
  `ALONE_LINE_S`) and re-forms the quorum; it never trains a round it could not commit.
  After `--lsgd-ft-max-wait` it stops with one error line, or, alone in its quorum under
  `--lsgd-ft-lone-site train`, trains alone (its rounds committed with itself as the only
  member) until another site joins its quorum.
  A heal is a `Heal` (returned, and kept in `heals`).
- `start` / `finish` (`reduce` is both at once): the round's one reduction over the sites
  present, issued right after the quorum and finished before the next one (a quorum may
  rebuild the group under it). A collective that fails (a peer died, a timeout) is
  reported to the Manager instead of raised, and the site's group is aborted so that the
  sites still waiting on it fail now, not a timeout later (one heal per fault);
  `should_commit` (agreed by every rank of the site) then says whether the round is kept.
  Not kept: the state in `undo` is put back as it was when the reduction was issued and
  None is returned, so the synchronizer leaves its anchor as it was; the next quorum
  names the site that was lost, in one line.
- the rhythm of reductions that overlap inner steps (`taken`, `step_started`): a reduction
  taken after a step is issued at the start of the next, right after its own quorum (one
  quorum per reduction; what is open is decided before it), and a process's first step
  takes a quorum even with nothing to send (a round of its own, decided at once), where a
  restarted site is healed. A site healed into a peer's closing exchanges takes part in
  the rest of them (`close_exchanges`).
- `job_finished`: when the job reaches its budget every site takes one last quorum, in
  which a site that missed the job's last rounds (restarting, or left out) receives the
  final state instead of waiting for peers that are gone. A site whose training is over by
  a heal (the job's final state, or the closing exchanges it was healed into are done)
  says so in `ended_by`, and its synchronizer ends training through the protocol
  (`Synchronizer.ended`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import warnings
from dataclasses import replace
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, TypeVar

import torch

from megatron_lsgd.core.lsgd.comm import InterSiteTimeout
from megatron_lsgd.core.lsgd.fault_tolerance.elastic_comm import ElasticComm
from megatron_lsgd.core.lsgd.fault_tolerance.lanes import LaneGroups, LaneManagers
from megatron_lsgd.core.lsgd.fault_tolerance.options import FaultToleranceOptions, require_torchft
from megatron_lsgd.core.lsgd.membership import Exchanges, Finished, Heal, SiteMembership

T = TypeVar("T")

ALONE_LINE_S = 2.0  # a site that knows no other site (its first quorum, or it was alone) says it waits this soon


def _no_flight_recorder_note(record: logging.LogRecord) -> bool:
    """torchft warns at every reconfiguration where NCCL's flight recorder is missing (every
    CPU run): noise in a site's log, unlike its other warnings."""
    return "flight recorder" not in record.getMessage()


def _sites(sites: Sequence[int]) -> str:
    return ",".join(map(str, sorted(sites))) or "none"


class _RoundTicket:
    """The reduction of an elastic round: the work's own poll/wait/done/result, except that a
    failure is reported (`failed(err)`: the round then does not commit), never raised."""

    def __init__(self, failed: Callable[[Exception], None], work, saved):
        self.report, self.work, self.saved = failed, work, saved
        self.failed = work is None
        self.decision: Optional[bool] = None  # set by finish: committed or not

    @property
    def done(self) -> bool:
        return self.failed or self.work.done

    @property
    def result(self):
        return None if self.failed else self.work.result

    def poll(self) -> bool:
        if not self.done:
            self._guarded(self.work.poll)
        return self.done

    def wait(self):
        if not self.done:
            self._guarded(self.work.wait)
        return self.result

    def run(self, call, failed=None):
        """A later collective of the round (membership.within): its result, or `failed` when
        it fails (reported, as a wait) or the round already has (a broken group: not tried)."""
        if self.failed:
            return failed
        out = [failed]
        self._guarded(lambda: out.__setitem__(0, call()))
        return failed if self.failed else out[0]

    def _guarded(self, call) -> None:
        try:
            call()
        except Exception as err:  # a peer died or timed out (gloo/nccl, InterSiteTimeout, torchft's own)
            self.failed = True
            self.report(err)
            abandon = getattr(self.work, "abandon", None)  # e.g. a queue that must drop the broken reduction
            if abandon is not None:
                abandon()


class TorchftMembership(SiteMembership):
    """Elastic sites: each a torchft replica group; rounds may fail and sites may join."""

    def __init__(self, comm: ElasticComm, options: FaultToleranceOptions, *, site: int, group_rank: int,
                 group_world_size: int, store_addr: str, store_port: int, device: torch.device,
                 log: Callable[[str], None] = print, log_every: float = 10.0, poll_s: float = 0.5,
                 hostname: Optional[str] = None, trace: Optional[Callable[[Dict], None]] = None,
                 lane_ranks: Optional[Sequence[int]] = None, lane_world: Optional[int] = None):
        """`lane_ranks`, `lane_world`: sites of different sizes, the torchft group ranks of this
        rank's lanes and how many a site presents (lanes.py); None: one, its `group_rank`."""
        require_torchft(options.mode)
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        lighthouse = options.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise ValueError("--lsgd-fault-tolerance torchft needs a lighthouse: --lsgd-lighthouse http://HOST:PORT "
                             "or $TORCHFT_LIGHTHOUSE (docs/fault_tolerance.md)")
        self.comm, self.options, self.site, self.device = comm, options, site, device
        logging.getLogger("torchft.manager").addFilter(_no_flight_recorder_note)
        # Said of torchft 0.2.0's own code on torch 2.13 (PGTransport: a deprecated pytree check,
        # and a tensor over the read-only bytes of the pickled metadata, which it only sends).
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        self.log = log if group_rank == 0 else (lambda _msg: None)  # one line per site
        self.log_every, self.poll_s = log_every, poll_s
        # `trace`: a record per quorum asked and formed, and per round not committed (quorum id,
        # sites, committed rounds, heal; the receiver stamps the time), for a timeline of who met whom
        self._trace = trace if group_rank == 0 else None
        timeout = timedelta(seconds=options.timeout_s)
        # torchft's own floor (no commit below it) is --lsgd-min-sites, the site's own floor being
        # round_started's; a site that may train alone commits rounds of one site.
        floor = 1 if options.lone_site == "train" else options.min_sites

        def lane(rank: int, world: int):
            # `device` is the inter-site group's (--inter-site-backend): NCCL where it is a GPU.
            pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
            # Healing state travels over the quorum's own group (reachable by construction, no
            # HTTP server per rank advertised under a host name other sites may not resolve).
            transport = PGTransport(pg, timeout=timeout, device=device)
            return pg, Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=floor,
                               use_async_quorum=False, timeout=timeout,
                               quorum_timeout=timedelta(seconds=options.max_wait_s), rank=rank,
                               world_size=world, store_addr=store_addr, store_port=store_port,
                               lighthouse_addr=lighthouse, replica_id=f"site{site}", init_sync=False,
                               hostname=hostname or socket.gethostname(), checkpoint_transport=transport)

        if lane_ranks is None or len(lane_ranks) == 1:
            self.pg, self.manager = lane(group_rank if lane_ranks is None else lane_ranks[0],
                                         group_world_size if lane_world is None else lane_world)
            self.lane_pgs = [self.pg]
        else:  # a rank of a smaller site holds several lanes: a Manager each, seen as one
            pgs, managers = zip(*(lane(rank, lane_world) for rank in lane_ranks))
            self.pg, self.manager, self.lane_pgs = LaneGroups(pgs), LaneManagers(managers, device), list(pgs)
        self.present: List[int] = []  # sites of the current round
        self.order: List[int] = []  # the same, in the order of the quorum group's ranks (a gather's rows)
        self.rounds_attempted = self.rounds_committed = 0
        self.failed_in_a_row = 0  # rounds not committed since the last that was (--lsgd-ft-max-failed-rounds)
        self.alone = False  # training alone (--lsgd-ft-lone-site train) until another site joins its quorum
        self.heals: List[Heal] = []  # every live peer's state this site received, in order
        self.ended_by: Optional[Heal] = None  # the heal that ended this site's training (Heal.ends_training)
        self.joined = False  # this process has taken a quorum (its first step takes one: a restarted site heals there)
        self._failed: Optional[List[int]] = None  # the sites of a round that was not committed
        self._failure = ""  # why, in a few words
        self._received: Optional[Dict] = None  # a peer's round counts, received in the quorum under way (a heal)
        self._open: Optional[_RoundTicket] = None  # the round's reduction, until finished
        self.finished = False  # this site reached the job's budget (told to a site it heals)
        self._digests: Optional[tuple] = None  # (path, the tensors to hash): record_digests
        self._digested = -1  # the committed-round count of the last digest written
        # A healed site numbers rounds as the peer that healed it does (its log lines name rounds).
        self.manager.register_state_dict_fn("membership", self._load_heal_counts,
                                            lambda: {**self._counts(), "finished": self.finished})

    # ---- state a healing site receives -------------------------------------------------------------
    def register_state(self, key: str, state_dict: Callable[[], object], load_state_dict: Callable[[object], None],
                       merge: Optional[Callable[[List[object]], object]] = None) -> None:
        """`state_dict` must return a snapshot (copies): torchft serves it while training goes on.
        `merge`: with several lanes, what is loaded from the lanes' payloads (lanes.py)."""
        if isinstance(self.manager, LaneManagers):
            self.manager.register_state_dict_fn(key, load_state_dict, state_dict, merge)
        else:
            self.manager.register_state_dict_fn(key, load_state_dict, state_dict)

    def _counts(self) -> Dict:
        return {"rounds_attempted": self.rounds_attempted, "rounds_committed": self.rounds_committed}

    def _load_counts(self, counts: Dict) -> None:
        self.rounds_attempted = int(counts["rounds_attempted"])
        self.rounds_committed = int(counts["rounds_committed"])

    def _load_heal_counts(self, counts: Dict) -> None:
        """torchft loads every registered key at a heal, this one included: what was received
        becomes the quorum's Heal."""
        self._load_counts(counts)
        self._received = counts  # (never from a checkpoint)

    def _heal(self, **where) -> Optional[Heal]:
        """The heal of the quorum just formed (None: this site received nothing)."""
        if self._received is None:
            return None
        received, self._received = self._received, None
        heal = Heal(committed_round=self.committed_rounds, final=bool(received.get("finished", False)), **where)
        self.heals.append(heal)
        return heal

    @property
    def committed_rounds(self) -> int:
        """Rounds the job has committed (torchft's step; a healed site takes its peer's)."""
        return self.manager.current_step()

    def record_digests(self, path: str, tensors: Callable[[], Sequence[torch.Tensor]]) -> None:
        """At each quorum (and at the job's end), append to `path` the SHA-256 of `tensors()`
        (this rank's anchor and outer momentum) as of the last committed round, once per
        committed-round count: every site must write the same digest for the same round."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._digests = (self._digests or []) + [(path, tensors)]  # (one per lane with sites of different sizes)

    def _record_digest(self, final: bool = False) -> None:
        if not self._digests or (self.committed_rounds == self._digested and not final):
            return
        self._digested = self.committed_rounds
        for path, tensors in self._digests:
            h = hashlib.sha256()
            for t in tensors():
                h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
            record = {"round": self.committed_rounds, "attempted": self.rounds_attempted, "digest": h.hexdigest(),
                      "site": self.site, "t": time.time()}
            if final:
                record["final"] = True
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # ---- SiteMembership -----------------------------------------------------------------------------
    def round_started(self) -> Optional[Heal]:
        if self._open is not None:
            raise RuntimeError("a round's reduction is still open: finish it before the next quorum")
        self._record_digest()
        heal = self._form_quorum_or_stop()
        if self._ended_by_final(heal):
            return heal
        waited_since = last_line = None  # the run's clock: real time (fault tolerance refuses a simulated one)
        while self.manager.num_participants() < self.options.min_sites:
            now = self.comm.clock.now()
            if waited_since is None:
                waited_since = now
            alone = self.present == [self.site]
            if alone and self.options.lone_site == "train" and (self.alone or
                                                                now - waited_since > self.options.max_wait_s):
                if not self.alone:
                    self.alone = True
                    self.log(f"site {self.site} trains alone: no other site in its quorum for --lsgd-ft-max-wait "
                             f"{self.options.max_wait_s:g} s (--lsgd-ft-lone-site train); its rounds commit with "
                             f"itself as the only member until another site joins")
                return heal
            missing = sorted(set(range(self.comm.configured_sites)) - set(self.present))
            if now - waited_since > self.options.max_wait_s:  # the run's one error line, exit code 2
                hint = "; --lsgd-ft-lone-site train would train alone" if alone else ""
                raise InterSiteTimeout(
                    f"site {self.site}: fewer than --lsgd-min-sites {self.options.min_sites} sites for "
                    f"--lsgd-ft-max-wait {self.options.max_wait_s:g} s (missing: {_sites(missing)}; stopped, "
                    f"unreachable, or finished the job before this site came{hint})")
            if last_line is None or now - last_line >= self.log_every:
                self._waiting(waited_since, f"{self.manager.num_participants()} site(s) in the quorum: "
                                            f"{_sites(self.present)}); missing: {_sites(missing)}")
                last_line = now
            self.comm.clock.sleep(self.poll_s)
            heal = self._form_quorum_or_stop() or heal
            if self._ended_by_final(heal):
                return heal
        return heal

    def _form_quorum_or_stop(self) -> Optional[Heal]:
        """A quorum (the heal it brought, if any), or the run's one error line when the
        lighthouse formed none with this site in --lsgd-ft-max-wait (torchft's quorum timeout)."""
        try:
            return self._form_quorum()
        except TimeoutError as err:  # the Manager's quorum_timeout: no other site (or too few for the lighthouse)
            alone = "; --lsgd-ft-lone-site train needs a lighthouse that forms a quorum of one site " \
                "(torchft_lighthouse --min_replicas 1)" if self.options.lone_site == "train" else ""
            raise InterSiteTimeout(
                f"site {self.site}: no quorum in --lsgd-ft-max-wait {self.options.max_wait_s:g} s (the lighthouse "
                f"formed none with this site: fewer sites than its --min_replicas came; sites of the last round: "
                f"{_sites(self.present)}{alone})") from err

    def _ended_by_final(self, heal: Optional[Heal]) -> bool:
        """Whether `heal` brought the job's final state (a peer had finished the job): this
        site's training is then over (`ended_by`), with nothing to train or exchange."""
        if heal is None or not heal.final:
            return False
        self.ended_by = heal
        self.log(f"site {self.site}: the job had finished at committed round {self.committed_rounds}: "
                 f"received its final state from a live peer; stopping")
        return True

    def _form_quorum(self) -> Optional[Heal]:
        """A quorum, who is in it, and a line for what changed since the last one."""
        before = self.present
        self._emit("quorum_asked", committed=self.committed_rounds)
        self._quorum()
        self.joined = True
        present = self._gather_present()
        if present is None:  # a site died right after the quorum: this round will not commit
            present = list(self.order or before)
        self.order, self.present = present, sorted(present)
        self.comm.set_sites(getattr(self.pg, "primary", self.pg), self.manager.num_participants(), self.present)
        heal = self._heal()
        self._emit("quorum", id=getattr(self.manager, "_quorum_id", None), sites=self.present,
                   committed=self.committed_rounds, healed=heal is not None,
                   errored=self.manager.errored() is not None)
        if heal is not None:
            self.log(f"site {self.site} rejoined at committed round {self.committed_rounds}: state received from "
                     f"a live peer; sites now {_sites(self.present)}")
        if self._failed is not None:
            lost = sorted(set(self._failed) - set(self.present))
            who = f"lost site {_sites(lost)}" if lost else "a site failed and is back"
            self.log(f"site {self.site}: round {self.rounds_attempted} was not committed ({who}: {self._failure}); "
                     f"rolled back; sites now {_sites(self.present)}")
            self._failed = None
        elif self.alone and len(self.present) > 1:
            self.log(f"site {self.site} no longer trains alone: sites now {_sites(self.present)} (committed round "
                     f"{self.committed_rounds})")
        elif before and before != self.present:
            self.log(f"site {self.site}: sites now {_sites(self.present)} (were {_sites(before)})")
        if len(self.present) > 1:
            self.alone = False
        return heal

    # ---- the rhythm of reductions that overlap inner steps --------------------------------------------
    def taken(self, ex: Exchanges) -> None:
        """Issued after the next step's quorum (step_started), not now: a quorum is taken at a
        step's start, where a returning site is healed, and never under a reduction in flight."""

    def step_started(self, ex: Exchanges) -> None:
        """A quorum for each reduction due, each issued right after it, what is open decided
        before each quorum (one reduction per quorum); and one quorum at this process's first
        step, where a restarted site is healed: with nothing to send it is a round of its own,
        decided at once, so that the committed-round count moves with the rounds (a site that
        missed it is behind, and healed). A site healed into a peer's closing exchanges
        finishes them with it, and its training is over (`ended_by`), as is that of a site
        healed to the job's final state."""
        if self.joined and not ex.exchange_due():
            return
        while True:
            ex.decide_open()
            heal = self.round_started()
            if self.ended_by is not None:  # the job's final state
                return
            if ex.finishing:  # what a heal at a peer's closing exchange brings (nothing else sets it at a step's start)
                self.close_exchanges(ex, quorum_taken=True)
                if self.ended_by is None:
                    self.ended_by = replace(heal or Heal(self.committed_rounds), joined_closing=True)
                return
            if not ex.exchange_due():  # a process's first quorum with nothing to send
                self.finish(self.start(lambda: Finished([])))
                return
            ex.issue_due()
            if not ex.exchange_due():
                return

    def start(self, issue: Callable[[], object], undo: Sequence[object] = ()) -> _RoundTicket:
        if self._open is not None:
            raise RuntimeError("a round issues one reduction: finish the open one first")
        saved = [(u, u.state_dict()) for u in undo]
        work = None
        if self.manager.errored() is None:  # else the quorum's group is already broken: nothing to try
            try:
                work = issue()
            except Exception as err:  # as in _RoundTicket: reported, the round will not commit
                self._collective_failed(err)
        self._open = _RoundTicket(self._collective_failed, work, saved)
        return self._open

    def finish(self, ticket: _RoundTicket) -> Optional[object]:
        if not isinstance(ticket, _RoundTicket):  # restored from a checkpoint: decided before it was saved
            return ticket.wait()
        if ticket.decision is None:
            ticket.wait()
            self._open = None
            self.rounds_attempted += 1
            ticket.decision = bool(self.manager.should_commit())
            if ticket.decision:
                self.rounds_committed += 1
                self.failed_in_a_row = 0
            else:
                for u, state in ticket.saved:
                    u.load_state_dict(state)
                self._note_failure()
                self._emit("not_committed", attempted=self.rounds_attempted, sites=self.present, why=self._failure)
                self._stop_if_failing()
        return ticket.result if ticket.decision else None

    def within(self, ticket, call, failed=None):
        if not isinstance(ticket, _RoundTicket):  # restored from a checkpoint: decided before it was saved
            return call()
        return ticket.run(call, failed)

    def round_sites(self) -> List[int]:
        return list(self.order or [self.site])

    def _stop_if_failing(self) -> None:
        """Sites that meet but can never reduce together (a backend that refuses them) would
        otherwise roll back every round and train apart for the whole job, and retry a
        closing exchange forever: past the bound, the run's one error line, exit code 2."""
        self.failed_in_a_row += 1
        limit = self.options.max_failed_rounds
        if limit and self.failed_in_a_row >= limit:
            raise InterSiteTimeout(
                f"site {self.site}: {self.failed_in_a_row} rounds in a row were not committed (the last: "
                f"{self._failure}); the sites meet but do not complete a round together (sites sharing a GPU "
                f"need --inter-site-backend gloo); stopped by --lsgd-ft-max-failed-rounds {limit}")

    def _note_failure(self) -> None:
        """What the next quorum's line says of a round that was not committed."""
        self._failed = list(self.present)
        err = self.manager.errored()
        cause = getattr(err, "original_exception", err)
        while cause is not None and cause.__cause__ is not None:  # the transport's own words, not a wrapper's
            cause = cause.__cause__
        self._failure = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:160] if cause is not None \
            else "a peer site did not commit"

    def job_finished(self) -> None:
        if self.ended_by is not None and self.ended_by.final:  # told by a peer: the others have left
            self._record_digest(final=True)
            return
        self._record_digest()
        self.finished = True
        try:  # a last quorum: a site waiting for peers (or behind) is healed to this final state
            self._quorum(timeout=timedelta(seconds=self.options.timeout_s))
        except Exception as err:  # noqa: BLE001 (nobody to tell: the job is over all the same)
            self.log(f"site {self.site}: no closing quorum ({type(err).__name__}); the job is over")
            self._record_digest(final=True)
            return
        if self._heal(closing_quorum=True) is not None:
            self.log(f"site {self.site}: took a peer's final state at the closing quorum (committed round "
                     f"{self.committed_rounds})")
        self._record_digest(final=True)

    def mean_over_sites(self, tensor: torch.Tensor) -> None:
        self._over_sites(tensor, mean=True)

    def sum_over_sites(self, tensor: torch.Tensor) -> None:
        self._over_sites(tensor, mean=False)

    def _over_sites(self, tensor: torch.Tensor, mean: bool) -> None:
        """Over the sites of the quorum; a site's own value when the quorum's group is broken
        or breaks here (reported: a round in flight then does not commit, as its mean would fail)."""
        n = self.manager.num_participants()
        if n <= 1 or self.manager.errored() is not None:
            return
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        weight = getattr(self.comm, "site_weight", None)  # sites of different sizes: weighted by tokens
        # (a copy: a failed collective may leave part of a sum behind)
        work = (tensor / n if weight is None else tensor * weight) if mean else tensor.clone()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        try:
            self.pg.allreduce([work], opts).wait()
        except Exception as err:  # as in reduce: a peer died or timed out
            self._collective_failed(err)
            return
        tensor.copy_(work)

    def state_dict(self) -> Dict:
        # torchft's committed rounds decide who heals whom after a restart
        return {"torchft": self.manager.state_dict(), **self._counts()}

    def load_state_dict(self, state: Dict) -> None:
        """From a checkpoint: the site counts itself one committed round behind what it saved,
        so live sites (which have committed at least as many) heal it to their state. Its
        checkpoint may lag them even at an equal count: a round they rolled back after it
        saved still moved their data position on. After a restart of the whole job every
        site is one behind, and the sites that saved last heal the others."""
        if "torchft" in state:
            saved = dict(state["torchft"])
            saved["step"] = max(0, int(saved["step"]) - 1)
            self.manager.load_state_dict(saved)
            self._digested = self.committed_rounds  # the state held is not that round's: no digest for it
        if "rounds_attempted" in state:
            self._load_counts(state)

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    # ---- helpers -----------------------------------------------------------------------------------
    def _collective_failed(self, err: Exception) -> None:
        """A cross-site collective failed (a peer died or timed out): the round will not commit
        (reported to the Manager), and this site's group is aborted at once. A ring collective
        fails first at the dead site's neighbours; the others wait on a live neighbour that
        has stopped sending, until --lsgd-ft-timeout. Closing this site's connections fails
        their collective now, so every survivor asks the lighthouse for the next quorum
        together (one quorum of the survivors; a restarted site is healed once, in the first
        quorum it joins) instead of one survivor a timeout later, left out of the restarted
        site's quorum and healed a round after it. The next quorum rebuilds the group (a
        round not committed bumps torchft's quorum id)."""
        self.manager.report_error(err)
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 (already broken or gone: the next quorum rebuilds it)
            pass

    def _emit(self, event: str, **fields) -> None:
        if self._trace is not None:
            self._trace({"ft": event, "site": self.site, **fields})  # the receiver stamps the time

    def _quorum(self, timeout: Optional[timedelta] = None) -> None:
        """A blocking quorum, with a line every `log_every` seconds while it waits."""
        done = threading.Event()
        started = self.comm.clock.now()

        # a site that knows no other site (none yet, or it was alone) says so within seconds
        first = min(ALONE_LINE_S, self.log_every) if len(self.present) <= 1 else self.log_every

        def watch() -> None:
            wait = first
            while not done.wait(wait):
                wait = self.log_every
                failed = f"; round {self.rounds_attempted} failed ({self._failure})" \
                    if self._failed is not None else ""
                self._waiting(started, f"no quorum yet); sites of the last round: {_sites(self.present)}{failed}")

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            self.manager.start_quorum(timeout=timeout)
        finally:
            done.set()
            watcher.join()

    def _waiting(self, since: float, what: str) -> None:
        limit = f"--lsgd-ft-max-wait {self.options.max_wait_s:g} s"
        then = f"trains alone at {limit} if no other site has come (--lsgd-ft-lone-site train)" \
            if self.options.lone_site == "train" else f"stops at {limit}"
        self.log(f"site {self.site} waits for --lsgd-min-sites {self.options.min_sites} sites "
                 f"({self.comm.clock.now() - since:.0f} s, {what}; {then}")

    def _gather_present(self) -> Optional[List[int]]:
        """Which sites the new quorum holds: each contributes its index (a few bytes)."""
        n = self.manager.num_participants()
        if self.manager.errored() is not None:  # the group could not be rebuilt (a peer too slow or gone)
            return None
        if n <= 1:
            return [self.site]
        mine = torch.tensor([float(self.site)], device=self.device)
        out = [torch.empty_like(mine) for _ in range(n)]
        from torch.distributed.distributed_c10d import AllgatherOptions

        try:
            self.pg.allgather([out], [mine], AllgatherOptions()).wait()
        except Exception as err:  # as in reduce: reported, the round will not commit
            self._collective_failed(err)
            return None
        return [int(t.item()) for t in out]  # (in the group's order)
