"""An asyncio event loop on a daemon thread: where a decoupled Triton model runs its requests, since
``execute`` must return at once while responses keep streaming."""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from typing import Coroutine


log = logging.getLogger(__name__)


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("task on the model loop failed", exc_info=future.exception())


class LoopThread:
    def __init__(self, name: str = "model-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> Future:
        """Run ``coro`` on the loop; an exception it lets escape is logged (nobody else would see it)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        future.add_done_callback(_log_failure)
        return future

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=timeout)
