"""What a rank does about signals and about its launcher.

- :func:`die_with_launcher`: a rank started by our own launcher dies with it, however the launcher ends
  (``kill -9``, the OOM killer). The launcher starts each rank in a session of its own (so a terminal's
  Ctrl-C reaches only the launcher), which also means nothing else stops the ranks when it dies: on Linux
  ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the kernel to kill the rank when its parent ends, and a watchdog
  thread checks the parent pid every half second as a fallback (other systems, or a parent thread that
  exits). Without this, orphaned ranks trained on, writing and pruning checkpoints under a new run.
- :class:`RankSignals`: SIGTERM (a preemption notice) only sets a flag, which the training loop agrees on
  across ranks at the next step boundary to save and stop together; under a launcher, SIGINT ends the rank
  at once and silently (the launcher prints the one line about it).
- :func:`stopped_by_signals`: in the command's own process, SIGTERM and SIGHUP (a closed terminal) raise
  :class:`Stopped`, so the command ends with one line and 128 + the signal, as Ctrl-C ends it with 130.
- :func:`exit_now`: a process that has done its work (a rank of our own launcher, the command itself) exits
  without the interpreter's teardown of the ~2,500 modules that torch and transformers load: 2-3 s at the
  end of every process of a run, measured on CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import NoReturn

__all__ = [
    "LAUNCHER_PID_ENV",
    "PREEMPTED_STATUS",
    "STOP_SIGNALS",
    "RankSignals",
    "Stopped",
    "die_with_launcher",
    "exit_now",
    "stopped_by_signals",
]

LAUNCHER_PID_ENV = "ULYSSES_SP_LAUNCHER_PID"
PREEMPTED_STATUS = 128 + signal.SIGTERM  # 143: stopped by SIGTERM after saving a checkpoint
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # signals that end the command (Ctrl-C: KeyboardInterrupt)
_PR_SET_PDEATHSIG = 1
_WATCH_INTERVAL_S = 0.5


def _parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent ends (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(_WATCH_INTERVAL_S)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)


def exit_now(status: int) -> NoReturn:
    """End this process with ``status``, its exit handlers run (they flush logging, close trackers' files) and
    its standard streams flushed, without the teardown of its modules. A normal exit instead while another
    non-daemon thread runs (it would be waited for), off the main thread, or where the exit handlers cannot be
    run from here. Only for a process that runs nothing after it: a caller that imported the code keeps
    calling the functions that return a status."""
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython's: what a normal exit runs first
    main = threading.main_thread()
    waited_for = [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
    if run_exit_handlers is None or waited_for or threading.current_thread() is not main:
        raise SystemExit(status)
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def die_with_launcher(environ: Mapping[str, str]) -> bool:
    """When our launcher started this rank (``ULYSSES_SP_LAUNCHER_PID``), make the rank end with it; True then."""
    launcher = environ.get(LAUNCHER_PID_ENV, "")
    if not launcher.isdigit():
        return False
    _parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(launcher):  # the launcher died before the line above: nobody is left to wait for us
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(int(launcher),), name="launcher-watchdog", daemon=True).start()
    return True


class RankSignals:
    """This rank's signal handlers for a run; :meth:`restore` puts the previous ones back.

    ``save_on_sigterm``: SIGTERM sets :attr:`sigterm` (else SIGTERM keeps its default: the process ends).
    ``under_launcher``: SIGINT ends the rank at once with status 130 and no traceback.
    """

    def __init__(self, *, save_on_sigterm: bool, under_launcher: bool) -> None:
        self.sigterm = False
        self._previous: dict[int, object] = {}
        if save_on_sigterm:
            self._install(signal.SIGTERM, self._on_sigterm)
        if under_launcher:
            self._install(signal.SIGINT, self._on_sigint)

    def _install(self, signum: int, handler: object) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous[signum] = signal.signal(signum, handler)  # type: ignore[arg-type]

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.sigterm = True

    @staticmethod
    def _on_sigint(signum: int, frame: FrameType | None) -> None:
        os._exit(130)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()


class Stopped(BaseException):
    """SIGTERM or SIGHUP stopped the command (see :func:`stopped_by_signals`). A BaseException, as
    KeyboardInterrupt is: no ``except Exception`` on its way up turns it into another error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise :class:`Stopped` (on the main thread; elsewhere nothing changes); the
    previous handlers come back on exit. A handler installed inside (:class:`RankSignals`) takes precedence."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, raise_stopped) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
