"""Where a stack's host CPU goes, per process (issue 36, item 2): ``clients.bench.side_by_side --profile``.

Two measurements of each row's timed window:
- **CPU per request per process** (``by_process``): the group accounting of ``side_table`` split by process, each
  named by what it is (``label``: ``tritonserver``, ``stub llm``, ``EngineCore``, ``openai endpoint``, ``api server``,
  ...; processes of one name are summed). Exact (the kernel's counters), free, always taken.
- **py-spy profiles** (``Profiles``, with ``--profile``): ``py-spy record --nonblocking --format raw`` of every Python
  process of the stack over the window (not tritonserver: C++), one collapsed-stack file per process, summarised
  (``summarise``) as the functions with the most samples on-CPU (``self``: the frame at the top of the stack) and
  the frames most often on the stack (``inclusive``), each as a share of that process's samples and as ms of CPU per
  request (the share times the process's CPU per request). py-spy's own sampling takes CPU of the machine (a 2-core
  one: expect the window's req/s to fall): profiled rows measure where the time goes, not how fast the stack is.
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

PYTHONS = ("python", "triton_python_backend_stub", "VLLM", "vllm")


def label(pid: int) -> str:
    """What process ``pid`` is, from its command line and name ("" if it is gone)."""
    found = _identity(pid)
    if found is None:
        return ""
    args, comm = found
    joined = " ".join(args)
    if "EngineCore" in comm or "EngineCore" in joined:
        return "EngineCore"
    if args and args[0].endswith("tritonserver"):
        return "tritonserver"
    if "triton_python_backend_stub" in joined:  # argv[1]: .../<model>/<version>/model.py
        model = next((Path(a).parts[-3] for a in args[1:] if a.endswith("model.py") and len(Path(a).parts) >= 3), "?")
        return f"stub {model}"
    if "frontend.openai" in joined:
        return "openai endpoint"
    if "disagg_epd_proxy" in joined:
        return "proxy"
    if "vllm" in joined and ("serve" in args or "vllm.entrypoints.openai.api_server" in joined):
        return "api server"
    return comm or (Path(args[0]).name if args else "?")


def _identity(pid: int) -> tuple[list[str], str] | None:
    """(command line, name) of ``pid``; None if it is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in argv if a], comm


def by_process(before: dict[str, dict[tuple[int, int], float]], after: dict[str, dict[tuple[int, int], float]],
               requests: int) -> dict[str, dict[str, float]]:
    """Group -> {process label: ms of CPU per request} between two ``side_table.cpu_snapshot``s (its rules: a process
    new in ``after`` counts from 0, one gone is not counted), largest first."""
    out = {}
    for group, processes in after.items():
        earlier, per = before.get(group, {}), Counter()
        for key, cpu in processes.items():
            per[label(key[0]) or "gone"] += max(0.0, cpu - earlier.get(key, 0.0))
        out[group] = {name: round(seconds * 1000 / max(requests, 1), 2) for name, seconds in per.most_common()
                      if seconds > 0}
    return out


def is_python(pid: int) -> bool:
    try:
        exe = Path(f"/proc/{pid}/exe").resolve().name
        comm = Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return False
    return any(p in exe or p in comm for p in PYTHONS) and not exe.startswith("tritonserver")


def py_spy() -> str | None:
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy")


class Profiles:
    """py-spy recording every Python process of ``pids`` into ``out`` (``<label>-<pid>.txt``) until ``stop``."""

    def __init__(self, pids: list[int], out: Path, rate: int = 100):
        exe = py_spy()
        if exe is None:
            raise RuntimeError("--profile needs py-spy (pip install py-spy into this venv)")
        out.mkdir(parents=True, exist_ok=True)
        self.recorders: list[tuple[str, int, Path, subprocess.Popen]] = []
        for pid in pids:
            if not is_python(pid):
                continue
            name = label(pid).replace(" ", "-")
            path = out / f"{name}-{pid}.txt"
            proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--nonblocking", "--format", "raw",
                                     "--rate", str(rate), "--output", str(path)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.recorders.append((label(pid), pid, path, proc))

    def stop(self) -> list[tuple[str, int, Path]]:
        """Stop every recorder (SIGINT: py-spy writes its file); (label, pid, file) of those that wrote one."""
        for *_, proc in self.recorders:
            proc.send_signal(signal.SIGINT)
        done = []
        for name, pid, path, proc in self.recorders:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            if path.exists() and path.stat().st_size:
                done.append((name, pid, path))
        return done


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: one name per function, whatever the line."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    file = m["file"]
    parts = Path(file).parts
    short = "/".join(parts[-2:]) if len(parts) >= 2 else file
    return f"{m['func']} ({short})"


def read_raw(path: Path) -> Counter:
    """py-spy's raw (collapsed) format: ``frame;frame;...;top count`` per line -> Counter of stack tuples."""
    stacks: Counter = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(frame_name(f) for f in stack.split(";") if f)] += int(count)
    return stacks


def summarise(stacks: Counter, cpu_ms_per_request: float | None, top: int = 15) -> dict:
    """The functions with the most samples at the top of the stack (``self``) and on it (``inclusive``): each as
    (name, share of the samples, ms of CPU per request where ``cpu_ms_per_request`` is known)."""
    total = sum(stacks.values())
    selfs, inclusive = Counter(), Counter()
    for stack, count in stacks.items():
        if stack:
            selfs[stack[-1]] += count
        for name in set(stack):
            inclusive[name] += count

    def rows(counter: Counter) -> list[tuple[str, float, float | None]]:
        return [(name, round(n / total, 4), None if cpu_ms_per_request is None else
                 round(cpu_ms_per_request * n / total, 2)) for name, n in counter.most_common(top)]

    return {"samples": total, "self": rows(selfs) if total else [], "inclusive": rows(inclusive) if total else []}


def report(row: str, profiles: dict[str, dict]) -> str:
    """Markdown of one row's summaries: per process, the top self and inclusive functions."""
    lines = [f"### {row}"]
    for process, summary in profiles.items():
        lines.append(f"\n#### {process} ({summary['samples']} samples)\n\n| self | share | ms/req | | inclusive | share "
                     f"| ms/req |\n|---|---|---|---|---|---|---|")
        pairs = zip(summary["self"], summary["inclusive"])
        for (s_name, s_share, s_ms), (i_name, i_share, i_ms) in pairs:
            lines.append(f"| `{s_name}` | {s_share:.0%} | {s_ms if s_ms is not None else ''} | | `{i_name}` | "
                         f"{i_share:.0%} | {i_ms if i_ms is not None else ''} |")
    return "\n".join(lines) + "\n"
