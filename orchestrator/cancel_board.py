"""In-band cancellation: one request cancels another by its Triton request id.

Why: Triton 2.51's gRPC frontend is not safe against a client cancelling a decoupled stream while the model
is sending on it: its completion-queue thread and the response callback take the stream's two mutexes in
opposite orders, and the server's whole gRPC streaming deadlocks; other times it segfaults
(docs/results/robustness.md, "gRPC stream cancellation"). An orchestrator therefore never cancels its stage streams:
it sends the stage a second request whose request parameter ``epd_cancel`` names the first one's request id,
and reads the first stream to its end, which the stage closes once it has aborted the engine request. Any
client can cancel the same way.

Instances of one model are separate stub processes and Triton picks the instance of each request, so the
cancel may reach an instance that does not hold the request. Each board therefore has a directory shared by
the model's instances in one server (``/dev/shm/epd-cancel-<tritonserver pid>-<model>``): a cancel for a request
not held here (held by a sibling, or not arrived yet) becomes an empty file named by the id's hash, which the
holder sees at its next cancellation check. A cancel for a request that finished here is dropped.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


class CancelBoard:
    STALE_SECONDS = 60.0  # a shared cancel nobody claimed by then (its request ended on a sibling) is removed
    RECENT = 4096  # ids of requests finished here, for dropping late cancels

    def __init__(self, directory: Path | None):
        self._dir = directory
        self._live: dict[str, bool] = {}  # requests running here -> cancelled
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._swept = time.monotonic()

    @classmethod
    def for_model(cls, model_name: str) -> "CancelBoard":
        """The board of a model's instance (a stub: its parent process is the tritonserver)."""
        return cls(Path("/dev/shm") / f"epd-cancel-{os.getppid()}-{model_name}")

    def _file(self, request_id: str) -> Path | None:
        return None if self._dir is None else self._dir / hashlib.sha256(request_id.encode()).hexdigest()[:32]

    def watch(self, request_id: str) -> Callable[[], bool]:
        """Register a request running here; the returned check says whether someone cancelled it."""
        with self._lock:
            self._live.setdefault(request_id, False)
        return lambda: self.is_cancelled(request_id)

    def is_cancelled(self, request_id: str) -> bool:
        if self._live.get(request_id):
            return True
        path = self._file(request_id)
        if path is not None and path.exists():
            with self._lock:
                if request_id in self._live:
                    self._live[request_id] = True
            return True
        return False

    def finish(self, request_id: str) -> None:
        with self._lock:
            self._live.pop(request_id, None)
            self._recent[request_id] = None
            while len(self._recent) > self.RECENT:
                self._recent.popitem(last=False)
        path = self._file(request_id)
        if path is not None:
            path.unlink(missing_ok=True)

    async def tracking(self, request_id: str, work: Awaitable[T]) -> T:
        """Await ``work`` (the request's run, after ``watch``) and ``finish`` the request however it ends."""
        try:
            return await work
        finally:
            self.finish(request_id)

    def cancel(self, request_id: str) -> str:
        """Cancel a request: ``"here"`` (running in this instance), ``"finished"`` (it ended here: nothing to
        do) or ``"shared"`` (left on the board for the instance that holds it, or will)."""
        with self._lock:
            if request_id in self._live:
                self._live[request_id] = True
                return "here"
            if request_id in self._recent:
                return "finished"
        path = self._file(request_id)
        if path is None:
            return "finished"
        path.parent.mkdir(exist_ok=True)
        path.touch()
        self._sweep()
        return "shared"

    def _sweep(self, older_than: float | None = None) -> None:
        now = time.monotonic()
        if older_than is None and now - self._swept < self.STALE_SECONDS:
            return
        self._swept = now
        limit = time.time() - (self.STALE_SECONDS if older_than is None else older_than)
        try:
            entries = list(os.scandir(self._dir))
        except OSError:
            return
        for entry in entries:
            try:
                if entry.stat().st_mtime <= limit:
                    os.unlink(entry.path)
            except OSError:
                pass

    def close(self) -> None:
        """At unload: remove what is left on the board, and the board once no instance uses it."""
        if self._dir is None:
            return
        self._sweep(older_than=0.0)
        try:
            self._dir.rmdir()
        except OSError:
            pass
