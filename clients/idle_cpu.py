"""How much CPU a served model repository burns while idle, per process.

Starts tritonserver, sends a few requests through ``--model`` (so NIXL agents have connected and
transferred), then samples every process of the server's group over ``--seconds`` of idleness.

    python -m clients.idle_cpu [--model epd] [--seconds 30]
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from clients.local_server import DEFAULT_REPOSITORY, ROOT, TritonServer, group_members
from clients.triton_client import GenerateInputs, generate

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> tuple[str, float] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    name = stat[stat.index("(") + 1: stat.rindex(")")]
    program = cmdline[0].decode().split("/")[-1] if cmdline and cmdline[0] else name
    if program.endswith("_stub") and len(cmdline) > 1:  # its first argument is <repo>/<model>/<version>/model.py
        label = f"stub of {cmdline[1].decode().split('/')[-3]}"
    elif program == "tritonserver":
        label = "tritonserver"
    else:
        label = name
    return label, (int(fields[11]) + int(fields[12])) / _TICK


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="epd")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    args = parser.parse_args(argv)
    from clients.images import image_bytes

    with TritonServer(args.model_repository, log_path=ROOT / ".cache" / "idle-cpu-server.log") as server:
        for seed in range(4):
            generate(server.grpc_url, args.model, GenerateInputs(prompt="Describe.", images=[image_bytes(64, 48, seed)]))
        time.sleep(1.0)
        pids = group_members(server.proc.pid)
        before = {pid: _cpu(pid) for pid in pids}
        time.sleep(args.seconds)
        usage: dict[str, float] = {}
        for pid in pids:
            start, end = before[pid], _cpu(pid)
            if start and end:
                label = f"{end[0]} (pid {pid})"
                usage[label] = (end[1] - start[1]) / args.seconds * 100
    print(f"CPU while idle for {args.seconds:.0f} s after {args.model} requests (% of one core):")
    for label, pct in sorted(usage.items(), key=lambda kv: -kv[1]):
        print(f"  {pct:6.2f}%  {label}")
    server_pct = sum(p for label, p in usage.items() if label.startswith("tritonserver"))
    print(f"  {sum(usage.values()):6.2f}%  total ({sum(usage.values()) - server_pct:.2f}% beyond tritonserver itself)")
    return usage


if __name__ == "__main__":
    main()
