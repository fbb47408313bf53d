"""How a run stops when it is told to: SIGTERM, Ctrl-C, or its launcher gone.

- `--exit-signal-handler` (Megatron's flag): SIGTERM, what a cluster scheduler sends before
  a job's time limit, is noted instead of obeyed at once. Every rank learns of it at the
  same iteration (termination.py's one-step-late vote), the run saves a checkpoint there
  and exits 0.
- Otherwise SIGTERM, like Ctrl-C, raises `Interrupted` (a KeyboardInterrupt) once, so the
  cleanup runs: a save in progress removes its partial directory, the --save lock is
  released, and the job prints one line instead of a traceback per worker. A second
  signal during that cleanup is ignored (torchrun follows Ctrl-C with a SIGTERM).
- A process started with SIGINT ignored keeps ignoring it, as Python itself does: a script's
  background job, or the ranks of a benchmark tool, which its parent stops all at once
  (tools/benchmarks/spawned_ranks.py).
- Under torchrun, a worker whose launcher is gone (SIGKILLed, it cannot stop its workers)
  notices within a second and sends itself SIGTERM: it stops as above, or saves and stops
  with --exit-signal-handler, instead of training on with nobody to report to.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

LAUNCHER_POLL_S = 1.0


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (not handled by --exit-signal-handler): stop now, cleaning up."""

    def __init__(self, signum: int, launcher_gone: bool = False):
        self.signum = signum
        self.launcher_gone = launcher_gone
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for "ended by signal N"

    def describe(self) -> str:
        return "the launcher is gone (its process was killed)" if self.launcher_gone \
            else f"{signal.Signals(self.signum).name} received"


class RunSignals:
    """Installed by pretrain() for the run (main thread only), restored afterwards."""

    def __init__(self, exit_signal_handler: bool, watch_launcher: bool):
        self.exit_signal_handler = exit_signal_handler
        self.watch_launcher = watch_launcher
        self.noted: Optional[str] = None  # what --exit-signal-handler noted ("SIGTERM"), None before
        self._interrupted = False
        self._launcher_gone = False
        self._previous = {}
        self._stop_watching = threading.Event()

    def install(self) -> "RunSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread: leave the defaults
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signum == signal.SIGINT and signal.getsignal(signum) is signal.SIG_IGN:
                continue  # started ignoring Ctrl-C (a script's background job; ranks their parent stops)
            self._previous[signum] = signal.signal(signum, self._on_signal)
        if self.watch_launcher:
            threading.Thread(target=self._watch_launcher, args=(os.getppid(),), name="launcher-watch",
                             daemon=True).start()
        return self

    def restore(self) -> None:
        self._stop_watching.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGTERM and self.exit_signal_handler:
            self.noted = "launcher gone" if self._launcher_gone else "SIGTERM"
            return
        if self._interrupted:  # already stopping: let the cleanup finish
            return
        self._interrupted = True
        raise Interrupted(signum, launcher_gone=self._launcher_gone)

    def _watch_launcher(self, parent: int) -> None:
        # A dead parent's children are re-parented (to init or a subreaper): the parent pid changes.
        while not self._stop_watching.wait(LAUNCHER_POLL_S):
            if os.getppid() != parent:
                self._launcher_gone = True
                os.kill(os.getpid(), signal.SIGTERM)
                return
