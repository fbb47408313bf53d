"""The built-in synchronizers and their command line.

Importing this module registers every built-in algorithm (it imports every module of
`algorithms/`). `add_arguments` puts `--lsgd-algorithm`, the shared option groups and one
group per algorithm on a parser (so `--help` shows each algorithm's flags together);
`config_from_args` builds the LsgdConfig and validates it as a whole, with every message
naming its flag.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
from typing import Dict, List, Optional

from megatron_lsgd.core.lsgd import algorithms
from megatron_lsgd.core.lsgd.config import COMPRESSIONS, SHARED_GROUPS, LinkOptions, LsgdConfig, RunFacts
from megatron_lsgd.core.options import OptionGroup, dest_of
from megatron_lsgd.core.lsgd.registry import registered_algorithms, synchronizer_class

__all__ = ["add_arguments", "arguments_it_ignores", "config_from_args", "fault_tolerant_algorithms",
           "registered_algorithms", "synchronizer_class", "validate"]


def _discover() -> None:
    """Import every module of the algorithms package (its subpackages' too), so each
    algorithm registers itself (`@register`): a new one is its module and nothing else here."""
    for module in pkgutil.walk_packages(algorithms.__path__, algorithms.__name__ + "."):
        importlib.import_module(module.name)


_discover()


def refusals(attribute: str, algorithms: Optional[List[str]] = None) -> Dict[str, str]:
    """{algorithm: its reason} for those of `algorithms` (default: every registered one) that
    refuse a shape of sites, by the class attribute `attribute` ("unequal_sites_refusal",
    "mixed_layouts_refusal", "fault_tolerance_refusal"; None: supported)."""
    names = registered_algorithms() if algorithms is None else algorithms
    return {n: getattr(synchronizer_class(n), attribute) for n in names
            if getattr(synchronizer_class(n), attribute) is not None}


def fault_tolerant_algorithms() -> List[str]:
    """The algorithms --lsgd-fault-tolerance torchft can run (no `fault_tolerance_refusal`)."""
    refused = refusals("fault_tolerance_refusal")
    return [n for n in registered_algorithms() if n not in refused]


def _summary(cls: type) -> str:
    doc = (cls.__doc__ or "").strip().splitlines()
    first = doc[0].rstrip(".") if doc else cls.name
    shared = ", ".join(sorted(cls.uses)) or "none"
    return f"{first}. Shared option groups it uses: {shared}."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cross-site synchronization (docs/algorithms/)")
    g.add_argument("--lsgd-algorithm", choices=registered_algorithms(), default="sync",
                   help="how data parallelism crosses sites (sync: average gradients every step)")
    for group in SHARED_GROUPS.values():
        group.add_arguments(parser)
    LinkOptions.add_arguments(parser)
    declared: List[str] = []
    # Options several algorithms inherit without being any algorithm's own (the streaming
    # algorithms' fragments) get a group of their own, named with every algorithm that reads them.
    for base, names in _shared_bases().items():
        base.add_arguments(parser, skip=declared, title=f"{base.title} (--lsgd-algorithm {' or '.join(names)})",
                           description=(base.__doc__ or "").strip() or None)
        declared += base.flags()
    # An algorithm whose Options extend another's (a-edit's extend edit's) comes after it, so
    # the shared flags are shown in the parent's group and the child's group adds its own.
    for name in sorted(registered_algorithms(), key=lambda n: (len(synchronizer_class(n).Options.__mro__), n)):
        cls = synchronizer_class(name)
        cls.Options.add_arguments(parser, skip=declared, title=f"{name} (--lsgd-algorithm {name})",
                                  description=_summary(cls))
        declared += cls.Options.flags()


def _shared_bases() -> Dict[type, List[str]]:
    """Option classes that are no algorithm's own Options but that several inherit -> those algorithms."""
    own = {synchronizer_class(n).Options for n in registered_algorithms()}
    shared: Dict[type, List[str]] = {}
    for name in sorted(registered_algorithms()):
        for base in synchronizer_class(name).Options.__mro__[1:]:
            if issubclass(base, OptionGroup) and base is not OptionGroup and base not in own and base.option_fields():
                shared.setdefault(base, []).append(name)
    return {base: names for base, names in shared.items() if len(names) > 1}


def _owners() -> Dict[str, List[str]]:
    """flag -> the algorithms whose own options declare it."""
    owners: Dict[str, List[str]] = {}
    for name in registered_algorithms():
        for flag in synchronizer_class(name).Options.flags():
            owners.setdefault(flag, []).append(name)
    return owners


def arguments_it_ignores(algorithm: str) -> List[str]:
    """The argparse names of the options only other algorithms declare as their own: a run of
    `algorithm` never reads them, so their values (and a default of theirs that changes) say
    nothing about it."""
    return sorted(dest_of(flag) for flag, owners in _owners().items() if algorithm not in owners)


def config_from_args(args: argparse.Namespace, num_sites: int, run: Optional[RunFacts] = None) -> LsgdConfig:
    cls = synchronizer_class(args.lsgd_algorithm)
    shared = {key: group.from_args(args) for key, group in SHARED_GROUPS.items()}
    config = LsgdConfig(algorithm=cls.name, seed=args.seed, link=LinkOptions.from_args(args),
                        algo=cls.Options.from_args(args), output_dir=output_dir(args), **shared)
    validate(config, num_sites, args, run)
    return config


def output_dir(args: argparse.Namespace):
    """Where a synchronizer may write files of its own (a profile, a schedule): the directory
    of --json-log, else --tensorboard-dir, else --save; None when the run writes nothing."""
    json_log = getattr(args, "json_log", None)
    if json_log:
        return os.path.dirname(os.path.abspath(json_log))
    return getattr(args, "tensorboard_dir", None) or getattr(args, "save", None)


def validate(config: LsgdConfig, num_sites: int, args: argparse.Namespace = None,
             run: Optional[RunFacts] = None) -> None:
    """Check the whole configuration; `args` (the parsed flags) lets flags that belong to
    another algorithm be reported instead of silently ignored; `run` (the one context an
    algorithm's own `validate` gets, None where the lsgd options are checked alone) tells it
    what else the run does: batch, stages, precision, budget, layers."""
    cls = synchronizer_class(config.algorithm)
    if cls.requires_multiple_sites and num_sites < 2:
        raise ValueError(f"--lsgd-algorithm {cls.name} needs --num-sites >= 2 (got {num_sites})")
    for group in (config.rounds, config.outer, config.compression, config.link):
        group.validate()
    if config.compression.enabled and "compression" not in cls.uses:
        takers = [n for n in registered_algorithms() if "compression" in synchronizer_class(n).uses]
        raise ValueError(f"--lsgd-compression {config.compression.kind} is not supported by --lsgd-algorithm "
                         f"{cls.name} (algorithms that compress: {', '.join(takers)})")
    for key in ("rounds", "outer"):  # a shared flag the algorithm never reads would be ignored silently
        changed = getattr(config, key).changed_flags()
        if key not in cls.uses and changed:
            takers = [n for n in registered_algorithms() if key in synchronizer_class(n).uses]
            raise ValueError(f"{changed[0]} has no effect with --lsgd-algorithm {cls.name}; it applies to "
                             f"{', '.join(takers)}")
    if not config.compression.enabled:
        changed = [f for f in config.compression.changed_flags() if f != "--lsgd-compression"]
        if changed:
            raise ValueError(f"{changed[0]} has no effect without --lsgd-compression "
                             f"({', '.join(k for k in COMPRESSIONS if k != 'none')})")
    if args is not None:
        own = set(cls.Options.flags())
        owners = _owners()
        for name in registered_algorithms():
            if name == cls.name:
                continue
            for flag in synchronizer_class(name).Options.from_args(args).changed_flags():
                if flag not in own:
                    raise ValueError(f"{flag} needs --lsgd-algorithm {' or '.join(owners[flag])}")
    config.algo.validate(config=config, num_sites=num_sites, run=run)
