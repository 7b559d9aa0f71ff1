"""E2E faults against a real server: an E+PD rendering whose embedding leases expire before any consumer
can read them (``lease_seconds`` 1 ms). Requests with media fail with a clear UNAVAILABLE after the
orchestrator encoded their items again and retried once (counted in ``epd_retries_total``); text-only
requests sent alongside succeed; the server keeps serving; nothing leaks (fixture checks)."""
from __future__ import annotations

import dataclasses
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend.topology import load, render
from clients.local_server import ROOT, TritonServer
from clients.triton_client import GenerateError, GenerateInputs, generate
from tests.e2e.conftest import _shm, orphaned_shm
from tests.images import image_bytes

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0.0, "max_tokens": 4}


@pytest.fixture(scope="module")
def expiring_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("expiring-leases") / "repo"
    topology = load(ROOT / "topologies" / "cpu-e-pd.yaml", "cpu")
    render(dataclasses.replace(topology, transfer={**topology.transfer, "lease_seconds": 0.001}), repo)
    before = _shm()
    with TritonServer(repo, log_path=repo.parent / "server.log") as server:
        yield server
    assert not server.stragglers, f"processes outlived tritonserver: {server.stragglers}"
    assert not server.leftover_shm, f"stubs killed at exit left their /dev/shm regions: {server.leftover_shm}"
    assert not orphaned_shm(_shm() - before), "/dev/shm entries leaked by the server"


def _retries(server) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("epd_retries_total{") and 'model="epd"' in line and 'what="request"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("epd_retries_total{model=epd,what=request} not exported")


def _ask(server, case):
    try:
        return generate(server.grpc_url, "epd", GenerateInputs(sampling=GREEDY, **case), timeout=120)
    except GenerateError as exc:
        return exc


def test_expired_leases_fail_only_their_requests_after_one_retry(expiring_server):
    before = _retries(expiring_server)
    with_media = [dict(prompt=f"<|vision_start|><|image_pad|><|vision_end|>What is {i}?", images=[image_bytes(64, 48, seed=i)])
                  for i in range(2)]
    text_only = [dict(prompt=f"Count to {i}.") for i in range(2)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda case: _ask(expiring_server, case), with_media + text_only))
    for failed in results[:2]:
        assert isinstance(failed, GenerateError), failed
        assert failed.message.startswith("image[0]: ") and "expired" in failed.message, failed.message
    for ok in results[2:]:
        assert not isinstance(ok, GenerateError), ok
        assert ok.finish_reason == "length"
    assert _retries(expiring_server) == before + 2
    again = _ask(expiring_server, text_only[0])  # still serving
    assert not isinstance(again, GenerateError) and again.text == results[2].text


# -- overload: the encoder's pool budget exhausted -------------------------------------------------------
POOL_BYTES = 8192  # room for three 64x48 items (2,112 bytes each with header and tags)


@pytest.fixture(scope="module")
def full_pool_server(tmp_path_factory):
    """E+PD whose encoder pool is tiny and whose leases live 10 minutes: leases nobody reads fill it."""
    repo = tmp_path_factory.mktemp("full-pool") / "repo"
    topology = load(ROOT / "topologies" / "cpu-e-pd.yaml", "cpu")
    render(dataclasses.replace(topology, transfer={**topology.transfer, "pool_bytes": POOL_BYTES, "lease_seconds": 600}), repo)
    before = _shm()
    with TritonServer(repo, log_path=repo.parent / "server.log") as server:
        yield server
    assert not server.stragglers, f"processes outlived tritonserver: {server.stragglers}"
    assert not server.leftover_shm, f"stubs killed at exit left their /dev/shm regions: {server.leftover_shm}"
    assert not orphaned_shm(_shm() - before), "/dev/shm entries leaked by the server"


def _encode_directly(server, image: bytes):
    """One item straight to the encoder model (as a client that never passes the layout on would)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        tensor = grpcclient.InferInput("image", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[image]], dtype=np.object_))
        result = client.infer("encoder", [tensor], parameters={"epd_error_codes": True})
        return result.as_numpy("layout").reshape(-1)[0].decode()
    finally:
        client.close()


def _pool_leases(server) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("epd_pool_leases{"))


def test_exhausted_encoder_pool_fails_new_requests_fast_and_recovers(full_pool_server):
    import time

    from tritonclient.utils import InferenceServerException

    from backend.layout import LayoutMetadata
    from backend.transfer.consumer import EmbeddingConsumer

    unread = []
    with pytest.raises(InferenceServerException, match="embedding pool full"):
        for i in range(10):  # leases nobody reads, until the pool is full
            unread.append(_encode_directly(full_pool_server, image_bytes(64, 48, seed=100 + i)))
    assert 1 <= len(unread) < 10

    def timed(case):
        started = time.monotonic()
        return _ask(full_pool_server, case), time.monotonic() - started

    with_media = [dict(prompt=f"<|vision_start|><|image_pad|><|vision_end|>What is {i}?", images=[image_bytes(64, 48, seed=i)])
                  for i in range(8)]
    text_only = [dict(prompt=f"Count to {i}.") for i in range(2)]
    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(timed, with_media + text_only))
    for failed, seconds in results[:8]:
        assert isinstance(failed, GenerateError), failed
        assert failed.message.startswith("image[0]: ") and "embedding pool full" in failed.message, failed.message
        assert seconds < 2.5, f"an overloaded request took {seconds:.1f} s to fail"
    for ok, _ in results[8:]:
        assert not isinstance(ok, GenerateError), ok
        assert ok.finish_reason == "length"

    consumer = EmbeddingConsumer(role="test-reader")  # the late reader: the leases are released
    for text in unread:
        consumer.pull(LayoutMetadata.from_json(text, "layout"))
    deadline = time.monotonic() + 10
    while _pool_leases(full_pool_server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pool_leases(full_pool_server) == 0
    again = _ask(full_pool_server, with_media[0])  # room again: served
    assert not isinstance(again, GenerateError) and again.finish_reason == "length"
