"""A vLLM general plugin (entry point ``vllm.general_plugins``, see pyproject.toml).

vLLM calls it in each of its processes, EngineCore included. With ``EPD_GLOO_SHARED_DEVICE=1`` (the project's
engines set it) the gloo process groups of a process share one transport device (``share_gloo_device``). When
``EPD_NIXL_POLL_DELAY_US`` is set
(the ``prefill`` and ``decode`` models set it before starting their engines), NIXL agents that vLLM's
NixlConnector creates poll with that delay instead of busy-spinning a core while idle (NIXL's Python
API hard-codes a delay of 0). When ``EPD_ENGINE_MEMDEBUG`` names a directory, each EngineCore process
writes memory reports there (``backend.diagnostics.memdebug``). Without the variables it does nothing, so other
vLLM users are untouched.
"""
from __future__ import annotations

import os
import queue


def patch_idle_wait(seconds: float) -> None:
    """EngineCore: after a step that ran no model while the scheduler still holds requests, wait up to
    ``seconds`` on the input queue (new requests and aborts wake it at once) before the next step.

    Such steps happen while requests only wait on the KV connector: in a KV producer (prefill), finished
    requests whose blocks decode has not read yet; in a consumer (decode), requests whose KV is still coming.
    vLLM sleeps 1 ms after each one and steps again (schedule, an empty model-runner pass that polls the
    connector, output update), which under load is a busy loop that costs CPU per request. The cost of the wait:
    a freed block or an arrived KV is noticed up to ``seconds`` later. Idempotent."""
    from vllm.v1.engine import core

    real = core.EngineCoreProc._process_engine_step
    if getattr(real, "epd_idle_wait", None) is not None:
        return

    def process_engine_step(self) -> bool:
        executed = real(self)
        if not executed and self.scheduler.has_requests():
            try:
                request = self.input_queue.get(timeout=seconds)
            except queue.Empty:
                pass
            else:
                self._handle_client_request(*request)
        return executed

    process_engine_step.epd_idle_wait = seconds
    core.EngineCoreProc._process_engine_step = process_engine_step


def share_gloo_device() -> None:
    """Gloo process groups made without options (what ``torch.distributed`` does for ``backend="gloo"``) use
    one transport device per process instead of a device each. A gloo device runs a loop thread that wakes
    every 10 ms even when idle; vLLM's CPU worker makes 13 groups, so an idle engine woke ~1,300 times a second
    (measured: ~1.2% of a core) for groups a single-process engine never sends on. Contexts sharing a device
    is how gloo is meant to be used (the device is the transport; each group keeps its own context and pairs).
    Idempotent."""
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "epd_shared_device", False):
        return
    shared: list = []

    class SharedDeviceGloo(base):
        epd_shared_device = True

        def __init__(self, store, rank, size, timeout=None):
            options = base._Options()
            if timeout is not None:
                options._timeout = timeout
            if not shared:
                shared.append(base.create_default_device())
            options._devices = [shared[0]]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo


def register() -> None:
    if os.environ.get("EPD_GLOO_SHARED_DEVICE") == "1":
        share_gloo_device()
    memdebug = os.environ.get("EPD_ENGINE_MEMDEBUG")
    if memdebug:
        from backend.diagnostics import memdebug as tool
        tool.install(memdebug)
    wait = os.environ.get("EPD_ENGINE_IDLE_WAIT_MS")
    if wait:
        patch_idle_wait(float(wait) / 1000)
    value = os.environ.get("EPD_NIXL_POLL_DELAY_US")
    if not value:
        return
    from backend.transfer.agent import patch_process_agents

    patch_process_agents(int(value))
