"""A conversation's KV kept across its turns: a vLLM KV connector (``SessionKVConnector``) that copies the full KV
blocks of a session's prompts (a request's ``session_id``, docs/reuse.md) into a store in the EngineCore's host
memory, and copies them back into the engine's KV cache when a later turn of the same conversation starts with them.

Why: an agent's tool pause lets other traffic evict the engine's prefix cache, so turn N+1 prefilled the whole
conversation again (docs/benchmarks.md, "Agent loop"), although its embeddings were kept (``backend.transfer.held``).
With this connector the engine prefills only what the conversation added since its last turn.

How, in vLLM's KV connector terms (``KVConnectorBase_V1``; both halves run in the EngineCore process):
- the scheduler's half owns the index (``SessionBlocks``): vLLM's own block hashes (chained over the tokens and
  the media items' ids, so a hit is the same prefix, images included) -> a slot of the store. A request of a
  session asks it for the blocks after its local prefix-cache hit (``get_num_new_matched_tokens``); each step's
  metadata lists the blocks to load into the request's new blocks before the forward and the prompt blocks that
  become full in the step, to save after it (``build_connector_meta``);
- the worker's half holds the store (one tensor per layer, ``slots`` blocks) and does the copies
  (``start_load_kv`` before the step's forward, ``wait_for_save`` after it): block copies in host memory.
Only requests with a session save or load; others never evict a conversation's blocks. A slot not used for
``session_seconds`` is freed; over the store's size the least recently used slot is reused.

Enabled per engine by the topology's ``reuse.session_kv_bytes`` (with ``session_seconds``): ``kv_transfer_config``
(``connector_config``); the engine host passes a request's session as ``kv_transfer_params`` (``SESSION_KEY``).
One KV cache group with full attention only (other models: the connector logs it and matches nothing).

This module imports neither vLLM nor torch (a stub reads it before its process is prepared); the connector is in
``backend.engine.session_kv_connector``.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

CONNECTOR = "SessionKVConnector"  # the class, in backend.engine.session_kv_connector (vLLM's KVConnectorBase_V1)
SESSION_KEY = "epd_session"  # a request's kv_transfer_params entry: its conversation


def connector_config(session_kv_bytes: int, session_seconds: float) -> dict[str, Any]:
    """The engine argument ``kv_transfer_config`` that gives an engine this connector."""
    # a load the worker could not do (its KV cache's layout not understood) is recomputed, never served
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": "backend.engine.session_kv_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"session_kv_bytes": int(session_kv_bytes),
                                          "session_seconds": float(session_seconds)}}


MULTI = "MultiConnector"  # vLLM's connector that runs several (here: NIXL's and this one) side by side


def with_session_connector(existing: dict[str, Any] | None, session_kv_bytes: int,
                           session_seconds: float) -> dict[str, Any]:
    """``kv_transfer_config`` that keeps conversations' KV beside an engine's ``existing`` one (None: this connector
    alone): E/P/D's prefill has vLLM's NixlConnector (kv_producer), so the two run under vLLM's MultiConnector, NIXL
    first (it loads nothing on a prefill; this connector loads a conversation's kept blocks, NIXL sends decode every
    block of the prompt, loaded ones included)."""
    ours = connector_config(session_kv_bytes, session_seconds)
    if not existing:
        return ours
    return {"kv_connector": MULTI, "kv_role": existing.get("kv_role", "kv_both"),
            "kv_load_failure_policy": ours["kv_load_failure_policy"],
            "kv_connector_extra_config": {"connectors": [existing, ours]}}


def keeps_sessions(kv_transfer_config: Any) -> bool:
    """Whether an engine with ``kv_transfer_config`` has this connector (alone or under MultiConnector)."""
    if not isinstance(kv_transfer_config, dict):
        return False
    if kv_transfer_config.get("kv_connector") == MULTI:
        children = kv_transfer_config.get("kv_connector_extra_config", {}).get("connectors", [])
        return any(keeps_sessions(child) for child in children)
    return kv_transfer_config.get("kv_connector") == CONNECTOR


# -- the index (the scheduler's half; plain Python, unit-tested apart) ---------------------------------------------
@dataclass
class _Slot:
    slot: int
    used: float


class SessionBlocks:
    """Block hash -> store slot, least recently used first; a slot unused for ``seconds`` is freed."""

    def __init__(self, slots: int, seconds: float, clock=time.monotonic):
        self.seconds, self._clock = seconds, clock
        self._index: "collections.OrderedDict[Any, _Slot]" = collections.OrderedDict()
        self._free = list(range(slots - 1, -1, -1))
        self.hits = 0  # blocks handed out for loads

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash) -> bool:
        return block_hash in self._index

    def match(self, hashes, start: int, limit: int) -> int:
        """How far (a block index <= ``limit``) the blocks from ``start`` on are held, each in turn."""
        end = start
        while end < min(limit, len(hashes)) and hashes[end] in self._index:
            end += 1
        return end

    def touch(self, hashes) -> None:
        """Mark ``hashes`` (held, a prefix's blocks in order) used now, the first last: over the store's size a
        conversation loses its last blocks before its first ones (a prefix without its first block matches nothing)."""
        now = self._clock()
        for block_hash in reversed(hashes):
            self._index[block_hash].used = now
            self._index.move_to_end(block_hash)

    def slots_of(self, hashes) -> list[int]:
        """The slots of ``hashes`` (held) for a load, touched."""
        self.touch(hashes)
        self.hits += len(hashes)
        return [self._index[block_hash].slot for block_hash in hashes]

    def add(self, block_hash, busy: set[int]) -> int | None:
        """A slot for ``block_hash`` (not held yet), a free one or the least recently used one not in ``busy`` (the
        step's copies); None if none can be taken."""
        self.expire()
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, entry in self._index.items() if entry.slot not in busy), None)
            if victim is None:
                return None
            slot = self._index.pop(victim).slot
        self._index[block_hash] = _Slot(slot, self._clock())
        return slot

    def expire(self) -> None:
        """Free the slots unused for ``seconds`` (the oldest first: the index is in order of use)."""
        cutoff = self._clock() - self.seconds
        while self._index and next(iter(self._index.values())).used < cutoff:
            self._free.append(self._index.popitem(last=False)[1].slot)


def session_of(request) -> str | None:
    """A vLLM request's conversation (its ``kv_transfer_params``' ``SESSION_KEY``), or None."""
    params = getattr(request, "kv_transfer_params", None)
    session = params.get(SESSION_KEY) if isinstance(params, dict) else None
    return session if isinstance(session, str) and session else None
