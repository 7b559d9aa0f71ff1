"""Producers announce their pools; a consumer's watcher hands each over once, a restarted producer again,
and a dead producer's leftover is removed by the next announcement (real files, a real thread)."""
import os
import subprocess
import time
from dataclasses import replace

from backend.protocol.layout import SharedMemoryHandle, TransferHandle
from backend.transfer.announce import ProducerWatcher, announce, directory, withdraw


def handle(name: str, pid: int) -> TransferHandle:
    return SharedMemoryHandle(agent_name=name, agent_metadata=b"meta-" + name.encode(), descriptors=b"", lease_id="",
                              nbytes=0, expires_at=0.0, host="h", shm_path=f"/proc/{pid}/fd/3", pid=pid)


def wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_watcher_hands_over_each_announcement_once_and_a_rewritten_one_again(tmp_path):
    where = tmp_path / "producers"
    first = announce(handle("encoder-a", os.getpid()), where)  # there before the watcher starts
    seen: list[TransferHandle] = []
    watcher = ProducerWatcher(where, seen.append, interval=0.02)
    try:
        assert wait_for(lambda: len(seen) == 1) and seen[0].agent_metadata == b"meta-encoder-a"
        announce(handle("encoder-b", os.getpid()), where)
        assert wait_for(lambda: len(seen) == 2) and seen[1].agent_name == "encoder-b"
        time.sleep(0.1)
        assert len(seen) == 2  # nothing handed over twice
        announce(replace(handle("encoder-a", os.getpid()), agent_metadata=b"restarted"), where)
        assert wait_for(lambda: len(seen) == 3) and seen[2].agent_metadata == b"restarted"
    finally:
        watcher.close()
    withdraw(first)
    assert where.exists()  # encoder-b is still announced
    withdraw(where / "encoder-b.json")
    assert not where.exists()  # the last one out removes the directory


def test_a_dead_producer_is_neither_handed_over_nor_left_behind(tmp_path):
    where = tmp_path / "producers"
    dead = subprocess.Popen(["true"])
    dead.wait()
    announce(handle("encoder-dead", dead.pid), where)
    live = announce(handle("encoder-live", os.getpid()), where)
    assert sorted(p.name for p in where.iterdir()) == ["encoder-live.json"]  # announcing removed the dead one's
    announce(handle("encoder-dead", dead.pid), where)
    seen: list[TransferHandle] = []
    watcher = ProducerWatcher(where, seen.append, interval=0.02)
    try:
        assert wait_for(lambda: not (where / "encoder-dead.json").exists())  # and so does a watcher
        assert wait_for(lambda: [h.agent_name for h in seen] == ["encoder-live"])
    finally:
        watcher.close()
    withdraw(live)
    assert not where.exists()


def test_the_directory_is_the_server_s():
    assert directory(1234).name == "epd-producers-1234" and str(directory(1234)).startswith("/dev/shm/")
    assert directory().name == f"epd-producers-{os.getppid()}"
