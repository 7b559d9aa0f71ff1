"""tests.netns without namespaces: what a Network refuses before it makes anything, and the names it would use."""
from __future__ import annotations

import os

import pytest

from tests.netns import PREFIX, Network

HOSTS = {"a": "10.77.0.1", "b": "10.77.0.2"}


@pytest.mark.parametrize("hosts, message", [
    ({}, "no hosts given"),
    ({"encoder-replica-0": "10.77.0.1"}, "host name 'encoder-replica-0' must match"),
    ({"A": "10.77.0.1"}, "host name 'A' must match"),
    ({"a": "10.78.0.1"}, "host 'a': address 10.78.0.1 is no host address of 10.77.0.0/24"),
    ({"a": "10.77.0.0"}, "address 10.77.0.0 is no host address"),
    ({"a": "10.77.0.255"}, "address 10.77.0.255 is no host address"),
    ({"a": "10.77.0.1", "b": "10.77.0.1"}, "hosts 'a' and 'b' both have address 10.77.0.1"),
])
def test_bad_hosts_are_refused_naming_the_host(hosts, message):
    with pytest.raises(ValueError, match=message):
        Network(hosts)


def test_names_are_ours_unique_per_network_and_fit_interface_limits():
    one, two = Network(HOSTS), Network(HOSTS)
    assert one.namespace("a").startswith(f"{PREFIX}{os.getpid()}n") and one.namespace("a") != two.namespace("a")
    assert one.switch.startswith(one.tag) and one.switch not in (one.namespace("a"), one.namespace("b"))
    longest = Network({"abcdefghijklm": "10.77.0.1"})  # the longest name allowed
    assert len(longest.port("abcdefghijklm")) == 15
    with pytest.raises(KeyError, match="no host 'c'"):
        one.namespace("c")
    assert Network({"a": "192.168.5.9"}, subnet="192.168.5.0/24").address("a") == "192.168.5.9"
    assert one.leftovers() == []  # nothing made before it is entered
