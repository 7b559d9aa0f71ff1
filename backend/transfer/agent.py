"""Creating NIXL agents that do not spin a core while idle.

NIXL's Python API builds the agent config itself and hard-codes the progress thread's poll delay to 0,
so an idle agent busy-polls (measured: 25-72% of a core here). ``create_agent`` hands the C++ agent a
config with ``pthrDelay`` set (5 ms by default; data moves in the caller's thread, the progress thread only delivers notifications and connection set-up), by wrapping the binding's constructor for the duration
of one construction. Nothing else of NIXL's behaviour changes.
"""
from __future__ import annotations

import os
import threading
import uuid

_construct_lock = threading.Lock()

DEFAULT_POLL_DELAY_US = 5000


def create_agent(role: str, poll_delay_us: int | None = None, name: str | None = None, thread_safe: bool = False):
    """A UCX-backed ``nixl_agent`` named ``name``, by default ``<role>-<pid>-<random>`` (names must be unique
    per peer set; a restarted process may take its predecessor's name, consumers then reconnect).
    ``thread_safe``: NIXL's strict thread sync (one lock around each agent call), for agents used from
    more than one thread."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from nixl import _api

    name = name or f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    real = _api.nixlBind.nixlAgent

    def construct(agent_name, config):
        config.pthrDelay = DEFAULT_POLL_DELAY_US if poll_delay_us is None else poll_delay_us
        return real(agent_name, config)

    with _construct_lock:
        _api.nixlBind.nixlAgent = construct
        try:
            sync = _api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if thread_safe else None
            return _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"], sync_mode=sync))
        finally:
            _api.nixlBind.nixlAgent = real


POLL_DELAY_ENV = "EPD_NIXL_POLL_DELAY_US"


def patch_process_agents(poll_delay_us: int = DEFAULT_POLL_DELAY_US) -> None:
    """Process-wide: every NIXL agent created from now on polls with ``poll_delay_us``. For processes
    whose agents others create, such as vLLM's NixlConnector in an EngineCore process (through the
    vLLM plugin ``backend.engine.patches``). Idempotent."""
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # what vLLM sets when it imports NIXL first
    from nixl import _api

    real = _api.nixlBind.nixlAgent
    if getattr(real, "epd_poll_delay_us", None) is not None:
        return

    def construct(agent_name, config):
        config.pthrDelay = poll_delay_us
        return real(agent_name, config)

    construct.epd_poll_delay_us = poll_delay_us
    _api.nixlBind.nixlAgent = construct
