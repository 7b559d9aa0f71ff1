"""``backend.triton.generate_model.engine_start_method``: an EngineCore is forked as asked, but spawned once this
process has made a NIXL agent (a forked child shares the agent's UCX state: the child's UCX thread and the parent's
spun a core each; ``tests/e2e/test_colocated.py::test_the_idle_server_spins_no_core``)."""
from backend.transfer import agent
from backend.triton.generate_model import engine_start_method


def test_fork_as_asked_while_no_agent_exists(monkeypatch, pb):
    monkeypatch.setattr(agent, "_agents_made", 0)
    assert [engine_start_method(asked) for asked in ("fork", "spawn", "")] == ["fork", "spawn", ""]
    assert not pb.logged


def test_spawn_instead_of_fork_after_an_agent(monkeypatch, pb):
    monkeypatch.setattr(agent, "_agents_made", 1)
    assert [engine_start_method(asked) for asked in ("fork", "spawn", "")] == ["spawn", "spawn", ""]
    assert pb.logged == [("WARNING", "a NIXL agent exists in this process: its next EngineCore is spawned, not forked")]
