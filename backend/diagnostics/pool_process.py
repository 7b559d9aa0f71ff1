"""A real EmbeddingPool in a child process, driven over a pipe: the producer side of the component
tests and of the transfer benchmark (clients/bench/transfer.py). Commands: ("publish", tensor) -> handle doc; ("pool_handle",) -> the pool's handle doc; ("state", lease_id); ("release",
lease_id); ("corrupt", lease_id); ("stats",); ("cpu",) -> process CPU seconds; ("stop",)."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch


def _serve(conn, pool_bytes: int, lease_seconds: float, alloc_timeout: float, device: str, agent_name: str | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from backend.transfer.producer import HEADER, EmbeddingPool

    pool = EmbeddingPool(pool_bytes, lease_seconds=lease_seconds, alloc_timeout=alloc_timeout, device=device,
                         agent_name=agent_name)
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if cmd == "publish":
                    conn.send(("ok", pool.publish(args[0]).to_doc()))
                elif cmd == "state":
                    state = pool.lease_state(args[0])
                    conn.send(("ok", state.value if state else None))
                elif cmd == "release":
                    conn.send(("ok", pool.release(args[0])))
                elif cmd == "publish_many":  # benchmark: (tensor, n) -> n handle docs, the tensor sent once
                    conn.send(("ok", [pool.publish(args[0]).to_doc() for _ in range(args[1])]))
                elif cmd == "corrupt":  # flip the payload bytes of a published lease (tests only)
                    lease = pool._leases[args[0]]
                    nbytes = int(pool.buffer[lease.offset + 8: lease.offset + 16].view(torch.int64)[0])
                    pool.buffer[lease.offset + HEADER: lease.offset + HEADER + nbytes].bitwise_xor_(0x5A)
                    conn.send(("ok", None))
                elif cmd == "pool_handle":
                    conn.send(("ok", pool.pool_handle().to_doc()))
                elif cmd == "stats":
                    conn.send(("ok", pool.stats()))
                elif cmd == "cpu":
                    times = os.times()
                    conn.send(("ok", times.user + times.system))
                elif cmd == "stop":
                    conn.send(("ok", None))
                    return
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        pool.close()


class ProducerProcess:
    def __init__(self, pool_bytes: int = 8 << 20, lease_seconds: float = 30.0, alloc_timeout: float = 0.2,
                 device: str = "cpu", agent_name: str | None = None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, pool_bytes, lease_seconds, alloc_timeout, device, agent_name),
                                daemon=True)
        self.proc.start()

    def call(self, *cmd):
        self.conn.send(cmd)
        if not self.conn.poll(60):
            raise TimeoutError(f"producer did not answer {cmd[0]}")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def wait_state(self, lease_id: str, want, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while (state := self.call("state", lease_id)) != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return state

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop")
            except (TimeoutError, OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def make_layout(handle_doc: dict, tensor: torch.Tensor, grid=(1, 2, 2)):
    from backend.protocol.layout import ImageLayout, LayoutMetadata, TransferHandle

    return LayoutMetadata(content_key="k", model="m", dtype=str(tensor.dtype).removeprefix("torch."),
                          shape=tuple(tensor.shape), handle=TransferHandle.from_doc(handle_doc, "test"),
                          media=ImageLayout(grid))
