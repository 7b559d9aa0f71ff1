"""How much CPU a served model repository burns while idle, per process.

Starts tritonserver, sends a few requests through ``--model`` (so NIXL agents have connected and
transferred), then samples every process of the server's group over ``--seconds`` of idleness.

    python -m clients.tools.idle_cpu [--model epd] [--seconds 30]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from backend.deploy.local_server import DEFAULT_REPOSITORY, ROOT, TritonServer
from backend.protocol.generate import GenerateInputs
from clients.bench.proc_cpu import snapshot
from clients.triton_client import generate

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
        before = snapshot(server.proc.pid)
        time.sleep(args.seconds)
        usage: dict[str, float] = {}
        for pid, (label, seconds) in snapshot(server.proc.pid).items():
            if pid in before and label != "load generator":
                usage[f"{label} (pid {pid})"] = (seconds - before[pid][1]) / args.seconds * 100
    print(f"CPU while idle for {args.seconds:.0f} s after {args.model} requests (% of one core):")
    for label, pct in sorted(usage.items(), key=lambda kv: -kv[1]):
        print(f"  {pct:6.2f}%  {label}")
    server_pct = sum(p for label, p in usage.items() if label.startswith("tritonserver"))
    print(f"  {sum(usage.values()):6.2f}%  total ({sum(usage.values()) - server_pct:.2f}% beyond tritonserver itself)")
    return usage


if __name__ == "__main__":
    main()
