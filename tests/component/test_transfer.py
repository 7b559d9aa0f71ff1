"""Component tests: real NIXL transfers between two processes (no Triton)."""
from __future__ import annotations

import time

import pytest
import torch

from backend.protocol.errors import Overloaded, Unavailable
from backend.protocol.layout import LayoutMetadata
from backend.transfer.consumer import EmbeddingConsumer
from backend.transfer.producer import EmbeddingPool
from devtools.diagnostics.pool_process import ProducerProcess, make_layout

pytestmark = pytest.mark.component


@pytest.fixture(scope="module", params=["same_host_copy", "nixl_read"])
def consumer(request):
    """Both data paths: the same-host copy out of the producer's memfd, and a NIXL READ."""
    return EmbeddingConsumer(same_host_copy=request.param == "same_host_copy")


def test_pull_returns_the_producer_tensor_and_releases_the_lease(consumer):
    tensor = torch.randn(37, 128)
    with ProducerProcess() as producer:
        layout = make_layout(producer.call("publish", tensor), tensor)
        layout = LayoutMetadata.from_json(layout.to_json(), "image_layouts[0]", expected_model="m")  # wire round trip
        assert producer.call("state", layout.handle.lease_id) == "published"
        pulled = consumer.pull(layout)
        assert torch.equal(pulled, tensor)
        assert producer.wait_state(layout.handle.lease_id, None) is None  # released on the notification
        stats = producer.call("stats")
        assert stats.open_leases == 0 and stats.released_total == 1 and stats.used_bytes == 0


def test_bfloat16_round_trip(consumer):
    tensor = torch.randn(5, 64).to(torch.bfloat16)
    with ProducerProcess() as producer:
        assert torch.equal(consumer.pull(make_layout(producer.call("publish", tensor), tensor)), tensor)


def test_read_after_release_is_detected(consumer):
    tensor = torch.randn(8, 128)
    with ProducerProcess() as producer:
        layout = make_layout(producer.call("publish", tensor), tensor)
        assert producer.call("release", layout.handle.lease_id) is True
        with pytest.raises(Unavailable, match="released or expired before the read"):
            consumer.pull(layout)


def test_expired_lease_is_reclaimed_and_refused(consumer):
    tensor = torch.randn(8, 128)
    with ProducerProcess(lease_seconds=0.2) as producer:
        layout = make_layout(producer.call("publish", tensor), tensor)
        assert producer.wait_state(layout.handle.lease_id, None) is None
        assert producer.call("stats").expired_total == 1
        with pytest.raises(Unavailable, match="expired"):
            consumer.pull(layout)  # refused by the consumer's expiry check
        late = EmbeddingConsumer(expiry_margin=-3600, same_host_copy=consumer.same_host_copy)  # skip that check
        with pytest.raises(Unavailable, match="released or expired"):
            late.pull(layout)


def test_corrupting_the_producer_buffer_changes_what_is_pulled(consumer):
    tensor = torch.randn(16, 128)
    with ProducerProcess() as producer:
        layout = make_layout(producer.call("publish", tensor), tensor)
        producer.call("corrupt", layout.handle.lease_id)
        assert not torch.equal(consumer.pull(layout), tensor)


def test_dead_producer_fails_the_pull_and_a_new_producer_works(consumer):
    tensor = torch.randn(8, 128)
    producer = ProducerProcess()
    layout = make_layout(producer.call("publish", tensor), tensor)
    producer.proc.kill()
    producer.proc.join(5)
    with pytest.raises(Unavailable):
        consumer.pull(layout)
    with ProducerProcess() as again:  # a restarted producer: the consumer connects afresh
        assert torch.equal(consumer.pull(make_layout(again.call("publish", tensor), tensor)), tensor)


def test_producer_restarted_under_the_same_agent_name_is_reconnected(consumer):
    """A producer restart (new process, new NIXL agent with the old name): the consumer notices the new
    metadata, removes the old remote agent, adds the new one, and the first pull already succeeds."""
    tensor = torch.randn(8, 128)
    name = f"encoder-restart-{consumer.same_host_copy}-{time.monotonic_ns()}"
    first = ProducerProcess(agent_name=name)
    try:
        assert torch.equal(consumer.pull(make_layout(first.call("publish", tensor), tensor)), tensor)
        stale = make_layout(first.call("publish", tensor), tensor)
    finally:
        first.proc.kill()
        first.proc.join(5)
    with ProducerProcess(agent_name=name) as again:
        layout = make_layout(again.call("publish", tensor * 2), tensor)
        assert layout.handle.agent_name == name and layout.handle.agent_metadata != stale.handle.agent_metadata
        assert torch.equal(consumer.pull(layout), tensor * 2)
        assert again.wait_state(layout.handle.lease_id, None) is None  # the release reached the new producer
        assert torch.equal(consumer.pull(make_layout(again.call("publish", tensor), tensor)), tensor)


def test_full_pool_applies_backpressure_then_fails_unavailable():
    pool = EmbeddingPool(pool_bytes=4096, alloc_timeout=0.1)
    try:
        first = pool.publish(torch.zeros(700, dtype=torch.float32))  # 2800 B + header: most of the pool
        started = time.monotonic()
        with pytest.raises(Unavailable, match="embedding pool full"):
            pool.publish(torch.zeros(700, dtype=torch.float32))
        assert 0.09 <= time.monotonic() - started < 1.0
        assert pool.release(first.lease_id)
        pool.publish(torch.zeros(700, dtype=torch.float32))  # space is back
        with pytest.raises(Unavailable):
            pool.publish(torch.zeros(2000, dtype=torch.float32))  # larger than the whole pool
        assert pool.stats().open_leases == 1
    finally:
        pool.close()


def test_an_overloaded_pool_fails_further_allocations_at_once():
    """After one allocation waited alloc_timeout in vain, others fail at once for alloc_timeout (their
    waits would queue up behind the encoder); released space is used at once; then waiting resumes."""
    pool = EmbeddingPool(pool_bytes=4096, alloc_timeout=0.3)
    try:
        first = pool.publish(torch.zeros(700, dtype=torch.float32))
        started = time.monotonic()
        with pytest.raises(Overloaded, match="embedding pool full"):
            pool.publish(torch.zeros(700, dtype=torch.float32))
        assert time.monotonic() - started >= 0.29
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(Overloaded):
                pool.publish(torch.zeros(700, dtype=torch.float32))
            assert time.monotonic() - started < 0.1
        assert pool.release(first.lease_id)
        second = pool.publish(torch.zeros(700, dtype=torch.float32))  # room: no wait, no failure
        time.sleep(0.35)
        started = time.monotonic()
        with pytest.raises(Overloaded):
            pool.publish(torch.zeros(700, dtype=torch.float32))
        assert time.monotonic() - started >= 0.29  # backpressure again
        assert pool.release(second.lease_id)
    finally:
        pool.close()


def test_same_host_copy_is_chosen_only_on_the_same_host():
    tensor = torch.randn(4, 128)
    with ProducerProcess() as producer:
        doc = producer.call("publish", tensor)
        local = EmbeddingConsumer()
        assert torch.equal(local.pull(make_layout(doc, tensor)), tensor) and len(local._shm.maps) == 1
        remote_doc = dict(producer.call("publish", tensor), host="another-host")
        other = EmbeddingConsumer()
        assert torch.equal(other.pull(make_layout(remote_doc, tensor)), tensor) and other._shm.maps == {}
    # the first producer is gone: its mapping is dropped on the next pull
    with ProducerProcess() as again:
        doc = again.call("publish", tensor)
        assert torch.equal(local.pull(make_layout(doc, tensor)), tensor)
        assert len(local._shm.maps) == 1  # only the live producer's mapping is held


def test_idle_agents_do_not_spin(consumer):
    tensor = torch.randn(64, 128)
    with ProducerProcess() as producer:
        consumer.pull(make_layout(producer.call("publish", tensor), tensor))  # progress threads now active
        before = producer.call("cpu")
        time.sleep(2.0)
        used = producer.call("cpu") - before
        assert used < 0.2, f"idle producer used {used / 2.0:.0%} of a core"  # a spinning agent uses ~100%


def test_warm_connects_ahead_so_the_first_pull_adds_no_peer_and_maps_nothing():
    """``EmbeddingConsumer.warm`` with the pool's announced handle (``backend.transfer.announce``): the first pull
    then finds the producer's agent added and its pool mapped, and returns the right bytes."""
    from backend.protocol.layout import TransferHandle

    tensor = torch.randn(24, 64)
    with ProducerProcess() as producer:
        consumer = EmbeddingConsumer()
        try:
            pool = TransferHandle.from_doc(producer.call("pool_handle"), "announcement")
            assert pool.lease_id == "" and pool.nbytes == 0 and pool.shm_path and pool.transport == "shared_memory"
            consumer.warm(pool)
            assert pool.agent_name in consumer._peers and (pool.agent_name, "pool") in consumer._shm.maps
            added = []
            consumer.agent.add_remote_agent = lambda metadata: added.append(metadata)  # must not be needed now
            mapped = dict(consumer._shm.maps)
            layout = make_layout(producer.call("publish", tensor), tensor)
            assert torch.equal(consumer.pull(layout), tensor)
            assert added == [] and consumer._shm.maps == mapped and consumer.paths["shared_memory"] == 1
            assert producer.wait_state(layout.handle.lease_id, None) is None  # released as usual
        finally:
            consumer.close()
        dead = EmbeddingConsumer()
        dead.warm(TransferHandle.from_doc({**producer.call("pool_handle"), "agent_metadata": "AAAA"}, "x"))  # bad: logged
        assert dead._peers == {}
        dead.close()


def test_the_process_counts_its_agents(consumer):
    """``agents_in_process``: what an engine start reads before forking an EngineCore (``backend.engine.host.engine_start_method``)."""
    from backend.transfer.agent import agents_in_process

    assert agents_in_process() >= 1  # the consumer's
    before = agents_in_process()
    EmbeddingConsumer(role="counted")
    assert agents_in_process() == before + 1
