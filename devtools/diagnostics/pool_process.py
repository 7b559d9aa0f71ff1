"""A real EmbeddingPool, or a real EmbeddingConsumer, in a child process, driven over a connection: the two sides of
the component tests, the network-namespace tests and the transfer benchmarks (clients/bench/transfer.py,
clients/bench/transfer_hosts.py).

The child is started by multiprocessing (spawn), or, given ``launch``, as ``python -m devtools.diagnostics.pool_process
ROLE FD KWARGS`` through ``launch(argv, pass_fds=(FD,))``, which returns a ``subprocess.Popen``: a caller that must
place the child somewhere (another network namespace: ``tests.netns.Network.popen``) starts it itself, and the
connection is a socket pair inherited as FD.

Producer commands: ("publish", tensor) -> handle doc; ("publish_many", tensor, n) -> n handle docs; ("pool_handle",)
-> the pool's handle doc; ("state", lease_id); ("release", lease_id); ("corrupt", lease_id); ("stats",).
Consumer commands: ("pull", handle docs, dtype, shape) -> {"seconds": per pull, "last": the last tensor, "paths":
pulls per data path so far}. Both: ("host",) -> the child's host identity; ("cpu",) -> its CPU seconds; ("stop",).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Callable

import torch

MODULE = "devtools.diagnostics.pool_process"
Launch = Callable[..., subprocess.Popen]  # launch(argv, pass_fds=...) -> the started child


def _send(conn, message) -> None:
    """Plain pickle, tensors by value: ``Connection.send`` would share a tensor's storage through a file descriptor
    handed over a Unix socket of multiprocessing's resource sharer, which a child in another network namespace (or
    started without multiprocessing's authentication key) cannot reach."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _loop(conn, commands: dict[str, Callable]) -> None:
    """Answer commands until ("stop",): ("ok", value) or ("error", "<type>: <message>")."""
    from backend.protocol.handles import host_identity

    commands = {**commands, "host": host_identity, "cpu": lambda: sum(os.times()[:2])}
    while True:
        cmd, *args = _recv(conn)
        if cmd == "stop":
            _send(conn, ("ok", None))
            return
        try:
            if cmd not in commands:
                raise KeyError(f"unknown command {cmd!r}")
            _send(conn, ("ok", commands[cmd](*args)))
        except Exception as exc:
            _send(conn, ("error", f"{type(exc).__name__}: {exc}"))


def _serve_producer(conn, pool_bytes: int = 8 << 20, lease_seconds: float = 30.0, alloc_timeout: float = 0.2,
                    device: str = "cpu", agent_name: str | None = None, poll_delay_us: int | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from backend.transfer.producer import EmbeddingPool, HEADER

    pool = EmbeddingPool(pool_bytes, lease_seconds=lease_seconds, alloc_timeout=alloc_timeout, device=device,
                         agent_name=agent_name, poll_delay_us=poll_delay_us)

    def state(lease_id):
        found = pool.lease_state(lease_id)
        return found.value if found else None

    def corrupt(lease_id):  # flip the payload bytes of a published lease (tests only)
        lease = pool._leases[lease_id]
        nbytes = int(pool.buffer[lease.offset + 8: lease.offset + 16].view(torch.int64)[0])
        pool.buffer[lease.offset + HEADER: lease.offset + HEADER + nbytes].bitwise_xor_(0x5A)

    try:
        _loop(conn, {"publish": lambda tensor: pool.publish(tensor).to_doc(),
                     # benchmark: (tensor, n) -> n handle docs, the tensor sent once
                     "publish_many": lambda tensor, n: [pool.publish(tensor).to_doc() for _ in range(n)],
                     "state": state, "release": pool.release, "corrupt": corrupt, "stats": pool.stats,
                     "pool_handle": lambda: pool.pool_handle().to_doc()})
    finally:
        pool.close()


def _serve_consumer(conn, same_host_copy: bool = True, device: str = "cpu", timeout: float = 10.0) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from backend.transfer.consumer import EmbeddingConsumer

    consumer = EmbeddingConsumer(role="pull-process", same_host_copy=same_host_copy, device=device, timeout=timeout)

    def pull(docs: list[dict], dtype: str, shape: tuple[int, ...]) -> dict:
        like = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        layouts = [make_layout(doc, like) for doc in docs]
        seconds, pulled = [], None
        for layout in layouts:
            t = time.perf_counter()
            pulled = consumer.pull(layout)
            seconds.append(time.perf_counter() - t)
        return {"seconds": seconds, "last": None if pulled is None else pulled.cpu().clone(),
                "paths": dict(consumer.paths)}

    try:
        _loop(conn, {"pull": pull})
    finally:
        consumer.close()


_SERVERS = {"producer": _serve_producer, "consumer": _serve_consumer}


class _Launched:
    """A ``subprocess.Popen`` child with the part of ``multiprocessing.Process``'s interface the callers use."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()


class _ChildProcess:
    role = ""

    def __init__(self, launch: Launch | None = None, **kwargs):
        if launch is None:
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_SERVERS[self.role], args=(child,), kwargs=kwargs, daemon=True)
            self.proc.start()
            return
        parent, child = socket.socketpair()
        try:
            argv = [sys.executable, "-m", MODULE, self.role, str(child.fileno()), json.dumps(kwargs)]
            self.proc = _Launched(launch(argv, pass_fds=(child.fileno(),)))
        finally:
            child.close()
        self.conn = Connection(parent.detach())

    def call(self, *cmd, timeout: float = 60.0):
        _send(self.conn, cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role} process did not answer {cmd[0]} within {timeout} s")
        status, value = _recv(self.conn)
        if status != "ok":
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=30)
            except (TimeoutError, OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class ProducerProcess(_ChildProcess):
    """An ``EmbeddingPool`` (arguments: ``pool_bytes``, ``lease_seconds``, ``alloc_timeout``, ``device``,
    ``agent_name``, ``poll_delay_us``: its NIXL progress thread's) in a child process."""

    role = "producer"

    def __init__(self, pool_bytes: int = 8 << 20, lease_seconds: float = 30.0, alloc_timeout: float = 0.2,
                 device: str = "cpu", agent_name: str | None = None, poll_delay_us: int | None = None,
                 launch: Launch | None = None):
        super().__init__(launch, pool_bytes=pool_bytes, lease_seconds=lease_seconds, alloc_timeout=alloc_timeout,
                         device=device, agent_name=agent_name, poll_delay_us=poll_delay_us)

    def wait_state(self, lease_id: str, want, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while (state := self.call("state", lease_id)) != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return state


class ConsumerProcess(_ChildProcess):
    """An ``EmbeddingConsumer`` (``same_host_copy``, ``device``, ``timeout``: its transfer deadline) in a child
    process: ``pull`` times each pull there."""

    role = "consumer"

    def __init__(self, same_host_copy: bool = True, device: str = "cpu", timeout: float = 10.0,
                 launch: Launch | None = None):
        super().__init__(launch, same_host_copy=same_host_copy, device=device, timeout=timeout)

    def pull(self, docs: list[dict], like: torch.Tensor) -> dict:
        """Pull the leases ``docs`` of tensors shaped like ``like``, one after another, in the child."""
        return self.call("pull", docs, str(like.dtype).removeprefix("torch."), tuple(like.shape))


def make_layout(handle_doc: dict, tensor: torch.Tensor, grid=(1, 2, 2)):
    from backend.protocol.layout import ImageLayout, LayoutMetadata, TransferHandle

    return LayoutMetadata(content_key="k", model="m", dtype=str(tensor.dtype).removeprefix("torch."),
                          shape=tuple(tensor.shape), handle=TransferHandle.from_doc(handle_doc, "test"),
                          media=ImageLayout(grid))


def main(argv: list[str] | None = None) -> None:
    """``python -m devtools.diagnostics.pool_process ROLE FD KWARGS``: serve ROLE on the inherited socket FD."""
    role, fd, kwargs = argv or sys.argv[1:]
    _SERVERS[role](Connection(int(fd)), **json.loads(kwargs))


if __name__ == "__main__":
    main()
