"""acco/dpu's stream discipline (core/lsgd/algorithms/acco.py, core/streams.py), checked on CPU with a
recording double of the device streams in one spawned rank (one site: the worker still runs
every optimizer step): the worker runs on a stream of its own; before a job reads the
gradients, the worker's stream waits for an event the compute stream recorded after the
intra-site reduce; before the model takes parameters a job wrote, the compute stream waits
for the event that job recorded last; a job counts as finished (adaptive accumulation asks)
only once the worker's stream has run its work. On a GPU the same calls are CUDA events and
streams.
Also: acco/dpu's inter-site backend is gloo (its worker's groups are), and nccl is refused."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from megatron_lsgd.core.lsgd.devices import choose_inter_site_backend, worker_group_backend
from tests.unit_tests.harness import free_port, join_as_rank, spawn

ARGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--log-interval", "1",
        "--eval-iters", "0", "--lsgd-accumulation", "fixed"]
ALGORITHMS = ("dpu", "acco")


def _job(rank, port, out_dir):
    join_as_rank(rank, 1, port)
    import megatron_lsgd.core.clock as clock_module
    import pretrain_gpt
    from megatron_lsgd.core.distributed.data_parallel import DistributedDataParallel
    from megatron_lsgd.core.optimizer.sharded_optimizer import ShardedOptimizer
    from megatron_lsgd.training.inner_step import InnerStep
    from tests.unit_tests.streams_double import RecordingStreams

    streams = RecordingStreams()
    clock_module.streams_for = lambda device: streams  # the run's clock (and acco through it) use the double

    def noted(cls, name, what):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            streams.note(what)
            return original(*args, **kwargs)
        setattr(cls, name, wrapper)

    noted(InnerStep, "reduce_in_site", "reduce")
    noted(DistributedDataParallel, "grad_shards", "read grads")
    noted(ShardedOptimizer, "copy_main_to_model_params", "load")
    noted(clock_module.Job, "finish", "finished")
    logs = {}
    for algo in ALGORITHMS:
        streams.log.clear()
        pretrain_gpt.main(ARGS + ["--lsgd-algorithm", algo])
        logs[algo] = list(streams.log)
    with open(os.path.join(out_dir, "log.json"), "w") as f:
        json.dump(logs, f)


def check_stream_discipline(log, worker: str) -> int:
    """The three rules of the module docstring on one run's log; returns the jobs seen."""
    main = [(what, arg) for thread, what, arg in log if thread == "MainThread"]
    work = [(what, arg) for thread, what, arg in log if thread == worker]
    assert work[:2] and work[0][0] == "side_stream" and work[1] == ("enter", work[0][1]), \
        "the worker does not run on a stream of its own"
    made_by_main = {arg for what, arg in main if what == "record"}
    # each job: the worker waits for the compute stream's hand-over before reading gradients
    jobs, done_of = 0, {}
    waiting_for, synchronized = None, False
    for what, arg in work[2:]:
        if what == "wait":
            waiting_for = arg
        elif what == "read grads":
            assert waiting_for in made_by_main, "a job read the gradients before waiting for the compute stream"
        elif what == "record":
            assert waiting_for is not None, "a job recorded its end without having waited for its hand-over"
            done_of[waiting_for] = arg
            jobs += 1
            waiting_for = None
            synchronized = False
        elif what == "synchronize":
            synchronized = True
        elif what == "finished":
            # adaptive accumulation reads a job's end: it must be its device work's, not the host's
            assert synchronized, "a job was marked finished before its stream had run its work"
    # the hand-over event is recorded after the reduce that wrote the gradients
    kinds = [(what, arg) for what, arg in main if what in ("reduce", "load", "record", "wait")]
    for i, (what, arg) in enumerate(kinds):
        if what == "record":
            assert i > 0 and kinds[i - 1][0] == "reduce", "the hand-over was recorded before the intra-site reduce"
    # the model takes new parameters only after the compute stream waited for the last job's end
    handed, waited = None, set()
    for what, arg in kinds:
        if what == "record":
            handed = arg
        elif what == "wait":
            waited.add(arg)
        elif what == "load" and handed is not None:
            assert done_of.get(handed) in waited, "the model took parameters before waiting for the job's end"
    return jobs


@pytest.mark.slow
def test_the_worker_waits_for_compute_and_compute_for_the_worker():
    with tempfile.TemporaryDirectory() as d:
        spawn(_job, args=(free_port(), d), nprocs=1, timeout=600)
        with open(os.path.join(d, "log.json")) as f:
            logs = json.load(f)
    assert check_stream_discipline(logs["dpu"], "lsgd-dpu") == 3  # one job per step
    assert check_stream_discipline(logs["acco"], "lsgd-acco") == 6  # two per step


def test_acco_and_dpu_communicate_on_gloo_groups_on_gpus():
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert choose_inter_site_backend(None, gpu, "acco", threaded=True) == "gloo"
    assert choose_inter_site_backend(None, gpu, "sync", threaded=False) == "nccl"
    assert choose_inter_site_backend("gloo", gpu, "dpu", threaded=True) == "gloo"
    with pytest.raises(ValueError, match=r"^--inter-site-backend nccl: --lsgd-algorithm dpu communicates from a "
                                         r"worker thread"):
        choose_inter_site_backend("nccl", gpu, "dpu", threaded=True)
    assert worker_group_backend(gpu) == "gloo" and worker_group_backend(cpu) is None
    from megatron_lsgd.core.lsgd.catalog import synchronizer_class
    assert {n for n in ("sync", "diloco", "acco", "dpu", "streaming-diloco", "edit")
            if synchronizer_class(n).communicates_from_a_thread} == {"acco", "dpu"}
