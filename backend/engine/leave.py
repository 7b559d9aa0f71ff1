"""Leaving a process at once, its exit handlers run and its streams flushed, without the interpreter's teardown (its
last garbage collection, the destructors it runs): a stub after its model's ``finalize``
(``backend.engine.host.bound_the_exit``) and a stopped EngineCore (``backend.engine.patches.patch_quick_exit``).
Imported where it is used before the exit comes: an import at exit runs code (and a collection) the exit skips."""
from __future__ import annotations

import atexit
import os
import sys


def leave_now(code: int = 0, note: str = "", *also) -> None:
    """The process's ``atexit`` handlers, then each of ``also``, ``note`` on stderr, the streams flushed, then
    ``os._exit(code)``."""
    atexit._run_exitfuncs()
    for call in also:
        call()
    if note:
        print(note, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass
    os._exit(code)
