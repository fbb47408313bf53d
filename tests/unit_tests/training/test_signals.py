"""Signals: --exit-signal-handler saves at the next iteration on every rank and exits 0;
Ctrl-C and SIGTERM stop cleanly (no partial save, no stale lock, one line, no traceback per
worker); workers whose torchrun was SIGKILLed notice and stop."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_lsgd.training import inner_step
from megatron_lsgd.training.checkpointing.checkpointer import HOLD_ENV
from megatron_lsgd.training.checkpointing.lock import LOCK_NAME
from megatron_lsgd.training.signals import RunSignals
from tests.unit_tests.checkpointing.launch import TINY, kill, read, start, wait_for
from tools.benchmarks.process_tree import alive, descendants
from tests.unit_tests.checkpointing.single import run_single


def test_exit_signal_handler_saves_at_the_next_iteration_and_exits_0(tmp_path, monkeypatch, capsys):
    save = str(tmp_path / "ckpt")
    real = inner_step.InnerStep.compute_grads

    def sigterm_during_iteration_3(self, *args, **kwargs):
        if self.iteration == 2:  # the third step (0-based)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(inner_step.InnerStep, "compute_grads", sigterm_during_iteration_3)
    code = run_single(["--train-iters", "20", "--save", save, "--exit-signal-handler"], monkeypatch)
    out = capsys.readouterr().out
    assert code == 0
    # noted in step 3, agreed one step late (the vote hides a WAN round trip behind a step)
    assert "exiting at iteration 4 (--exit-signal-handler: SIGTERM on some rank)" in out
    assert "iteration        5/" not in out
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "4"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored after the run


def _workers(proc):
    return [pid for pid in descendants(proc.pid) if "pretrain_gpt.py" in open(f"/proc/{pid}/cmdline").read()]


@pytest.mark.parametrize("inherited", [signal.default_int_handler, signal.SIG_IGN])
def test_an_ignored_sigint_stays_ignored(inherited):
    """A process started ignoring Ctrl-C (a script's background job, the ranks a benchmark
    tool stops itself) keeps ignoring it; SIGTERM is always handled."""
    previous = signal.signal(signal.SIGINT, inherited)
    try:
        signals = RunSignals(exit_signal_handler=False, watch_launcher=False).install()
        try:
            assert (signal.getsignal(signal.SIGINT) is signal.SIG_IGN) == (inherited is signal.SIG_IGN)
            assert signal.getsignal(signal.SIGTERM) == signals._on_signal
        finally:
            signals.restore()
        assert signal.getsignal(signal.SIGINT) is inherited
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_signals_under_torchrun(tmp_path):
    """Three jobs of two ranks: SIGTERM to one rank with --exit-signal-handler; Ctrl-C
    (SIGINT to torchrun) in the middle of a save; SIGKILL to torchrun."""
    base = TINY + ["--train-iters", "100000"]
    # 1. --exit-signal-handler: one rank is told, both stop at the same iteration and save.
    save, log = str(tmp_path / "a"), str(tmp_path / "a.log")
    proc = start(base + ["--save", save, "--exit-signal-handler"], 2, log)
    try:
        wait_for(lambda: "iteration        3/" in read(log), proc, log)
        os.kill(_workers(proc)[1], signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, read(log)[-3000:]
    finally:
        kill(proc)
    text = read(log)
    stopped = [line for line in text.splitlines() if "exiting at iteration" in line]
    assert len(stopped) == 1 and "(--exit-signal-handler: SIGTERM on some rank)" in stopped[0], text[-3000:]
    iteration = stopped[0].split("exiting at iteration ")[1].split()[0]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == iteration
    assert not os.path.exists(os.path.join(save, LOCK_NAME)) and "Traceback" not in text

    # 2. Ctrl-C while rank 0 holds a save before its commit.
    save, log = str(tmp_path / "b"), str(tmp_path / "b.log")
    proc = start(base + ["--save", save, "--save-interval", "2"], 2, log, env={HOLD_ENV: "4"})
    try:
        wait_for(lambda: os.path.exists(os.path.join(save, ".holding_4")), proc, log)
        workers = _workers(proc)
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends torchrun (its workers run in sessions of their own)
        proc.wait(timeout=120)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in workers)
    finally:
        kill(proc)
    text = read(log)
    assert sorted(os.listdir(save)) == [".holding_4", "iter_0000002", "latest_checkpointed_iteration.txt"], text
    # torchrun prints its own traceback (SignalException); no worker prints one
    assert "KeyboardInterrupt" not in text and "megatron_lsgd/" not in text, text[-3000:]
    assert text.count("stopped: SIGINT received") == 1, text[-3000:]

    # 3. torchrun SIGKILLed: its workers notice and stop.
    log = str(tmp_path / "c.log")
    proc = start(base, 2, log)
    try:
        wait_for(lambda: "iteration        3/" in read(log), proc, log)
        workers = _workers(proc)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in workers), read(log)[-3000:]
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        kill(proc)
    text = read(log)
    assert text.count("stopped: the launcher is gone") == 1 and "Traceback" not in text, text[-3000:]
