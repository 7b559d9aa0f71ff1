"""Producers on this host announce their pools, so consumers connect before the first request needs them.

A consumer's first pull from a producer pays for the connection: adding the producer's NIXL agent (UCX
wire-up) and mapping its pool (measured: 13 ms and 4 ms for an 8 MiB pool on the 2-core machine; the first
``epd`` request of a fresh server took 23-39 ms for what later ones did in 0.3-0.5 ms). So each encoder instance
writes its pool's handle (a ``TransferHandle`` with no lease) into a directory of the server
(``directory()``: ``/dev/shm/epd-producers-<tritonserver pid>``) when it loads, and removes it when it
unloads; each consumer model watches that directory (``ProducerWatcher``) and warms every pool it finds
(``backend.transfer.consumer.EmbeddingConsumer.warm``). A request still works without any of this: the
first pull then connects, as before.

No Triton import; unit-tested with real files and threads.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Callable

from backend.protocol.errors import EpdError
from backend.protocol.layout import TransferHandle

log = logging.getLogger(__name__)
PREFIX = "epd-producers-"


def directory(server_pid: int | None = None) -> Path:
    """The announcement directory of this process's tritonserver (a stub's parent)."""
    return Path("/dev/shm") / f"{PREFIX}{os.getppid() if server_pid is None else server_pid}"


def announce(handle: TransferHandle, where: Path) -> Path:
    """Write ``handle`` (a pool's, no lease) as ``<agent name>.json`` in ``where``, atomically; remove what
    producers that died without withdrawing (a killed stub) left there."""
    where.mkdir(exist_ok=True)
    for stale in where.glob("*.json"):
        try:
            if not _alive(json.loads(stale.read_text()).get("pid", 0)):
                stale.unlink()
        except (OSError, ValueError):
            pass
    path = where / f"{handle.agent_name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(handle.to_doc()))
    tmp.rename(path)
    return path


def withdraw(path: Path) -> None:
    """Remove an announcement, and its directory once no producer is left in it."""
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:  # other producers still there (or gone already)
        pass


def _alive(pid: int) -> bool:
    return bool(pid) and os.path.exists(f"/proc/{pid}")


class ProducerWatcher:
    """Calls ``on_new(handle)`` once for every announcement that appears in ``where`` (one already there too),
    from a thread that looks every ``interval`` seconds, until ``close``. An announcement rewritten by a
    restarted producer (same name, new agent) is new again."""

    def __init__(self, where: Path, on_new: Callable[[TransferHandle], None], interval: float = 0.5):
        self.where, self.on_new, self.interval = where, on_new, interval
        self._seen: dict[str, int] = {}  # file name -> inode of the version handed over
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="producer-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.scan()
            except Exception as exc:  # noqa: BLE001 - warming is an optimisation; the pulls still work
                log.warning("watching %s: %s", self.where, exc)
            if self._stop.wait(self.interval):
                return

    def scan(self) -> None:
        try:
            entries = sorted(self.where.glob("*.json"))
        except OSError:
            return
        for path in entries:
            try:
                inode = path.stat().st_ino
                if self._seen.get(path.name) == inode:
                    continue
                handle = TransferHandle.from_doc(json.loads(path.read_text()), path.name)
            except (OSError, ValueError, EpdError) as exc:  # withdrawn meanwhile, or not an announcement
                log.debug("skipping %s: %s", path, exc)
                continue
            self._seen[path.name] = inode
            if _alive(handle.pid):
                self.on_new(handle)
            else:  # a producer killed before it could withdraw: nobody else will remove its file
                path.unlink(missing_ok=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
