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


IPC = r'''
import os, subprocess, sys
from backend.engine.host import private_ipc_dir, release_ipc_dir

before = os.environ.get("VLLM_RPC_BASE_PATH")
first = private_ipc_dir()
assert os.environ["VLLM_RPC_BASE_PATH"] == first and os.path.isdir(first)
release_ipc_dir(first)
assert not os.path.exists(first)
assert os.environ.get("VLLM_RPC_BASE_PATH") == before, os.environ.get("VLLM_RPC_BASE_PATH")
# a process started now (a tritonserver whose stubs host engines) makes its own directory
child = "from backend.engine.host import private_ipc_dir, release_ipc_dir; release_ipc_dir(private_ipc_dir())"
subprocess.run([sys.executable, "-c", child], check=True)
second = private_ipc_dir()  # a later host of this process: under the same base again
assert os.path.dirname(second) == os.path.dirname(first)
release_ipc_dir(second)
print("ok")
'''


def test_a_released_ipc_dir_is_not_left_in_the_environment(tmp_path):
    """An engine host's private directory for vLLM's sockets is removed at its stop; the environment must not keep
    naming it, or a process started later inherits a removed base: on the H200 an engine test followed by a served
    test in one pytest process failed every engine's start (mkdtemp: No such file or directory)."""
    for base in (None, str(tmp_path)):
        env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
        if base:
            env["VLLM_RPC_BASE_PATH"] = base
        out = subprocess.run([sys.executable, "-c", IPC], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def test_the_ipc_dir_of_a_killed_process_is_removed_by_the_next_one(tmp_path):
    """A stub killed with its engine (a host lost, Triton's exit timeout) never releases its directory; the next
    ``private_ipc_dir`` under the same base removes it, and leaves a live process's and a foreign name alone."""
    env = {**os.environ, "VLLM_RPC_BASE_PATH": str(tmp_path)}
    hold = ("from backend.engine.host import private_ipc_dir; import time\n"
            "print(private_ipc_dir(), flush=True); time.sleep(600)")
    killed = subprocess.Popen([sys.executable, "-c", hold], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    live = subprocess.Popen([sys.executable, "-c", hold], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        orphan, kept = killed.stdout.readline().strip(), live.stdout.readline().strip()
        killed.kill()
        killed.wait(timeout=30)
        (tmp_path / "epd-vllm-ipc-someone-elses").mkdir()
        assert os.path.isdir(orphan) and os.path.isdir(kept)
        subprocess.run([sys.executable, "-c", "from backend.engine.host import private_ipc_dir, release_ipc_dir;"
                        "release_ipc_dir(private_ipc_dir())"], cwd=ROOT, env=env, check=True, timeout=120)
        assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(kept), "epd-vllm-ipc-someone-elses"])
    finally:
        for proc in (killed, live):
            proc.kill()
            proc.wait(timeout=30)
