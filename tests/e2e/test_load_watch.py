"""E2E, the real tritonserver: a stub that is not scheduled for a while as its model loads (here: stopped for 2.5 s with
SIGSTOP, as a loaded two-core machine can leave it) makes tritonserver 2.51 give up on it and wait for its exit for good
(the load hang of tests/e2e/test_checkpoints.py in CI). With ``backend.triton.load_watch`` (every model through
``counter_batch.after_load``) the stub leaves, the server fails its start with Triton's own error, and the harness
starts it again (``TritonServer.start``)."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from backend.deploy.local_server import TritonServer
from backend.deploy.stacks import STUB_GAVE_UP

pytestmark = pytest.mark.e2e

CONFIG = """name: "slow"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters { key: "pid_file" value: { string_value: "%s" } }
"""

MODEL = """import json, os, time
from backend.triton.counter_batch import after_load


@after_load
class TritonPythonModel:
    def initialize(self, args):
        pid_file = json.loads(args["model_config"])["parameters"]["pid_file"]["string_value"]
        with open(pid_file, "a") as out:
            out.write(f"{os.getpid()}\\n")
        deadline = time.monotonic() + 60
        while not os.path.exists(pid_file + ".resumed") and time.monotonic() < deadline:
            time.sleep(0.05)  # a slow load: the test stops this stub meanwhile, then lets it finish

    def execute(self, requests):
        return []
"""


def test_a_stub_the_server_gave_up_on_while_loading_leaves_and_the_server_is_started_again(tmp_path):
    pid_file = tmp_path / "stub-pids"
    model = tmp_path / "repo" / "slow"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG % pid_file)
    (model / "1" / "model.py").write_text(MODEL)
    stopped = []

    def stop_the_first_stub_for_a_while():
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(pid_file.read_text().split()[0])  # in its initialize, which waits for the ".resumed" file
        os.kill(pid, signal.SIGSTOP)
        time.sleep(2.5)  # more than the server's one-second window
        os.kill(pid, signal.SIGCONT)
        stopped.append(pid)
        time.sleep(1.0)
        Path(f"{pid_file}.resumed").touch()

    stopper = threading.Thread(target=stop_the_first_stub_for_a_while, daemon=True)
    stopper.start()
    log = tmp_path / "server.log"
    started = time.monotonic()
    with pytest.warns(RuntimeWarning, match=STUB_GAVE_UP):
        with TritonServer(tmp_path / "repo", log_path=log, start_timeout=120) as server:
            took = time.monotonic() - started
            assert server.is_ready()
    stopper.join(10)
    first = Path(f"{log}.1").read_text()
    assert stopped and STUB_GAVE_UP in first and f"stub pid {stopped[0]}" in first
    assert "Stub process 'slow_0_0' is not healthy" in first  # Triton's own error: the load failed, not hung
    assert len(pid_file.read_text().split()) == 2 and STUB_GAVE_UP not in log.read_text()
    assert took < 90, f"the start took {took:.0f} s"  # hung, it would wait out the start timeout
