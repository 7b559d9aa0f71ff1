"""An asyncio event loop on a daemon thread: where a decoupled Triton model runs its requests, since
``execute`` must return at once while responses keep streaming."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Coroutine


class LoopThread:
    def __init__(self, name: str = "model-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=timeout)
