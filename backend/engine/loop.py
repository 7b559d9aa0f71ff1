"""An asyncio event loop on a daemon thread: where a decoupled Triton model runs its requests, since
``execute`` must return at once while responses keep streaming."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import Future
from typing import Coroutine


log = logging.getLogger(__name__)


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("task on the model loop failed", exc_info=future.exception())


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where installed (``EPD_EVENT_LOOP=asyncio``: the standard one), as vLLM's API server and uvicorn
    use: the loop of a model that serves HTTP (``frontend.openai.in_process``) and streams every engine step."""
    if os.environ.get("EPD_EVENT_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


LAG_INTERVAL_SECONDS = 0.05


async def watch_lag(observe, interval: float = LAG_INTERVAL_SECONDS) -> None:
    """Until cancelled: sleep ``interval`` on the running loop and ``observe`` how late it woke (seconds, >= 0): the
    time its other callbacks held it, which every request on the loop waits too (a refusal's answer among them)."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(interval)
        observe(max(0.0, loop.time() - asked - interval))


class LoopThread:
    def __init__(self, name: str = "model-loop"):
        self.loop = new_event_loop()
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
