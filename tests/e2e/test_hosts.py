"""E2E across hosts: each topology host a network namespace with its own tritonserver (``tests.hosts_deploy``), gRPC
between them over the veth addresses, embeddings (and E/P/D's KV) over NIXL/UCX TCP on the hosts' ``eth0``; the
client on a host of its own. Same tokens as ``llm``; routing across two pd replicas; a host killed or cut off mid-load
(failover); nothing left behind."""
from __future__ import annotations

import time

import pytest

from backend.deploy.local_server import python_envs, unowned_python_envs
from backend.protocol.generate import GenerateInputs
from backend.protocol.modality import IMAGE
from clients.triton_client import GenerateError, GenerateResult
from tests.e2e.conftest import assert_same_answer
from tests.e2e.netns_fixture import checked_network
from tests.hosts_deploy import HostsDeployment, hosts_e_pd
from tests.images import image_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.netns, pytest.mark.memory_heavy]

CHAT = "<|im_start|>user\n{images}{text}<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0.0, "max_tokens": 16}
PD_1, PD_2 = "10.77.0.4:8001", "10.77.0.5:8001"  # the pd replicas' gRPC addresses
LONG = {"temperature": 0.0, "max_tokens": 96, "ignore_eos": True}  # streams long enough to be cut mid-way


def request(i: int, sampling: dict = GREEDY) -> GenerateInputs:
    """A one-image request, its image and question varied by ``i``."""
    w, h = [(64, 48), (112, 112), (200, 150), (48, 64)][i % 4]
    return GenerateInputs(prompt=CHAT.format(images=IMAGE.placeholder, text=f"Question {i}: what is this?"),
                          images=[image_bytes(w, h, seed=300 + i)], sampling=sampling)


@pytest.fixture(scope="module")
def e_pd(tmp_path_factory, server):  # the reference's server first: the directories below are the hosts' alone
    workdir = tmp_path_factory.mktemp("hosts-e-pd")
    envs = python_envs()
    # the consumers keep what they pulled and the orchestrator asks them first (demand-aware: docs/tier.md)
    topology = hosts_e_pd(workdir, pd_replicas=2, reuse={"held_bytes": 64 << 20, "demand_aware": True}, encoders=2)
    with checked_network(HostsDeployment.addresses(topology)) as net, HostsDeployment(topology, net, workdir) as deployed:
        yield deployed
    for host in deployed.servers.values():
        assert not host.stragglers, f"processes outlived {host.plan.name}'s tritonserver: {host.stragglers}"
    # the killed hosts' servers could not remove their Python backend's directory: the launcher did
    assert not (left := unowned_python_envs(envs)), left  # a server of another test (another xdist worker) may run


@pytest.fixture(scope="module")
def reference(server):
    """``llm``'s answers (the baseline, on the session's own server) to requests 0..7, greedy and long."""
    from tests.e2e.conftest import asker

    ask = asker(GREEDY)
    cache = {}

    def answer(i: int, sampling: dict = GREEDY) -> GenerateResult:
        key = (i, tuple(sorted(sampling.items())))
        if key not in cache:
            inputs = request(i, sampling)
            cache[key] = ask(server, "llm", prompt=inputs.prompt, images=inputs.images, sampling=sampling)
        return cache[key]
    return answer


def test_e_pd_across_hosts_gives_llm_s_tokens_with_embeddings_over_nixl_and_both_pd_replicas_used(e_pd, reference):
    before = {name: e_pd.metric(name, "epd_transfer_items_total", path="nixl") for name in ("pd-1", "pd-2")}
    futures = [e_pd.submit("epd", request(i)) for i in range(8)]
    replicas = []
    for i, future in enumerate(futures):
        got = future.result()
        assert isinstance(got, GenerateResult), got
        assert_same_answer(got, reference(i))
        replicas.append(got.timings["pd_replica"])
    assert sorted(set(replicas)) == [PD_1, PD_2], replicas  # concurrent requests spread over both
    time.sleep(1.5)  # counters are flushed in batches
    pulled = {name: e_pd.metric(name, "epd_transfer_items_total", path="nixl") - before[name] for name in before}
    assert pulled == {name: replicas.count(address) for name, address in (("pd-1", PD_1), ("pd-2", PD_2))}, pulled
    for name in pulled:
        assert e_pd.metric(name, "epd_transfer_items_total", path="shared_memory") == 0


def test_a_request_goes_to_the_replica_that_holds_its_items_and_skips_the_encoder(e_pd, reference):
    """Demand-aware routing: request 0's image is held by the replica that served it before; asked again, one at a
    time (round robin would alternate), it goes there every time, encoding nothing."""
    first = e_pd.ask("epd", request(0))
    assert_same_answer(first, reference(0))
    holder = first.timings["pd_replica"]
    for _ in range(4):
        again = e_pd.ask("epd", request(0))
        assert_same_answer(again, reference(0))
        assert (again.timings["pd_replica"], again.timings.get("held")) == (holder, 1), again.timings


def _outcomes(futures, reference, sampling) -> tuple[list[str], list[str]]:
    """The pd replica of each request that gave ``llm``'s answer, and the messages of those that failed (each must
    name the pd stage: a stream cut mid-way); anything else fails the test."""
    served, failed = [], []
    for i, future in enumerate(futures):
        got = future.result()
        if isinstance(got, GenerateError):
            assert "stage pd" in got.message, got
            failed.append(got.message)
        else:
            assert_same_answer(got, reference(i % 8, sampling))
            served.append(got.timings["pd_replica"])
    return served, failed


def _wave(e_pd, reference, n: int = 4) -> list[str]:
    """``n`` concurrent short requests, all answered as ``llm`` does: the pd replica of each."""
    served, failed = _outcomes([e_pd.submit("epd", request(i, GREEDY)) for i in range(n)], reference, GREEDY)
    assert not failed, failed
    return served


@pytest.mark.parametrize("fault", ["killed", "partitioned"])
def test_a_pd_host_lost_mid_load_fails_only_its_streams_and_is_routed_around_and_used_again(e_pd, reference, fault):
    """pd-2 dies (every process at once) or is cut off (its veth down) while 12 long streams run on both replicas:
    requests it had produced no token for go to pd-1; its streams end UNAVAILABLE naming the stage; new requests all
    succeed on pd-1 at once; once it is back (restarted, or the cable back in) it serves again."""
    first = [e_pd.submit("epd", request(i % 8, LONG)) for i in range(12)]
    time.sleep(1.0)  # the streams are running on both replicas
    e_pd.kill("pd-2") if fault == "killed" else e_pd.network.partition("pd-2")
    lost_at = time.monotonic()
    second = _wave(e_pd, reference, 6)  # sent before any health check ran: retried on pd-1 where they hit pd-2
    served, failed = _outcomes(first, reference, LONG)
    assert len(served) + len(failed) == 12 and PD_1 in served, (served, failed)  # pd-1's streams all ended
    assert all("10.77.0.5" in message for message in failed), failed  # the cut streams name the lost replica
    assert set(second) == {PD_1}
    assert time.monotonic() - lost_at < 30  # nothing waited for the lost host past its deadline
    assert set(_wave(e_pd, reference)) == {PD_1}  # routed around
    e_pd.start("pd-2") if fault == "killed" else e_pd.network.heal("pd-2")
    deadline = time.monotonic() + 30
    while PD_2 not in _wave(e_pd, reference):  # used again within a few health checks
        assert time.monotonic() < deadline, f"pd-2 not used again 30 s after it came back ({fault})"
        time.sleep(1.0)


def test_an_encoder_host_killed_mid_load_fails_no_request_and_its_items_are_encoded_again(e_pd, reference):
    """encode-2 dies while 12 requests of new images are being encoded and pulled: no token was produced for any of
    them, so every one is answered as ``llm`` answers (items it held encoded again on encode-1, the request asked
    again); new items then all go to encode-1; restarted, encode-2 encodes again."""
    want = [reference(100 + i) for i in range(12)]
    futures = [e_pd.submit("epd", request(100 + i)) for i in range(12)]  # images no consumer holds yet
    time.sleep(0.3)
    e_pd.kill("encode-2")
    for future, expected in zip(futures, want):
        got = future.result()
        assert isinstance(got, GenerateResult), got
        assert_same_answer(got, expected)
    time.sleep(1.5)  # counters are flushed in batches: the re-encodes of the requests above counted first
    before = e_pd.metric("encode-1", "epd_encoder_items_total")
    for i in range(4):
        assert isinstance(e_pd.ask("epd", request(300 + i)), GenerateResult)
    time.sleep(1.5)  # counters are flushed in batches
    assert e_pd.metric("encode-1", "epd_encoder_items_total") - before == 4  # routed around encode-2
    e_pd.start("encode-2")
    deadline, k = time.monotonic() + 30, 0
    while e_pd.metric("encode-2", "epd_encoder_items_total") == 0:
        assert time.monotonic() < deadline, "encode-2 not used again 30 s after it came back"
        assert isinstance(e_pd.ask("epd", request(400 + k)), GenerateResult)
        k += 1
        time.sleep(0.5)
