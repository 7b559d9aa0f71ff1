"""``backend.engine.session_kv.SessionBlocks``: the index of the KV blocks kept for conversations (which prefix is
held, which slot a new block takes, what expires). The connector around it, with a real engine:
``tests/component/test_session_kv.py``."""
from __future__ import annotations

from backend.engine.session_kv import SessionBlocks, connector_config, session_of


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
