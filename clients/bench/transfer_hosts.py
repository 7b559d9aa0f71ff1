"""Embedding handoff on one host and across hosts, side by side in one run: the project's producer pool
(``EmbeddingPool``) in one process, its consumer (``EmbeddingConsumer.pull``) in another, the two in one network
namespace or in two (hosts of ``tests.netns.Network``, joined by veths through a bridge), per item size:

  same-host   both in host a: the consumer copies the region out of the producer's pool memfd (the path the
              project takes on one host), the release goes back as a NIXL notification;
  cma         both in host a, the same-host copy off: one NIXL READ, UCX left to its defaults (it moves the data by
              cross-memory attach);
  tcp lo      both in host a, the same-host copy off: one NIXL READ, UCX on TCP over loopback
              (``UCX_TLS=tcp UCX_NET_DEVICES=lo``);
  tcp veth    the producer in host a, the consumer in host b: one NIXL READ over TCP on the veth
              (``UCX_TLS=tcp UCX_NET_DEVICES=eth0``; the consumer picks NIXL by itself: another host identity);
  socket veth the wire's reference, no NIXL: host b asks host a for the item's bytes over one TCP connection
              (an 8-byte request, the bytes back into a buffer allocated once), timed per item in host b.

Timed in the consumer's process: each pull, leases published beforehand, pulled back to back (as in
clients/bench/transfer.py); every mode's processes run from the start, and the rounds go through each size and mode in
turn, so that this machine's drift hits every mode alike. Printed: p50 latency per item and GB/s at the p50, the data
path each consumer took and the bytes that reached its host's veth. Needs root (network namespaces); nothing is bound
outside them.

    python -m clients.bench.transfer_hosts [--sizes 262144,1048576,8388608,33554432] [--iters 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from clients.bench.transfer import _size, _summary
from devtools.diagnostics.pool_process import ConsumerProcess, ProducerProcess
from tests.netns import Network, ucx_env

ROOT = Path(__file__).resolve().parents[2]
HOSTS = {"a": "10.77.0.1", "b": "10.77.0.2"}
POOL_CEILING = 256 << 20  # bytes of leases published at once per size (the iterations are capped by it)


@dataclass(frozen=True)
class Mode:
    name: str
    consumer_host: str  # the producer is always in host a
    same_host_copy: bool
    ucx: dict[str, str] = field(default_factory=dict)


MODES = [Mode("same-host", "a", True, {"UCX_NET_DEVICES": "lo"}),
         Mode("cma", "a", False, {"UCX_NET_DEVICES": "lo"}),
         Mode("tcp lo", "a", False, {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}),
         Mode("tcp veth", "b", False, ucx_env())]
SOCKET = "socket veth"
NAMES = [mode.name for mode in MODES] + [SOCKET]
SOCKET_PORT = 7400


def _env(mode: Mode) -> dict[str, str]:
    """This process's environment without UCX settings of its own, plus the mode's."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    return {**base, "OMP_NUM_THREADS": "1", **mode.ucx}


def start_pair(net: Network, mode: Mode, sizes: list[int], stack: contextlib.ExitStack):
    """The mode's producer (host a) and consumer (its host), both with the mode's UCX settings."""
    env = _env(mode)
    producer = stack.enter_context(ProducerProcess(pool_bytes=POOL_CEILING + 4 * max(sizes), lease_seconds=600,
                                                   alloc_timeout=5, launch=net.launch("a", env=env, cwd=ROOT)))
    consumer = stack.enter_context(ConsumerProcess(same_host_copy=mode.same_host_copy, timeout=60,
                                                   launch=net.launch(mode.consumer_host, env=env, cwd=ROOT)))
    return producer, consumer


def measure(mode: Mode, pair, nbytes: int, iters: int) -> tuple[list[float], dict]:
    """One round of one size: the pull times, and the pulls per data path so far."""
    producer, consumer = pair
    tensor = torch.randn(nbytes // 4 // 128, 128)
    consumer.pull([producer.call("publish", tensor) for _ in range(3)], tensor)  # connection, first touch
    pulled = consumer.pull(producer.call("publish_many", tensor, max(8, min(iters, POOL_CEILING // nbytes))), tensor)
    if not torch.equal(pulled["last"], tensor):
        raise AssertionError(f"{mode.name}: the {_size(nbytes)} item pulled differs from the one published")
    return pulled["seconds"], pulled["paths"]


def socket_server(address: str) -> None:
    """Host a's side of "socket veth": for each 8-byte request n, n bytes back (0 ends the connection)."""
    server = socket.create_server((address, SOCKET_PORT))
    print("ready", flush=True)
    chunk = memoryview(os.urandom(1 << 20))
    while True:
        conn, _ = server.accept()
        with conn:
            while n := int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little"):
                for offset in range(0, n, len(chunk)):
                    conn.sendall(chunk[:min(len(chunk), n - offset)])


def socket_client(address: str, nbytes: int, count: int) -> None:
    """Host b's side: ``count`` items of ``nbytes`` after 3 unmeasured ones; prints the seconds of each as JSON."""
    buffer, seconds = memoryview(bytearray(nbytes)), []
    with socket.create_connection((address, SOCKET_PORT)) as conn:
        for i in range(count + 3):
            started = time.perf_counter()
            conn.sendall(nbytes.to_bytes(8, "little"))
            got = 0
            while got < nbytes:
                got += conn.recv_into(buffer[got:])
            if i >= 3:
                seconds.append(time.perf_counter() - started)
        conn.sendall(bytes(8))
    print(json.dumps(seconds))


def socket_round(net: Network, nbytes: int, iters: int) -> list[float]:
    client = net.popen("b", [sys.executable, "-m", __spec__.name, "socket-client", HOSTS["a"], str(nbytes),
                             str(max(8, min(iters, POOL_CEILING // nbytes)))], cwd=ROOT, stdout=subprocess.PIPE)
    out, _ = client.communicate(timeout=120)
    if client.returncode != 0:
        raise RuntimeError(f"socket veth: the client in host b failed ({client.returncode})")
    return json.loads(out)


def bench(net: Network, sizes: list[int], iters: int, rounds: int) -> dict:
    """Every mode's pair started at once, then round after round each size through each mode in turn (drift of
    this machine's speed hits every mode alike): {mode: {"sizes": {nbytes: summary}, "paths", "veth_bytes"}}."""
    seconds = {name: {n: [] for n in sizes} for name in NAMES}
    paths, veth = {SOCKET: {}}, {mode.name: 0 for mode in MODES}
    with contextlib.ExitStack() as stack:
        pairs = {mode.name: start_pair(net, mode, sizes, stack) for mode in MODES}
        server = net.popen("a", [sys.executable, "-m", __spec__.name, "socket-server", HOSTS["a"]], cwd=ROOT,
                           stdout=subprocess.PIPE, text=True)
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("socket veth: the server in host a did not start")
        for _ in range(rounds):
            for nbytes in sizes:
                for mode in MODES:
                    rx = net.link(mode.consumer_host)["stats64"]["rx"]["bytes"]
                    taken, paths[mode.name] = measure(mode, pairs[mode.name], nbytes, iters)
                    veth[mode.name] += net.link(mode.consumer_host)["stats64"]["rx"]["bytes"] - rx
                    seconds[mode.name][nbytes] += taken
                seconds[SOCKET][nbytes] += socket_round(net, nbytes, iters)
    veth[SOCKET] = None
    return {name: {"sizes": {n: _summary(seconds[name][n], n) for n in sizes}, "paths": paths[name],
                   "veth_bytes": veth[name]} for name in NAMES}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Embedding handoff within one host and across two (namespaces)")
    parser.add_argument("--sizes", default="262144,1048576,8388608,33554432")
    parser.add_argument("--iters", type=int, default=64, help="pulls per size (fewer where they would exceed 256 MiB)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds through every size and mode, interleaved")
    parser.add_argument("--json", type=Path, help="also write the results here")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["socket-server"]:
        return socket_server(argv[1])
    if argv[:1] == ["socket-client"]:
        return socket_client(argv[1], int(argv[2]), int(argv[3]))
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("transfer_hosts: network namespaces need root (ip netns add)")
    sizes = [int(s) for s in args.sizes.split(",")]
    with Network(HOSTS) as net:
        results = bench(net, sizes, args.iters, args.rounds)
    print("p50 latency per item in µs, and GB/s at the p50; producer in host a, consumer in a or b\n")
    print("| size | " + " | ".join(NAMES) + " | tcp veth / same-host |")
    print("|---" * (len(NAMES) + 2) + "|")
    for n in sizes:
        cells = [results[name]["sizes"][n] for name in NAMES]
        ratio = results["tcp veth"]["sizes"][n]["p50_us"] / cells[0]["p50_us"]
        print(f"| {_size(n)} | " + " | ".join(f"{c['p50_us']:.0f} µs, {c['GBps']:.2f} GB/s" for c in cells)
              + f" | {ratio:.1f}x the latency |")
    print()
    for mode in MODES:
        r, ucx = results[mode.name], " ".join(f"{k}={v}" for k, v in mode.ucx.items())
        print(f"{mode.name}: consumer in host {mode.consumer_host}, {ucx}; pulls per path {r['paths']}; "
              f"{r['veth_bytes'] / 2**20:.1f} MiB received on host {mode.consumer_host}'s veth")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
