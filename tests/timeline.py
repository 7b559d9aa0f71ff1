"""Which test ran when: a /dev/shm entry found left behind at the end of the session (the session server's check)
is named with the test that ran when it was made."""
from __future__ import annotations

import contextlib
import os
import time

RAN: list[tuple[str, float, float]] = []  # (test, wall-clock start, end)
# A file's mtime comes from the kernel's coarse clock, up to a tick (1-10 ms) behind time.time(): a file made
# just after a test started can carry an mtime a few ms before the recorded start.
MTIME_LAG_SECONDS = 0.02


@contextlib.contextmanager
def ran(test: str):
    started = time.time()
    try:
        yield
    finally:
        RAN.append((test, started, time.time()))


def made_during(path: str) -> str:
    """``path`` with the test that ran when it was made (its mtime: a semaphore is written once, at creation)."""
    try:
        made = os.stat(path).st_mtime
    except OSError:
        return f"{path} (gone)"
    when = time.strftime("%H:%M:%S", time.localtime(made))
    test = next((name for name, start, end in RAN if start - MTIME_LAG_SECONDS <= made <= end),
                "no test (between tests)")
    return f"{path} (made {when}, during {test})"

