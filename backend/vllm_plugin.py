"""A vLLM general plugin (entry point ``vllm.general_plugins``, see pyproject.toml).

vLLM calls it in each of its processes, EngineCore included. When ``EPD_NIXL_POLL_DELAY_US`` is set
(the ``prefill`` and ``decode`` models set it before starting their engines), NIXL agents that vLLM's
NixlConnector creates poll with that delay instead of busy-spinning a core while idle (NIXL's Python
API hard-codes a delay of 0). When ``EPD_ENGINE_MEMDEBUG`` names a directory, each EngineCore process
writes memory reports there (``backend.memdebug``). Without the variables it does nothing, so other
vLLM users are untouched.
"""
from __future__ import annotations

import os


def register() -> None:
    memdebug = os.environ.get("EPD_ENGINE_MEMDEBUG")
    if memdebug:
        from backend import memdebug as tool
        tool.install(memdebug)
    value = os.environ.get("EPD_NIXL_POLL_DELAY_US")
    if not value:
        return
    from backend.transfer.agent import patch_process_agents

    patch_process_agents(int(value))
