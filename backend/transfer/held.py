"""The consumer's own copy of the embeddings it pulled (issue 18, items 3 and 4): demand-aware encoding and
conversations kept across turns.

Who uses it: a consumer model (``pd``, ``prefill``; ``backend.triton.generate_model.MetadataOnlyModel``) keeps every
item it pulled here, keyed by the item's content key (bytes, processing options, model identity), with the layout
document it came with. Before an orchestrator sends an item to an encoder it asks the consumer it routes to which
of the request's keys it holds (``lookup``): for those it skips the encoder and the transfer and sends the layout
the consumer gave back; the consumer then takes its copy (``take``) instead of pulling.

A copy is used only for the layout it was stored with (same content key and lease id, the tensor contract, dtype
and shape, checked again): a layout with another lease (an item the orchestrator did encode) is pulled as usual
and replaces the copy, so a producer's lease is always read and released.

Two budgets:
- ``held_bytes``: recently pulled items, least recently used evicted first;
- ``session_bytes``: items of conversations (a request's ``session_id``) whose last turn is less than
  ``session_seconds`` ago; they are not evicted by other traffic. Over the budget, the conversations idle longest
  lose that protection first (their items then count as recently used ones), so idle sessions cannot starve live
  ones. An item the orchestrator looked up is not evicted for ``PIN_SECONDS``, the time its request has to take it.

Thread-safe: lookups run on the model's event loop, takes and puts on its pull thread.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import torch

from backend.transfer.same_host import DTYPES

PIN_SECONDS = 30.0  # how long a looked-up item is kept for the request that will take it


@dataclass
class _Entry:
    tensor: torch.Tensor
    layout_text: str
    lease_id: str
    nbytes: int
    sessions: set[str] = field(default_factory=set)
    pinned_until: float = 0.0


class HeldEmbeddings:
    def __init__(self, held_bytes: int, session_seconds: float = 0.0, session_bytes: int = 0,
                 clock=time.monotonic):
        self.held_bytes, self.session_seconds, self.session_bytes = held_bytes, session_seconds, session_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: "collections.OrderedDict[str, _Entry]" = collections.OrderedDict()  # LRU order
        self._sessions: "collections.OrderedDict[str, float]" = collections.OrderedDict()  # id -> last turn
        self.hits = self.misses = 0

    # -- the orchestrator's side --------------------------------------------------------------------------------
    def lookup(self, keys, session: str | None = None) -> dict[str, str]:
        """The layout documents of ``keys`` held here, each pinned for the request that will send them back;
        ``session`` (its conversation) is kept alive by the lookup too."""
        now = self._clock()
        with self._lock:
            self._touch_session(session, now)
            found = {}
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.pinned_until = now + PIN_SECONDS
                    self._entries.move_to_end(key)
                    found[key] = entry.layout_text
            return found

    # -- the consumer's side ------------------------------------------------------------------------------------
    def take(self, layout, session: str | None = None) -> torch.Tensor | None:
        """The copy of ``layout``'s item if it is the one stored for this very layout (content key, lease id,
        dtype and shape), else None (the caller pulls). ``session``: the conversation now using it."""
        now = self._clock()
        with self._lock:
            entry = self._entries.get(layout.content_key)
            usable = (entry is not None and entry.lease_id == layout.handle.lease_id
                      and entry.tensor.dtype == DTYPES.get(layout.dtype) and tuple(entry.tensor.shape) == tuple(layout.shape))
            if not usable:
                self.misses += 1
                return None
            self._entries.move_to_end(layout.content_key)
            self._touch_session(session, now)
            if session is not None and self.session_seconds > 0:
                entry.sessions.add(session)
            self.hits += 1
            return entry.tensor

    def put(self, layout, tensor: torch.Tensor, session: str | None = None) -> None:
        """Keep ``tensor``, pulled for ``layout``, for later requests (``session``: the conversation it belongs to)."""
        nbytes = tensor.numel() * tensor.element_size()
        now = self._clock()
        with self._lock:
            if nbytes > max(self.held_bytes, self.session_bytes if session else 0):
                return
            old = self._entries.pop(layout.content_key, None)
            entry = _Entry(tensor, layout.to_json(), layout.handle.lease_id, nbytes)
            if old is not None:
                entry.sessions = old.sessions
            self._entries[layout.content_key] = entry
            self._touch_session(session, now)
            if session is not None and self.session_seconds > 0:
                entry.sessions.add(session)
            self._evict(now)

    # -- accounting ---------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is held (no pin, no use: for tests and accounting)."""
        with self._lock:
            return key in self._entries

    def _touch_session(self, session: str | None, now: float) -> None:
        if session is None or self.session_seconds <= 0:
            return
        self._sessions[session] = now
        self._sessions.move_to_end(session)

    def _live_sessions(self, now: float) -> set[str]:
        while self._sessions and next(iter(self._sessions.values())) < now - self.session_seconds:
            self._sessions.popitem(last=False)  # oldest last turn first: the rest are younger
        return set(self._sessions)

    def _evict(self, now: float) -> None:
        """Retained items (of live sessions) within ``session_bytes``, dropping the protection of the sessions idle
        longest while over it; then the others, least recently used first, within ``held_bytes``. Pinned items stay."""
        live = self._live_sessions(now)
        retained = lambda entry: bool(entry.sessions & live)  # noqa: E731
        while live and sum(e.nbytes for e in self._entries.values() if retained(e)) > self.session_bytes:
            oldest = next(s for s in self._sessions if s in live)
            del self._sessions[oldest]
            live.discard(oldest)
        loose = sum(e.nbytes for e in self._entries.values() if not retained(e))
        for key in list(self._entries):
            if loose <= self.held_bytes:
                break
            entry = self._entries[key]
            if retained(entry) or entry.pinned_until > now:
                continue
            del self._entries[key]
            loose -= entry.nbytes
        for entry in self._entries.values():
            entry.sessions &= live


__all__ = ["HeldEmbeddings", "PIN_SECONDS"]
