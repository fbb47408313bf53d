"""pretrain_gpt.py for a site whose failure or return a test times (tests of elastic sites):
- $LSGD_TEST_DIE_AFTER_QUORUM=N: the rank SIGKILLs itself right after its quorum number N
  (from 1, in this process), before that round's reduction, so the peers of that quorum
  lose the round whatever the timing (a site killed from outside may die between rounds);
- $LSGD_TEST_DIE_AT_UNIT=N:K (edit): the rank SIGKILLs itself in its sync number N (from 1)
  just before unit K's mean is applied, its units 0..K-1 synced: the peers lose that round
  in the middle of its forward pass, after outer steps on those units;
- $LSGD_TEST_DIE_AT_AVERAGE=N (dreamddp): the rank SIGKILLs itself just before its N-th unit
  average (from 1, in this process, as its backward launches them): the peers lose that
  round in the middle of its steps, after the averages before it landed on every site;
- $LSGD_TEST_DIE_AT_GATHER=N: the rank SIGKILLs itself as it enters its N-th cross-site
  all-gather (edit's norm gather, uncompressed: sync number N), after the site's own sums;
- $LSGD_TEST_DIE_AT_STEP=N: the rank SIGKILLs itself as its step N (from 1) starts, between
  two rounds when no round is at that step (a-edit mid-interval): the peers lose no round,
  their next quorum leaves the site out;
- $LSGD_TEST_DIE_RANKS=R[,R...]: only these ranks of the site die so (default: all), so that
  a peer site's ranks see the loss in different collectives;
- $LSGD_TEST_HOLD_UNTIL=PATH: the site starts (imports, model, optimizer) but builds its
  torchft manager only once PATH exists, so a test can bring a restarted site back at a
  chosen moment without waiting for a process to start;
- $LSGD_TEST_READY_FILE=PATH: the site writes PATH once its torchft manager is built (a
  test then starts its peers, which meet it at their first quorum);
- $LSGD_TEST_HOLD_CLOSING_UNTIL=PATH: at the job's end the site writes PATH.reached and
  takes its closing quorum only once PATH exists (a test brings a late site in first).
Run as a script under torchrun, or as launch.Job's entry (main(argv) in a forked rank)."""

import os
import signal
import sys
import time

from megatron_lsgd.core.lsgd.fault_tolerance.torchft_membership import TorchftMembership


def main(argv=None) -> None:
    die_after = int(os.environ.get("LSGD_TEST_DIE_AFTER_QUORUM", "0"))
    hold = os.environ.get("LSGD_TEST_HOLD_UNTIL", "")
    hold_closing = os.environ.get("LSGD_TEST_HOLD_CLOSING_UNTIL", "")
    ready = os.environ.get("LSGD_TEST_READY_FILE", "")
    dying = os.environ.get("LSGD_TEST_DIE_RANKS", "")
    if dying and os.environ.get("RANK", "0") not in dying.split(","):
        die_after, die_at_unit, die_at_gather, die_at_step, die_at_average = 0, "", 0, 0, 0
    else:
        die_at_unit = os.environ.get("LSGD_TEST_DIE_AT_UNIT", "")
        die_at_gather = int(os.environ.get("LSGD_TEST_DIE_AT_GATHER", "0"))
        die_at_step = int(os.environ.get("LSGD_TEST_DIE_AT_STEP", "0"))
        die_at_average = int(os.environ.get("LSGD_TEST_DIE_AT_AVERAGE", "0"))
    if die_at_step:
        from megatron_lsgd.training.training import Trainer

        step = Trainer.step

        def dying_step(self, run):
            if self.position.iteration + 1 == die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            return step(self, run)

        Trainer.step = dying_step
    if die_at_average:
        from megatron_lsgd.core.lsgd.algorithms.dreamddp.round import RoundUndo

        averages, keep = [0], RoundUndo.keep  # (called once per unit average, just before it is sent)

        def dying_keep(self, *args, **kwargs) -> None:
            averages[0] += 1
            if averages[0] == die_at_average:
                os.kill(os.getpid(), signal.SIGKILL)
            keep(self, *args, **kwargs)

        RoundUndo.keep = dying_keep
    if die_at_gather:
        from megatron_lsgd.core.lsgd.fault_tolerance.elastic_comm import ElasticComm

        gathers, gather = [0], ElasticComm.all_gather

        def dying_gather(self, *args, **kwargs):
            gathers[0] += 1
            if gathers[0] == die_at_gather:
                os.kill(os.getpid(), signal.SIGKILL)
            return gather(self, *args, **kwargs)

        ElasticComm.all_gather = dying_gather
    if die_after:
        taken = [0]
        quorum = TorchftMembership.round_started

        def round_started(self):
            heal = quorum(self)
            taken[0] += 1
            if taken[0] == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            return heal

        TorchftMembership.round_started = round_started
    if die_at_unit:
        from megatron_lsgd.core.lsgd.algorithms.edit.edit import EDiT

        sync, unit = (int(x) for x in die_at_unit.split(":"))
        apply = EDiT._apply

        def dying_apply(self, j: int) -> None:
            if self.syncs == sync and j == unit:
                os.kill(os.getpid(), signal.SIGKILL)
            apply(self, j)

        EDiT._apply = dying_apply
    if hold or ready:
        build = TorchftMembership.__init__

        def held(self, *args, **kwargs) -> None:
            while hold and not os.path.exists(hold):
                time.sleep(0.05)
            build(self, *args, **kwargs)
            if ready:
                open(ready, "w").close()

        TorchftMembership.__init__ = held
    if hold_closing:
        closing = TorchftMembership.job_finished

        def held_closing(self) -> None:
            open(hold_closing + ".reached", "w").close()
            while not os.path.exists(hold_closing):
                time.sleep(0.05)
            closing(self)

        TorchftMembership.job_finished = held_closing
    import pretrain_gpt

    pretrain_gpt.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
