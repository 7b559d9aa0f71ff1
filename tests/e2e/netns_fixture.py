"""Fixtures for e2e tests whose processes run on separate hosts: network namespaces (``tests.netns``).

``make_network(hosts, **kwargs)`` returns an entered ``tests.netns.Network``; after the test every network it made is
closed (its processes stopped, its namespaces deleted) and checked gone, whether the test passed or not. A test
module takes it with ``from tests.e2e.netns_fixture import make_network  # noqa: F401`` (or tests/e2e/conftest.py
does once for all). ``checked_network`` is the same for one network, for fixtures of a wider scope. Both need root;
without it the tests that use them are skipped with the reason.
"""
from __future__ import annotations

import contextlib
import os

import pytest

from tests.netns import Network


@contextlib.contextmanager
def checked_network(hosts: dict[str, str], **kwargs):
    """An entered ``Network``; on the way out closed (``NetnsError`` if anything stays) and checked gone."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    with Network(hosts, **kwargs) as network:
        yield network
    assert not network.leftovers(), f"namespaces left behind: {network.leftovers()}"


@pytest.fixture
def make_network():
    with contextlib.ExitStack() as stack:
        yield lambda hosts, **kwargs: stack.enter_context(checked_network(hosts, **kwargs))
