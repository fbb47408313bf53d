"""What every command line of the project shares (pretrain_gpt.py and the tools).

- `ArgumentParser`: a mistyped flag ends in one `error:` line and exit code 2, without
  argparse's usage block first (pretrain_gpt.py's runs to some 140 lines, which push the
  one line that matters off the screen); `--help` still prints everything.
- `HelpFormatter`: each default shown once, and only where there is one.
- `user_errors`: a tool's bad input (ValueError, OSError: missing or unwritable files, a
  full disk) ends the same way, and Ctrl-C ends quietly with exit code 130.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from typing import Iterator, NoReturn

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default once: not when its help already tells it, and not for flags
    whose default is "not given" (None) or "off" (a store_true flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


@contextmanager
def user_errors() -> Iterator[None]:
    try:
        yield
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED) from None
