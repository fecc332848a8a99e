"""Stopping on SIGTERM / SIGINT without losing work (a cluster's preemption, Ctrl-C).

Training: `StopRequest` turns the first signal into a flag that the loop reads after each step,
so the step finishes, a checkpoint is written and the process exits with `exit_code(signal)`
(128 + the signal number: 143 for SIGTERM, 130 for SIGINT, what a shell reports for a process the
signal ended, so job scripts treat it alike). The handler does nothing else: Python runs it between
two bytecodes of the main thread, where printing or saving could re-enter half-done work.
A second signal restores the default action and re-sends itself: the process ends at once.
Launchers forward the signal they receive (torchrun to every worker, a terminal's Ctrl-C reaches
the whole process group, Slurm signals every task), so a worker often gets the same request twice
within milliseconds: a repeat within `ECHO_S` seconds of the first is taken for that echo.

Evaluation: `interrupt_on_signals()` makes both signals raise `Interrupted`, so eval.py unwinds
(no file is left half-written: see fsutil) and prints one line.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT)
ECHO_S = 1.0


def exit_code(signum: int) -> int:
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequest:
    """While installed (`with StopRequest(): ...`), `signum` is 0 until SIGTERM or SIGINT arrives,
    then that signal's number."""

    def __init__(self, announce: bool = True):
        self.announce = announce
        self.signum = 0
        self._first = 0.0
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signal.signal's condition
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first = signum, now
            if self.announce:  # os.write: a print here could re-enter a print the signal interrupted
                os.write(2, f"received {signal_name(signum)}: finishing this step, then writing a "
                            f"checkpoint (send it again to stop at once)\n".encode())
        elif now - self._first >= ECHO_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived; like KeyboardInterrupt, not an Exception, so nothing swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


@contextmanager
def interrupt_on_signals():
    """Raise Interrupted on the first SIGTERM or SIGINT; a second one acts as if unhandled."""
    def handle(signum, frame):
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        raise Interrupted(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
