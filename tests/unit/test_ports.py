"""backend.deploy.ports: listener ports are picked outside the ephemeral range that outgoing connections draw from."""
import socket

from backend.deploy import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    picked = ports.free_ports(3)
    assert len(set(picked)) == 3
    assert all(ports.LOWEST <= p < low for p in picked), picked
    for p in picked:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", p))


def test_a_taken_port_is_not_picked(monkeypatch):
    with socket.socket() as taken, socket.socket() as probe:
        taken.bind(("127.0.0.1", 0))
        probe.bind(("127.0.0.1", 0))
        busy, free = taken.getsockname()[1], probe.getsockname()[1]
        probe.close()
        offers = iter([busy, free])

        class Rng:
            def choice(self, _candidates):
                return next(offers)

        assert ports.free_ports(1, rng=Rng()) == [free]


def test_the_range_comes_from_the_kernel_setting(tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(setting)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
