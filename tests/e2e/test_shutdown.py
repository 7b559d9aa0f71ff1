"""E2E: requests through ``epd`` (E+PD: encoder over BLS, ``pd`` over the server's own gRPC endpoint) on the session
server (the README's command), some of them refused, some cancelled mid-stream; its stop at the session's end is checked
(``tests.e2e.conftest.check_clean_stop``): SIGTERM stops it well under tritonserver's 30 s exit timeout, every model
unloads, no stub has to be killed, no /dev/shm region, IPC directory or process is left.

The 30 s hang this guards against comes from Triton 2.51's gRPC frontend: a gRPC call that ends in a
cancel around its final response (a client closing its channel right after the last response, before the
server's status; or cancelling after an error response) can make it leak the stream's request, which
keeps the model from unloading (docs/results/robustness.md, "Shutdown"). The asyncio clients here open a channel
per request and close it after the stream, as the soak's do, and some cancel mid-stream: before
``clients.triton_client.read_to_end`` this stop took 30 s. It also caught ``pd``'s unload waiting 5 s on
multiprocessing's resource tracker (stop 12-17 s here before, 13.5 s in this test with a 10 s bound)."""
from __future__ import annotations

import asyncio

import pytest

from backend.deploy.local_server import TritonServer
from backend.protocol.generate import GenerateInputs
from clients.tools.soak import drive
from clients.triton_client import GenerateError, generate
from tests.images import image_bytes

pytestmark = pytest.mark.e2e

PH = "<|vision_start|><|image_pad|><|vision_end|>"


def test_epd_answers_refuses_and_is_cancelled_before_the_session_server_stops(server):
    for i in range(4):
        result = generate(server.grpc_url, "epd", GenerateInputs(
            prompt=f"{PH}What is {i}?", images=[image_bytes(64, 48, seed=i)], stream=bool(i % 2),
            sampling={"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}), timeout=120)
        assert result.finish_reason == "length"
    for i in range(4):  # refused: the error is the request's final response
        with pytest.raises(GenerateError, match="sampling_parameters.max_tokens"):
            generate(server.grpc_url, "epd", GenerateInputs(prompt=f"{PH}Bad {i}.", images=[image_bytes(64, 48, seed=i)],
                                                            sampling={"max_tokens": -1}), timeout=60)
    text_only = generate(server.grpc_url, "epd", GenerateInputs(prompt="Count.", sampling={"max_tokens": 4, "ignore_eos": True}))
    assert text_only.finish_reason == "length"
    # asyncio clients, a channel each, closed after the stream; a quarter cancel mid-stream (in band: a gRPC
    # stream cancel can deadlock or crash Triton 2.51, docs/results/robustness.md)
    outcomes, _, _ = asyncio.run(drive(server.grpc_url, "epd", 32, 8, cancel_fraction=0.25, timeout=120, seed=3,
                                       cancel_via="request"))
    assert outcomes["ok"] + outcomes["cancelled"] == 32 and outcomes["cancelled"] >= 2, outcomes


def test_a_port_taken_before_the_server_binds_it_is_picked_again(tmp_path, monkeypatch):
    """Free ports are only free when picked: another process (a parallel test run) may bind one first."""
    import socket

    from backend.deploy.local_server import Ports

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real, picks = Ports.free, []

    def free():  # the first pick has the taken port for HTTP
        ports = real()
        picks.append(ports if picks else Ports(taken.getsockname()[1], ports.grpc, ports.metrics))
        return picks[-1]

    monkeypatch.setattr(Ports, "free", staticmethod(free))
    (tmp_path / "empty-repo").mkdir()
    try:
        with TritonServer(tmp_path / "empty-repo", log_path=tmp_path / "server.log") as server:
            assert len(picks) == 2 and server.ports == picks[1] and server.is_ready()
    finally:
        taken.close()
