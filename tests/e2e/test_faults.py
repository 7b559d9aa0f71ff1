"""E2E faults against real servers (one E+PD server with an encoder and an orchestrator per fault); nothing leaks
(fixture checks):
- leases that expire before any consumer can read them (``lease_seconds`` 1 ms): requests with media fail
  with a clear UNAVAILABLE after the orchestrator encoded their items again and retried once (counted in
  ``epd_retries_total``); text-only requests sent alongside succeed; the server keeps serving;
- overload: the encoder's pool full of leases nobody reads: requests with media fail fast with
  UNAVAILABLE naming the item, text-only ones succeed, reading the leases brings service back;
- an encoder instance (one of two) killed mid-request: its items are encoded again (on the live
  instance, or a clear UNAVAILABLE naming the item and the dead instance), the rest succeeds, the
  server keeps serving; Triton 2.51 neither restarts the stub nor removes its /dev/shm region;
- E/P/D (its own rendering, explicit model control): a request past the deadline fails with UNAVAILABLE naming
  the phase, its stages' KV comes back, requests alongside succeed; with `prefill` or `decode` unloaded, requests
  fail with UNAVAILABLE naming the stage after one retry, and succeed again once it is loaded."""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend.deploy.local_server import ROOT, TritonServer
from backend.deploy.render import render
from backend.deploy.topology import load
from backend.protocol import errors
from backend.protocol.generate import GenerateInputs
from clients.triton_client import GenerateError, generate
from tests.e2e.conftest import (_shm, _shm_of_this_process, clone_model, held_shm, left_behind, metric,
                               settled_orphans)
from tests.images import image_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.solo]  # timing-bound: engines killed, stages reloaded (ModuleLocks)

GREEDY = {"temperature": 0.0, "max_tokens": 4}


# name -> (the encoder's parameters, its instances): one encoder and one `epd_<name>` orchestrator per fault below, all
# in one E+PD server over one pd engine (a server per fault cost CI an engine start each; reloading the encoder with a
# configuration override instead crashed tritonserver 2.51 with heap corruption as the old encoder unloaded)
POOL_BYTES = 8192  # the "full" variant's pool: room for three 64x48 items (2,112 bytes each with header and tags)
VARIANTS = {"expiring": ({"lease_seconds": "0.001"}, 1),
            "full": ({"pool_bytes": str(POOL_BYTES), "lease_seconds": "600"}, 1),
            "two": ({}, 2)}


@pytest.fixture(scope="module")
def e_pd_server(tmp_path_factory):
    """E+PD with an encoder and an orchestrator of each of ``VARIANTS`` (``encoder_<name>``, ``epd_<name>``)."""
    import shutil

    repo = tmp_path_factory.mktemp("e-pd-faults") / "repo"
    render(load(ROOT / "topologies" / "cpu-e-pd.yaml", "cpu"), repo)
    for name, (parameters, instances) in VARIANTS.items():
        clone_model(repo, "encoder", f"encoder_{name}", parameters, instances)
        clone_model(repo, "epd", f"epd_{name}", {"encoder_model": f"encoder_{name}"})
    shutil.rmtree(repo / "encoder")
    shutil.rmtree(repo / "epd")
    before = _shm()
    # the encoder with a killed instance never finishes unloading (Triton 2.51): the server would wait out its
    # default exit timeout (30 s, measured) for it; 15 s leaves the other models' unload (pd's: 7 s) whole
    with TritonServer(repo, log_path=repo.parent / "server.log", extra_args=["--exit-timeout-secs=15"]) as server:
        server.killed_regions, server.encoder_stubs = set(), _stubs(server, "encoder_two")
        yield server
        held = held_shm(server.proc.pid) - _shm_of_this_process()
    # Triton leaves a dead stub's region in /dev/shm (measured), and a model with a dead instance may not finish
    # unloading (measured in full suite runs: the server waited out its exit timeout, then either killed the
    # encoder's live stub or left it running until the launcher killed it). The launcher removed those processes
    # and regions; no other process or region may be left. An encoder stub killed before it unloaded also leaves its
    # pool's announcement (backend.transfer.announce), which the launcher removed too.
    assert set(server.stragglers) <= set(server.encoder_stubs), f"processes outlived tritonserver: {server.stragglers}"
    allowed = set(server.encoder_stubs.values()) | {f"epd-producers-{server.server_pid}"}
    assert server.killed_regions <= set(server.leftover_shm) <= allowed, (server.leftover_shm, allowed)
    assert not (leaked := settled_orphans(before)), f"/dev/shm entries leaked by the server: {leaked}"
    assert not left_behind(held - allowed), "/dev/shm entries leaked by the server"


def _variant(server, name: str):
    """The server with ``name``'s encoder and orchestrator as the ones its test asks (``server.epd``, ``.encoder``)."""
    server.epd, server.encoder = f"epd_{name}", f"encoder_{name}"
    return server


@pytest.fixture
def expiring_server(e_pd_server):
    """Leases that expire before any consumer can read them (1 ms)."""
    return _variant(e_pd_server, "expiring")


def _retries(server, what: str = "request") -> float:
    return metric(server, "epd_retries_total", model=server.epd, what=what)


def _ask(server, case):
    try:
        return generate(server.grpc_url, server.epd, GenerateInputs(**{"sampling": GREEDY, **case}), timeout=120)
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
    deadline = time.monotonic() + 5  # counters come in batches (CounterBatch)
    while _retries(expiring_server) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _retries(expiring_server) == before + 2
    again = _ask(expiring_server, text_only[0])  # still serving
    assert not isinstance(again, GenerateError) and again.text == results[2].text


# -- overload: the encoder's pool budget exhausted -------------------------------------------------------


@pytest.fixture
def full_pool_server(e_pd_server):
    """An encoder pool with room for three 64x48 items, leases that live 10 minutes: leases nobody reads fill it."""
    return _variant(e_pd_server, "full")


def _encode_directly(server, image: bytes):
    """One item straight to the encoder model (as a client that never passes the layout on would)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        tensor = grpcclient.InferInput("image", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[image]], dtype=np.object_))
        result = client.infer(server.encoder, [tensor], parameters={"epd_error_codes": True})
        return result.as_numpy("layout").reshape(-1)[0].decode()
    finally:
        client.close()


def _pool_leases(server) -> float:
    return metric(server, "epd_pool_leases", model=server.encoder)


def test_exhausted_encoder_pool_fails_new_requests_fast_and_recovers(full_pool_server):
    import time

    from tritonclient.utils import InferenceServerException

    from backend.protocol.layout import LayoutMetadata
    from backend.transfer.consumer import EmbeddingConsumer

    unread = []
    with pytest.raises(InferenceServerException, match="embedding pool full"):
        for i in range(10):  # leases nobody reads, until the pool is full
            unread.append(_encode_directly(full_pool_server, image_bytes(64, 48, seed=100 + i)))
    assert len(unread) in range(1, 10), unread  # the pool took some leases, not all ten

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


# -- an encoder instance dies mid-request ------------------------------------------------------------------
@pytest.fixture
def two_encoder_server(e_pd_server):
    """Two encoder instances (two stub processes), normal leases."""
    return _variant(e_pd_server, "two")


def _stubs(server, model: str) -> dict[int, str]:
    """PID -> /dev/shm region of ``model``'s live stub processes (children of this test's tritonserver)."""
    import psutil

    stubs = {}
    for child in psutil.Process(server.proc.pid).children():
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if any(part.endswith(f"/{model}/1/model.py") for part in cmd) and child.status() != psutil.STATUS_ZOMBIE:
            stubs[child.pid] = next(part for part in cmd if part.startswith("triton_python_backend_shm_region_"))
    return stubs


def test_an_encoder_instance_killed_mid_request_affects_only_its_requests(two_encoder_server):
    import os
    import signal
    import time

    server = two_encoder_server
    stubs = _stubs(server, server.encoder)
    assert len(stubs) == 2, stubs
    with_media = [dict(prompt="<|vision_start|><|image_pad|><|vision_end|>" * 3 + f"Compare {i}.",
                       images=[image_bytes(112, 112, seed=10 * i + k) for k in range(3)]) for i in range(8)]
    text_only = [dict(prompt=f"Count to {i}.") for i in range(3)]
    victim = min(stubs)
    down = f"{server.encoder} instance down"  # the error names the served encoder model (the variant's name)
    server.killed_regions.add(stubs[victim])
    retries = _retries(server, "encode")
    with ThreadPoolExecutor(11) as pool:
        futures = [pool.submit(_ask, server, case) for case in with_media + text_only]
        time.sleep(0.3)  # items are being encoded
        os.kill(victim, signal.SIGKILL)
        results = [f.result() for f in futures]
    for result in results[:8]:  # recovered by the retry on the other instance, or a clear error
        if isinstance(result, GenerateError):
            assert result.message.startswith("image[") and down in result.message, result.message
        else:
            assert result.finish_reason == "length"
    for ok in results[8:]:
        assert not isinstance(ok, GenerateError), ok
    assert len(_stubs(server, server.encoder)) == 1  # Triton 2.51 does not restart the stub
    later = [_ask(server, case) for case in with_media + text_only]  # still serving
    assert not any(isinstance(r, GenerateError) for r in later[8:]), later[8:]
    for result in later[:8]:
        assert not isinstance(result, GenerateError) or down in result.message, result
    assert any(not isinstance(r, GenerateError) for r in later[:8]), "no image request served after the kill"
    deadline = time.monotonic() + 5  # counters come in batches (CounterBatch)
    while _retries(server, "encode") <= retries and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _retries(server, "encode") > retries  # items sent to the dead instance were encoded again
    assert len(_stubs(server, server.encoder)) == 1


DEADLINE = 2.0  # seconds: the E/P/D faults server's request deadline (limits.request_timeout_seconds)
KV_LEASE = 6  # seconds: how long its prefill keeps a KV no decode read (transfer.kv_lease_seconds; vLLM's: 30)


@pytest.fixture(scope="module")
def epd_faults_server(tmp_path_factory):
    """E/P/D (1E+1P+1D) with a short request deadline, its models loaded and unloaded by the tests
    (explicit model control)."""
    repo = tmp_path_factory.mktemp("epd-faults") / "repo"
    topology = load(ROOT / "topologies" / "cpu-e-p-d.yaml", "cpu")
    stages = {**topology.stages, "encoder": dataclasses.replace(topology.stages["encoder"], instances=1)}
    render(dataclasses.replace(topology, stages=stages, limits={**topology.limits, "request_timeout_seconds": DEADLINE},
                               transfer={**topology.transfer, "kv_lease_seconds": KV_LEASE}), repo)
    before = _shm()
    with TritonServer(repo, log_path=repo.parent / "server.log",
                      extra_args=["--model-control-mode=explicit", "--load-model=*"]) as server:
        server.epd, server.encoder = "epd", "encoder"  # what _ask and the helpers above call
        yield server
    assert not server.stragglers, f"processes outlived tritonserver: {server.stragglers}"
    assert not server.leftover_shm, f"stubs killed at exit left their /dev/shm regions: {server.leftover_shm}"
    assert not (leaked := settled_orphans(before)), f"/dev/shm entries leaked by the server: {leaked}"


def _wait_unloaded(client, model: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = next((m.get("state") for m in client.get_model_repository_index() if m["name"] == model), None)
        if state == "UNAVAILABLE":
            return
        time.sleep(0.2)
    raise AssertionError(f"{model} still not unloaded after {seconds} s")


def _kv_usage(server) -> dict[str, float]:
    return {m: metric(server, "epd_vllm_kv_cache_usage", model=m) for m in ("prefill", "decode")}


def test_a_slow_request_fails_at_the_deadline_and_frees_its_stages(epd_faults_server):
    """A request that runs past the deadline (3000 tokens; 4-token requests take a few tens of ms) fails with
    UNAVAILABLE naming the deadline and the phase; decode's request is cancelled and both engines' KV comes back;
    requests sent alongside succeed."""
    server = epd_faults_server
    image = dict(prompt="<|vision_start|><|image_pad|><|vision_end|>Describe.", images=[image_bytes(64, 48, seed=7)])
    assert not isinstance(_ask(server, image), GenerateError)  # warm: NIXL connections made
    slow = {**image, "sampling": {"temperature": 0.0, "max_tokens": 3000, "ignore_eos": True}}
    with ThreadPoolExecutor(4) as pool:
        started = time.monotonic()
        late = pool.submit(_ask, server, slow)
        time.sleep(0.3)
        quick = list(pool.map(lambda i: _ask(server, dict(prompt=f"Count to {i}.")), range(3)))
        failed = late.result()
        elapsed = time.monotonic() - started
    assert isinstance(failed, GenerateError), failed
    assert failed.message == f"request: deadline of {DEADLINE:g} s exceeded while generating", failed.message
    assert DEADLINE <= elapsed < DEADLINE + 5, elapsed
    assert not any(isinstance(r, GenerateError) for r in quick), quick
    deadline = time.monotonic() + 10
    while any(_kv_usage(server).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _kv_usage(server) == {"prefill": 0.0, "decode": 0.0}


def _stopped(server, model: str) -> float:
    """Requests ``model`` ended at their deadline, or cancelled by the orchestrator that saw it first (0 before any)."""
    total = 0.0
    for outcome in ("deadline", "cancelled"):
        try:
            total += metric(server, "epd_requests_total", model=model, outcome=outcome, wait_s=0)
        except AssertionError:  # not exported yet
            pass
    return total


def test_a_request_s_own_deadline_stops_prefill_and_decode_and_is_counted_there(epd_faults_server):
    """``deadline_ms`` (shorter than the server's): the E/P/D request fails with DeadlineExceeded while decode
    generates, and decode stops it (its own deadline or the orchestrator's cancel: counted, its KV back); prefill,
    asked directly with a deadline already past, refuses the request before its engine gets it (counted)."""
    server = epd_faults_server
    decode_before = _stopped(server, "decode")
    slow = dict(prompt="Describe.", sampling={"temperature": 0.0, "max_tokens": 3000, "ignore_eos": True},
                parameters={"deadline_ms": 700, "epd_error_codes": True})
    started = time.monotonic()
    failed = _ask(server, slow)
    assert isinstance(failed, GenerateError) and time.monotonic() - started < DEADLINE, failed
    assert isinstance(errors.decode(failed.message), errors.DeadlineExceeded), failed.message
    deadline = time.monotonic() + 10
    while _stopped(server, "decode") < decode_before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _stopped(server, "decode") == decode_before + 1
    before = _stopped(server, "prefill")
    with pytest.raises(GenerateError) as info:
        generate(server.grpc_url, "prefill", GenerateInputs(prompt="Describe.", sampling=GREEDY, parameters={
            "epd_deadline": f"{time.time() - 1:.3f}", "epd_error_codes": True}), timeout=60)
    assert isinstance(errors.decode(info.value.message), errors.DeadlineExceeded), info.value.message
    assert "before this stage started it" in info.value.message
    deadline = time.monotonic() + 5
    while _stopped(server, "prefill") < before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _stopped(server, "prefill") == before + 1
    while any(_kv_usage(server).values()) and time.monotonic() < deadline + 5:
        time.sleep(0.2)
    assert _kv_usage(server) == {"prefill": 0.0, "decode": 0.0}


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_an_unavailable_stage_fails_requests_clearly_until_it_is_back(epd_faults_server, stage):
    """With `decode` (or `prefill`) unloaded, E/P/D requests fail with UNAVAILABLE naming the stage (after the
    orchestrator's one retry), the server keeps serving, and once the stage is loaded again requests succeed.
    The KV prefill kept for the decode that never came goes back at the end of its KV lease (``KV_LEASE``)."""
    import tritonclient.http as httpclient

    server = epd_faults_server
    client = httpclient.InferenceServerClient(server.http_url)  # closed below: an open connection delays the stop 30 s
    case = dict(prompt="<|vision_start|><|image_pad|><|vision_end|>What is it?", images=[image_bytes(80, 64, seed=3)])
    want = _ask(server, case)
    assert not isinstance(want, GenerateError), want
    retries = metric(server, "epd_retries_total", model="epd", what="request")
    client.unload_model(stage)
    try:
        _wait_unloaded(client, stage)
        failed = [_ask(server, case), _ask(server, dict(prompt="Hello."))]
        failed_at = time.monotonic()
        for result in failed:
            assert isinstance(result, GenerateError), result
            assert result.message.startswith(f"stage {stage} unavailable: "), result.message
        assert client.is_model_ready("epd") and client.is_model_ready("encoder")
        deadline = time.monotonic() + 5  # counters come in batches (CounterBatch)
        while metric(server, "epd_retries_total", model="epd", what="request") < retries + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(server, "epd_retries_total", model="epd", what="request") == retries + 2  # one per request
    finally:
        _wait_unloaded(client, stage)  # the old instance's finalize done (it removes its metric families)
        client.load_model(stage)
        client.close()
    again = _ask(server, case)
    assert not isinstance(again, GenerateError), again
    assert again.text == want.text
    # every KV goes back within a lease of the last request that could hold one: the failed ones, or ``again`` (the
    # stage's reload is an engine start: on a slow machine it outlasted failed_at + KV_LEASE + 15 and the check
    # then read again's KV before decode had released it, 2026-12-05)
    settle_by = max(failed_at, time.monotonic()) + KV_LEASE + 15
    while any(_kv_usage(server).values()) and time.monotonic() < settle_by:
        time.sleep(0.5)
    assert _kv_usage(server) == {"prefill": 0.0, "decode": 0.0}


def test_a_restarted_encoder_is_a_new_producer_its_consumers_reach(epd_faults_server):
    """The encoder unloaded: requests with media fail with UNAVAILABLE naming the item and the stage (after
    the item's one re-encode), text-only requests succeed. Loaded again, it is a new producer (new process,
    NIXL agent and pool): prefill adds it as a remote agent and pulls from it, and a request gives the
    tokens it gave before."""
    import tritonclient.http as httpclient

    server = epd_faults_server
    client = httpclient.InferenceServerClient(server.http_url)
    case = dict(prompt="<|vision_start|><|image_pad|><|vision_end|>And this?", images=[image_bytes(96, 64, seed=5)])
    want = _ask(server, case)
    assert not isinstance(want, GenerateError), want
    encoders = want.timings["encoders"]
    client.unload_model("encoder")
    try:
        _wait_unloaded(client, "encoder")
        failed, text_only = _ask(server, case), _ask(server, dict(prompt="Still there?"))
        assert isinstance(failed, GenerateError), failed
        assert failed.message.startswith("image[0]: stage encoder unavailable: "), failed.message
        assert not isinstance(text_only, GenerateError), text_only
    finally:
        _wait_unloaded(client, "encoder")
        client.load_model("encoder")
        client.close()
    again = _ask(server, dict(case, images=[image_bytes(96, 64, seed=5)]))
    assert not isinstance(again, GenerateError), again
    assert again.text == want.text and again.timings["encoders"] != encoders  # another producer agent


def test_openai_health_is_503_while_a_stage_is_down_and_requests_needing_it_are_503(epd_faults_server):
    """``frontend.openai`` in front of this server (explicit model control): the encoder unloaded, /health answers
    503 naming it while ``epd`` itself is still READY, and a chat request with an image is a 503 error object; loaded
    again, 200 and answered."""
    import openai
    import tritonclient.http as httpclient

    from tests.e2e.conftest import openai_endpoint
    from tests.e2e.test_openai import CASES, _health

    server = epd_faults_server
    with openai_endpoint(server.grpc_url, models="epd") as base:
        status, ready = _health(base)
        assert status == 200 and ready["ready"]["encoder"] and all(ready["ready"].values()), ready
        control = httpclient.InferenceServerClient(server.http_url)  # closed before the stop: an open HTTP
        try:  # connection holds tritonserver 30 s at exit, then it kills the stubs (a vLLM semaphore leaked so)
            control.unload_model("encoder")
            deadline = time.monotonic() + 60
            while _health(base)[0] == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _health(base) == (503, {"ready": {**ready["ready"], "encoder": False}})
            sdk = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.APIStatusError) as info:
                sdk.chat.completions.create(model="epd", messages=CASES["image"], **GREEDY)
            assert info.value.status_code == 503, info.value
        finally:
            _wait_unloaded(control, "encoder")
            control.load_model("encoder")
            control.close()
        assert _health(base)[0] == 200
        assert sdk.chat.completions.create(model="epd", messages=CASES["image"], **GREEDY).choices[0].message.content
