"""Free TCP ports for listeners that bind later (vLLM's NIXL side channel, a tritonserver's three ports).

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the range every outgoing connection
takes its local port from. Between the pick and the listener's own bind, seconds later, any client
connection in any process can take it: measured in a soak, prefill's NIXL handshake listener died with
``ZMQError: Address already in use`` and the model never finished loading. Ports are therefore picked at
random below the ephemeral range, where only another listener can take them.
"""
from __future__ import annotations

import random
import socket

LOWEST = 20000  # above the ports services usually listen on


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        low, high = (int(x) for x in open(path).read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(count: int = 1, host: str = "127.0.0.1", rng: random.Random | None = None) -> list[int]:
    """``count`` distinct ports that ``host`` can bind now, outside the ephemeral range."""
    rng = rng or random.SystemRandom()
    low, high = ephemeral_range()
    candidates = range(LOWEST, low) if low - LOWEST >= 1000 else range(high + 1, 65536)
    picked: list[int] = []
    for _ in range(1000):
        port = rng.choice(candidates)
        if port in picked:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        picked.append(port)
        if len(picked) == count:
            return picked
    raise RuntimeError(f"no {count} free ports in {candidates.start}-{candidates.stop - 1} on {host}")
