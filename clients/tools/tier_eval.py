"""Mooncake Store, measured on this machine for the shared embedding tier (docs/tier.md): put/get latency between two
client processes, ``is_exist``, what a full byte budget does, what a writer's exit and a killed master do to the
others, and whether one process can hold both a Mooncake client and a NIXL agent and exit cleanly.

Runs outside the project venv (the venv cannot import mooncake), in the Mooncake venv (``EPD_MOONCAKE_VENV``,
``.venv-mooncake`` from ``make setup``) with its libibverbs/libnl on the library path (docs/tier.md), one run,
everything printed side by side:

    export LD_LIBRARY_PATH=$EPD_MOONCAKE_LIBS
    PYTHONPATH=$PWD "$EPD_MOONCAKE_VENV/bin/python" -m clients.tools.tier_eval

``PROJECT_PYTHON`` (default: this checkout's ``.venv/bin/python``) runs the NIXL-and-Mooncake check.

Client processes are *spawned*, never forked: a process forked from one that holds a Mooncake client hangs in its
own ``setup`` (the lead's first script did exactly that, through multiprocessing's default ``fork``).
Standard library only besides mooncake (imported in the workers), so the house's layer check can read it.
"""
from __future__ import annotations

import json
import random
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from backend.deploy.tier_service import MooncakeHolder, MooncakeMaster

SIZES = (64 << 10, 1 << 20, 16 << 20)
MiB = 1 << 20


def _ms(fn, reps: int) -> tuple[float, object]:
    """Median milliseconds of ``reps`` calls of ``fn(i)``, and the last result."""
    times, out = [], None
    for i in range(reps):
        started = time.perf_counter()
        out = fn(i)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), out


def _worker(name: str, master: dict, segment: int, conn) -> None:
    """One store client: runs the commands the parent sends (``(command, args)``), answers each with its result."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    started = time.perf_counter()
    rc = store.setup(master["local_hostname"], master["metadata"], segment, 32 * MiB, "tcp", "", master["rpc"])
    conn.send({"setup_rc": rc, "setup_ms": (time.perf_counter() - started) * 1000})
    payloads = {n: random.Random(n).randbytes(n) for n in SIZES}  # the same in every worker
    while True:
        command, args = conn.recv()
        started = time.perf_counter()
        try:
            result = COMMANDS[command](store, payloads, *args)
        except Exception as exc:  # a measurement: report it, keep serving
            result = f"raised {type(exc).__name__}: {exc}"
        conn.send({"result": result, "ms": round((time.perf_counter() - started) * 1000, 2)})
        if command == "close":
            return


def _put_sizes(store, payloads, reps, prefix="s"):
    out = {}
    for n in SIZES:
        rcs = []
        ms, _ = _ms(lambda i: rcs.append(store.put(f"{prefix}{n}-{i}", payloads[n])), reps if n < 16 * MiB else 5)
        out[n] = (round(ms, 3), "rc " + ",".join(sorted({str(rc) for rc in rcs})))
    return out


def _get_sizes(store, payloads, reps):
    out = {}
    for n in SIZES:
        ms, value = _ms(lambda i: store.get(f"s{n}-{i}"), reps if n < 16 * MiB else 5)
        out[n] = (round(ms, 3), bytes(value) == payloads[n])
    return out


def _exist(store, payloads, reps):
    hit, rc_hit = _ms(lambda i: store.is_exist(f"s{SIZES[0]}-0"), reps)
    miss, rc_miss = _ms(lambda i: store.is_exist(f"nope-{i}"), reps)
    get_miss, value = _ms(lambda i: store.get(f"nope-{i}"), reps)
    return {"is_exist_hit_ms": round(hit, 3), "rc": rc_hit, "is_exist_miss_ms": round(miss, 3), "rc_miss": rc_miss,
            "get_miss_ms": round(get_miss, 3), "get_miss_len": len(value)}


def _fill(store, payloads, count, size, pause=0.0, prefix="fill"):
    """``count`` puts of ``size`` bytes (``pause`` s apart): how many failed (count per rc), which keys remain."""
    data, failures = os.urandom(size), {}
    store.remove_all()
    time.sleep(1.0)
    for i in range(count):
        time.sleep(pause)
        rc = store.put(f"{prefix}{i}", data)
        if rc != 0:
            failures[rc] = failures.get(rc, 0) + 1
    kept = [i for i in range(count) if store.is_exist(f"{prefix}{i}") == 1]
    return {"puts": count, "failed": failures, "kept": len(kept), "first_kept": kept[:1], "last_kept": kept[-1:],
            "early_keys_kept": sum(i < count // 4 for i in kept)}


def _oversize(store, payloads, size):
    return {"put_rc": store.put("huge", os.urandom(size))}


def _exists_keys(store, payloads, keys):
    return {k: store.is_exist(k) for k in keys}


def _after_master(store, payloads):
    out = {}
    for name, fn in (("get", lambda: len(store.get(f"s{SIZES[0]}-0"))), ("is_exist", lambda: store.is_exist("x")),
                     ("put", lambda: store.put("after", b"y" * 1000))):
        started = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:
            value = f"raised {type(exc).__name__}: {exc}"
        out[name] = {"value": value, "ms": round((time.perf_counter() - started) * 1000, 1)}
    return out


def _close(store, payloads):
    return store.close() if hasattr(store, "close") else None


COMMANDS = {"put_sizes": _put_sizes, "get_sizes": _get_sizes, "exist": _exist, "fill": _fill, "oversize": _oversize,
            "exists_keys": _exists_keys, "after_master": _after_master, "close": _close}


class Client:
    """A spawned worker process and its command pipe."""

    def __init__(self, name: str, master: dict, segment: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(name, master, segment, child), daemon=True)
        self.process.start()
        self.setup = self._answer(60)

    def _answer(self, timeout: float):
        if not self.conn.poll(timeout):
            return f"no answer in {timeout} s"
        return self.conn.recv()

    def __call__(self, command: str, *args, timeout: float = 120):
        self.conn.send((command, args))
        return self._answer(timeout)


NIXL_AND_MOONCAKE = """
import os, time
from nixl._api import nixl_agent, nixl_agent_config
from mooncake.store import MooncakeDistributedStore
agent = nixl_agent("both-%d" % os.getpid(), nixl_agent_config(backends=["UCX"]))
import torch
buf = torch.zeros(1 << 20, dtype=torch.uint8)
reg = agent.register_memory(buf)
store = MooncakeDistributedStore()
rc = store.setup(os.environ["MC_LOCAL"], os.environ["MC_META"], 16 << 20, 16 << 20, "tcp", "", os.environ["MC_RPC"])
assert rc == 0, rc
assert store.put("both", b"z" * 4096) == 0 and bytes(store.get("both")) == b"z" * 4096
agent.deregister_memory(reg)
store.close()
print("nixl+mooncake ok", flush=True)
"""


def nixl_and_mooncake(master: dict, ucx_modules: str | None) -> dict:
    """The project venv's Python with mooncake on its path: a NIXL agent and a store client in one process, exit."""
    env = dict(os.environ, MC_LOCAL=master["local_hostname"], MC_META=master["metadata"], MC_RPC=master["rpc"],
               UCX_NET_DEVICES="lo", PYTHONPATH=os.pathsep.join(sys.path[1:]))
    env.pop("UCX_MODULES", None)
    if ucx_modules is not None:
        env["UCX_MODULES"] = ucx_modules
    python = os.environ.get("PROJECT_PYTHON", str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"))
    started = time.perf_counter()
    done = subprocess.run([python, "-c", NIXL_AND_MOONCAKE], env=env, capture_output=True, text=True, timeout=120)
    errors = [line[:160] for line in done.stderr.splitlines() if "rror" in line or "egmentation" in line][-2:]
    return {"UCX_MODULES": ucx_modules, "rc": done.returncode, "put/get ok": "nixl+mooncake ok" in done.stdout,
            "s": round(time.perf_counter() - started, 1), "errors": errors}


def main() -> None:
    rows: list[tuple[str, object]] = []
    master = MooncakeMaster(log_path=os.environ.get("MC_MASTER_LOG", "/tmp/tier_eval_master.log")).start()
    holder = MooncakeHolder(master, 256 * MiB, log_path="/tmp/tier_eval_holder.log").start()
    info = master.client_config()
    writer = Client("A", info, 0)   # encoder-like clients: no segment of their own, the holder's 256 MiB is the pool
    reader = Client("B", info, 0)
    rows += [("setup A", writer.setup), ("setup B", reader.setup)]
    rows.append(("put ms, A, median of 20 (16 MiB: 5), rc", writer("put_sizes", 20)))
    rows.append(("get ms in B of A's puts, bytes equal", reader("get_sizes", 20)))
    rows.append(("get ms in A of its own puts", writer("get_sizes", 20)))
    rows.append(("is_exist / get miss in B, median of 200", reader("exist", 200)))
    rows.append(("put ms from B", reader("put_sizes", 5, "b")))
    rows.append(("A closes", writer("close")))
    rows.append(("B: is_exist of A's keys after A exited", reader("exists_keys", ["s65536-0", "s1048576-19"])))
    rows.append(("fill: 400 x 1 MiB at once into the 256 MiB pool", reader("fill", 400, MiB)))
    rows.append(("fill: 400 x 1 MiB, 20 ms apart", reader("fill", 400, MiB, 0.02)))
    rows.append(("put of 300 MiB (> pool)", reader("oversize", 300 * MiB)))
    rows.append(("nixl+mooncake in one process, UCX_MODULES=^ib", nixl_and_mooncake(info, "^ib")))
    rows.append(("nixl+mooncake in one process, UCX_MODULES unset", nixl_and_mooncake(info, None)))
    master.kill()
    rows.append(("B after the master was killed (SIGKILL)", reader("after_master", timeout=300)))
    rows.append(("B again (second call after the kill)", reader("after_master", timeout=300)))
    master.start()
    time.sleep(2.0)
    rows.append(("B after the master restarted (same ports)", reader("after_master", timeout=300)))
    rows.append(("B close", reader("close", timeout=60)))
    holder.stop()
    master.stop()
    for name, value in rows:
        print(f"{name:<52} {json.dumps(value, default=str)}")


if __name__ == "__main__":
    main()
