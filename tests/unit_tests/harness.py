"""Run pretrain_gpt.py in N spawned CPU/gloo processes and collect what each rank saw.

Every rank writes its logged losses and its parameters (global names, TP slices with
their partition metadata) to a temporary directory; `merge_full_params` rebuilds the
single-rank view so any layout can be compared with a single-rank run.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import tempfile
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lsgd.core.tensor_parallel.initialize import merge_tp_slices
from megatron_lsgd.training.initialize import free_port


# Ranks fork from a server that imported torch and the project once per test session: a
# spawned rank otherwise spends ~2 s importing, the suite's largest cost on 2 cores.
# torch._dynamo too: torch.optim's first optimizer imports it (with sympy, about 800
# modules, 2-3 s of CPU), and without it every forked rank paid that again.
multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "pretrain_gpt"])


def _entry(rank: int, fn, env: Dict[str, str], cwd: str, args: tuple) -> None:
    os.environ.clear()  # the caller's environment and directory now, as a spawned rank gets
    os.environ.update(env)  # them, not the server's from when it started
    os.chdir(cwd)
    fn(rank, *args)


def start_spawned(fn, args: tuple = (), nprocs: int = 1) -> mp.ProcessContext:
    """Fork `nprocs` ranks of fn(rank, *args) from the preloaded server and return at once
    (fn must be importable by name, as for spawn); `join_spawned` waits for them."""
    return mp.start_processes(_entry, args=(fn, dict(os.environ), os.getcwd(), tuple(args)), nprocs=nprocs,
                              join=False, start_method="forkserver")


def join_spawned(context: mp.ProcessContext, timeout: Optional[float] = None) -> None:
    """Wait for every rank (a failed rank raises, as in torch.multiprocessing.spawn, the
    others killed); after `timeout` seconds the ranks are killed and TimeoutError raised."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if deadline is not None and time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{len(context.processes)} ranks still running after {timeout:g} s")


def spawn(fn, args: tuple = (), nprocs: int = 1, timeout: Optional[float] = None) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs, join=True)`, with the ranks forked from
    the preloaded server (fn must be importable by name, as for spawn); after `timeout`
    seconds the ranks are killed and TimeoutError raised."""
    join_spawned(start_spawned(fn, args, nprocs), timeout)


def tree_digest(path: str) -> Dict[str, str]:
    """Relative path -> SHA-256 of every file under `path` (or of `path` itself), plus every
    directory, so a test can show that a failed command changed nothing on disk."""
    import hashlib

    if not os.path.exists(path):
        return {}
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {".": hashlib.sha256(f.read()).hexdigest()}
    out = {}
    for dirpath, dirs, files in os.walk(path):
        out[os.path.relpath(dirpath, path) + "/"] = "dir"
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _worker(rank: int, world: int, port: int, argv: List[str], out_dir: str) -> None:
    _worker_many(rank, world, port, [argv], out_dir, None)


def join_as_rank(rank: int, world: int, port: int, **env: str) -> None:
    """The environment torchrun gives a rank of a one-host job, and one compute thread."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    torch.set_num_threads(1)


def _worker_many(rank: int, world: int, port: int, argvs: List[List[str]], out_dir: str,
                 setup_module: Optional[str]) -> None:
    join_as_rank(rank, world, port)
    if setup_module:
        importlib.import_module(setup_module)  # e.g. registers a test-only synchronizer
    import pretrain_gpt

    for i, argv in enumerate(argvs):
        _record(pretrain_gpt.main(argv), os.path.join(out_dir, f"rank{rank}.pt" if len(argvs) == 1
                                                         else f"rank{rank}.run{i}.pt"))
        dist.barrier()
    dist.destroy_process_group()


def _record(result, path: str) -> None:
    model = result.model
    pgs = model.pgs
    params = {}
    for name, p in model.global_named_parameters():
        params[name] = {"value": p.detach().float().clone(), "tp": bool(getattr(p, "tensor_model_parallel", False)),
                        "dim": getattr(p, "partition_dim", 0), "stride": getattr(p, "partition_stride", 1)}
    anchors = getattr(getattr(result.synchronizer, "outer", None), "anchors", None)
    torch.save({"anchors": [a.clone() for a in anchors] if anchors else None, "losses": result.logged_losses,
                "valid": result.validation_losses, "params": params, "skipped": result.skipped_iterations,
                "coords": pgs.coords, "tp": pgs.dims.tp, "comm": result.comm, "sync_stats": result.sync_stats,
                "traffic": result.traffic, "compile": result.compile_counts, "clock_seconds": result.clock_seconds, "consumed": (result.consumed_samples, result.site_consumed_samples)},
               path)


def run_distributed(argv: List[str], world: int) -> List[dict]:
    """Spawn `world` ranks running pretrain_gpt.main(argv); return every rank's record."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_worker, args=(world, free_port(), argv, out_dir), nprocs=world)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def run_distributed_many(argvs: List[List[str]], world: int, setup_module: Optional[str] = None
                         ) -> List[List[dict]]:
    """Several runs back to back in the same `world` spawned ranks (one process start-up);
    `setup_module` is imported in every rank first. One list of records per argv."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_worker_many, args=(world, free_port(), argvs, out_dir, setup_module), nprocs=world)
        return [[torch.load(os.path.join(out_dir, f"rank{r}.run{i}.pt" if len(argvs) > 1 else f"rank{r}.pt"),
                            weights_only=False) for r in range(world)] for i in range(len(argvs))]


def logged_losses(records: List[dict]) -> List[float]:
    return records[-1]["losses"]  # the last rank logs


def merge_full_params(records: List[dict], site: int = 0, dp_intra: int = 0) -> Dict[str, torch.Tensor]:
    """Full single-rank parameters from one replica (site, dp_intra) of a run."""
    by_name: Dict[str, dict] = {}
    for rec in records:
        c = rec["coords"]
        if c.site != site or c.dp_intra != dp_intra:
            continue
        for name, info in rec["params"].items():
            by_name.setdefault(name, {"info": info, "slices": {}})["slices"].setdefault(c.tp, info["value"])
    full = {}
    for name, entry in by_name.items():
        info, slices = entry["info"], entry["slices"]
        ordered = [slices[t] for t in sorted(slices)]
        full[name] = merge_tp_slices(ordered, info["dim"], info["stride"]) if info["tp"] and len(ordered) > 1 \
            else ordered[0]
    return full


def assert_replicas_identical(records: List[dict]) -> None:
    """Every replica (site, dp_intra) holds bit-identical parameters."""
    ref = merge_full_params(records)
    for site, dpi in {(r["coords"].site, r["coords"].dp_intra) for r in records}:
        other = merge_full_params(records, site=site, dp_intra=dpi)
        for name in ref:
            assert torch.equal(other[name], ref[name]), f"replica (site {site}, dp {dpi}) differs in {name}"


def assert_resumed_per_site(whole: List[dict], paused: List[dict], resumed: List[dict], at: int) -> None:
    """A run paused at iteration `at` and resumed from its checkpoint reproduces the
    uninterrupted run bit for bit: its losses and every site's model."""
    assert logged_losses(paused) == logged_losses(whole)[:at]
    assert logged_losses(resumed) == logged_losses(whole)[at:]
    for site in {r["coords"].site for r in whole}:
        got, want = merge_full_params(resumed, site=site), merge_full_params(whole, site=site)
        assert all(torch.equal(got[n], want[n]) for n in want), f"site {site} resumed differently"


def convert_lsgd(src: str, dst: str, tp: int, pp: int = 1) -> str:
    """tools/checkpoint/convert.py lsgd -> lsgd with the optimizer state, to TP `tp` x PP `pp`;
    returns `dst`."""
    from tools.checkpoint.convert import main as convert

    assert convert(["--model-type", "GPT", "--loader", "lsgd", "--saver", "lsgd", "--load-dir", src, "--save-dir",
                    dst, "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)]) == 0
    return dst


def by_parameter_state(ckpt: str) -> list:
    """Every site's (model, optimizer and synchronizer tensors, values) as convert.py reads
    them (resume_state.py), full tensors by name, copied out of the files."""
    from megatron_lsgd.training.checkpointing.checkpointer import find_checkpoint, read_metadata
    from megatron_lsgd.training.checkpointing.resume_state import CheckpointFiles, read_resume_state

    iter_dir = find_checkpoint(ckpt)
    src = CheckpointFiles(iter_dir, read_metadata(iter_dir))
    sites = [({n: site.params[n].clone() for n in site.params},
              {k: {n: by_name[n].clone() for n in by_name} for k, by_name in site.tensors.items()}, site.values)
             for site in read_resume_state(src).sites]
    src.files.release()
    return sites


def assert_same_by_parameter_state(got: list, want: list, what: str) -> None:
    """Two by_parameter_state results hold the same values, bit for bit, site by site."""
    from megatron_lsgd.training.checkpointing.parameter_state import _first_difference

    assert len(got) == len(want)
    for site, ((params, tensors, values), (params_w, tensors_w, values_w)) in enumerate(zip(got, want)):
        # by name: the order a layout lists names in is its own
        assert sorted(params) == sorted(params_w), (what, site)
        assert all(torch.equal(params[n], params_w[n]) for n in params), (what, site)
        assert sorted(tensors) == sorted(tensors_w), (what, site)
        for key, by_name in tensors_w.items():
            assert sorted(tensors[key]) == sorted(by_name), (what, site, key)
            for name, value in by_name.items():
                assert torch.equal(tensors[key][name], value), (what, site, key, name)
        assert _first_difference(values, values_w) is None, (what, site, _first_difference(values, values_w))


@contextlib.contextmanager
def no_room_for_files(limit_bytes: int = 0):
    """While inside, no regular file of this process may grow past `limit_bytes`: a write
    beyond it fails in the kernel with OSError EFBIG, as a full disk fails with ENOSPC
    (RLIMIT_FSIZE; Python ignores the SIGXFSZ that would otherwise kill the process). Pipes
    and in-memory captures are not files, so the test's own output still flows."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
