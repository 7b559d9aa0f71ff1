"""E2E: the README's ways of starting the server, run as a user runs them, on ports other than Triton's
defaults: ``make serve`` with the port variables and ``.venv/bin/tritonserver`` with tritonserver's own flags (the
session server, started that way).
Through each, an image request to ``epd`` (E+PD) and ``epd_disagg`` (E/P/D) gives ``llm``'s tokens: the
orchestrators find their stages on whatever gRPC port the server has (``backend.deploy.server_address``), with no
environment variable set for them. A server without gRPC refuses to load ``epd``, saying why."""
from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest

from backend.deploy.local_server import ROOT, TritonServer, VENV, group_members
from backend.deploy.ports import free_ports
from backend.protocol.generate import GenerateInputs
from clients.triton_client import generate
from tests.e2e.conftest import _shm, readme_command, settled_orphans, user_env
from tests.images import image_bytes

pytestmark = pytest.mark.e2e

PH = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def _same_tokens_through_every_deployment(server: TritonServer) -> None:
    inputs = GenerateInputs(prompt=f"{PH}Describe the picture.", images=[image_bytes(72, 56, seed=5)], sampling=GREEDY)
    answers = {model: generate(server.grpc_url, model, inputs, timeout=120) for model in ("llm", "epd", "epd_disagg")}
    assert answers["epd"].text == answers["llm"].text == answers["epd_disagg"].text
    assert answers["epd"].timings["items"] == answers["epd_disagg"].timings["items"] == 1  # through the encoder
    other = generate(server.grpc_url, "epd", GenerateInputs(prompt=f"{PH}Describe the picture.", sampling=GREEDY,
                                                            images=[image_bytes(72, 56, seed=6)]), timeout=120)
    assert other.text != answers["epd"].text  # the answer depends on the image


def _stopped_clean(server: TritonServer, before: set[str]) -> None:
    assert not server.stragglers, f"processes outlived tritonserver: {server.stragglers}"
    assert not server.leftover_shm, server.leftover_shm
    assert not (left := settled_orphans(before)), f"/dev/shm entries left after the stop: {sorted(left)}"


def _openai_answers_as_triton(server: TritonServer, port: int) -> None:
    """The OpenAI-compatible endpoint ``make serve`` started beside the server: healthy once the models are, and
    an image chat request through it gives what Triton's generate gives."""
    import base64
    import time

    import openai

    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "the OpenAI endpoint of make serve did not become healthy"
        time.sleep(0.5)
    url = "data:image/png;base64," + base64.b64encode(image_bytes(72, 56, seed=5)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe the picture."}]}]
    want = generate(server.grpc_url, "epd", GenerateInputs(messages=messages, sampling=GREEDY), timeout=120)
    got = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model="epd", messages=messages, **GREEDY)
    assert got.choices[0].message.content == want.text


def test_make_serve_on_other_ports(tmp_path):
    (openai_port,) = free_ports(1)
    env = {**user_env(), "OPENAI_PORT": str(openai_port)}  # HTTP_PORT, GRPC_PORT, METRICS_PORT: the harness's
    server = TritonServer(log_path=tmp_path / "server.log", env=env,
                          argv=[shutil.which("make") or "make", "-C", str(ROOT), "serve"])
    before = _shm()
    with server:
        _same_tokens_through_every_deployment(server)
        _openai_answers_as_triton(server, openai_port)
    _stopped_clean(server, before)  # the endpoint too: it is in the server's process group


def test_the_in_process_endpoint_topology_as_the_docs_start_it(tmp_path):
    """docs/openai.md's command: ``backend.deploy.local_server --topology topologies/cpu-e-pd-openai.yaml --openai-port N``
    (the endpoint in epd's own process, colocated orchestrator): an image chat request through it gives what Triton's
    generate of the same model gives; the server stops clean."""
    (openai_port,) = free_ports(1)
    argv = [str(VENV / "bin" / "python"), "-m", "backend.deploy.local_server", "--topology",
            str(ROOT / "topologies" / "cpu-e-pd-openai.yaml"), "--openai-port", str(openai_port)]
    server = TritonServer(log_path=tmp_path / "server.log", env=user_env(), argv=argv)  # the ports: the harness's
    before = _shm()
    with server:
        _openai_answers_as_triton(server, openai_port)
    _stopped_clean(server, before)
    assert f"(in the served model's process) on http://127.0.0.1:{openai_port}/v1" in (tmp_path / "server.log").read_text()


def test_tritonserver_run_directly_with_its_own_flags(server):
    """The README's ``.venv/bin/tritonserver --model-repository model_repository --http-port ...`` is how the suite's
    session server starts (``tests/e2e/conftest.py``): its stop is checked clean there, at the session's end."""
    assert server.started_argv == readme_command(server.ports)
    _same_tokens_through_every_deployment(server)


def test_the_readme_server_s_engine_cores_are_forked_from_their_stubs(server):
    """Each EngineCore of the session server (4 engines) is a fork of its Triton stub (``EPD_ENGINE_START_METHOD``'s
    default), not a spawned interpreter: spawned, each imports torch and vLLM again (~10 s of CPU against ~2 s), which
    went unseen for a day (docs/results/ci-time.md, twelfth session)."""
    cores = {}
    for pid in group_members(server.proc.pid):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore"):
                cores[pid] = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
    assert len(cores) == 4, cores
    assert all(exe.endswith("triton_python_backend_stub") for exe in cores.values()), cores


def test_a_server_without_grpc_refuses_epd_naming_the_stage(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "model_repository" / "epd", repo / "epd")  # alone: its load fails before any stage is asked
    checkpoint = ROOT / "models" / "tiny-qwen2-vl"
    config = (repo / "epd" / "config.pbtxt").read_text()
    (repo / "epd" / "config.pbtxt").write_text(config.replace('"../../models/tiny-qwen2-vl"', f'"{checkpoint}"'))
    def argv(ports):
        return [str(VENV / "bin" / "tritonserver"), f"--model-repository={repo}", "--allow-grpc=false",
                "--exit-on-error=false", f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
                f"--metrics-port={ports.metrics}"]

    server = TritonServer(log_path=tmp_path / "server.log", env=user_env(), argv=argv)
    server.is_ready = server._metrics_up  # not ready by design (epd failed): wait for the endpoints
    before = _shm()
    with server:
        request = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as resp:
            [epd] = json.loads(resp.read())
    assert epd["state"] == "UNAVAILABLE", epd
    assert "stage pd is reached over this server's gRPC endpoint" in epd["reason"], epd
    assert "--allow-grpc=false" in epd["reason"] and "stages.pd.endpoint" in epd["reason"], epd
    _stopped_clean(server, before)
