"""``backend.engine.patches.share_gloo_device``: gloo process groups of one process share one transport device
(one loop thread that wakes every 10 ms instead of one per group), and the groups still work."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed")

SCRIPT = r"""
import json, sys, tempfile
from pathlib import Path
import torch, torch.distributed as dist
if sys.argv[1] == "shared":
    from backend.engine.patches import share_gloo_device
    share_gloo_device()
    share_gloo_device()  # idempotent
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
groups = [dist.new_group([0], backend="gloo") for _ in range(12)]  # as vLLM's CPU worker makes them
t = torch.arange(3.0)
for g in groups:
    dist.all_reduce(t, group=g)
    dist.broadcast(t, 0, group=g)
loops = sum((p / "comm").read_text().strip() == "gloo_tcp_loop" for p in Path("/proc/self/task").iterdir())
for g in groups:
    dist.destroy_process_group(g)
dist.destroy_process_group()
print(json.dumps({"loops": loops, "t": t.tolist()}))
"""


def _run(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gloo_groups_share_one_device_and_still_work():
    assert _run("own") == {"loops": 13, "t": [0.0, 1.0, 2.0]}  # torch's default: a device (thread) per group
    assert _run("shared") == {"loops": 1, "t": [0.0, 1.0, 2.0]}
