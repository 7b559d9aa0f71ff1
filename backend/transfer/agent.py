"""Creating NIXL agents that do not spin a core while idle.

NIXL's Python API builds the agent config itself and hard-codes the progress thread's poll delay to 0, so an idle
agent busy-polls (measured: 25-72% of a core here). The binding's agent constructor is wrapped once per process
(``_wrap_constructor``, NIXL versions checked: ``POLL_DELAY``) to set the config's ``pthrDelay`` before the C++
agent is made: to the process-wide delay where ``patch_process_agents`` set one (for agents others create, such as
vLLM's NixlConnector), else to the delay of the agent ``create_agent`` is making on this thread, else left as NIXL
set it.
Data moves in the caller's thread; the progress thread only delivers notifications and connection set-up, so a
5 ms delay costs a notification up to 5 ms. Nothing else of NIXL's behaviour changes.
"""
from __future__ import annotations

import os
import threading
import uuid

from backend.protocol.versions import Guard

DEFAULT_POLL_DELAY_US = 5000
POLL_DELAY_ENV = "EPD_NIXL_POLL_DELAY_US"
POLL_DELAY = Guard("NIXL poll delay", "nixl", "1.5", "1.6",
                   "each NIXL agent's progress thread busy-polls: 25-72% of a core per idle agent "
                   "(~95% of a core per idle prefill or decode EngineCore, docs/results/epd.md)")

_creating = threading.local()  # .delay_us: the delay of the agent create_agent is making on this thread
_process_delay_us: int | None = None  # patch_process_agents: every agent of this process made from then on
_agents_made = 0  # create_agent's agents in this process (a fork after one shares its UCX state: agents_in_process)


def agents_in_process() -> int:
    """How many agents ``create_agent`` made in this process. A child forked after one inherits its UCX context's
    event descriptors: measured, the child's UCX progress thread and this process's UCX async thread then each spin
    a core for good (an E/P/D orchestrator whose decode EngineCore forked after its embeddings consumer's agent)."""
    return _agents_made


def _wrap_constructor() -> bool:
    """Wrap ``nixlBind.nixlAgent`` once per process; False (and the agents keep NIXL's delay) where ``POLL_DELAY``
    does not allow it."""
    from nixl import _api

    if getattr(_api.nixlBind.nixlAgent, "epd_poll_delay", False):
        return True
    if not POLL_DELAY.allows(_api.nixlBind, "nixlAgent", "nixlAgentConfig"):
        return False
    real = _api.nixlBind.nixlAgent

    def construct(agent_name, config):
        delay = getattr(_creating, "delay_us", None) if _process_delay_us is None else _process_delay_us
        if delay is not None:
            config.pthrDelay = delay
        return real(agent_name, config)

    construct.epd_poll_delay = True
    _api.nixlBind.nixlAgent = construct
    return True


def create_agent(role: str, poll_delay_us: int | None = None, name: str | None = None, thread_safe: bool = False):
    """A UCX-backed ``nixl_agent`` polling with ``poll_delay_us`` (``DEFAULT_POLL_DELAY_US`` by default), named
    ``name``, by default ``<role>-<pid>-<random>`` (names must be unique per peer set; a restarted process may take
    its predecessor's name, consumers then reconnect). ``thread_safe``: NIXL's strict thread sync (one lock around
    each agent call), for agents used from more than one thread."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from nixl import _api

    global _agents_made
    name = name or f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    _wrap_constructor()
    _agents_made += 1
    _creating.delay_us = DEFAULT_POLL_DELAY_US if poll_delay_us is None else poll_delay_us
    try:
        sync = _api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if thread_safe else None
        return _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"], sync_mode=sync))
    finally:
        _creating.delay_us = None


def patch_process_agents(poll_delay_us: int = DEFAULT_POLL_DELAY_US) -> None:
    """Process-wide: every NIXL agent created from now on polls with ``poll_delay_us``. For processes
    whose agents others create, such as vLLM's NixlConnector in an EngineCore process (through the
    vLLM plugin ``backend.engine.patches``). Idempotent: the first delay stays."""
    global _process_delay_us
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # what vLLM sets when it imports NIXL first
    if _process_delay_us is None and _wrap_constructor():
        _process_delay_us = poll_delay_us
