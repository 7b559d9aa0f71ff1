"""The native stacks of a process that would not exit (``py-spy dump --native``): a stub hung in a C destructor shows
no Python frame in its own faulthandler dump ("Garbage-collecting"), so the harness (``backend.deploy.local_server``)
asks py-spy before it kills a straggler, and prints what it says into the test's output and the server's log."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

# The line a stub writes into the server's log when tritonserver gave up on it while its model loaded
# (backend.triton.load_watch): the server then fails its start, and the harness starts it again (TritonServer.start).
STUB_GAVE_UP = "the server gave up on this stub while it loaded"
# tritonserver 2.51 aborting (-6) while the Python backend started two models' stubs at once: a lock on a robust
# mutex in a stub's shared memory failed (ESRCH); seen in CI's Qwen3-VL family server twice on 2026-12-06
# (5d97d28, c25346a; docs/results/ci-time.md). Not understood yet; a second start is what the harness makes of it.
LOCK_ABORT = "boost::interprocess::lock_exception"
LOAD_FAILURES = (STUB_GAVE_UP, LOCK_ABORT)  # a start that failed with one of these in the log is made again


def native_stacks(pid: int, timeout: float = 20.0) -> str:
    """What ``py-spy dump --native`` says of ``pid`` (its threads' Python and C frames); "" without py-spy."""
    exe = Path(sys.executable).with_name("py-spy")
    exe = str(exe) if exe.exists() else shutil.which("py-spy")
    if not exe:
        return ""
    try:
        done = subprocess.run([exe, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy dump --native --pid {pid}: {exc}"
    return f"py-spy dump --native --pid {pid}:\n{done.stdout}{done.stderr}"


def gdb_stacks(pid: int, timeout: float = 60.0, keep: str = "") -> str:
    """The threads' C stacks of ``pid`` as gdb sees them (tritonserver: not a Python process, so not py-spy's), only
    those with a frame containing ``keep`` where given; "" without gdb."""
    exe = shutil.which("gdb")
    if not exe:
        return ""
    try:
        done = subprocess.run([exe, "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"], capture_output=True,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"gdb -p {pid}: {exc}"
    threads, current = [], []
    for line in done.stdout.splitlines():
        if line.startswith("Thread "):
            current = [line]
            threads.append(current)
        elif line.startswith("#") and current:
            current.append(line[:200])
    kept = [t for t in threads if not keep or any(keep in line for line in t[1:])]
    return f"gdb -p {pid}, {len(kept)} of {len(threads)} threads:\n" + "\n".join("\n".join(t) for t in kept) + "\n"


def report_native_stacks(pids, log_path=None, echo: bool = True) -> None:
    """The native stacks of ``pids`` (taken at once), logged and, with ``echo``, printed (a failing test shows them)."""
    from concurrent.futures import ThreadPoolExecutor

    pids = list(pids)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(pids)))) as pool:
        text = "\n".join(pool.map(native_stacks, pids))
    if echo:
        print(text, flush=True)
    if log_path:
        with open(log_path, "a") as log:
            log.write(text)


__all__ = ["gdb_stacks", "native_stacks", "report_native_stacks"]
