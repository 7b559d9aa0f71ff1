"""Routing across a stage's replicas (orchestrator.replicas): least loaded, healthy, preferred, lost."""
import asyncio

import pytest

from orchestrator.health import Lost, cancelled_here, unless
from orchestrator.replicas import LOST_AFTER, PREFER_SLACK, ReplicaSet, expand


def test_the_least_loaded_replica_is_picked_and_ties_go_to_the_one_that_served_fewest():
    replicas = ReplicaSet("pd", ["a:1", "b:1", "c:1"])
    first = replicas.pick()
    with replicas.using(first):
        second = replicas.pick()
        assert second is not first
        with replicas.using(second):
            third = replicas.pick()
            assert third not in (first, second)
            with replicas.using(third):
                pass
    assert [r.outstanding for r in replicas.replicas] == [0, 0, 0]
    # all idle, each served once: round robin goes on
    assert replicas.pick() is first


def test_lower_kv_cache_usage_breaks_a_tie_of_outstanding_calls():
    replicas = ReplicaSet("pd", ["a:1", "b:1"])
    replicas.answered("a:1", True, kv_usage=0.9)
    replicas.answered("b:1", True, kv_usage=0.1)
    assert replicas.pick().address == "b:1"
    replicas.answered("a:1", True, kv_usage=0.03)  # an idle engine's last step: no preference, round robin
    replicas.answered("b:1", True, kv_usage=0.0)
    with replicas.using(replicas.get("b:1")):
        pass
    assert replicas.pick().address == "a:1"


def test_a_failed_replica_is_routed_around_until_a_health_check_finds_it():
    replicas = ReplicaSet("pd", ["a:1", "b:1"])
    replicas.failed("a:1", "connection refused")
    assert replicas.get("a:1").lost.is_set()
    assert {replicas.pick().address for _ in range(4)} == {"b:1"}
    replicas.answered("a:1", True)
    assert not replicas.get("a:1").lost.is_set()
    with replicas.using(replicas.get("b:1")):
        assert replicas.pick().address == "a:1"


def test_one_failed_health_check_routes_around_and_lost_after_several_in_a_row():
    replicas = ReplicaSet("decode", ["a:1", "b:1"])
    for check in range(1, LOST_AFTER + 1):
        replicas.answered("a:1", False, why="timeout")
        assert not replicas.get("a:1").healthy
        assert replicas.get("a:1").lost.is_set() == (check >= LOST_AFTER)
    replicas.answered("a:1", True)
    assert replicas.get("a:1").healthy and replicas.get("a:1").failures == 0


def test_a_slow_call_routes_around_without_counting_the_replica_lost():
    replicas = ReplicaSet("encoder", ["a:1", "b:1"])
    replicas.failed("a:1", "deadline exceeded", lost=False)
    assert not replicas.get("a:1").healthy and not replicas.get("a:1").lost.is_set()


def test_with_every_replica_down_the_one_that_failed_longest_ago_is_tried():
    replicas = ReplicaSet("pd", ["a:1", "b:1"])
    replicas.failed("b:1", "x")
    replicas.failed("a:1", "x")
    assert replicas.pick().address == "b:1"


def test_a_preferred_replica_is_taken_unless_it_is_overloaded_or_down():
    replicas = ReplicaSet("pd", ["a:1", "b:1"])
    a = replicas.get("a:1")
    a.outstanding = PREFER_SLACK
    assert replicas.pick(prefer="a:1") is a
    a.outstanding = PREFER_SLACK + 1
    assert replicas.pick(prefer="a:1").address == "b:1"
    a.outstanding = 0
    replicas.failed("a:1", "x")
    assert replicas.pick(prefer="a:1").address == "b:1"
    assert replicas.pick(prefer="nowhere:1").address == "b:1"


def test_exclude_avoids_a_replica_unless_nothing_else_is_left():
    replicas = ReplicaSet("pd", ["a:1", "b:1"])
    assert replicas.pick(exclude=["a:1"]).address == "b:1"
    assert replicas.pick(exclude=["a:1", "b:1"]).address in ("a:1", "b:1")


def test_names_resolve_to_every_address_and_literals_stay():
    assert asyncio.run(expand("10.1.2.3:8001")) == ["10.1.2.3:8001"]
    assert asyncio.run(expand("[::1]:8001")) == ["[::1]:8001"]
    assert asyncio.run(expand("localhost:8001")) == ["localhost:8001"]
    assert asyncio.run(expand("no-such-host.invalid:8001")) == ["no-such-host.invalid:8001"]


def test_a_refresh_adds_new_addresses_and_drops_gone_ones_once_idle(monkeypatch):
    answers = {"pods:8001": ["10.0.0.1:8001", "10.0.0.2:8001"]}

    async def fake_expand(entry):
        return answers[entry]

    monkeypatch.setattr("orchestrator.replicas.expand", fake_expand)
    replicas = ReplicaSet("pd", ["pods:8001"])
    asyncio.run(replicas.refresh())
    assert [r.address for r in replicas.replicas] == ["10.0.0.1:8001", "10.0.0.2:8001"]
    busy = replicas.get("10.0.0.1:8001")
    answers["pods:8001"] = ["10.0.0.2:8001", "10.0.0.3:8001"]
    with replicas.using(busy):
        asyncio.run(replicas.refresh())
        assert replicas.get("10.0.0.1:8001") is busy  # still in flight: kept until idle
    asyncio.run(replicas.refresh())
    assert sorted(r.address for r in replicas.replicas) == ["10.0.0.2:8001", "10.0.0.3:8001"]


def test_a_health_check_probes_every_replica_and_a_hung_probe_counts_as_failed():
    replicas = ReplicaSet("pd", ["a:1", "b:1", "c:1"])

    async def probe(address):
        if address == "b:1":
            await asyncio.sleep(10)
        if address == "c:1":
            raise ConnectionError("refused")
        return True, 0.25

    asyncio.run(replicas.check(probe, timeout=0.05))
    assert [(r.address, r.healthy, r.kv_usage) for r in replicas.replicas] == [
        ("a:1", True, 0.25), ("b:1", False, 0.0), ("c:1", False, 0.0)]


def test_no_addresses_is_an_error_naming_the_stage():
    with pytest.raises(ValueError, match="stage pd: no replica addresses"):
        ReplicaSet("pd", [])


def test_a_call_its_closed_channel_cancels_as_the_replica_is_lost_is_lost_not_a_cancel_of_the_request():
    """The replica lost: its channel closes at once, which cancels the calls on it (grpc.aio raises
    ``CancelledError`` from a call cancelled locally); a call ended that way in the same turn of the loop as ``lost``
    woke its waiter is ``Lost`` too. Escaping as a ``CancelledError``, it ended the request's task with no answer: the
    HTTP stream never ended and the model never unloaded (test_hosts[partitioned], 1 in 3 runs)."""
    async def scenario():
        lost = asyncio.Event()

        async def call_on_the_channel():
            await lost.wait()  # on_lost closes the channel as lost is set
            raise asyncio.CancelledError

        asyncio.get_running_loop().call_later(0.01, lost.set)  # the health check finds it lost
        with pytest.raises(Lost):
            await unless(call_on_the_channel(), lost)
        assert not cancelled_here()  # the task itself was never cancelled
        lost.clear()

        async def answered():
            return "ok"
        assert await unless(answered(), lost) == "ok"

        async def slow():
            await asyncio.sleep(10)
        task = asyncio.ensure_future(unless(slow(), lost))
        await asyncio.sleep(0.01)
        lost.set()
        with pytest.raises(Lost):
            await task

    asyncio.run(scenario())
