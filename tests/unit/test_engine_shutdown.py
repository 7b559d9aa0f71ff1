"""How an engine's processes end, on real processes: an engine process killed while it holds a POSIX semaphore (as
vLLM's EngineCore holds tqdm's) leaves nothing in /dev/shm once its host exits, because multiprocessing's resource
tracker is left to unlink it (``backend.engine.host.stop_engine_processes``; the launcher's kill of survivors,
``backend.deploy.local_server``, leaves the tracker last for the same reason); an engine process whose host is killed exits
by itself (``backend.engine.patches.follow_parent``); the exit bound after ``finalize``; the private IPC directory."""
import os
import subprocess
import sys
import time

import pytest

from backend.deploy.local_server import ROOT

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


def run_python(code: str) -> tuple[subprocess.CompletedProcess, float]:
    """``code`` run by this venv's Python in the project root: the finished process and its seconds."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - started


def test_a_teardown_that_hangs_after_finalize_is_cut_at_the_bound():
    """``bound_the_exit``: a teardown stuck before the interpreter's ``atexit`` handlers (here a thread that never
    ends, which the interpreter waits for first) ends the process at the bound with every thread's stack in stderr."""
    code = ("import threading, time\nfrom backend.engine.host import bound_the_exit\n"
            "def stuck():\n    time.sleep(60)\n"
            "threading.Thread(target=stuck, name='stuck').start()  # not a daemon: waited for at exit\n"
            "bound_the_exit(1.0)\n")
    done, took = run_python(code)
    assert done.returncode == 1 and took < 30, (done.returncode, done.stderr[-2000:])
    assert "Timeout (0:00:01)!" in done.stderr and "stuck" in done.stderr, done.stderr[-2000:]


def test_after_the_bound_the_stub_leaves_without_the_last_collection(tmp_path):
    """After ``bound_the_exit`` the process leaves at its ``atexit`` handlers (the others still run, the streams are
    flushed) without the interpreter's last garbage collection, whose destructors crashed stubs and which took the
    10 s of the bound on a loaded machine: a cycle's finalizer that would sleep 60 s never runs, the exit is 0."""
    out = tmp_path / "notes"
    code = ("import atexit, sys, time\nfrom backend.engine.host import bound_the_exit\n"
            f"atexit.register(lambda: open({str(out)!r}, 'a').write('atexit ran\\n'))\n"
            "class Stuck:\n    def __del__(self):\n        time.sleep(60)\n"
            "a = Stuck(); a.cycle = [a]; del a  # a cycle: only the collection at exit would free it\n"
            "bound_the_exit(30.0)\nprint('bye', end='')\n")
    done, took = run_python(code)
    assert done.returncode == 0 and took < 20, (done.returncode, done.stderr[-2000:])
    assert done.stdout == "bye" and out.read_text() == "atexit ran\n"


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


def semaphores() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.mp-")}


ORPHAN = r'''
import multiprocessing as mp, sys, time

ENGINE = """
import multiprocessing as mp, sys, threading, time
if follow:
    from backend.engine.patches import follow_parent
    follow_parent()
    follow_parent()
    assert [t.name for t in threading.enumerate()].count("epd-follow-parent") == 1  # else no semaphore: the test fails
lock = mp.get_context("spawn").Lock()  # a semaphore the resource tracker unlinks once this process is gone
time.sleep(120)
"""

if __name__ == "__main__":
    # as vLLM starts its EngineCore
    child = mp.get_context("spawn").Process(target=exec, args=(ENGINE, {"follow": sys.argv[1] == "1"}))
    child.start()
    print(child.pid, flush=True)
    time.sleep(120)
'''


def _host_with_semaphore(follow: bool) -> tuple[subprocess.Popen, "psutil.Process", set[str]]:
    """A host process (a session of its own) whose spawned child holds a semaphore, once the semaphore exists."""
    import psutil

    before = semaphores()
    host = subprocess.Popen([sys.executable, "-c", ORPHAN, "1" if follow else "0"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    child = psutil.Process(int(host.stdout.readline()))
    deadline = time.monotonic() + 60
    while not (made := semaphores() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert made, "the child made no semaphore"
    return host, child, made


def _left(made: set[str], wait: float = 10.0) -> set[str]:
    """What of ``made`` is still in /dev/shm after up to ``wait`` s (a tracker unlinks once its processes are gone)."""
    deadline = time.monotonic() + wait
    while (left := {name for name in made if os.path.exists(f"/dev/shm/{name}")}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _orphan(follow: bool):
    """The host killed hard: the child's pid, whether it was still running 5 s later, the semaphores left once it is
    gone (killed here if it ran on), and the host's stderr (the child's too)."""
    from backend.engine.host import _alive

    host, child, made = _host_with_semaphore(follow)
    try:
        host.kill()
        host.wait(10)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        running = _alive(child)
    finally:
        host.kill()
        host.wait(10)
    if running:
        child.kill()
    return child.pid, running, _left(made), host.stderr.read()


def test_an_engine_process_exits_when_its_parent_is_killed_and_leaves_no_semaphore():
    """``backend.engine.patches.follow_parent`` (on in every EngineCore: ``EPD_ENGINE_FOLLOW_PARENT``): the parent
    killed hard, the spawned child exits on its own, says so, and multiprocessing's tracker then unlinks its
    semaphore. Without it, the child outlives its parent (killed here after 5 s)."""
    pid, running, left, log = _orphan(follow=True)
    assert not running and not left, (running, left, log[-2000:])
    assert f"pid {pid}: its parent" in log, log[-2000:]
    _, running, left, _ = _orphan(follow=False)
    assert running and not left  # the control: orphaned; nothing left once it is killed by hand


@pytest.mark.parametrize("trackers_last", [True, False])
def test_the_launcher_kills_survivors_before_their_resource_tracker(trackers_last):
    """``backend.deploy.local_server``: processes that outlived tritonserver are killed, multiprocessing's tracker last, so it
    unlinks what they registered; killing the whole group at once (the control) leaves the semaphore behind."""
    import signal

    from backend.deploy.local_server import _kill_leaving_trackers_last, group_members

    host, child, made = _host_with_semaphore(follow=False)
    members = group_members(host.pid)
    assert len(members) == 3, members  # the host, its tracker, the child
    if trackers_last:
        _kill_leaving_trackers_last(host.pid, members)
    else:
        os.killpg(host.pid, signal.SIGKILL)
    host.wait(10)
    left = _left(made, wait=3.0)
    for name in left:
        os.unlink(f"/dev/shm/{name}")
    assert not group_members(host.pid)
    assert bool(left) != trackers_last, left


def test_follow_parent_starts_nothing_outside_a_spawned_process():
    """The stub itself (and an in-process ``LLM``) has no multiprocessing parent: no thread."""
    import threading

    from backend.engine import patches

    patches.follow_parent()
    assert not [t for t in threading.enumerate() if t.name == "epd-follow-parent"]


def test_a_stuck_engine_loop_does_not_keep_the_engine_from_being_stopped(monkeypatch, capsys):
    """``EngineHost.shutdown`` cancels vLLM's output handler on the engine's loop first; a loop that does not get to
    it in ``CANCEL_SECONDS`` (stuck in a call) is said in the log and the engine is stopped all the same. Before, the
    timeout escaped ``shutdown`` and the engine was never stopped. And ``shutdown`` stops the processes its engine
    started, no other child of the host process."""
    import asyncio

    from backend.engine.host import EngineHost
    from backend.engine.loop import LoopThread

    class Engine:  # what shutdown touches on an AsyncLLM
        def __init__(self, handler):
            self.output_handler, self.stopped = handler, 0

        def shutdown(self):
            self.stopped += 1

    async def handler_task():
        return asyncio.get_running_loop().create_task(asyncio.sleep(3600))

    loop = LoopThread("stuck-loop")
    try:
        engine = Engine(loop.submit(handler_task()).result(timeout=5))
        loop.loop.call_soon_threadsafe(time.sleep, 2.0)  # the loop stuck for 2 s
        monkeypatch.setattr(EngineHost, "CANCEL_SECONDS", 0.3)
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not the engine's
        try:
            EngineHost(loop, engine, None).shutdown()
            assert bystander.poll() is None  # it killed every child of the process after 5 s (in CI: the servers)
        finally:
            bystander.kill()
            bystander.wait(10)
        assert engine.stopped == 1
        assert "did not cancel vLLM's output handler in 0.3 s" in capsys.readouterr().err
    finally:
        loop.stop()
        if not loop._thread.is_alive():  # what the stuck loop still held (the late cancel) runs, then it closes
            loop.loop.run_until_complete(asyncio.sleep(0.1))
            loop.loop.close()


FORKED_EXIT = r'''
import atexit, multiprocessing as mp, os, sys, weakref
from backend.engine import patches

out = sys.argv[1]
def note(what):
    with open(out, "a") as f:
        f.write(f"{what} {'child' if mp.parent_process() else 'parent'}\n")

class Held:
    pass
held = Held()
weakref.finalize(held, note, "parent-finalizer")
atexit.register(note, "parent-atexit")
patches.register()  # as vLLM loads the plugin in the process that forks its EngineCore

def child():
    mine = Held()
    weakref.finalize(mine, note, "child-finalizer")
    atexit.register(note, "child-atexit")
    atexit._run_exitfuncs()  # as the quick exit does (patches._exit_now)
    child.keep = mine

p = mp.get_context("fork").Process(target=child)
p.start()
p.join()
'''


def test_a_forked_engine_core_runs_its_own_exit_handlers_not_its_parent_s(tmp_path):
    """``patches.register`` in the forking process: the forked child drops the ``atexit`` and ``weakref.finalize``
    handlers it inherited (the parent's vLLM process manager's finalizer tried to stop the child itself), and its
    own still run at its exit; the parent's run at the parent's."""
    out = tmp_path / "notes"
    env = {**os.environ, "EPD_ENGINE_QUICK_EXIT": "0", "EPD_ENGINE_FOLLOW_PARENT": "0"}
    subprocess.run([sys.executable, "-c", FORKED_EXIT, str(out)], cwd=ROOT, env=env, check=True, timeout=60)
    notes = sorted(out.read_text().splitlines())
    assert notes == ["child-atexit child", "child-finalizer child", "parent-atexit parent",
                     "parent-finalizer parent"], notes
