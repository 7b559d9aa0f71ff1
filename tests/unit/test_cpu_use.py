"""tests.cpu_use: a test file's CPU counts the processes its worker started, live or exited."""
import subprocess
import sys
import time

from tests.cpu_use import subtree_cpu_seconds

BURN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\nprint('done', flush=True)\ntime.sleep(30)"


def test_a_live_child_s_cpu_counts_and_stays_counted_once_it_is_reaped():
    before = subtree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "done"
        live = subtree_cpu_seconds()
        assert live - before >= 0.5, (before, live)
    finally:
        child.kill()
        child.wait()
    reaped = subtree_cpu_seconds()
    assert reaped >= live - 0.05, (live, reaped)


def test_this_process_alone_is_its_os_times():
    started = subtree_cpu_seconds()
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert 0.15 <= subtree_cpu_seconds() - started < 1.0
