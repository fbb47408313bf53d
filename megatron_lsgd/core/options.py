"""Typed option groups: a dataclass whose fields carry their command-line flag.

Each group (a core config such as the model's or the optimizer's, a shared lsgd piece such as
the outer optimizer, or one algorithm's own knobs) declares its fields once, with `option(...)`; the same declaration gives the argparse
group (`add_arguments`), the typed object (`from_args`) and the list of flags a user set
to something other than the default (`changed_flags`, for "this flag needs another
algorithm" errors). Validation is each group's own `validate()`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Dict, List, Optional, Sequence


def finite_float(text: str) -> float:
    """argparse type for every float flag: `nan` and `inf` parse as floats but are never a
    setting (a nan latency, an inf interval), so they are refused, naming the flag."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


class AS_GIVEN:  # noqa: N801 (a marker, used as a type)
    """`option(type=AS_GIVEN)`: the flag's text as argparse gives it, with no conversion (a
    choice among strings, as core flags have always been declared)."""


def option(flag: str, default: Any, help: Optional[str] = None, *, choices: Optional[Sequence] = None,
           metavar: Optional[str] = None, type: Optional[type] = None, required: bool = False,
           nargs: Optional[str] = None, negates: bool = False) -> Any:
    """A dataclass field bound to `flag`. Booleans become store_true flags (`negates`: the flag
    turns off a field that defaults to True, as --disable-bias-linear does add_bias_linear);
    a list default is copied for each object (`nargs` then says how many values the flag
    takes). A `required` flag must be given on the command line; its `default` serves objects
    built in code."""
    meta = {"flag": flag, "help": help, "choices": tuple(choices) if choices else None, "metavar": metavar,
            "type": type, "required": required, "nargs": nargs, "negates": negates}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def dest_of(flag: str) -> str:
    """A flag's argparse name (--lsgd-edit-clip -> lsgd_edit_clip)."""
    return flag.lstrip("-").replace("-", "_")


def _default_of(f) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


@dataclass
class OptionGroup:
    """Base for option dataclasses. Subclasses set `title` and may override `validate`."""

    title: ClassVar[str] = "options"
    description: ClassVar[Optional[str]] = None

    @classmethod
    def option_fields(cls):
        return [f for f in fields(cls) if "flag" in f.metadata]

    @classmethod
    def flags(cls) -> List[str]:
        return [f.metadata["flag"] for f in cls.option_fields()]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, skip: Sequence[str] = (), title: Optional[str] = None,
                      description: Optional[str] = None):
        """Add one argparse group holding every flag of this class (except `skip`: flags an
        earlier group already declared, e.g. a subclass sharing its parent's flags); returns it."""
        group = parser.add_argument_group(title or cls.title, description or cls.description)
        for f in cls.option_fields():
            m = f.metadata
            if m["flag"] in skip:
                continue
            default = _default_of(f)
            if isinstance(default, bool) and m["type"] is None:
                if default and not m.get("negates"):  # a store_true flag could never give it False
                    raise TypeError(f"{cls.__name__}.{f.name}: a flag for a field that defaults to True must "
                                    f"negate it (option(..., negates=True))")
                group.add_argument(m["flag"], action="store_true", help=m["help"])
                continue
            extra = {"required": True} if m.get("required") else {}
            if m.get("nargs") is not None:
                extra["nargs"] = m["nargs"]
            if isinstance(default, list) or m["type"] is AS_GIVEN:  # values as given, unless a type is declared
                kind = None if m["type"] is AS_GIVEN else m["type"]
            else:
                kind = m["type"] or (type(default) if default is not None else str)
            kind = finite_float if kind is float else kind
            group.add_argument(m["flag"], type=kind, default=None if m.get("required") else default,
                               choices=m["choices"], metavar=m["metavar"], help=m["help"], **extra)
        return group

    @classmethod
    def from_args(cls, args: argparse.Namespace, **others):
        """The group from the parsed flags; `others`: its fields that other flags set (a
        config's copy of --seq-length, say)."""
        values: Dict[str, Any] = {}
        for f in cls.option_fields():
            dest = dest_of(f.metadata["flag"])
            if f.metadata.get("negates"):
                values[f.name] = not getattr(args, dest, False)
            else:
                values[f.name] = getattr(args, dest, _default_of(f))
        return cls(**{**values, **others})

    def changed_flags(self) -> List[str]:
        """Flags whose value differs from the declared default."""
        out = []
        for f in self.option_fields():
            if getattr(self, f.name) != _default_of(f):
                out.append(f.metadata["flag"])
        return out

    def validate(self, **context) -> None:
        """Raise ValueError naming the flag; `context` carries what a group may need
        (num_sites, the shared options as `config`, the parsed command line as `args` —
        None when validated without one —, `run` (RunFacts), the model's `num_layers` when
        known)."""


@dataclass
class NoOptions(OptionGroup):
    """An algorithm with no knobs of its own."""
