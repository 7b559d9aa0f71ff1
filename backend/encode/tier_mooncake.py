"""The embedding tier's store on Mooncake Store (``mooncake-transfer-engine-non-cuda``; docs/tier.md): a store client
with no segment of its own (the tier's memory is the ``mooncake_client`` holder that ``backend.deploy.tier_service``
starts beside the master), so an encoder that exits takes no entries with it.

``mooncake`` is imported when a store is made, never at module import: the project venv does not have it, and a
deployment without it works as before (``connect`` raises ``TierUnavailable`` naming the reason, the encoder runs
without a tier). Where it comes from: the site-packages of Mooncake's own venv (``backend.deploy.tier_service.
mooncake_paths``, which the encoder model passes in; else ``EPD_MOONCAKE_VENV``'s), appended to ``sys.path``, and its
private libraries, which must already be on ``LD_LIBRARY_PATH`` of the process (the dynamic loader reads it at start:
the launcher sets it for the server, ``tier_service.TierRun.env``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from backend.encode.tier import EmbeddingTier, TierUnavailable

OBJECT_NOT_FOUND, OBJECT_HAS_LEASE = -704, -706  # mooncake-store/include/types.h


def import_store_class(site_packages: str | Path | None = None):
    """``mooncake.store.MooncakeDistributedStore``, from this environment, ``site_packages`` or
    ``EPD_MOONCAKE_VENV``'s."""
    venv = os.environ.get("EPD_MOONCAKE_VENV")
    sites = [Path(site_packages)] if site_packages else sorted(Path(venv).glob("lib/python3*/site-packages")) if venv else []
    for site in sites:
        if str(site) not in sys.path:
            sys.path.append(str(site))  # after the project's own packages: theirs win
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:  # not installed, or its libibverbs not on LD_LIBRARY_PATH
        raise TierUnavailable(f"mooncake is not importable: {exc}") from exc
    return MooncakeDistributedStore


class MooncakeStore:
    """The byte store ``EmbeddingTier`` runs on: one ``MooncakeDistributedStore`` client over TCP."""

    def __init__(self, master: str, metadata: str, local_hostname: str = "127.0.0.1", local_buffer: int = 64 << 20,
                 site_packages: str | Path | None = None):
        self.store = import_store_class(site_packages)()
        rc = self.store.setup(local_hostname, metadata, 0, local_buffer, "tcp", "", master)
        if rc != 0:
            raise TierUnavailable(f"mooncake store setup with master {master} failed: rc {rc}")

    def get_bytes(self, key: str) -> bytes | None:
        value = self.store.get(key)  # b"" for a missing key (and for an unreachable master, after ~4 s)
        return bytes(value) or None

    def put_bytes(self, key: str, blob: bytes) -> None:
        rc = self.store.put(key, blob)  # a key that exists keeps its first value, rc 0
        if rc != 0:
            raise TierUnavailable(f"mooncake put of {len(blob)} bytes: rc {rc}")

    def exists(self, key: str) -> bool:
        rc = self.store.is_exist(key)
        if rc < 0:
            raise TierUnavailable(f"mooncake is_exist: rc {rc}")
        return rc == 1

    def remove(self, key: str) -> None:
        rc = self.store.remove(key, True)  # force: a key just read holds a lease (default_kv_lease_ttl)
        if rc not in (0, OBJECT_NOT_FOUND):
            raise TierUnavailable(f"mooncake remove: rc {rc}")

    def close(self) -> None:
        self.store.close()


def connect(master: str, metadata: str, site_packages: str | Path | None = None, **options) -> EmbeddingTier:
    """A tier on the Mooncake master at ``master`` (``host:port``) with its metadata server ``metadata``
    (``http://host:port/metadata``); ``site_packages``: where mooncake is (``import_store_class``); ``options``:
    ``EmbeddingTier``'s. ``TierUnavailable`` where it cannot be had."""
    return EmbeddingTier(MooncakeStore(master, metadata, site_packages=site_packages), **options)
