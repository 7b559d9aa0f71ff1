"""CPU seconds per process of a served model repository, labelled by role (for ``clients.bench.e2e``).

``snapshot(server_pid)``: the CPU time (user + system) so far of every live process in the server's process
group, and of this process (the load generator), keyed by pid with a role label: ``tritonserver``,
``stub <model>`` (a Python-backend stub; its first argument is ``<repo>/<model>/<version>/model.py``),
``EngineCore <model>`` (a vLLM engine process, a child of that model's stub), ``load generator``, or the
process name. CPU time is read at nanosecond resolution (``/proc/<pid>/task/*/schedstat``, the time on a CPU of
every live thread), or from the 10 ms ticks of ``/proc/<pid>/stat`` where those are more (threads that ended since
the process started are only in the ticks). ``per_request(before, after, requests)``: milliseconds of CPU per request per label, over the
processes alive in both snapshots (processes of one label are summed). ``gpu_memory(server_pid)``: MiB of GPU
memory per label (``nvidia-smi``'s compute processes; empty without a GPU). ``GpuBusy``: the GPU's busy share over
a timed window.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from backend.deploy.local_server import group_members

_TICK = os.sysconf("SC_CLK_TCK")


def _threads_seconds(pid: int) -> float:
    """Seconds on a CPU of ``pid``'s live threads (schedstat, nanoseconds); 0 where unreadable."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    except OSError:
        return 0.0
    return total / 1e9


def _stat(pid: int) -> tuple[str, int, float, list[bytes]] | None:
    """(name, parent pid, CPU seconds, command line) of ``pid``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    name = stat[stat.index("(") + 1: stat.rindex(")")]
    ticks = (int(fields[11]) + int(fields[12])) / _TICK
    fine = _threads_seconds(pid)
    return name, int(fields[1]), fine if fine > ticks - 2 / _TICK else ticks, cmdline


def _label(name: str, cmdline: list[bytes]) -> str:
    program = cmdline[0].decode(errors="replace").split("/")[-1] if cmdline and cmdline[0] else name
    if program.endswith("_stub") and len(cmdline) > 1:
        return f"stub {cmdline[1].decode(errors='replace').split('/')[-3]}"
    if program == "tritonserver":
        return "tritonserver"
    return name


def snapshot(server_pid: int | None) -> dict[int, tuple[str, float]]:
    """pid -> (label, CPU seconds) for the server's group and this process."""
    return snapshot_of(group_members(server_pid) if server_pid else [])


def snapshot_of(pids) -> dict[int, tuple[str, float]]:
    """pid -> (label, CPU seconds) for ``pids`` (a deployment's processes) and this process."""
    stats = {pid: _stat(pid) for pid in pids}
    labels = {pid: _label(s[0], s[3]) for pid, s in stats.items() if s}
    out = {}
    for pid, s in stats.items():
        if not s:
            continue
        label = labels[pid]
        if "EngineCor" in s[0] and labels.get(s[1], "").startswith("stub "):
            label = f"EngineCore {labels[s[1]][5:]}"
        out[pid] = (label, s[2])
    # this process: the kernel's CPU clock of the whole process (every thread, ended ones too, at ns resolution);
    # /proc's ticks, what _stat falls back to where threads have ended, move in 10 ms steps (seen: 60 ms of a phase
    # read as 50 inside the test suite, whose process has ended many threads)
    out[os.getpid()] = ("load generator", time.process_time())
    return out


def per_request(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], requests: int) -> dict[str, float]:
    """Label -> ms of CPU per request between the snapshots, largest first."""
    used: dict[str, float] = {}
    for pid, (label, seconds) in after.items():
        if pid in before:
            used[label] = used.get(label, 0.0) + seconds - before[pid][1]
    return {label: round(seconds * 1000 / max(requests, 1), 2)
            for label, seconds in sorted(used.items(), key=lambda kv: -kv[1])}


def gpu_memory(server_pid: int | None) -> dict[str, int]:
    """Label -> MiB of GPU memory used by the server's processes (``nvidia-smi --query-compute-apps``), largest
    first; empty where there is no ``nvidia-smi`` or no server."""
    if not server_pid or shutil.which("nvidia-smi") is None:
        return {}
    query = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    labels = {pid: label for pid, (label, _) in snapshot(server_pid).items()}
    used: dict[str, int] = {}
    for line in query.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in labels and mib.strip().isdigit():
            used[labels[int(pid)]] = used.get(labels[int(pid)], 0) + int(mib)
    return dict(sorted(used.items(), key=lambda kv: -kv[1]))


class GpuBusy:
    """The GPU's busy share over a timed window: ``nvidia-smi`` samples ``utilization.gpu`` (the share of the last
    sample period in which a kernel ran, per GPU) every ``period_ms`` while the window runs; ``stop`` returns the
    mean per GPU in percent, or ``None`` where there is no ``nvidia-smi``. A stack held back by its host shows a
    GPU far from busy; one bound by the GPU, near 100."""

    def __init__(self, period_ms: int = 250):
        self.proc = None
        if shutil.which("nvidia-smi") is not None:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu",
                                          "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> list[float] | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        return mean_busy(out)


def mean_busy(samples: str) -> list[float] | None:
    """``index, utilization.gpu`` lines -> the mean utilisation of each GPU index, in index order (None: no
    sample)."""
    per_gpu: dict[int, list[int]] = {}
    for line in samples.splitlines():
        index, _, busy = (part.strip() for part in line.partition(","))
        if index.isdigit() and busy.isdigit():
            per_gpu.setdefault(int(index), []).append(int(busy))
    return [round(sum(v) / len(v), 1) for _, v in sorted(per_gpu.items())] or None
