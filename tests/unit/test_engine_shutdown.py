"""``backend.engine.host.stop_engine_processes`` on real processes: an engine process killed while it holds a POSIX
semaphore (as vLLM's EngineCore holds tqdm's) leaves nothing in /dev/shm once its host exits, because
multiprocessing's resource tracker is left to unlink it."""
import os
import subprocess
import sys
import time

from clients.local_server import ROOT

HOST = r'''
import multiprocessing as mp, os, sys, time
import psutil
from backend.engine.host import _engine_process, stop_engine_processes

def semaphores():
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.mp-")}

if __name__ == "__main__":
    before = semaphores()
    ctx = mp.get_context("spawn")  # as vLLM starts its EngineCore
    child = ctx.Process(target=exec, args=("import multiprocessing as mp, time\nlock = mp.get_context('spawn').Lock()\ntime.sleep(120)",))
    child.start()
    deadline = time.monotonic() + 60
    while not (made := semaphores() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    engines = [proc for proc in psutil.Process().children(recursive=True) if _engine_process(proc)]
    assert [proc.pid for proc in engines] == [child.pid], engines  # the tracker is no engine
    stop_engine_processes(engines, timeout=0.1)  # the child does not exit by itself: killed
    assert not psutil.pid_exists(child.pid)
    print(",".join(sorted(made)), flush=True)
'''


def test_a_killed_engine_leaves_no_semaphore_once_its_host_exits():
    proc = subprocess.run([sys.executable, "-c", HOST], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = proc.stdout.strip().split(",")
    assert made and all(name.startswith("sem.mp-") for name in made), proc.stdout
    deadline = time.monotonic() + 10  # the tracker unlinks them when its pipe closes, just after the host exits
    while (left := [name for name in made if os.path.exists(f"/dev/shm/{name}")]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left in /dev/shm: {left}"


def test_a_teardown_that_hangs_after_finalize_is_cut_at_the_bound():
    """``bound_the_exit``: the interpreter's last garbage collection stuck (a finalizer that never returns, as the
    encoder stub's once did in C) ends the process at the bound with every thread's stack in its stderr."""
    code = ("import time\nfrom backend.engine.host import bound_the_exit\n"
            "class Stuck:\n    def __del__(self):\n        time.sleep(60)\n"
            "a = Stuck(); a.cycle = [a]; del a  # a cycle: freed by the collection at exit\n"
            "bound_the_exit(1.0)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and time.monotonic() - started < 30, (done.returncode, done.stderr[-2000:])
    assert "Timeout (0:00:01)!" in done.stderr and "__del__" in done.stderr, done.stderr[-2000:]
