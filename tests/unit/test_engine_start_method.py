"""How an EngineCore starts (``backend.engine.host``): forked as the stub's defaults say, read by ``EngineHost.start``
after ``prepare_process`` applied them; spawned where the caller may not fork (the Triton models, once their process
has made a NIXL agent: a forked child shares the agent's UCX state, and the child's UCX thread and the parent's spun a
core each; ``tests/e2e/test_colocated.py::test_the_idle_server_spins_no_core``)."""
import os

import pytest

from backend.engine import host


def test_fork_as_asked_where_the_process_may_fork(monkeypatch, capsys):
    asked = []
    for method in ("fork", "spawn", ""):
        monkeypatch.setenv(host.START_METHOD_ENV, method)
        asked.append(host.engine_start_method(may_fork=True))
    assert asked == ["fork", "spawn", ""] and not capsys.readouterr().err


def test_spawn_instead_of_fork_where_it_may_not(monkeypatch, capsys):
    asked = []
    for method in ("fork", "spawn", ""):
        monkeypatch.setenv(host.START_METHOD_ENV, method)
        asked.append(host.engine_start_method(may_fork=False))
    assert asked == ["spawn", "spawn", ""]
    assert "a NIXL agent exists in this process: its next EngineCore is spawned, not forked" in capsys.readouterr().err


class _Made(Exception):
    """Raised where vLLM would make the engine: what the EngineCore's start method was by then."""


def test_the_engine_start_reads_the_method_after_the_stub_s_defaults(monkeypatch):
    """``START_METHOD_ENV`` unset in the server's environment: the stub's default (fork) is what vLLM is told. Read
    before the defaults were applied (2026-12-07, the method then came from the model's ``start_engine``), it was
    "", and vLLM's CPU platform spawned every EngineCore: 10 s of CPU each instead of 2."""
    from vllm.engine import arg_utils
    from vllm.v1.engine import async_llm

    for key in host.PROCESS_ENV_DEFAULTS:  # set-then-deleted: monkeypatch gives the test process its own back
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM's CPU platform sets in the config
    monkeypatch.setattr(host, "prepare_process", lambda: [os.environ.setdefault(key, value)
                                                          for key, value in host.PROCESS_ENV_DEFAULTS.items()])
    monkeypatch.setattr(arg_utils, "AsyncEngineArgs", lambda **args: type("Args", (), {
        "create_engine_config": lambda self: None, "enable_log_requests": False, "disable_log_stats": True})())

    def made(*args, **kwargs):
        raise _Made(os.environ["VLLM_WORKER_MULTIPROC_METHOD"])
    monkeypatch.setattr(async_llm.AsyncLLM, "from_vllm_config", made)
    # a process that has not made an IPC directory yet, with no base configured (all given back after the test)
    monkeypatch.setattr(host, "_IPC_BASE", None)
    monkeypatch.setattr(host, "_IPC_ENV_BEFORE", None)
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "")
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    with pytest.raises(_Made) as told:
        host.EngineHost.start({"model": "unused"})
    assert told.value.args == ("fork",)
    # the failed start gave its IPC directory back with the environment's base: before, VLLM_RPC_BASE_PATH kept naming
    # the removed directory, and every tritonserver this pytest worker started afterwards failed its engines' start
    # in mkdtemp (the fresh-clone CI of ed12bad: 60 errors)
    assert "VLLM_RPC_BASE_PATH" not in os.environ
