"""A stub that tritonserver gave up on while its model loaded leaves, so that the load fails instead of hanging.

Tritonserver 2.51's Python backend waits for a model's ``initialize`` answer in windows of one second, and in each it
expects the stub's health thread (a C++ thread that marks the stub healthy every 300 ms) to have run. A stub that does
not for one window (its process not scheduled for ~0.7 s on a loaded machine: the two-core CI under two test servers
loading at once) is declared "not healthy"; the backend then waits for the stub process to exit (``waitpid``, no kill)
before it reports the error. But the stub is well: it finishes ``initialize``, answers, and waits for the next command
for good. So tritonserver never finishes loading, never reports, never serves (measured 2026-12-06: gdb shows the
loading thread in ``StubLauncher::WaitForStubProcess`` -> ``wait4(<the stub's pid>)``; a stub stopped with SIGSTOP for
2.5 s in its ``initialize`` hangs tritonserver so every time, ``tests/e2e/test_load_watch.py``; python_backend's
later releases give the window 5 s, the wait unchanged).

``LoadWatch``: from before ``initialize`` runs until ``AFTER_SECONDS`` after it returned (or ``finalize`` began), a
thread looks every ``PERIOD_SECONDS`` at the parent's threads (``/proc/<parent>/task/*/syscall``); one blocked in
``wait4`` on this process means the parent gave up on it: the watch says so in the server's log and ends the stub
(``_exit``), so the parent's wait returns and tritonserver reports Triton's own error ("Stub process '<instance>' is
not healthy.") and fails the load, as it would have. Where ``/proc`` does not show the parent's system calls (another
architecture, no ptrace access to the parent) the watch stops at once and says so.
``backend.triton.counter_batch.after_load`` runs every model's ``initialize`` under one;
``backend.deploy.local_server.TritonServer`` starts a server whose load failed so again.
"""
from __future__ import annotations

import os
import platform
import sys
import threading
import time
from pathlib import Path

from backend.deploy.stacks import STUB_GAVE_UP

WAIT4 = {"x86_64": 61, "aarch64": 260}  # the wait4 system call's number, by machine
PERIOD_SECONDS = 0.25
AFTER_SECONDS = 10.0  # after initialize returned: the parent reads the answer within its one-second window


def parent_waits_for(pid: int, parent: int) -> bool | None:
    """Whether a thread of process ``parent`` is blocked in ``wait4`` on ``pid``; None where this cannot be told
    (an unknown machine, the parent's ``/proc`` not readable)."""
    number = WAIT4.get(platform.machine())
    if number is None:
        return None
    wanted = f"{number} {pid:#x} "
    try:
        tasks = list(Path(f"/proc/{parent}/task").iterdir())
    except OSError:
        return None
    readable = False
    for task in tasks:
        try:
            line = (task / "syscall").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        except OSError:  # no ptrace access to the parent: its system calls cannot be read
            continue
        readable = True
        if line.startswith(wanted):
            return True
    return False if readable else None


class LoadWatch:
    """One model load's watch (module docstring): ``start`` before ``initialize``, ``initialized`` after it returned,
    ``stop`` when it raised or ``finalize`` begins."""

    def __init__(self, name: str = "", period: float = PERIOD_SECONDS, after: float = AFTER_SECONDS,
                 leave=os._exit):
        self.name = name
        self.period, self.after = period, after
        self.leave = leave  # how the stub ends (tests pass their own)
        self.pid, self.parent = os.getpid(), os.getppid()
        self._until: float | None = None  # monotonic time the watch ends, once initialize returned
        self._done = threading.Event()
        self.gave_up = False
        self._thread = threading.Thread(target=self._run, name="load-watch", daemon=True)

    @classmethod
    def start(cls, name: str = "", **kwargs) -> "LoadWatch":
        watch = cls(name, **kwargs)
        watch._thread.start()
        return watch

    def initialized(self) -> None:
        """``initialize`` returned: the watch ends ``after`` seconds from now."""
        self._until = time.monotonic() + self.after

    def stop(self) -> None:
        """``initialize`` raised (the stub leaves on its own) or ``finalize`` began (the server waits for the stub's
        exit then): the watch ends now."""
        self._done.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._done.wait(self.period):
            if self._until is not None and time.monotonic() >= self._until:
                return
            waits = parent_waits_for(self.pid, self.parent)
            if waits is None:
                print(f"epd: {self.name or 'model'}: load watch off: the system calls of tritonserver (pid "
                      f"{self.parent}) cannot be read here ({platform.machine()})", file=sys.stderr, flush=True)
                return
            if waits:
                self.gave_up = True
                print(f"epd: {self.name or 'model'}: {STUB_GAVE_UP} (tritonserver, pid {self.parent}, waits for "
                      f"stub pid {self.pid} to exit: its health check missed a one-second window); leaving so that it "
                      "reports the failed load instead of waiting for good", file=sys.stderr, flush=True)
                self.leave(1)
                return
