"""pretrain_gpt.py's command line is frozen: every flag, its aliases, its default, its type,
its choices and its count of values, one line each, in fixtures/cli_surface.txt. A flag added,
removed, renamed or given another default changes what users' launch scripts do, so the change
must be deliberate: when it is, rewrite the file and say so in the commit

    python tests/unit_tests/training/test_cli_surface.py --write

(help texts are not frozen: they are prose, and change freely)."""

import argparse
import difflib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from megatron_lsgd.training.arguments import build_parser  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "cli_surface.txt")


def _name(value) -> str:
    return getattr(value, "__name__", None) or type(value).__name__


def surface(parser: argparse.ArgumentParser) -> str:
    lines = []
    for action in sorted((a for a in parser._actions if a.option_strings), key=lambda a: a.option_strings[0]):
        if isinstance(action, argparse._HelpAction):
            continue
        parts = [" ".join(action.option_strings), f"dest={action.dest}", f"default={action.default!r}"]
        if action.type is not None:
            parts.append(f"type={_name(action.type)}")
        if action.nargs is not None:
            parts.append(f"nargs={action.nargs}")
        if action.choices is not None:
            parts.append(f"choices={list(action.choices)}")
        if action.const is not None and action.nargs == 0:
            parts.append(f"const={action.const!r}")
        if action.required:
            parts.append("required")
        lines.append(" | ".join(parts))
    return "\n".join(lines) + "\n"


def test_the_command_line_is_what_the_fixture_says():
    # in a fresh interpreter: other tests register algorithms of their own in this one's catalog
    now = subprocess.run([sys.executable, os.path.abspath(__file__), "--print"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    frozen = open(FIXTURE).read()
    if now != frozen:
        diff = "".join(difflib.unified_diff(frozen.splitlines(True), now.splitlines(True), "frozen", "now", n=0))
        raise AssertionError("pretrain_gpt.py's flags changed (a user's launch script would behave otherwise). If "
                             "that is deliberate, run `python tests/unit_tests/training/test_cli_surface.py --write` and "
                             f"say so in the commit.\n{diff}")


def test_the_surface_shows_a_changed_default():
    parser = build_parser()
    before = surface(parser)
    next(a for a in parser._actions if "--lr" in a.option_strings).default = 123.0
    assert surface(parser) != before and "default=123.0" in surface(parser)


if __name__ == "__main__":
    if sys.argv[1:] == ["--print"]:
        sys.stdout.write(surface(build_parser()))
        sys.exit(0)
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/unit_tests/training/test_cli_surface.py --write")
    with open(FIXTURE, "w") as f:
        f.write(surface(build_parser()))
    print(f"wrote {FIXTURE}")
