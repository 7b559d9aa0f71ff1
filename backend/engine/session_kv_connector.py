"""``SessionKVConnector``: the vLLM KV connector that keeps conversations' prompt KV (``backend.engine.session_kv``
says what and why). Imported by vLLM in the EngineCore (``kv_connector_module_path``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole, SupportsHMA)

from backend.engine.session_kv import CONNECTOR, SessionBlocks, session_of

log = logging.getLogger(__name__)


@dataclass
class SessionKVMetadata(KVConnectorMetadata):
    loads: list[tuple[int, int]] = field(default_factory=list)  # (slot, block id): before the forward
    saves: list[tuple[int, int]] = field(default_factory=list)  # (block id, slot): after it


@dataclass
class _Request:
    request: Any  # vllm.v1.request.Request
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # prompt blocks before this one are held (saved, or found held)


class SessionKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Keeps a session's prompt blocks (module docstring). ``SupportsHMA``: vLLM keeps its hybrid KV cache manager
    on, as for NIXL alone, so that E/P/D's prefill (this connector beside NIXL's under MultiConnector) and decode
    (NIXL alone) agree on it: NIXL's handshake refuses peers that differ (its compatibility hash); the connector
    itself works on one full-attention group only (others: it keeps nothing)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        groups = kv_cache_config.kv_cache_groups
        enabled = len(groups) == 1 and type(groups[0].kv_cache_spec).__name__ == "FullAttentionSpec"
        block_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors) // max(1, self.num_blocks)
        self.slots = int(extra.get("session_kv_bytes", 0)) // max(1, block_bytes) if enabled else 0
        if not enabled:
            log.warning("%s: %d KV cache groups (%s): conversations' KV not kept", CONNECTOR, len(groups),
                        ", ".join(type(g.kv_cache_spec).__name__ for g in groups))
        if role is KVConnectorRole.SCHEDULER:
            self.index = SessionBlocks(self.slots, float(extra.get("session_seconds", 0)))
            self._requests: dict[str, _Request] = {}
            self._matched: dict[str, int] = {}  # request id -> the first block index of its external hit
            self._loads: list[tuple[int, int]] = []
        else:
            self._layers: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}  # name -> (KV, block dim, store)
            self._failed: set[int] = set()  # block ids a load could not fill (vLLM recomputes them)

    # -- scheduler side -----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.slots or session_of(request) is None:
            return 0, False
        self._requests.setdefault(request.request_id, _Request(request))
        first = num_computed_tokens // self.block_size
        # at least the last prompt token is computed by the engine (its logits start the answer)
        end = self.index.match(request.block_hashes, first, (request.num_tokens - 1) // self.block_size)
        if end == first:
            return 0, False
        self._matched[request.request_id] = first
        return (end - first) * self.block_size, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        first = self._matched.pop(request.request_id, None)
        if first is None or num_external_tokens <= 0:
            return
        end = first + num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0]
        slots = self.index.slots_of(request.block_hashes[first:end])
        self._loads.extend(zip(slots, block_ids[first:end]))

    def build_connector_meta(self, scheduler_output) -> SessionKVMetadata:
        meta = SessionKVMetadata(loads=self._loads)
        self._loads = []
        if not self._requests:
            return meta
        scheduled = {}
        for new in scheduler_output.scheduled_new_reqs:
            if (state := self._requests.get(new.req_id)) is not None:
                state.block_ids = list(new.block_ids[0])
                scheduled[new.req_id] = (state, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (state := self._requests.get(req_id)) is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and back: a block table of its own again
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            scheduled[req_id] = (state, cached.num_computed_tokens[i])
        busy = {slot for slot, _ in meta.loads}
        for req_id, (state, computed) in scheduled.items():
            request = state.request
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(done, request.num_prompt_tokens, len(request.block_hashes) * self.block_size) // self.block_size
            if full <= state.saved:  # no prompt block filled in this step (a decode step)
                continue
            for index in range(state.saved, min(full, len(state.block_ids))):
                block_hash = request.block_hashes[index]
                if block_hash in self.index:
                    continue
                slot = self.index.add(block_hash, busy)
                if slot is None:
                    break
                busy.add(slot)
                meta.saves.append((state.block_ids[index], slot))
            state.saved = full
            # the conversation's prompt is used by this turn: kept longer, its first blocks longest
            self.index.touch([h for h in request.block_hashes[:full] if h in self.index])
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self._requests.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        return self.request_finished(request, block_ids)

    # -- worker side ----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.slots:
            return
        for name, kv in kv_caches.items():
            dim = next((d for d, size in enumerate(kv.shape) if size == self.num_blocks), None)
            if dim is None:
                log.warning("%s: layer %s's KV %s has no dimension of %d blocks: conversations' KV not kept",
                            CONNECTOR, name, tuple(kv.shape), self.num_blocks)
                self._layers.clear()
                return
            shape = (self.slots, *kv.shape[:dim], *kv.shape[dim + 1:])
            self._layers[name] = (kv, dim, torch.empty(shape, dtype=kv.dtype, device="cpu"))
        log.info("%s: %d blocks kept for conversations (%d layers)", CONNECTOR, self.slots, len(self._layers))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        if not self._layers:  # the KV cache's layout was not understood (register_kv_caches): nothing is loaded
            self._failed.update(block for _, block in meta.loads)
            return
        slots = torch.tensor([s for s, _ in meta.loads], dtype=torch.long)
        block_ids = torch.tensor([b for _, b in meta.loads], dtype=torch.long)
        for kv, dim, store in self._layers.values():
            kv.index_copy_(dim, block_ids.to(kv.device), store.index_select(0, slots).movedim(0, dim).to(kv.device))

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # the step's saves are copied once its forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not meta.saves or not self._layers:
            return
        block_ids = torch.tensor([b for b, _ in meta.saves], dtype=torch.long)
        slots = torch.tensor([s for _, s in meta.saves], dtype=torch.long)
        for kv, dim, store in self._layers.values():
            store.index_copy_(0, slots, kv.index_select(dim, block_ids.to(kv.device)).movedim(dim, 0).cpu())
