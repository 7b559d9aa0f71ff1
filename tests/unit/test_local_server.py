"""``clients.local_server.remove_python_envs``: which of tritonserver's Python-backend directories
(``/tmp/python_env_*``) a stopped server's launcher removes. The directories are real ones in /tmp; the running
servers' start times are given (real servers' directories: tests/e2e/test_hosts.py, whose killed hosts leave theirs)."""
import os
import tempfile
import time

import pytest

from clients import local_server


@pytest.fixture
def made():
    paths = []

    def make() -> str:
        paths.append(tempfile.mkdtemp(prefix="python_env_", dir="/tmp"))
        return paths[-1]
    yield make
    for path in paths:
        if os.path.isdir(path):
            os.rmdir(path)


def test_an_empty_directory_made_while_the_server_started_is_removed(made, monkeypatch):
    before = local_server.python_envs()
    start = time.time()
    ours = made()
    monkeypatch.setattr(local_server, "_tritonserver_starts", lambda: [])
    assert local_server.remove_python_envs(before, [start, time.time()]) == [ours]
    assert not os.path.exists(ours)


def test_a_directory_a_running_server_may_have_made_is_left(made, monkeypatch):
    before = local_server.python_envs()
    start = time.time()
    theirs = made()
    monkeypatch.setattr(local_server, "_tritonserver_starts", lambda: [start - 2.0])  # started 2 s before it was made
    assert local_server.remove_python_envs(before, [start, time.time()]) == []
    assert os.path.isdir(theirs)
    monkeypatch.setattr(local_server, "_tritonserver_starts", lambda: [start - 120.0])  # long before: not its
    assert local_server.remove_python_envs(before, [start, time.time()]) == [theirs]


def test_what_was_there_before_made_later_or_not_empty_is_left(made, monkeypatch):
    monkeypatch.setattr(local_server, "_tritonserver_starts", lambda: [])
    older = made()
    before = local_server.python_envs()
    start = time.time()
    full = made()
    open(os.path.join(full, "env.tar.gz"), "w").close()  # a model's extracted execution environment
    ready = time.time()
    time.sleep(1.2)
    later = made()
    assert local_server.remove_python_envs(before, [start, ready]) == []
    assert all(os.path.isdir(path) for path in (older, full, later))
    os.unlink(os.path.join(full, "env.tar.gz"))
    assert local_server.remove_python_envs(before, [None, None]) == []  # never started
