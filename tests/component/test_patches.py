"""Component tests of the patches of vLLM, torch and NIXL internals (docs/architecture.md, "Patches of vLLM, torch
and NIXL internals") on the real things: a real EngineCore process of vLLM hosting the tiny model as a KV producer
(prefill), holding a finished request whose KV nobody reads, with and without the patches; real NIXL agents, made
by the project's factory and the way vLLM's NixlConnector makes them. Each configuration runs in a fresh process,
since a patch applies to its process (and to an EngineCore forked from it) for good."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.deploy.local_server import ROOT

pytestmark = pytest.mark.component

ENGINE = r'''
import json, os, sys, time
from pathlib import Path
import psutil
from backend.deploy.ports import free_ports
from backend.engine.host import EngineHost, _engine_process, kv_transfer_config, load_engine_args
from backend.request.generate import GenerateRequest

# below the ephemeral range (backend.deploy.ports): a port bind(0) picked could be taken by one of the EngineCore's
# own connections before its NIXL handshake listener binds it, and vLLM then waits for that listener for good
os.environ.update(VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_ports()[0]), VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1")
args = load_engine_args(Path("model_repository/prefill/model.json"))
host = EngineHost.start({**args, "kv_transfer_config": kv_transfer_config("kv_producer", False)})

def generate(request_id, **kv):
    request = GenerateRequest("Describe a cat.", None, (), {"temperature": 0.0, "max_tokens": 1}, **kv)
    async def run():
        return [delta async for delta in host.generate(request, request_id)][-1]
    return host.submit(run()).result(timeout=300)

[core] = [proc for proc in psutil.Process().children(recursive=True) if _engine_process(proc)]
held = generate("held", kv_transfer_params={"do_remote_decode": True})  # its KV waits for a decode that never reads
time.sleep(1.0)
before = sum(core.cpu_times()[:2])
time.sleep(3.0)
cpu = sum(core.cpu_times()[:2]) - before
loops = sum((task / "comm").read_text().strip() == "gloo_tcp_loop" for task in Path(f"/proc/{core.pid}/task").iterdir())
started = time.monotonic()
generate("next")  # a new request while the engine holds the first: it ends the idle wait at once
latency = time.monotonic() - started
from vllm.v1.engine import core as vllm_core
front = getattr(vllm_core.EngineCoreProc._process_engine_step, "epd_idle_wait", None)
host.shutdown()
print(json.dumps({"held_params": bool(held.kv_transfer_params), "cpu": cpu, "gloo_loops": loops,
                  "latency": latency, "front_idle_wait": front}))
'''

IDLE_WAIT_S = 3.0
PATCHED = {"EPD_ENGINE_IDLE_WAIT_MS": str(int(IDLE_WAIT_S * 1000)), "EPD_GLOO_SHARED_DEVICE": "1"}
VLLM_OWN = {"EPD_ENGINE_IDLE_WAIT_MS": "", "EPD_GLOO_SHARED_DEVICE": "0"}


def _start(script: str, env: dict[str, str], *argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo", **env}
    return subprocess.Popen([sys.executable, "-c", script, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> tuple[dict, str]:
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _run(script: str, env: dict[str, str], *argv: str) -> tuple[dict, str]:
    return _result(_start(script, env, *argv))


@pytest.fixture(scope="module")
def engines() -> dict[str, tuple[dict, str]]:
    """Both configurations, with NIXL's poll delay on in both (without it NIXL's progress thread alone keeps
    the EngineCore at ~95% of a core, hiding what the idle wait saves)."""
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    common = {"EPD_NIXL_POLL_DELAY_US": "5000"}
    # both at once: each start is one process importing vLLM after another (host, then its EngineCore), one core
    # each, so on 2 cores the pair takes one's time (CI: 62 s one after the other)
    started = {name: _start(ENGINE, {**common, **env}) for name, env in (("vllm", VLLM_OWN), ("patched", PATCHED))}
    try:
        return {name: _result(proc) for name, proc in started.items()}
    finally:  # one failed: the other stopped too
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_a_real_engine_core_holding_a_finished_request_waits_instead_of_stepping(engines):
    """vLLM's loop steps every 1 ms while the EngineCore holds a finished producer request; with the idle wait
    (applied to the real ``EngineCoreProc._process_engine_step`` by the plugin) it steps once per wait."""
    own, _ = engines["vllm"]
    patched, log = engines["patched"]
    assert own["held_params"] and patched["held_params"]  # both hold a KV for decode
    assert own["cpu"] > 0.2, own  # 3 s of vLLM's own loop: >6% of a core (measured: 0.56 s, 19%)
    assert patched["cpu"] < min(0.15, own["cpu"] / 4), (patched, own)
    assert patched["front_idle_wait"] == IDLE_WAIT_S and own["front_idle_wait"] is None
    assert "epd patch" not in log, log[-2000:]  # nothing skipped on the versions installed here


def test_new_input_ends_the_idle_wait_of_a_real_engine_core(engines):
    patched, _ = engines["patched"]
    assert patched["latency"] < IDLE_WAIT_S / 2, patched


def test_gloo_groups_of_a_real_engine_core_share_one_device(engines):
    """The gloo groups vLLM's CPU worker makes (a real torch gloo ``ProcessGroup`` each) run one transport loop
    thread with the shared device, one per group without it; the engine still serves (the requests above)."""
    assert engines["patched"][0]["gloo_loops"] == 1
    assert engines["vllm"][0]["gloo_loops"] > 1


STOP = r'''
import json, time
from pathlib import Path
import psutil
from backend.engine.host import EngineHost, _engine_process, load_engine_args
from backend.request.generate import GenerateRequest

host = EngineHost.start(load_engine_args(Path("model_repository/pd/model.json")))
async def run():
    request = GenerateRequest("Describe a cat.", None, (), {"temperature": 0.0, "max_tokens": 2})
    return [delta async for delta in host.generate(request, "one")][-1]
host.submit(run()).result(timeout=300)
[core] = [proc for proc in psutil.Process().children(recursive=True) if _engine_process(proc)]
host.shutdown()
print(json.dumps({"core": core.pid, "left": psutil.pid_exists(core.pid)}))
'''


def test_a_stopped_real_engine_core_exits_without_the_interpreter_s_teardown():
    """The quick exit (on for every stub: ``PROCESS_ENV_DEFAULTS``): a real EngineCore that served, asked to stop,
    leaves once vLLM's shutdown has run, saying so, and nothing of it is left. What it saves was measured with
    both values of ``EPD_ENGINE_QUICK_EXIT`` (2 cores: the host's stop 3.6-4.2 s -> 1.6 s, a default-topology
    server's 10.0 -> 7.4 s and 8.7 -> 6.7 s, ``tests/e2e/test_shutdown.py -s``)."""
    pytest.importorskip("vllm")
    stopped, log = _run(STOP, {})
    assert not stopped["left"], stopped
    assert f"epd quick exit: EngineCore pid {stopped['core']} stopped" in log, log[-3000:]
    assert "epd patch" not in log, log[-2000:]  # not skipped on the version installed here


ORPHANED = r'''
import json, time
from pathlib import Path
import psutil
from backend.engine.host import EngineHost, _engine_process, load_engine_args

host = EngineHost.start(load_engine_args(Path("model_repository/pd/model.json")))
[core] = [proc for proc in psutil.Process().children(recursive=True) if _engine_process(proc)]
print(json.dumps({"core": core.pid, "ipc": host._ipc_dir}), flush=True)
time.sleep(600)
'''


def test_a_real_engine_core_whose_host_is_killed_exits(tmp_path):
    """``follow_parent`` (on for every stub: ``PROCESS_ENV_DEFAULTS``): the process hosting a real engine killed hard
    (a stub killed, or ended by tritonserver's exit timeout while its finalize hung), its EngineCore exits on its
    own within seconds, saying so; vLLM alone leaves it running for good (tests/unit/test_engine_shutdown.py has
    that control on plain processes)."""
    import shutil
    import signal

    import psutil

    from backend.engine.host import _alive

    pytest.importorskip("vllm")
    log = tmp_path / "host.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as err:
        host = subprocess.Popen([sys.executable, "-c", ORPHANED], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=err, text=True)
    core = started = None
    stores = []  # the file of its gloo store: in the host's IPC directory, gone with it
    try:
        for line in iter(host.stdout.readline, ""):  # vLLM logs to stdout too
            if line.startswith('{"core"'):
                started = json.loads(line)
                break
            stores += re.findall(r"distributed_init_method=file://(\S+)", line)
        assert started, log.read_text()[-4000:]
        core = psutil.Process(started["core"])
        host.send_signal(signal.SIGKILL)
        host.wait(10)
        deadline = time.monotonic() + 10
        while _alive(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        running = _alive(core)
    finally:
        host.kill()
        host.wait(10)
        if core is not None and _alive(core):
            core.kill()
        if started:
            shutil.rmtree(started["ipc"], ignore_errors=True)  # the killed host's: its release never ran
        for store in stores:
            Path(store).unlink(missing_ok=True)
    assert not running, log.read_text()[-3000:]
    assert f"its parent, pid {host.pid}, is gone" in log.read_text(), log.read_text()[-3000:]
    assert stores and all(Path(store).parent == Path(started["ipc"]) for store in stores), (stores, started)


AGENT = r'''
import json, sys, time
from backend.transfer import agent
from nixl import _api
mode, delay = sys.argv[1], int(sys.argv[2])
if mode == "create":
    made = agent.create_agent("test", delay)
else:  # as vLLM's NixlConnector makes its agents, after the plugin called patch_process_agents
    agent.patch_process_agents(delay)
    agent.patch_process_agents(delay + 1)  # idempotent: the first delay stays
    made = _api.nixl_agent("test-process", _api.nixl_agent_config(backends=["UCX"]))
assert made.get_agent_metadata()
time.sleep(0.5)
start = time.process_time()
time.sleep(1.0)
print(json.dumps({"cpu": time.process_time() - start, "process_delay": agent._process_delay_us,
                  "wrapped": getattr(_api.nixlBind.nixlAgent, "epd_poll_delay", False)}))
'''


@pytest.mark.parametrize("mode", ["create", "process"])
def test_a_real_nixl_agent_with_the_poll_delay_does_not_spin(mode):
    """A real UCX agent on loopback: NIXL's own delay 0 busy-polls its progress thread (>10% of a core here);
    with the wrapped constructor's 5 ms the process stays idle."""
    pytest.importorskip("nixl")
    spinning, _ = _run(AGENT, {}, mode, "0")
    idle, log = _run(AGENT, {}, mode, "5000")
    assert spinning["cpu"] > 0.1, spinning
    assert idle["cpu"] < min(0.05, spinning["cpu"] / 4), (idle, spinning)
    assert idle["wrapped"] is True and "epd patch" not in log
    assert idle["process_delay"] == (5000 if mode == "process" else None)
