"""Typed option groups (core/options.py): a flag declared once on a dataclass field gives
the argparse flag, the typed object and the changed flags; the core configs are declared so
(arguments.py reads them with from_args)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar, List, Optional

import pytest

from megatron_lsgd.core.options import AS_GIVEN, OptionGroup, option


@dataclass
class Toy(OptionGroup):
    title: ClassVar[str] = "toy"

    width: int = option("--width", 8, type=int, required=True, help="must be given")
    paths: List[str] = option("--paths", [], nargs="*")
    kind: str = option("--kind", "a", type=AS_GIVEN, choices=["a", "b"])
    bias: bool = option("--no-bias", True, negates=True)
    fast: bool = option("--fast", False)
    rate: Optional[float] = option("--rate", None, type=float)
    derived: int = 0  # no flag: set by whoever builds the group


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    Toy.add_arguments(p)
    return p


def test_a_group_reads_its_flags_and_takes_the_rest_from_the_caller():
    toy = Toy.from_args(_parser().parse_args(["--width", "3", "--paths", "x", "y", "--kind", "b", "--no-bias",
                                              "--rate", "0.5"]), derived=7)
    assert (toy.width, toy.paths, toy.kind, toy.bias, toy.fast, toy.rate, toy.derived) == (3, ["x", "y"], "b", False,
                                                                                          False, 0.5, 7)
    assert toy.changed_flags() == ["--width", "--paths", "--kind", "--no-bias", "--rate"]
    plain = Toy.from_args(_parser().parse_args(["--width", "8"]))
    assert plain.bias is True and plain.paths == [] and plain.changed_flags() == []


def test_declarations_reach_argparse():
    actions = {a.option_strings[0]: a for a in _parser()._actions if a.option_strings}
    assert actions["--width"].required and actions["--width"].default is None
    assert actions["--paths"].nargs == "*" and actions["--paths"].type is None
    assert actions["--kind"].type is None and list(actions["--kind"].choices) == ["a", "b"]
    assert actions["--no-bias"].default is False and actions["--no-bias"].const is True
    with pytest.raises(SystemExit):
        _parser().parse_args([])  # --width is required
    assert Toy().paths == [] and Toy().paths is not Toy().paths  # a list default is each object's own


def test_a_flag_that_could_never_turn_its_field_off_is_refused():
    @dataclass
    class Wrong(OptionGroup):
        on: bool = option("--on", True)

    with pytest.raises(TypeError, match="negate"):
        Wrong.add_arguments(argparse.ArgumentParser())
