"""The consumer's copies of what it pulled (``backend.transfer.held``): which layouts a copy serves, the two budgets,
session retention on a clock, pins of looked-up items, and ``pull_media_embeds`` taking copies instead of pulling."""
import pytest
import torch

from backend.transfer.engine_inputs import pull_media_embeds
from backend.transfer.held import PIN_SECONDS, HeldEmbeddings
from tests.unit.test_layout import HANDLES, layout

KIB = 4 * 128 * 4  # the bytes of one [4, 128] float32 item


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def item(key: str, lease: str = "00ab", value: float = 1.0):
    from dataclasses import replace

    return layout(content_key=key, handle=replace(HANDLES["shared_memory"], lease_id=lease)), torch.full((4, 128), value)


def test_a_copy_serves_the_very_layout_it_was_stored_with_only():
    held = HeldEmbeddings(10 * KIB)
    stored, tensor = item("k1", "00ab")
    held.put(stored, tensor)
    assert held.take(stored) is tensor
    fresh, _ = item("k1", "00cd")  # encoded again: a new lease, which must be pulled (and so released)
    assert held.take(fresh) is None
    from dataclasses import replace
    assert held.take(replace(stored, shape=(8, 64))) is None  # another contract is never served
    assert held.take(replace(stored, dtype="bfloat16")) is None
    assert (held.hits, held.misses) == (1, 3)


def test_the_lookup_returns_the_stored_layouts_of_the_keys_held():
    held = HeldEmbeddings(10 * KIB)
    a, ta = item("a")
    held.put(a, ta)
    found = held.lookup(["a", "b"])
    assert list(found) == ["a"] and found["a"] == a.to_json()
    from backend.protocol.layout import LayoutMetadata
    assert held.take(LayoutMetadata.from_json(found["a"], "image_layouts[0]")) is ta


def test_recent_items_are_kept_within_their_budget_least_recently_used_out_first():
    held = HeldEmbeddings(3 * KIB)
    layouts = [item(k) for k in "abcd"]
    for stored, tensor in layouts[:3]:
        held.put(stored, tensor)
    assert held.take(layouts[0][0]) is not None  # "a" used again: "b" is now the oldest
    held.put(*layouts[3])
    assert [k in held for k in "abcd"] == [True, False, True, True] and held.nbytes == 3 * KIB


def test_an_item_larger_than_the_budgets_is_not_kept():
    held = HeldEmbeddings(KIB - 1)
    held.put(*item("a"))
    assert len(held) == 0


def test_a_sessions_items_survive_other_traffic_until_its_retention_ends():
    clock = Clock()
    held = HeldEmbeddings(2 * KIB, session_seconds=30, session_bytes=4 * KIB, clock=clock)
    held.put(*item("turn1"), session="s")
    for i in range(6):  # other users' items churn the recent-items budget
        clock.now += 1
        held.put(*item(f"other{i}"))
    assert "turn1" in held and len(held) == 3
    clock.now = 1000 + 30.5  # the session's last turn was at 1000
    held.put(*item("late"))
    assert "turn1" not in held and len(held) == 2
    # without a session the same item goes with the churn
    plain = HeldEmbeddings(2 * KIB, session_seconds=30, session_bytes=4 * KIB, clock=clock)
    plain.put(*item("turn1"))
    for i in range(2):
        plain.put(*item(f"other{i}"))
    assert "turn1" not in plain


@pytest.mark.parametrize("second_turn", [True, False])
def test_a_turn_restarts_the_retention_of_its_session(second_turn):
    clock = Clock()
    held = HeldEmbeddings(KIB, session_seconds=30, session_bytes=4 * KIB, clock=clock)
    held.put(*item("turn1"), session="s")
    clock.now += 25
    if second_turn:
        held.lookup(["turn2"], session="s")  # turn 2 arrives (asks for its new item only: nothing pinned)
    clock.now += 25  # 50 s after turn 1, 25 s after turn 2
    held.put(*item("other"))
    held.put(*item("other2"))
    assert ("turn1" in held) is second_turn and "other" not in held


def test_over_the_session_budget_the_session_idle_longest_loses_its_protection_first():
    clock = Clock()
    held = HeldEmbeddings(0, session_seconds=60, session_bytes=2 * KIB, clock=clock)
    held.put(*item("old1"), session="old")
    clock.now += 1
    held.put(*item("live1"), session="live")
    clock.now += 1
    held.put(*item("live2"), session="live")  # 3 items in a 2-item budget: "old" (idle longest) goes
    assert "old1" not in held and "live1" in held and "live2" in held


def test_a_looked_up_item_is_not_evicted_before_its_request_takes_it():
    clock = Clock()
    held = HeldEmbeddings(KIB, clock=clock)
    stored, tensor = item("a")
    held.put(stored, tensor)
    held.lookup(["a"])
    held.put(*item("b"))  # over budget, but "a" is pinned
    assert held.take(stored) is tensor
    clock.now += PIN_SECONDS + 1
    held.put(*item("c"))
    assert "a" not in held and "c" in held


class Puller:
    """``EmbeddingConsumer.pull_many`` stand-in: records what it was asked to pull."""

    def __init__(self):
        self.pulled = []

    def pull_many(self, layouts, names=None):
        self.pulled.append([(layout.content_key, name) for layout, name in zip(layouts, names)])
        return [torch.full(tuple(layout.shape), 2.0) for layout in layouts]


@pytest.mark.parametrize("session", [None, "s"])
def test_pull_media_embeds_takes_the_copies_and_keeps_what_it_pulled(session):
    held = HeldEmbeddings(10 * KIB, session_seconds=30, session_bytes=10 * KIB)
    a, ta = item("a", value=1.0)
    held.put(a, ta)
    b, _ = item("b")
    puller = Puller()
    copies = [held.take(a, session), held.take(b, session)]
    [(embeds, grid)] = pull_media_embeds(puller, [a, b], copies, held, session).values()
    assert puller.pulled == [[("b", "image_layouts[1]")]]  # named as the request's second image
    assert embeds.shape == (8, 128) and embeds[:4].eq(1).all() and embeds[4:].eq(2).all()
    assert grid.tolist() == [[1, 4, 4], [1, 4, 4]] and "b" in held
