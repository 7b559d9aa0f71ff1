"""``backend.deploy.local_server.remove_python_envs``: which of tritonserver's Python-backend directories
(``/tmp/python_env_*``) a stopped server's launcher removes. The directories are real ones in /tmp; the running
servers' start times are given (real servers' directories: tests/e2e/test_hosts.py, whose killed hosts leave theirs).
Also: a start that meets another listener, and ``--engine-arg`` over a topology's engine arguments."""
import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from backend.deploy import local_server


@pytest.fixture
def made():
    paths = []

    def make() -> str:
        paths.append(tempfile.mkdtemp(prefix="python_env_", dir="/tmp"))
        return paths[-1]
    yield make
    for path in paths:
        if os.path.isdir(path):
            os.rmdir(path)


def test_an_empty_directory_made_while_the_server_started_is_removed(made, monkeypatch):
    before = local_server.python_envs()
    start = time.time()
    ours = made()
    monkeypatch.setattr(local_server, "_tritonserver_starts", lambda: [])
    assert local_server.remove_python_envs(before, [start, time.time()]) == [ours]
    assert not os.path.exists(ours)


def test_a_directory_a_running_server_may_have_made_is_left(made, monkeypatch):
    before = local_server.python_envs()
    start = time.time()
    theirs = made()
    monkeypatch.setattr(local_server, "_tritonserver_starts", lambda: [start - 2.0])  # started 2 s before it was made
    assert local_server.remove_python_envs(before, [start, time.time()]) == []
    assert os.path.isdir(theirs)
    monkeypatch.setattr(local_server, "_tritonserver_starts", lambda: [start - 120.0])  # long before: not its
    assert local_server.remove_python_envs(before, [start, time.time()]) == [theirs]


def test_what_was_there_before_made_later_or_not_empty_is_left(made, monkeypatch):
    monkeypatch.setattr(local_server, "_tritonserver_starts", lambda: [])
    older = made()
    before = local_server.python_envs()
    start = time.time()
    full = made()
    open(os.path.join(full, "env.tar.gz"), "w").close()  # a model's extracted execution environment
    ready = time.time()
    time.sleep(1.2)
    later = made()
    assert local_server.remove_python_envs(before, [start, ready]) == []
    assert all(os.path.isdir(path) for path in (older, full, later))
    os.unlink(os.path.join(full, "env.tar.gz"))
    assert local_server.remove_python_envs(before, [None, None]) == []  # never started


def test_a_start_that_meets_something_else_on_its_port_stops_what_it_started(tmp_path):
    """The readiness probe answered by a listener that is not HTTP (seen: a ZeroMQ greeting on a port picked free
    before the server bound it) is not ready, and whatever ends the wait stops the process it started: an exception
    other than OSError once escaped ``start`` and left the server running."""
    import signal
    import socket
    import sys
    import threading

    from backend.deploy.local_server import Ports, TritonServer

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def greet():  # a ZMTP greeting to every connection, as a ZeroMQ socket sends
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f")
            conn.close()
    threading.Thread(target=greet, daemon=True).start()
    port = listener.getsockname()[1]
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    server = TritonServer(ports=Ports(port, port + 1, port), log_path=tmp_path / "log", argv=sleeper)
    try:
        assert not server.is_ready() and not server._metrics_up()
        with pytest.raises(TimeoutError):
            server.start(timeout=2)
        assert server.proc.poll() is not None  # stopped
        server2 = TritonServer(ports=Ports(port, port + 1, port), log_path=tmp_path / "log2", argv=sleeper)
        server2.is_ready = lambda: (_ for _ in ()).throw(ValueError("probe broke"))
        with pytest.raises(ValueError):
            server2.start(timeout=10)
        assert server2.proc.poll() is not None
    finally:
        listener.close()
        for s in (server, locals().get("server2")):
            if s is not None and s.proc is not None and s.proc.poll() is None:
                os.killpg(s.proc.pid, signal.SIGKILL)


def test_engine_args_given_on_the_command_line_lie_over_the_topology_s(monkeypatch, tmp_path):
    """``--engine-arg KEY=VALUE`` (JSON where it parses): every engine's model.json gets it over the topology's
    engine_args; the checkpoint stays ``--checkpoint``'s; a malformed one or ``model`` is refused by the parser."""
    monkeypatch.setattr(local_server, "ROOT", tmp_path)  # renders into tmp_path/.cache/repositories
    key, value = local_server.engine_arg("kv_cache_memory_bytes=268435456")
    assert (key, value) == ("kv_cache_memory_bytes", 268435456)
    assert local_server.engine_arg("dtype=bfloat16") == ("dtype", "bfloat16")
    assert local_server.engine_arg('limit={"a": 1}') == ("limit", {"a": 1})
    for bad in ("model=/x", "no_value", "=3"):
        with pytest.raises(argparse.ArgumentTypeError):
            local_server.engine_arg(bad)
    topology = Path(__file__).resolve().parents[2] / "topologies" / "checkpoint-cpu.yaml"
    repository, _ = local_server.render_topology(topology, engine_args={key: value, "max_model_len": 4096})
    engines = sorted(repository.glob("*/model.json"))
    assert engines, sorted(repository.iterdir())
    for path in engines:
        args = json.loads(path.read_text())
        assert (args["kv_cache_memory_bytes"], args["max_model_len"]) == (268435456, 4096), path
        assert args["dtype"] == "float32"  # the topology's own, untouched
        assert Path(args["model"]).name == "tiny-qwen2-vl"  # the topology's checkpoint (no --checkpoint given)


def test_a_slow_stop_logs_its_stubs_native_stacks(tmp_path, monkeypatch):
    """A server whose stop takes longer than ``SLOW_STOP_SECONDS`` gets its stubs' native stacks (py-spy, C frames
    too) into its log, taken while they still run: a stub waiting after its finalize shows no Python frame in its
    own watchdog's dump."""
    import subprocess
    import sys

    from backend.deploy import local_server
    from backend.deploy.local_server import Ports, TritonServer

    monkeypatch.setattr(local_server, "SLOW_STOP_SECONDS", 1.0)
    # the "server": ignores SIGTERM for 4 s, with a child named as a stub whose code naps in a named function
    stub = "import time\ndef stub_nap():\n    time.sleep(60)\nstub_nap()"
    server_code = ("import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: None)\n"
                   f"child = subprocess.Popen(['bash', '-c', 'exec -a triton_python_backend_stub {sys.executable} "
                   f"-c \"$0\"', {stub!r}])\n"
                   "print('up', flush=True)\ntime.sleep(4)\nchild.kill()\n")
    server = TritonServer(ports=Ports(1, 2, 3), log_path=tmp_path / "log", argv=[sys.executable, "-c", server_code])
    server.proc = subprocess.Popen(server.argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert server.proc.stdout.readline().strip() == "up"
    for _ in range(100):  # the stub child running its code
        if any(b"stub_nap" in open(f"/proc/{pid}/cmdline", "rb").read() for pid in server._stubs()):
            break
        time.sleep(0.05)
    time.sleep(0.5)
    server.stop(timeout=30)
    log = (tmp_path / "log").read_text()
    assert "py-spy dump --native" in log and "stub_nap" in log, log[-2000:]


def test_a_launcher_s_ports_are_picked_again_when_one_was_taken_in_its_environment_and_command(tmp_path):
    """A launcher (``make serve``, ``local_server``) reads its ports from the environment the harness gives it, and a
    command that names them is a function of them: a port another process bound first ("already in use") is picked
    again for both, twice at most (CI, 2026-12-06: a taken HTTP port failed a test whose ports were fixed)."""
    import sys

    from backend.deploy.local_server import TritonServer

    seen = tmp_path / "seen"
    code = ("import os, sys; open(sys.argv[1], 'a').write(os.environ['HTTP_PORT'] + ' ' + sys.argv[2] + '\\n'); "
            "print('failed to start HTTP service: Socket already in use'); sys.exit(1)")
    server = TritonServer(log_path=tmp_path / "log",
                          argv=lambda ports: [sys.executable, "-c", code, str(seen), str(ports.http)])
    with pytest.raises(RuntimeError, match="exited with 1"):
        server.start(timeout=30)
    starts = [line.split() for line in seen.read_text().splitlines()]
    assert len(starts) == 3 and all(env == argv for env, argv in starts), starts  # the same ports in both
    assert len({env for env, _ in starts}) == 3 and server.started_argv[-1] == starts[-1][1]


@pytest.mark.parametrize("line", ["epd: encoder: the server gave up on this stub while it loaded (tritonserver ...)",
                                  "terminate called after throwing an instance of 'boost::interprocess::lock_exception'"])
def test_a_start_that_failed_in_a_known_way_at_load_is_made_again_its_log_kept(tmp_path, line):
    log = tmp_path / "server.log"
    server = local_server.TritonServer(tmp_path, log_path=log)
    log.write_text(f"I1206 loading: epd:1\n{line}\n")
    with pytest.warns(RuntimeWarning, match="starting it again"):
        assert server._failed_at_load(0)
    assert (tmp_path / "server.log.1").read_text() == log.read_text()
    log.write_text("I1206 loading: epd:1\nE1206 failed to load 'epd': a model's own error\n")
    assert not server._failed_at_load(1) and not (tmp_path / "server.log.2").exists()


def test_tritonserver_is_started_without_auto_complete_unless_the_command_asks_for_it():
    """The rendered configs are complete: no auto-complete stub per model (~1.3 s of CPU each) unless the user's
    command says how model configs are to be completed."""
    from backend.deploy.local_server import tritonserver_argv

    argv = tritonserver_argv(["--model-repository=model_repository"])
    assert argv.count("--disable-auto-complete-config") == 1 and argv[-1] == "--model-repository=model_repository"
    for asked in (["--strict-model-config=false"], ["--disable-auto-complete-config"]):
        argv = tritonserver_argv(["--model-repository=r", *asked])
        assert "--disable-auto-complete-config" not in argv[:-2] and argv[-1] == asked[0], argv


def test_a_server_that_died_under_its_tests_is_reported_with_its_log_at_exit(tmp_path):
    """A server that exits by itself while tests use it (they see refused connections only) makes ``with
    TritonServer()`` raise at its end with the exit status and the log's last lines (a CI run keeps no /tmp); one
    stopped by the harness, even twice, does not."""
    import subprocess
    import sys

    from backend.deploy.local_server import Ports, TritonServer

    def started(code: str) -> TritonServer:
        server = TritonServer(ports=Ports(1, 2, 3), log_path=tmp_path / "log", argv=[sys.executable, "-c", code])
        with open(tmp_path / "log", "w") as log:
            server.proc = subprocess.Popen(server.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return server

    server = started("import os, time; print('Signal (11) received.', flush=True); time.sleep(0.2); os._exit(139)")
    server.proc.wait(timeout=10)
    with pytest.raises(RuntimeError, match=r"exited by itself with 139(.|\n)*Signal \(11\) received"):
        server.__exit__(None, None, None)
    assert server.died
    server = started("import time; time.sleep(60)")
    server.stop(timeout=10)
    server.__exit__(None, None, None)  # the second stop finds it gone: stopped, not dead
    assert not server.died and server.proc.returncode is not None
