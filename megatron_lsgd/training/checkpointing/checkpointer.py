"""save_checkpoint / load_checkpoint for a Trainer: what goes where, and in which order.

Every rank writes its own files into one shared `.iter_XXXXXXX.partial/` directory;
rank 0 then writes metadata.json (the layout, the model config and every file's size),
fsyncs the tree, renames it to `iter_XXXXXXX/` and only then rewrites the tracker. A
crash at any point leaves the previous checkpoint and the tracker pointing at it intact.

Each site's position is kept per site: its iteration, its LR schedule and its consumed
samples (`site_iterations`, `site_schedulers`, `site_consumed_samples`). In a lockstep run
they are equal; a non-lockstep run's sites differ, its checkpoint is named by the job's
agreed progress (`trainer.checkpoint_iteration`, which the training loop names) and `ended`
says its training is over (restored where the loop says so, `loop.resumes_ended`: a
lockstep run's end is a step count instead).

"Rank 0" and every collective here are the torch.distributed world's. Under fault
tolerance each site is a world of its own: it writes a checkpoint of its own (in
<save>/site<k>, arguments.py), committed by its own first rank, and no collective of a
save crosses sites (a dead site cannot stall the others' saves). The rank files then also
keep the torchft committed-round count, so that after a restart of the whole job the
sites that are behind heal from the one that saved last.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_lsgd.core.distributed.data_parallel import unwrap
from megatron_lsgd.core.output_files import WriteError, no_room_hint, remove_path, written_or_removed
from megatron_lsgd.training.checkpointing import layout
from megatron_lsgd.training.checkpointing.atomic import commit_dir, fsync_tree, write_text_atomic
from megatron_lsgd.training.checkpointing.compat import (check_layout, check_model_config, check_site_layouts,
                                                        model_config_dict)
from megatron_lsgd.training.checkpointing.config import CheckpointConfig
from megatron_lsgd.training.checkpointing.errors import CheckpointError
from megatron_lsgd.training.checkpointing.model_io import load_model_state, model_state
from megatron_lsgd.training.checkpointing.parameter_state import load_synchronizer_state, synchronizer_layout
from megatron_lsgd.training.checkpointing.resume_state import BY_PARAMETER
from megatron_lsgd.training.checkpointing.rng import capture_rng_state, restore_rng_state
from megatron_lsgd.training.checkpointing.safe_io import load_file, save_file
from megatron_lsgd.training.data_samplers import build_data_iterator

FORMAT = "megatron_lsgd"
FORMAT_VERSION = 1
# Test hook: the save of this iteration stops right before its commit (rename), after
# announcing itself in <save>/.holding_<iteration>, so a test can kill the job mid-save.
HOLD_ENV = "MEGATRON_LSGD_TEST_HOLD_BEFORE_COMMIT"


def _jsonable(value):
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def _agree(error: Optional[BaseException]) -> None:
    """Collective: raise on every rank if any rank failed, so no rank waits forever in a
    later collective while another has given up (a missing file is seen by one rank only)."""
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{error}")
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"rank {rank}: {message}")


def _rank_relpath(pgs, file_name: str) -> str:
    return os.path.join(layout.mp_rank_dir_name(pgs.tp_rank, pgs.pp_rank, pgs.dims.pp), file_name)


def _check_finite(model) -> None:
    """Never write a model that has diverged: every parameter must be finite."""
    for name, p in unwrap(model).named_parameters():
        if not torch.isfinite(p.detach()).all():
            raise CheckpointError(f"refusing to save a non-finite model: parameter {name} holds NaN or Inf "
                                  f"values (the run diverged); the checkpoints already on disk are kept")


def _save_rank_files(trainer, cfg: CheckpointConfig, partial: str) -> Dict[str, tuple]:
    """This rank's files: relative path -> (size, sha256)."""
    pgs = trainer.pgs
    records: Dict[str, tuple] = {}
    _check_finite(trainer.model)
    os.makedirs(os.path.join(partial, _rank_relpath(pgs, "")), exist_ok=True)
    if pgs.dp_intra_rank == 0:  # replicas inside a site are identical; sites may differ (local SGD)
        rel = _rank_relpath(pgs, layout.model_file_name(pgs.site_rank))
        records[rel] = save_file(model_state(unwrap(trainer.model)), os.path.join(partial, rel), rel)
    rank_state = {"rng": capture_rng_state(trainer.rng_tracker)}
    if not cfg.no_save_optim:
        rank_state["optimizer"] = trainer.optimizer.state_dict()
        rank_state["synchronizer"] = trainer.synchronizer.state_dict()
        membership = getattr(trainer, "membership", None)
        if membership is not None and membership.state_dict():  # elastic sites: the committed rounds
            rank_state["membership"] = membership.state_dict()
        rank_state["synchronizer_layout"] = synchronizer_layout(trainer.synchronizer)  # for convert.py
    rel = _rank_relpath(pgs, layout.rank_file_name(pgs.site_rank, pgs.dp_intra_rank))
    records[rel] = save_file(rank_state, os.path.join(partial, rel), f"{rel} (synchronizer/optimizer/RNG state)")
    return records


def tokenizer_info(tokenizer) -> Dict:
    """What an export needs to know about the run's tokenizer: the true (unpadded)
    vocabulary and the special ids."""
    if tokenizer is None:
        return {}
    return {"vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod),
            "bos": None if tokenizer.bos is None else int(tokenizer.bos)}


def _save_failed(err: BaseException, iteration: int, save_dir: str) -> CheckpointError:
    if isinstance(err, CheckpointError):
        return err
    hint = no_room_hint(err) if isinstance(err, OSError) and not isinstance(err, WriteError) else ""
    return CheckpointError(f"saving the checkpoint of iteration {iteration} to {save_dir} failed: {err}{hint}. "
                           f"The checkpoints already there are intact (the incomplete one was removed)")


def save_checkpoint(trainer, cfg: CheckpointConfig) -> None:
    """Write the checkpoint of the trainer's agreed iteration (its step count if lockstep),
    or raise CheckpointError on every rank (disk full, unwritable directory, a non-finite
    model) leaving earlier checkpoints and the tracker untouched and no partial directory
    behind (also when Ctrl-C or SIGTERM interrupts the save)."""
    partial = os.path.join(cfg.save, layout.partial_dir_name(trainer.checkpoint_iteration))
    try:
        _save(trainer, cfg, partial)
    except KeyboardInterrupt:  # the other ranks are interrupted too: no barrier, rank 0 cleans up
        if dist.get_rank() == 0:
            remove_path(partial)
        raise


def _save(trainer, cfg: CheckpointConfig, partial: str) -> None:
    pgs = trainer.pgs
    iteration = trainer.checkpoint_iteration  # agreed by every rank (a site's own step count if lockstep)
    final = os.path.join(cfg.save, layout.iteration_dir_name(iteration))
    start = time.perf_counter()
    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(cfg.save, exist_ok=True)
            if os.path.exists(partial):  # left by a save that was killed
                shutil.rmtree(partial)
            os.makedirs(partial)
        except OSError as err:
            error = err
    try:
        _agree(error)
    except (CheckpointError, OSError) as err:
        raise _save_failed(err, iteration, cfg.save) from err

    records: Dict[str, tuple] = {}
    error = None
    try:
        records = _save_rank_files(trainer, cfg, partial)
    except (CheckpointError, OSError) as err:
        error = err
    _agree_or_remove_partial(error, pgs, partial, iteration, cfg.save)

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"files": records, "site": pgs.site_rank,
                                      "position": trainer.position.state_dict(),
                                      "scheduler": None if cfg.no_save_optim else trainer.scheduler.state_dict()})
    error = None
    if dist.get_rank() == 0:
        try:
            _commit(trainer, cfg, partial, final, iteration, gathered, start)
        except (CheckpointError, OSError) as err:
            error = err
    _agree_or_remove_partial(error, pgs, partial, iteration, cfg.save)


def _agree_or_remove_partial(error: Optional[BaseException], pgs, partial: str, iteration: int,
                             save_dir: str) -> None:
    """Every rank learns whether any failed; then the half-written save is removed and every
    rank raises the same error."""
    try:
        _agree(error)
    except (CheckpointError, OSError) as err:
        _remove_partial(pgs, partial)
        raise _save_failed(err, iteration, save_dir) from err


def _remove_partial(pgs, partial: str) -> None:
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()


def _commit(trainer, cfg: CheckpointConfig, partial: str, final: str, iteration: int, gathered, start) -> None:
    """Rank 0: metadata.json, fsync, rename, tracker (in that order)."""
    d = trainer.pgs.dims
    records = {k: v for part in gathered for k, v in part["files"].items()}
    files = {k: size for k, (size, _) in records.items()}
    site_samples, site_iterations, site_schedulers = [0] * d.sites, [0] * d.sites, [None] * d.sites
    for part in gathered:  # each site's own position (the same on every rank of a site)
        site_samples[part["site"]] = part["position"]["site_consumed_samples"]
        site_iterations[part["site"]] = part["position"]["iteration"]
        site_schedulers[part["site"]] = part["scheduler"]
    raw = trainer.config.raw_args
    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "iteration": iteration,
        "consumed_samples": trainer.position.consumed_samples,
        "site_consumed_samples": site_samples,  # each site's position in its own sample stream
        "consumed_valid_samples": trainer.position.consumed_valid_samples,  # the validation stream's
        "site_iterations": site_iterations,  # each site's own steps (differ in non-lockstep runs)
        "site_schedulers": site_schedulers,  # each site's own LR schedule position
        "ended": trainer.position.ended,
        "layout": {"tp": d.tp, "pp": d.pp, "dp_intra": d.dp_intra, "sites": d.sites,
                   **({"site_dp": list(d.site_dp)} if d.heterogeneous else {}),
                   # sites of different layouts: tp and pp are site 0's, each site's files its own
                   **({"site_tp": list(d.site_tp), "site_pp": list(d.site_pp)} if d.mixed_layouts else {})},
        "use_distributed_optimizer": trainer.config.ddp.use_distributed_optimizer,
        "lsgd_algorithm": trainer.config.lsgd.algorithm,
        "has_optimizer": not cfg.no_save_optim, "has_rng": True,
        "scheduler": None if cfg.no_save_optim else trainer.scheduler.state_dict(),
        "model_config": model_config_dict(trainer.config.model),
        "tokenizer": tokenizer_info(getattr(trainer, "tokenizer", None)),
        "args": {k: _jsonable(v) for k, v in vars(raw).items()} if raw is not None else {},
        "files": files,
        "sha256": {k: digest for k, (_, digest) in records.items()},
    }
    meta_path = os.path.join(partial, layout.METADATA)
    with written_or_removed(meta_path):
        with open(meta_path, "w") as f:
            json.dump(metadata, f, indent=1, sort_keys=True)
    fsync_tree(partial)
    if os.environ.get(HOLD_ENV) == str(iteration):
        with open(os.path.join(cfg.save, f".holding_{iteration}"), "w"):
            pass
        while True:
            time.sleep(1.0)
    commit_dir(partial, final)
    write_text_atomic(os.path.join(cfg.save, layout.TRACKER), str(iteration))
    print(f" saved checkpoint at iteration {iteration:8d} to {cfg.save} "
          f"({sum(files.values()) / 2**20:.1f} MB, {time.perf_counter() - start:.2f} s)", flush=True)


def read_metadata(iter_dir: str) -> Dict:
    path = os.path.join(iter_dir, layout.METADATA)
    if not os.path.isdir(iter_dir):
        raise CheckpointError(f"the tracker points to {iter_dir}, which does not exist")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: {iter_dir} is not a complete checkpoint")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable: {err}") from err
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}, "
                              f"expected {FORMAT!r} version {FORMAT_VERSION}")
    return meta


def find_checkpoint(load_dir: str) -> Optional[str]:
    """The iteration directory to load, or None when `load_dir` holds no checkpoint yet
    (a fresh run launched with --load equal to --save). A directory holding iteration
    folders without a tracker is damaged, not empty: that is an error."""
    if not os.path.exists(os.path.join(load_dir, layout.TRACKER)):
        if os.path.isdir(load_dir):
            stray = sorted(n for n in os.listdir(load_dir) if n.startswith("iter_") or n == layout.RELEASE)
            if stray:
                raise CheckpointError(f"{os.path.join(load_dir, layout.TRACKER)} is missing but {load_dir} holds "
                                      f"{', '.join(stray[:5])}: restore the tracker (it names the iteration to "
                                      f"load) or point --load elsewhere")
        return None
    return os.path.join(load_dir, layout.read_tracker(load_dir))


def _dp_words(site_dp, dp_intra: int, sites: int) -> str:
    if site_dp:
        return f"data-parallel sizes {','.join(map(str, site_dp))} on its {sites} sites"
    return f"{dp_intra} data-parallel ranks per site x {sites} sites"


def _check_compatible(meta: Dict, trainer, cfg: CheckpointConfig, source: str) -> bool:
    """Raise on anything that would make the load partial or wrong; return whether each site
    loads its own model, schedule and position (the data-parallel layout matches, or a
    converted checkpoint's sites do and its optimizer state is loaded)."""
    d = trainer.pgs.dims
    saved = meta["layout"]
    check_site_layouts(saved, d, source)
    check_layout(saved, d.tp_of(0), d.pp_of(0), source)  # site 0's: the layout's tp and pp
    check_model_config(meta["model_config"], trainer.config.model, source)
    same_dp = saved["dp_intra"] == d.dp_intra and saved["sites"] == d.sites and \
        list(saved.get("site_dp", [])) == list(d.site_dp)
    if saved.get("site_dp") and meta.get("optimizer_layout") == BY_PARAMETER:
        raise CheckpointError(f"checkpoint {source}: a converted checkpoint of sites with different data-parallel "
                              f"sizes is not supported yet")
    by_parameter = meta.get("optimizer_layout") == BY_PARAMETER
    if cfg.load_optim and not meta["has_optimizer"]:
        raise CheckpointError(f"checkpoint {source} holds no optimizer state (saved with --no-save-optim or "
                              f"converted with --model-only): pass --no-load-optim (and --no-load-rng) or --finetune")
    if cfg.load_rng and not meta["has_rng"]:
        why = " (convert.py does not convert RNG states; dropout draws differ)" if by_parameter else ""
        raise CheckpointError(f"checkpoint {source} holds no RNG state{why}: pass --no-load-rng or --finetune")
    changed = _changed_flags(meta, trainer, ["optimizer"])
    if cfg.load_optim and changed:
        raise CheckpointError(f"checkpoint {source} was saved with {changed[0]}: its optimizer state "
                              f"does not apply; pass --no-load-optim")
    if by_parameter:  # converted: the state is by parameter, any DP_intra loads it; sites stay
        if cfg.load_optim and saved["sites"] != d.sites:
            raise CheckpointError(f"checkpoint {source} holds the optimizer state of {saved['sites']} sites, this "
                                  f"run has --num-sites {d.sites}: each site's state is its own; pass "
                                  f"--no-load-optim to load the model only")
        return cfg.load_optim
    if (cfg.load_optim or cfg.load_rng) and not same_dp:
        raise CheckpointError(
            f"checkpoint {source} was saved with {_dp_words(saved.get('site_dp'), saved['dp_intra'], saved['sites'])}, "
            f"this run has {_dp_words(d.site_dp, d.dp_intra, d.sites)}: optimizer shards and RNG states are "
            f"per rank: convert it for this layout first (tools/checkpoint/convert.py reshards the optimizer "
            f"state), or pass --no-load-optim --no-load-rng (or --finetune) to load the model only")
    if cfg.load_optim and meta["use_distributed_optimizer"] != trainer.config.ddp.use_distributed_optimizer:
        raise CheckpointError(f"checkpoint {source} was saved with use_distributed_optimizer="
                              f"{meta['use_distributed_optimizer']}, this run uses "
                              f"{trainer.config.ddp.use_distributed_optimizer}: pass --no-load-optim")
    if cfg.load_optim and meta["lsgd_algorithm"] != trainer.config.lsgd.algorithm:
        raise CheckpointError(f"checkpoint {source} was saved with --lsgd-algorithm {meta['lsgd_algorithm']}, "
                              f"this run uses {trainer.config.lsgd.algorithm}: its synchronizer state does not "
                              f"apply; pass --no-load-optim")
    return same_dp


def _changed_flags(meta: Dict, trainer, names: List[str]) -> List[str]:
    """'--flag saved, this run has now' for each of `names` whose value the checkpoint recorded
    (its args) and this run changed; a refused resume names the flag that actually differs."""
    saved, raw = meta.get("args") or {}, trainer.config.raw_args
    out = []
    for name in names:
        if raw is not None and name in saved and hasattr(raw, name) and saved[name] != getattr(raw, name):
            flag = "--" + name.replace("_", "-")
            out.append(f"{flag} {saved[name]}, this run has {flag} {getattr(raw, name)}")
    return out


@torch.no_grad()
def refresh_main_params(optimizer) -> None:
    """bf16/fp16 models keep a separate fp32 main copy: re-derive it from the loaded weights
    (the optimizer state, when loaded afterwards, overwrites it with the saved fp32 values)."""
    for bucket, main, _ in optimizer.main_shards:
        shard = bucket.param_shard(optimizer.shard_index)
        if main.data_ptr() != shard.data_ptr():
            main.copy_(shard)


def _load_by_parameter(trainer, iter_dir: str, rel: str, files: Dict, digests: Dict) -> None:
    """A converted checkpoint's optimizer and synchronizer state: this rank takes its pieces."""
    record = load_file(os.path.join(iter_dir, rel), files.get(rel), digests.get(rel))
    try:
        trainer.optimizer.load_parameter_state(record)
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"optimizer state in {os.path.join(iter_dir, rel)} does not fit this run: "
                              f"{err}") from err
    try:
        load_synchronizer_state(trainer.synchronizer, trainer.optimizer, record)
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"synchronizer state in {os.path.join(iter_dir, rel)} does not fit this run: "
                              f"{err}") from err


def load_checkpoint(trainer, cfg: CheckpointConfig) -> bool:
    """Restore `trainer` from cfg.load; False when there is nothing to load yet. Either
    every rank loads completely or every rank raises CheckpointError."""
    loaded, error = False, None
    try:
        loaded = _load_local(trainer, cfg)
    except CheckpointError as err:
        error = err
    _agree(error)
    return loaded


def _same_path(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def _saved_position(meta: Dict, pgs, per_site: bool) -> Dict[str, int]:
    """This rank's Position.state_dict as the checkpoint recorded it: its site's own
    iteration and sample position where the sites' layout matches (per_site), else the
    job's, split as a fresh run would."""
    site_iterations = meta.get("site_iterations") if per_site else None
    site_samples = meta.get("site_consumed_samples")  # absent in checkpoints that predate per-site streams
    consumed = int(meta["consumed_samples"])
    return {"iteration": site_iterations[pgs.site_rank] if site_iterations else meta["iteration"],
            "consumed_samples": consumed,
            "site_consumed_samples": site_samples[pgs.site_rank] if site_samples and per_site
            else pgs.dims.site_part(consumed, pgs.site_rank),
            "consumed_valid_samples": meta.get("consumed_valid_samples", 0)}


def _load_local(trainer, cfg: CheckpointConfig) -> bool:
    if os.path.exists(cfg.load) and not os.path.isdir(cfg.load):
        raise CheckpointError(f"--load {cfg.load} is a file; give the checkpoint directory (the one holding "
                              f"{layout.TRACKER})")
    iter_dir = find_checkpoint(cfg.load)
    if iter_dir is None:
        if not _same_path(cfg.load, cfg.save):  # a typo must not silently start from scratch
            state = "does not exist" if not os.path.exists(cfg.load) else f"holds no checkpoint ({layout.TRACKER})"
            raise CheckpointError(f"--load {cfg.load} {state}. Point --load at a checkpoint directory, or give "
                                  f"the same directory as --save to resume-or-start")
        if dist.get_rank() == 0:
            print(f" no checkpoint in {cfg.load}: starting from scratch", flush=True)
        return False
    meta = read_metadata(iter_dir)
    pgs = trainer.pgs
    per_site = _check_compatible(meta, trainer, cfg, iter_dir)  # each site its own model and position
    by_parameter = meta.get("optimizer_layout") == BY_PARAMETER
    files = meta["files"]
    digests = meta.get("sha256", {}) if cfg.verify_checksums else {}

    site = pgs.site_rank if per_site else 0
    rel = _rank_relpath(pgs, layout.model_file_name(site))
    load_model_state(unwrap(trainer.model), load_file(os.path.join(iter_dir, rel), files.get(rel), digests.get(rel)),
                     os.path.join(iter_dir, rel))
    refresh_main_params(trainer.optimizer)

    rank_state = None
    if (cfg.load_optim and not by_parameter) or cfg.load_rng:
        rel = _rank_relpath(pgs, layout.rank_file_name(pgs.site_rank, pgs.dp_intra_rank))
        rank_state = load_file(os.path.join(iter_dir, rel), files.get(rel), digests.get(rel))
    if cfg.load_optim and by_parameter:
        _load_by_parameter(trainer, iter_dir, _rank_relpath(pgs, layout.optimizer_file_name(pgs.site_rank)), files,
                           digests)
    elif cfg.load_optim:
        try:
            trainer.optimizer.load_state_dict(rank_state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as err:
            changed = _changed_flags(meta, trainer, ["ddp_bucket_size"])
            why = f" (saved with {', '.join(changed)})" if changed else ""
            raise CheckpointError(f"optimizer state in {iter_dir} does not fit this run's parameter shards"
                                  f"{why}: {err}") from err
        try:
            trainer.synchronizer.load_state_dict(rank_state["synchronizer"])
        except ValueError as err:  # a synchronizer's saved state that does not fit this run's flags
            raise CheckpointError(f"synchronizer state in {iter_dir} does not fit this run: {err}") from err
        if "membership" in rank_state and getattr(trainer, "membership", None) is not None:
            trainer.membership.load_state_dict(rank_state["membership"])
    if cfg.load_optim:
        site_schedulers = meta.get("site_schedulers") if per_site else None  # absent in older checkpoints
        try:
            trainer.scheduler.load_state_dict(site_schedulers[pgs.site_rank] if site_schedulers else meta["scheduler"])
        except ValueError as err:
            raise CheckpointError(f"checkpoint {iter_dir}: {err}") from err
    if not cfg.finetune:
        pos = trainer.position
        pos.load_state_dict(_saved_position(meta, pgs, per_site))
        pos.agreed_iteration = int(meta["iteration"])
        if trainer.loop.resumes_ended:  # the loop says whether an ended run stays ended
            pos.ended = bool(meta.get("ended", False))
        if not cfg.load_optim:  # the schedule continues at the loaded position
            trainer.scheduler.num_steps = pos.consumed_samples if trainer.scheduler.by_samples else pos.iteration
        t = trainer.config.training
        trainer.train_iterator = build_data_iterator(trainer.train_ds, pos.site_consumed_samples,
                                                     t.micro_batch_size, pgs, trainer.config.data.num_workers)
        trainer.valid_iterator = build_data_iterator(trainer.valid_ds,
                                                     pgs.dims.site_part(pos.consumed_valid_samples, pgs.site_rank),
                                                     t.micro_batch_size, pgs, trainer.config.data.num_workers,
                                                     cyclic=True)
    rng = "no"
    if cfg.load_rng:  # last: building the data iterator above draws from the torch generator
        rng = "yes" if restore_rng_state(rank_state["rng"], trainer.rng_tracker) else \
            f"host streams only: the dropout streams were saved on another kind of device than {trainer.device.type}"
    if dist.get_rank() == 0:
        print(f" loaded checkpoint {iter_dir} (iteration {meta['iteration']}, consumed samples "
              f"{meta['consumed_samples']}; optimizer {'yes' if cfg.load_optim else 'no'}, "
              f"RNG {rng}{', finetune: iteration reset to 0' if cfg.finetune else ''})", flush=True)
    return True
