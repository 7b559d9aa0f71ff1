"""Embeddings across hosts: the project's producer pool (``EmbeddingPool``) in host a, its consumer
(``EmbeddingConsumer``) in host b, two network namespaces joined by veths (tests.netns), NIXL/UCX over TCP on the
veth (``tests.netns.ucx_env``: ``UCX_NET_DEVICES=eth0``, ``UCX_TLS=tcp``).

Checked: the bytes pulled are the bytes published; the consumer counted a NIXL pull, not a same-host copy (its host
identity differs from the producer's: another network namespace); the payload crossed the veths (their byte
counters); the lease was released at the producer. Beside it, a consumer in the producer's own host takes the
same-host path and moves nothing over the veth (the counters tell the two apart). Then the failures a host brings: a
partition fails the pull at the consumer's deadline and heals, a killed producer fails it at once.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from devtools.diagnostics.pool_process import ConsumerProcess, ProducerProcess
from tests.e2e.netns_fixture import checked_network
from tests.netns import Network, ucx_env

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (ip netns add)")]

ROOT = Path(__file__).resolve().parents[2]
HOSTS = {"a": "10.77.0.1", "b": "10.77.0.2", "c": "10.77.0.3"}


def launch(net: Network, host: str):
    return net.launch(host, env={**os.environ, **ucx_env()}, cwd=ROOT)


def veth_bytes(net: Network, host: str) -> tuple[int, int]:
    stats = net.link(host)["stats64"]
    return stats["rx"]["bytes"], stats["tx"]["bytes"]


@dataclass
class Hosts:
    net: Network
    producer: ProducerProcess  # in a
    consumer: ConsumerProcess  # in b
    local: ConsumerProcess     # in a, beside the producer
    doomed: ProducerProcess    # in c, for the test that kills its host


@pytest.fixture(scope="module")
def hosts():
    """The processes of every test here, started at once for the module (their start-up is most of the time)."""
    with checked_network(HOSTS) as net, contextlib.ExitStack() as stack:
        yield Hosts(net, stack.enter_context(ProducerProcess(pool_bytes=16 << 20, launch=launch(net, "a"))),
                    stack.enter_context(ConsumerProcess(timeout=1.0, launch=launch(net, "b"))),
                    stack.enter_context(ConsumerProcess(launch=launch(net, "a"))),
                    stack.enter_context(ProducerProcess(launch=launch(net, "c"))))


def test_embeddings_cross_hosts_through_nixl_over_the_veth(hosts):
    net, producer, consumer = hosts.net, hosts.producer, hosts.consumer
    tensor = torch.randn(2048, 256)  # 2 MiB
    assert producer.call("host") != consumer.call("host")
    b_rx, _ = veth_bytes(net, "b")
    _, a_tx = veth_bytes(net, "a")
    docs = [producer.call("publish", tensor) for _ in range(2)]
    assert all(doc["transport"] == "shared_memory" for doc in docs)  # same-host capable: the consumer must decline
    pulled = consumer.pull(docs, tensor)
    assert torch.equal(pulled["last"], tensor)
    assert pulled["paths"] == {"nixl": 2}
    payload = 2 * tensor.numel() * tensor.element_size()
    assert veth_bytes(net, "b")[0] - b_rx >= payload and veth_bytes(net, "a")[1] - a_tx >= payload
    assert all(producer.wait_state(doc["lease_id"], None) is None for doc in docs)  # released on the notification
    # the contrast: a consumer on the producer's host copies out of the pool's memfd, nothing crosses the veth
    doc = producer.call("publish", tensor)
    before = veth_bytes(net, "a")
    pulled = hosts.local.pull([doc], tensor)
    assert torch.equal(pulled["last"], tensor) and pulled["paths"] == {"shared_memory": 1}
    assert veth_bytes(net, "a")[1] - before[1] < payload // 4


def test_a_partition_fails_the_pull_at_its_deadline_and_healing_restores_it(hosts):
    net, producer, consumer = hosts.net, hosts.producer, hosts.consumer
    tensor = torch.randn(64, 256)
    assert torch.equal(consumer.pull([producer.call("publish", tensor)], tensor)["last"], tensor)  # connected
    net.partition("a")
    doc = producer.call("publish", tensor)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="Unavailable: embedding transfer from .* timed out after 1.0 s"):
        consumer.pull([doc], tensor)
    assert time.monotonic() - started < 5
    net.heal("a")
    assert torch.equal(consumer.pull([producer.call("publish", tensor)], tensor)["last"], tensor)


def test_a_killed_producer_host_fails_the_pull_at_once(hosts):
    net, producer, consumer = hosts.net, hosts.doomed, hosts.consumer
    tensor = torch.randn(64, 256)
    assert torch.equal(consumer.pull([producer.call("publish", tensor)], tensor)["last"], tensor)
    doc = producer.call("publish", tensor)
    assert net.kill_host("c")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="Unavailable: embedding transfer from .* failed"):
        consumer.pull([doc], tensor)
    assert time.monotonic() - started < 1.0
