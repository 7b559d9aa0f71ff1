import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest

from tests.timeline import ran


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set-up (module and session servers starting), call and teardown of each test, timed (tests.timeline)."""
    with ran(item.nodeid):
        yield


# The files that take longest (docs/results/ci-time.md), first, when the suite runs on xdist workers (`make test
# TEST_WORKERS=2`: each takes the next file as it finishes one, --dist loadfile --no-loadscope-reorder), so the long
# ones start early and the many short unit files fill the end. The memory-heavy ones apart (memory_heavy_alone).
SLOW_FIRST = ("tests/e2e/test_faults.py", "tests/e2e/test_checkpoints.py", "tests/e2e/test_families.py",
              "tests/e2e/test_tier.py", "tests/e2e/test_reuse.py", "tests/e2e/test_serving_commands.py",
              "tests/e2e/test_hosts.py", "tests/component/test_patches.py", "tests/e2e/test_audio.py",
              "tests/e2e/test_epd.py", "tests/e2e/test_colocated.py", "tests/e2e/test_omni.py",
              "tests/e2e/test_video_split.py", "tests/e2e/test_hosts_disagg.py", "tests/e2e/test_openai.py",
              "tests/e2e/test_differential.py", "tests/e2e/test_pd_transfer.py", "tests/e2e/test_openai_in_process.py")
FILE_SECONDS: dict[str, dict[str, float]] = {}  # test file -> test -> its set-up + call + teardown seconds


def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "numprocesses", None):  # one process: the order as collected
        return
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected


@pytest.fixture(scope="module", autouse=True)
def memory_heavy_alone(request, tmp_path_factory):
    """A module marked ``memory_heavy`` (servers of real checkpoint shapes: ~11 GiB; several hosts' servers) runs
    while no other such module does, on either xdist worker or in another pytest session of this machine: two at once
    took CI's 24 GiB and the kernel's OOM killer an EngineCore. An exclusive lock on a file in pytest's temporary root
    (the kernel drops it with the process)."""
    if request.node.get_closest_marker("memory_heavy") is None:
        yield
        return
    import fcntl

    root = tmp_path_factory.getbasetemp().parent
    with open(root / "memory-heavy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pytest_runtest_logreport(report):
    """Each test's phases, as the controller gets them (from every xdist worker)."""
    tests = FILE_SECONDS.setdefault(report.nodeid.split("::")[0], {})
    tests[report.nodeid] = tests.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Where the run's time went, per test file (its tests' set-up, call and teardown, module servers included):
    the files that cost most first (docs/results/ci-time.md). With two workers the files' seconds add up to about
    twice the wall time."""
    files = sorted(((name, sum(tests.values()), len(tests)) for name, tests in FILE_SECONDS.items()),
                   key=lambda row: -row[1])
    if not files:
        return
    terminalreporter.section("time per test file")
    total = sum(seconds for _, seconds, _ in files)
    for name, seconds, count in files[:30]:
        terminalreporter.write_line(f"{seconds:8.1f} s {seconds / total:6.1%} {count:5d} tests  {name}")
    terminalreporter.write_line(f"{total:8.1f} s in all, {len(files)} files")
