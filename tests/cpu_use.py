"""The CPU a pytest process and everything it started have used: what each test file costs the machine (the summary's
"time per test file", tests/conftest.py), where wall seconds alone mix a file's own work with its neighbour's on the
other worker. A server started in a session of its own is still a descendant of the worker that started it; its
processes that have exited count through their parents' reaped-children times."""
from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _direct_children(pid: int) -> bool:
    """Whether ``pid`` has a live child (its threads' ``children`` files: no scan of /proc)."""
    try:
        return any((task / "children").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False


def _processes() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of it and its reaped children) of every process in /proc."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the command's name, which may hold spaces
        found[int(name)] = (int(fields[1]), sum(int(value) for value in fields[11:15]) / TICK)
    return found


def subtree_cpu_seconds(pid: int | None = None) -> float:
    """User and system CPU seconds of this process (or ``pid``), its reaped children and its live descendants."""
    pid = pid or os.getpid()
    if pid == os.getpid() and not _direct_children(pid):
        times = os.times()
        return times.user + times.system + times.children_user + times.children_system
    processes = _processes()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in processes.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += processes.get(current, (0, 0.0))[1]
        todo.extend(children.get(current, ()))
    return total
