import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest

from tests.cpu_use import subtree_cpu_seconds
from tests.timeline import ran


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set-up (module and session servers starting), call and teardown of each test, timed (tests.timeline), inside
    its module's locks (ModuleLocks): taken before the module's first test sets anything up (the session server
    included, where this module is the first to need it), dropped after its last test's teardown."""
    MODULE_LOCKS.enter(item)
    with ran(item.nodeid):
        yield
    if nextitem is None or nextitem.module is not item.module:
        MODULE_LOCKS.leave()


_CPU_MARK: list[float] = []  # the worker's subtree CPU seconds at its last report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the CPU seconds the worker and the processes it started used since the last one
    (tests.cpu_use): a module server's start in its first test's set-up, its stop in its last test's teardown."""
    outcome = yield
    now = subtree_cpu_seconds()
    used = now - _CPU_MARK[0] if _CPU_MARK else 0.0
    _CPU_MARK[:] = [now]
    report = outcome.get_result()
    report.user_properties = [*report.user_properties, ("cpu_s", used)]


class ModuleLocks:
    """What a test module may run beside, on either xdist worker (`make test TEST_WORKERS=2`) or in another pytest
    session of this machine; flock()s on files in pytest's temporary root, which the kernel drops with the process.
    - ``memory_heavy`` (servers of real checkpoint shapes: ~11 GiB; several hosts' servers): never two at once: two
      took CI's 24 GiB and the kernel's OOM killer an EngineCore.
    - ``solo`` (fault and overload tests whose timings a busy neighbour broke: engines killed and stages reloaded,
      docs/results/ci-time.md): runs while no other module that starts servers runs. Every such module holds a shared
      lock while it runs; a solo module takes it exclusively. A turnstile in front (held by a solo module from its wait
      to its end, passed through by the others) keeps a stream of short modules from starving it: flock has no writer
      preference. Unit-test modules (a ``unit`` folder's: no server, one process) take no lock: they run beside a solo
      module on the other worker, which would otherwise wait idle."""

    def __init__(self):
        self.held = []

    def enter(self, item):
        if self.held or _light(item.fspath):
            return
        import fcntl
        import time

        root = Path(item.config._tmp_path_factory.getbasetemp()).parent
        started = time.monotonic()

        def lock(name, mode):
            handle = open(root / name, "a")
            fcntl.flock(handle, mode)
            self.held.append(handle)
            return handle

        if item.get_closest_marker("solo") is not None:
            lock("turnstile.lock", fcntl.LOCK_EX)
            lock("solo.lock", fcntl.LOCK_EX)
        else:
            turnstile = lock("turnstile.lock", fcntl.LOCK_EX)
            lock("solo.lock", fcntl.LOCK_SH)
            self.held.remove(turnstile)
            turnstile.close()
        if item.get_closest_marker("memory_heavy") is not None:
            lock("memory-heavy.lock", fcntl.LOCK_EX)
        # the wait, in the first test's reports (pytest_terminal_summary's "workers" section)
        item.user_properties.append(("module_lock_wait_s", time.monotonic() - started))

    def leave(self):
        while self.held:
            self.held.pop().close()


MODULE_LOCKS = ModuleLocks()


def _light(path) -> bool:
    """A unit-test module's file (under a ``unit`` folder): it starts no server."""
    return "unit" in Path(str(path)).parent.parts


# The files that take longest (docs/results/ci-time.md; the order: the fresh-clone run of 55e09ae), first, when the
# suite runs on xdist workers (`make test TEST_WORKERS=2`: each takes the next file as it finishes one, --dist loadfile
# --no-loadscope-reorder), so the long ones start early and the short files fill the end. The memory-heavy and solo
# ones apart (ModuleLocks): the unit files right after the first solo module (the other worker runs them meanwhile,
# beside it), the second solo module after three quarters of them (the rest go on beside it).
SOLO = ("tests/e2e/test_faults.py", "tests/e2e/test_overload.py")
SLOW_FIRST = ("tests/e2e/test_checkpoints.py", "tests/e2e/test_families.py", "tests/e2e/test_colocated.py",
              "tests/e2e/test_tier.py", "tests/e2e/test_reuse.py", "tests/e2e/test_audio.py",
              "tests/e2e/test_hosts.py", "tests/e2e/test_serving_commands.py", "tests/e2e/test_omni.py",
              "tests/e2e/test_differential.py", "tests/component/test_patches.py", "tests/e2e/test_hosts_disagg.py",
              "tests/component/test_transfer.py", "tests/e2e/test_openai_in_process.py", "tests/e2e/test_demo.py",
              "tests/e2e/test_openai.py", "tests/e2e/test_llm.py", "tests/e2e/test_video_split.py",
              "tests/e2e/test_epd.py", "tests/e2e/test_pd_transfer.py")
FILE_SECONDS: dict[str, dict[str, float]] = {}  # test file -> test -> its set-up + call + teardown seconds
FILE_CPU: dict[str, float] = {}  # test file -> the CPU seconds its worker and that worker's processes used in it
WORKERS: dict[str, dict[str, float]] = {}  # xdist worker -> busy seconds, first start, last stop, lock waits
LOCK_WAITS: dict[str, float] = {}  # test file -> the seconds its first test waited for the module locks


def pytest_collection_modifyitems(config, items):
    # on xdist's workers (each collects; the controller hands out files in their order): ``config.option.numprocesses``
    # is None there, which kept this order from ever applying until 2026-12-07 (docs/results/ci-time.md)
    if getattr(config, "workerinput", None) is None:  # one process: the order as collected
        return
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    rank = {name: i for i, name in enumerate(run_order(files))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable: a file's tests as collected


def run_order(files: list[str]) -> list[str]:
    """``files`` in the order the workers take them (the comment above ``SOLO``): the first solo module, three
    quarters of the unit files, the second, the other unit files, ``SLOW_FIRST``, the rest as given."""
    units = [name for name in files if _light(name)]
    cut = len(units) * 3 // 4
    order = [SOLO[0], *units[:cut], SOLO[1], *units[cut:], *SLOW_FIRST]
    return [name for name in order if name in files] + [name for name in files if name not in order]


def pytest_runtest_logreport(report):
    """Each test's phases, as the controller gets them (from every xdist worker)."""
    file = report.nodeid.split("::")[0]
    tests = FILE_SECONDS.setdefault(file, {})
    tests[report.nodeid] = tests.get(report.nodeid, 0.0) + report.duration
    FILE_CPU[file] = FILE_CPU.get(file, 0.0) + dict(report.user_properties).get("cpu_s", 0.0)
    gateway = getattr(getattr(report, "node", None), "gateway", None)
    worker = WORKERS.setdefault(getattr(gateway, "id", "main"), {"busy": 0.0, "first": report.start,
                                                                  "last": report.stop, "waits": 0.0})
    worker["busy"] += report.duration
    worker["first"], worker["last"] = min(worker["first"], report.start), max(worker["last"], report.stop)
    if report.when == "setup" and (wait := dict(report.user_properties).get("module_lock_wait_s", 0.0)):
        worker["waits"] += wait
        LOCK_WAITS[report.nodeid.split("::")[0]] = wait


def pytest_terminal_summary(terminalreporter):
    """Where the run's time went, per test file (its tests' set-up, call and teardown, module servers included):
    the files that cost most first (docs/results/ci-time.md). With two workers the files' seconds add up to about
    twice the wall time."""
    files = sorted(((name, sum(tests.values()), len(tests)) for name, tests in FILE_SECONDS.items()),
                   key=lambda row: -row[1])
    if not files:
        return
    terminalreporter.section("time per test file")  # CPU: of its worker and the processes that worker started
    total, cpu = sum(seconds for _, seconds, _ in files), sum(FILE_CPU.values())
    for name, seconds, count in files[:30]:
        terminalreporter.write_line(f"{seconds:8.1f} s {seconds / total:6.1%} {FILE_CPU.get(name, 0.0):8.1f} s CPU "
                                    f"{count:5d} tests  {name}")
    terminalreporter.write_line(f"{total:8.1f} s in all, {cpu:.1f} s CPU, {len(files)} files")
    terminalreporter.section("workers")  # idle: between its tests (module locks, waiting for work, the harness)
    for name, worker in sorted(WORKERS.items()):
        span = worker["last"] - worker["first"]
        terminalreporter.write_line(f"{name}: {span:7.1f} s from its first test to its last, "
                                    f"busy {worker['busy']:7.1f} s, "
                                    f"idle {span - worker['busy']:6.1f} s (waiting for module locks "
                                    f"{worker['waits']:6.1f} s)")
    for name, wait in sorted(LOCK_WAITS.items(), key=lambda item: -item[1]):
        if wait >= 1.0:
            terminalreporter.write_line(f"{wait:8.1f} s waiting for the module locks before {name}")


@pytest.fixture
def thawed_heap():
    """A model's ``initialize`` wrapped by ``backend.triton.counter_batch.after_load`` freezes the heap it finds (in a
    unit test: pytest's own, whose frozen objects would then never be collected): thawed after the test."""
    import gc

    yield
    gc.unfreeze()
