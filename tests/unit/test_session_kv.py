"""``backend.engine.session_kv.SessionBlocks``: the index of the KV blocks kept for conversations (which prefix is
held, which slot a new block takes, what expires). The connector around it, with a real engine:
``tests/component/test_session_kv.py``."""
from __future__ import annotations

from backend.engine.session_kv import (SessionBlocks, connector_config, keeps_sessions, session_of,
                                      with_session_connector)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_prefix_matches_block_by_block_from_where_the_local_hit_ends_and_never_past_the_limit():
    blocks = SessionBlocks(8, 60)
    for h in ("a", "b", "c"):
        blocks.add(h, set())
    assert blocks.match(["a", "b", "c", "d"], 0, 4) == 3
    assert blocks.match(["a", "b", "c", "d"], 1, 4) == 3  # the local prefix cache had "a"
    assert blocks.match(["a", "b", "c"], 0, 2) == 2  # the last prompt token is the engine's to compute
    assert blocks.match(["x", "b", "c"], 0, 3) == 0  # a chain: nothing after a block not held
    assert blocks.slots_of(["a", "b"]) == [0, 1] and blocks.hits == 2


def test_over_the_store_s_size_the_least_recently_used_conversation_loses_its_last_blocks_first():
    clock = Clock()
    blocks = SessionBlocks(4, 60, clock)
    for conversation in ("a", "b"):  # a turn's blocks saved, then its prompt touched (the connector's order)
        for h in (f"{conversation}1", f"{conversation}2"):
            blocks.add(h, set())
        blocks.touch([f"{conversation}1", f"{conversation}2"])
        clock.now += 1
    blocks.touch(["a1", "a2"])  # conversation a's next turn
    clock.now += 1
    assert blocks.add("b3", set()) is not None  # the store is full: b's last block goes, not its first
    assert "b1" in blocks and "b2" not in blocks and blocks.match(["b1", "b2"], 0, 2) == 1
    assert blocks.add("a3", set()) is not None and "b1" not in blocks
    assert blocks.match(["a1", "a2", "a3"], 0, 3) == 3


def test_a_slot_the_step_copies_is_never_taken_and_a_full_busy_store_takes_nothing():
    blocks = SessionBlocks(2, 60)
    first = blocks.add("a", set())
    second = blocks.add("b", {first})
    assert blocks.add("c", {first, second}) is None
    assert blocks.add("c", {first}) == second and "a" in blocks and "b" not in blocks


def test_blocks_unused_for_session_seconds_are_freed():
    clock = Clock()
    blocks = SessionBlocks(4, 30, clock)
    blocks.add("old", set())
    clock.now += 20
    blocks.add("young", set())
    clock.now += 15  # old: 35 s unused, young: 15 s
    blocks.expire()
    assert "old" not in blocks and "young" in blocks and len(blocks) == 1


def test_a_request_s_session_comes_from_its_kv_transfer_params_and_the_config_names_this_module():
    class Request:
        def __init__(self, params):
            self.kv_transfer_params = params

    assert session_of(Request({"epd_session": "conv-1"})) == "conv-1"
    assert session_of(Request(None)) is None and session_of(Request({"epd_session": ""})) is None
    assert session_of(Request({"do_remote_decode": True})) is None
    config = connector_config(1 << 20, 60)
    assert config["kv_connector_module_path"] == "backend.engine.session_kv_connector"
    assert config["kv_connector_extra_config"] == {"session_kv_bytes": 1 << 20, "session_seconds": 60.0}


# -- the connector's two halves against fakes of vLLM's configuration, requests and scheduler output ---------------
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

BLOCK = 4  # tokens a block
BLOCKS = 6  # blocks in the fake engine's KV cache


class FullAttentionSpec:  # the connector keeps KV for one group of this kind only (its name is what it checks)
    pass


def _connector(role: str, kv_bytes: int, layers: int = 2, groups: int = 1):
    from backend.engine.session_kv_connector import KVConnectorRole, SessionKVConnector

    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
        "session_kv_bytes": kv_bytes, "session_seconds": 60}), cache_config=SimpleNamespace(block_size=BLOCK))
    block_bytes = 2 * 1 * BLOCK * 3 * 4  # a layer's (K and V, 1 head, BLOCK tokens, head size 3, float32) per block
    kv_cache = SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[SimpleNamespace(kv_cache_spec=FullAttentionSpec())] * groups,
                               kv_cache_tensors=[SimpleNamespace(size=BLOCKS * block_bytes)] * layers)
    return SessionKVConnector(config, getattr(KVConnectorRole, role), kv_cache)


def _request(rid: str, hashes: list[str], tokens: int, session: str | None = "conv"):
    return SimpleNamespace(request_id=rid, kv_transfer_params={"epd_session": session} if session else None,
                           block_hashes=hashes, num_tokens=tokens, num_prompt_tokens=tokens)


def _output(new=(), cached=(), scheduled=None):
    """A SchedulerOutput: ``new`` (request, block ids, computed tokens), ``cached`` (request id, new block ids,
    computed tokens), ``scheduled`` request id -> tokens this step."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(ids,), num_computed_tokens=c) for r, ids, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
                                              new_block_ids=[(ids,) if ids else None for _, ids, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=scheduled or {})


def test_the_scheduler_saves_a_session_s_prompt_blocks_and_loads_them_into_a_later_turn_s_blocks():
    sched = _connector("SCHEDULER", kv_bytes=8 * 2 * 96)  # 8 slots
    first = _request("t1", ["h0", "h1", "h2"], 3 * BLOCK + 1)
    assert sched.get_num_new_matched_tokens(first, 0) == (0, False)
    meta = sched.build_connector_meta(_output(new=[(first, [10, 11], 0)], scheduled={"t1": 2 * BLOCK}))  # a chunk
    assert (meta.loads, meta.saves) == ([], [(10, 0), (11, 1)])
    meta = sched.build_connector_meta(_output(cached=[("t1", [12, 13], 2 * BLOCK)], scheduled={"t1": BLOCK + 1}))
    assert meta.saves == [(12, 2)]  # the last block is not full of prompt: not saved
    assert sched.build_connector_meta(_output(cached=[("t1", None, 3 * BLOCK + 1)], scheduled={"t1": 1})).saves == []
    sched.request_finished(first, [10, 11, 12, 13])
    other = _request("x", ["h0", "h1"], 2 * BLOCK + 3, session=None)  # no session: neither loads nor saves
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
    second = _request("t2", ["h0", "h1", "h2", "h3"], 4 * BLOCK + 2)
    assert sched.get_num_new_matched_tokens(second, BLOCK) == (2 * BLOCK, False)  # "h0" was a local hit
    sched.update_state_after_alloc(second, SimpleNamespace(get_block_ids=lambda: ([20, 21, 22, 23, 24],)), 2 * BLOCK)
    meta = sched.build_connector_meta(_output(new=[(second, [20, 21, 22, 23, 24], 3 * BLOCK), (other, [30, 31, 32], 0)],
                                              scheduled={"t2": BLOCK + 2, "x": 2 * BLOCK + 3}))
    assert meta.loads == [(1, 21), (2, 22)] and meta.saves == [(23, 3)]


def test_the_worker_copies_blocks_out_after_the_forward_and_back_before_the_next_one():
    from backend.engine.session_kv_connector import SessionKVMetadata

    worker = _connector("WORKER", kv_bytes=3 * 2 * 96)  # 3 slots of 2 layers
    kv = {f"layer{i}": torch.randn(2, BLOCKS, 1, BLOCK, 3) for i in range(2)}
    original = {name: t.clone() for name, t in kv.items()}
    worker.register_kv_caches(kv)
    worker.bind_connector_metadata(SessionKVMetadata(saves=[(2, 0), (4, 1)]))
    worker.wait_for_save()
    for t in kv.values():
        t.zero_()
    worker.bind_connector_metadata(SessionKVMetadata(loads=[(0, 5), (1, 0)]))
    worker.start_load_kv(None)
    for name, t in kv.items():
        assert torch.equal(t[:, 5], original[name][:, 2]) and torch.equal(t[:, 0], original[name][:, 4])
        assert not t[:, 1:5].any()  # nothing else written
    assert worker.get_block_ids_with_load_errors() == set()


def test_a_kv_cache_laid_out_otherwise_loads_nothing_and_reports_the_blocks_for_vllm_to_recompute():
    from backend.engine.session_kv_connector import SessionKVMetadata

    worker = _connector("WORKER", kv_bytes=3 * 2 * 96)
    worker.register_kv_caches({"layer0": torch.zeros(2, BLOCKS + 1, BLOCK, 3)})  # no dimension of BLOCKS blocks
    worker.bind_connector_metadata(SessionKVMetadata(loads=[(0, 5), (1, 0)]))
    worker.start_load_kv(None)
    assert worker.get_block_ids_with_load_errors() == {0, 5}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    assert connector_config(1, 1)["kv_load_failure_policy"] == "recompute"


@pytest.mark.parametrize("groups", [0, 2])
def test_an_engine_without_exactly_one_kv_cache_group_keeps_nothing(groups):
    other = _connector("SCHEDULER", kv_bytes=1 << 20, groups=groups)
    assert other.slots == 0 and other.get_num_new_matched_tokens(_request("r", ["h0"], BLOCK + 1), 0) == (0, False)


def test_beside_nixl_both_connectors_run_under_vllms_multiconnector():
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    alone = with_session_connector(None, 1 << 20, 60)
    assert alone == connector_config(1 << 20, 60) and keeps_sessions(alone)
    both = with_session_connector(nixl, 1 << 20, 60)
    assert both["kv_connector"] == "MultiConnector" and both["kv_role"] == "kv_producer"
    assert both["kv_connector_extra_config"]["connectors"] == [nixl, alone]  # NIXL's settings as they were
    assert both["kv_load_failure_policy"] == "recompute" and keeps_sessions(both)
    assert not keeps_sessions(nixl) and not keeps_sessions(None) and not keeps_sessions(
        {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [nixl]}})
