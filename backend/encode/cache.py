"""The encoder's embedding cache: what one encoder instance encoded recently, by content key, so an item sent again
(a multi-turn conversation's earlier images, a retried request) is published again without running the tower.
Per instance, in its process (a tier shared across instances and hosts would sit beside it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.encode.encoder import EncodedItem


class EmbeddingCache:
    """Embeddings of recently encoded items by content key, least recently used out first, at most
    ``max_bytes`` of tensors (0: off). Keys are computed here from the bytes (never taken from the caller,
    so a request cannot plant embeddings under another item's key)."""

    def __init__(self, max_bytes: int):
        import collections

        self.max_bytes, self.bytes = max_bytes, 0
        self._items: "collections.OrderedDict[str, EncodedItem]" = collections.OrderedDict()

    def get(self, key: str) -> "EncodedItem | None":
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: str, item: EncodedItem) -> None:
        size = item.embeddings.numel() * item.embeddings.element_size()
        if size > self.max_bytes or key in self._items:
            return
        self._items[key] = item
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.embeddings.numel() * old.embeddings.element_size()

    def __len__(self) -> int:
        return len(self._items)
